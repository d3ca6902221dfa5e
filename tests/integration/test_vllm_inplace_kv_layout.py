"""The in-place route on the caches vLLM-CPU itself allocates and binds for our k3-tiny checkpoint, in a child
interpreter (vLLM's process-global state stays out of pytest).

The child builds vLLM-CPU's own K3 model class (no weights loaded: only its attention layers' cache specs and
``bind_kv_cache`` are used), asks each layer for its ``KVCacheSpec``, resolves vLLM's KV cache layout, sizes
the caches with ``get_kv_cache_configs`` (block size 256: vLLM unifies a hybrid model's page sizes by padding
the KDA pages up to the MLA page, which must be the larger one), allocates them with ``allocate_kv_cache`` and
binds them with each layer's ``bind_kv_cache``: the tensors a served model's layers hold. Then:
- the layouts are what ``vllm_inplace`` assumes: each KDA layer's conv window and recurrent state strided views
  of one padded page per state index, the MLA cache paged;
- ``in_place_reason`` accepts them;
- vLLM puts the layers in cache groups (k3-tiny: KDA layers 0, 2, 5 / 1, 4 and MLA 3, 6, 7), each with its
  own state indices / blocks per request over one shared buffer: three requests' prefilled state (the
  reference model over the same checkpoint) laid into vLLM's tensors at distinct ids per group, three decode
  steps through ``InPlaceRouter`` (emulated fast step, every layer reading its own group's metadata) on
  vLLM's own tensors and through the import / export router on compact copies (every KDA layer at one index)
  give bitwise the same hidden states, and vLLM's caches end bitwise as the import / export router leaves
  its copies.
"""

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
BLOCK = 256


def _child(ckpt: str, out: str) -> None:  # python this_file.py --child CKPT OUT, in a fresh interpreter
    from types import SimpleNamespace

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "tests"))
    from vllm import ModelRegistry
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache
    from vllm_child import cpu_construction_stand_ins
    from vllm_layout import decode_metadata, every_layer

    from k3_fastpath.integrations.vllm_inplace import InPlaceRouter, in_place_reason
    from k3_fastpath.integrations.vllm_routing import VllmDecodeRouter
    from k3_fastpath.integrations.vllm_state import VllmLayout
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.weights import load_checkpoint

    res: dict = {}
    vc = EngineArgs(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, max_model_len=512,
                    enable_prefix_caching=False, block_size=BLOCK).create_engine_config()
    cpu_construction_stand_ins(vc, lambda msg: None)
    cls = ModelRegistry._try_load_model_cls("KimiK3ForConditionalGeneration")
    with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
        initialize_model(vllm_config=vc, model_class=cls)
    with set_current_vllm_config(vc):
        layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
        specs = {n: s for n, layer in layers.items() if (s := layer.get_kv_cache_spec(vc)) is not None}
        layout = resolve_kv_cache_layout(
            vc, [[x.name for x in get_supported_kv_cache_layouts({la.get_attn_backend() for la in layers.values()})]],
            specs.values())
        kcc = get_kv_cache_configs(vc, [specs], [64 * 2**20])[0]
        caches = allocate_kv_cache(kcc, torch.device("cpu"), layout)
        for n, t in caches.items():
            layers[n].bind_kv_cache(t)
    res["layout"], res["num_blocks"] = layout.name, kcc.num_blocks
    cfg, sd = load_checkpoint(ckpt)
    names = [f"language_model.model.layers.{i}.self_attn" for i in range(cfg.num_hidden_layers)]
    bound = [layers[n] for n in names]
    res["tensors"] = [[[list(x.shape), list(x.stride()), str(x.dtype), x.is_contiguous()]
                       for x in (la.kv_cache if isinstance(la.kv_cache, (tuple, list)) else (la.kv_cache,))]
                      for la in bound]
    kv = [la.kv_cache for la in bound]
    res["in_place_reason"] = in_place_reason(cfg, kv, VllmLayout(False, BLOCK), conv_dtype=torch.bfloat16,
                                             kv_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for t in (x for la in bound for x in (la.kv_cache if isinstance(la.kv_cache, (tuple, list)) else (la.kv_cache,))):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))  # garbage everywhere a request does not own

    # vLLM's cache groups: each holds its own state indices / blocks per request, over one shared buffer, so a
    # request's ids differ between groups and never collide across them
    group_of = {names.index(n): gi for gi, grp in enumerate(kcc.kv_cache_groups) for n in grp.layer_names}
    res["groups"] = [[names.index(n) for n in grp.layer_names] for grp in kcc.kv_cache_groups]
    kda_groups = sorted({group_of[i] for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)})
    m16 = load_reference(cfg, sd, dtype=torch.bfloat16)
    lens = [300, 5, 130]
    ids = torch.randperm(kcc.num_blocks - 1, generator=g)[: 3 * len(kda_groups) + 6].add(1).tolist()
    idx = {gi: ids[3 * k: 3 * k + 3] for k, gi in enumerate(kda_groups)}  # state indices per KDA group
    blocks = torch.tensor(ids[3 * len(kda_groups):], dtype=torch.int32).reshape(3, 2)  # MLA blocks
    toks = torch.randint(3, cfg.vocab_size, (3, max(lens)), generator=g)
    ref = m16.new_cache(3, 512)
    m16.prefill(toks, torch.tensor(lens), ref)
    for i, (la, lr) in enumerate(zip(bound, ref.layers, strict=True)):  # the prefilled state into vLLM's tensors
        for r in range(3):
            if cfg.is_kda_layer(i):
                s_i = idx[group_of[i]][r]
                la.kv_cache[0][s_i] = torch.cat([lr.conv_q[r], lr.conv_k[r], lr.conv_v[r]], dim=-1)
                la.kv_cache[1][s_i] = lr.state[r].transpose(-1, -2)
            else:
                for p in range(lens[r]):
                    la.kv_cache[int(blocks[r, p // BLOCK]), p % BLOCK] = lr.latent[r, p]
    first = idx[kda_groups[0]]  # the import / export router's compact copies: every KDA layer at these
    compact = []
    for i, la in enumerate(bound):
        if cfg.is_kda_layer(i):
            c = tuple(x.clone() for x in la.kv_cache)
            for x, y in zip(c, la.kv_cache, strict=True):
                x[first] = y[idx[group_of[i]]]
            compact.append(SimpleNamespace(kv_cache=c))
        else:
            compact.append(SimpleNamespace(kv_cache=la.kv_cache.clone()))

    def executor():
        return DecodeExecutor(m16, max_batch=4, max_len=512, envelope=Envelope(emulate=True), readout="hidden")

    lay = VllmLayout(False, BLOCK)
    inplace = InPlaceRouter(executor(), bound, lay, names)
    pooled = VllmDecodeRouter(executor(), compact, lay, (names[0], names[3]))
    seq = torch.tensor(lens)
    res["steps"] = []
    for _ in range(3):
        seq = seq + 1
        tok = torch.randint(3, cfg.vocab_size, (3,), generator=g)
        per_group = {gi: decode_metadata(names[0], names[3], idx[gi], seq.tolist(), blocks) for gi in kda_groups}
        meta = every_layer(per_group[kda_groups[0]], cfg, names,
                           {i: per_group[group_of[i]] for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)})
        plan = inplace.plan(meta, seq - 1)
        got = inplace.run(plan, tok) if plan.route else None
        want = pooled.run(pooled.plan(per_group[kda_groups[0]], positions=seq - 1), tok)
        res["steps"].append({"reason": plan.reason, "equal": got is not None and torch.equal(got, want),
                             "max_diff": None if got is None else float((got.float() - want.float()).abs().max())})
    pooled.sync_back()
    same = []
    for i, (a, b) in enumerate(zip(bound, compact, strict=True)):
        if cfg.is_kda_layer(i):
            same.append(all(torch.equal(a.kv_cache[j][idx[group_of[i]]], b.kv_cache[j][first]) for j in range(2)))
        else:
            same.append(all(torch.equal(a.kv_cache[blocks[r].long()], b.kv_cache[blocks[r].long()]) for r in range(3)))
    res["caches_equal"] = same
    Path(out).write_text(json.dumps(res))


@pytest.fixture(scope="module")
def got():
    from vllm_child import child_json

    return child_json(__file__, "k3-verify-kvlayout-")


def test_vllms_own_caches_are_the_layouts_the_in_place_step_reads(got):
    kda = [t for t in got["tensors"] if len(t) == 2]
    mla = [t[0] for t in got["tensors"] if len(t) == 1]
    assert kda and mla, got["tensors"]
    for (conv, state) in kda:  # conv [N, W-1, 3C] and state [N, h, V, K] strided by one padded page
        assert conv[2] == "torch.bfloat16" and state[2] == "torch.float32"
        assert not conv[3] and not state[3], "vLLM's KDA views were expected to be strided (shared padded pages)"
        assert conv[1][0] * 2 == state[1][0] * 4, "conv window and state share one page per state index"
    for lat in mla:
        assert lat[0][1] == BLOCK and lat[2] == "torch.bfloat16"
    assert got["in_place_reason"] is None


def test_in_place_steps_on_vllms_own_caches_are_the_import_export_route(got):
    kda_groups = [g for g in got["groups"] if any(i not in (3, 6, 7) for i in g)]
    assert len(kda_groups) >= 2, got["groups"]  # vLLM splits k3-tiny's KDA layers into groups of their own
    assert [s["reason"] for s in got["steps"]] == [None] * 3, got["steps"]
    assert all(s["equal"] for s in got["steps"]), got["steps"]
    assert all(got["caches_equal"]), got["caches_equal"]


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2], sys.argv[3])
