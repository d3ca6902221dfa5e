"""The strong standard path (``backend="standard_graph"``: cuBLAS + fla + ``torch._grouped_mm`` + PyTorch glue
in the executor's CUDA graphs) on an H100/H200. Run: python -m pytest -m gpu tests/test_standard_path_gpu.py

It is the baseline of ``perf.decode_sweep``'s fast-vs-standard ratios, so it must be right (same greedy
tokens within the top-5 rule and KL as the fast path against the reference), captured (graph replays, no
kernel of ours launched) and served by the libraries it names (fla and the grouped GEMM really ran)."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath._lib import counters
from k3_fastpath.config import preset
from k3_fastpath.runtime import standard_ops as S
from k3_fastpath.runtime.executor import DecodeExecutor
from verify.checks.equivalence import build_synthetic_model, compare_greedy, fill_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

_models: dict = {}


def _model():
    if "m" not in _models:
        _models["m"] = build_synthetic_model(preset("k3-tiny").config, 0, "stable", "cuda")
    return _models["m"]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_standard_graph_matches_reference_and_uses_the_libraries(batch, seed):
    model = _model()
    assert S.fla_kda() is not None, "fla is not importable on this GPU host (stage it: ../shared/gpuhost)"
    assert S.grouped_mm_works("cuda:0"), "torch._grouped_mm does not run here"
    ex = DecodeExecutor(model, backend="standard_graph", max_len=64, max_batch=8, buckets=(1, 2, 4, 8))
    assert ex.fast and ex.use_graphs, ex.model_reason
    ref = model.new_cache(batch, 64)
    first = fill_reference(model, ref, None, 12, seed)
    cache = ex.new_cache(batch, 64)
    ex.copy_cache(cache, ref)
    out = torch.empty(batch, model.cfg.vocab_size, device="cuda")
    before = counters.snapshot()
    r = compare_greedy(lambda t: model.decode(t, ref), lambda t: ex.decode(t, cache, out=out), first, 16)
    assert not r["topk_violations"], f"seed {seed}: {r['topk_violations'][:3]}"
    assert r["nonfinite_steps"] == 0 and r["kl_mean"] <= 0.01, f"seed {seed}: {r['kl_mean']}"
    after = counters.snapshot()
    assert after["launches"] == before["launches"], "the standard path launched one of our kernels"
    recs = list(ex.trace.records)
    assert all(rec.graph and rec.fallback is None and not rec.kernels for rec in recs)
    ops = {o["op"]: o["reason"] for o in recs[-1].standard_ops}
    assert "fla fused_recurrent_kda_fwd" in ops["kda_step"] and "_grouped_mm" in ops["moe_experts"], ops
