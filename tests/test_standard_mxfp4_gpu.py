"""The standard path's MXFP4 experts through humming-kernels (``runtime/standard_mxfp4.py``) on an H100/H200.
Run: python -m pytest -m gpu tests/test_standard_mxfp4_gpu.py (humming-kernels==0.1.20 staged).

It becomes the baseline of the fast-vs-standard ratios when ``standard_mxfp4_experts`` is on, so it must be
as right as the BF16 standard experts: against the FP64 oracle ``moe_experts_ref(compute_dtype=float64,
rounding=False)`` on the same (exactly dequantised) weights, max|got - ref64| <= 2 x max|bf16 - ref64| +
1e-3 max|ref64|, ``bf16`` being the BF16 grouped-GEMM standard op on the same inputs; a CUDA-graph replay of
the op over new routing equals the eager call to 1e-5 of its scale (humming's split sums are not bitwise
repeatable); and in the executor (``backend="standard_graph"``) greedy
decoding follows the reference with humming named as what served ``moe_experts``. Fresh random inputs each
run (the seed in every message).
"""

from __future__ import annotations

import pytest
import torch

from k3_fastpath import mxfp4

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

BETA, LBETA, EPS = 4.0, 25.0, 1e-5
_CACHE: dict = {}


class _Bank:
    """What the op reads of ``step_plan.ExpertBank``: the stacked weights, the count, the SiTU betas and the
    module its prepared experts are cached under."""

    def __init__(self, weights, num_experts):
        self.weights, self.num_experts, self.beta, self.linear_beta = weights, num_experts, BETA, LBETA
        self.module = self  # any weak-referenceable key


def _bank(E: int, I: int, L: int) -> _Bank:
    from k3_fastpath.kernels.moe_experts import ExpertWeights

    key = (E, I, L)
    if key not in _CACHE:
        g = torch.Generator(device="cuda").manual_seed(4321 + E + I + L)

        def mat(rows, K):
            p, s = mxfp4.quantize(torch.randn(E * rows, K, device="cuda", generator=g) / K**0.5)
            return p.view(E, rows, K // 2), s.view(E, rows, K // 32)

        _CACHE[key] = _Bank(ExpertWeights("mxfp4", mat(I, L), mat(I, L), mat(L, I)), E)
    return _CACHE[key]


def _inputs(N, E, L, k, norm):
    z = torch.randn(N, L, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(N)]).int()
    w = torch.rand(N, k, device="cuda") + 0.1
    nw = (1 + 0.1 * torch.randn(L, device="cuda")).bfloat16() if norm else None
    return z, ids, w / w.sum(dim=1, keepdim=True), nw


@pytest.mark.parametrize("N, E, I, L, k", [
    (1, 128, 192, 3584, 16), (8, 128, 192, 3584, 16), (64, 128, 192, 3584, 16),  # the TP16 slice
    (3, 64, 3072, 3584, 16),  # k3-mini (TP1)
    (5, 16, 128, 64, 4),  # k3-tiny (padded: K 64 -> 128, w2 N 64 -> 256)
])
@pytest.mark.parametrize("norm", [False, True])
def test_humming_experts_as_accurate_as_the_bf16_standard_experts(N, E, I, L, k, norm, seed):
    from k3_fastpath.kernels.moe_experts.reference import moe_experts_ref
    from k3_fastpath.runtime.standard_mxfp4 import humming_unavailable
    from k3_fastpath.runtime.standard_ops import moe_experts_humming, moe_experts_standard

    assert humming_unavailable("cuda:0") is None, humming_unavailable("cuda:0")
    bank = _bank(E, I, L)
    z, ids, w, nw = _inputs(N, E, L, k, norm)
    what = f"N={N} E={E} I={I} L={L} k={k} norm={norm} seed={seed}"
    got = moe_experts_humming(z, ids, w, bank, nw, EPS)
    bf16 = moe_experts_standard(z, ids, w, bank, nw, EPS)
    ref = moe_experts_ref(z, ids, w, bank.weights, beta=BETA, linear_beta=LBETA, norm_weight=nw, eps=EPS,
                          compute_dtype=torch.float64, rounding=False)
    assert got.shape == (N, L) and got.dtype == (torch.bfloat16 if norm else torch.float32), what
    assert torch.isfinite(got).all(), what
    scale = ref.abs().max().item()
    err, bound = (got.double() - ref).abs().max().item(), (bf16.double() - ref).abs().max().item()
    assert err <= 2 * bound + 1e-3 * scale, f"{what}: humming {err:.3e} vs bf16 standard {bound:.3e} (scale {scale:.3e})"
    assert scale > 0, what


def test_humming_experts_replay_in_a_cuda_graph(seed):
    from k3_fastpath.runtime.standard_ops import moe_experts_humming

    N, E, I, L, k = 8, 128, 192, 3584, 16
    bank = _bank(E, I, L)
    z, ids, w, _ = _inputs(N, E, L, k, False)
    moe_experts_humming(z, ids, w, bank)  # JIT and module loads before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_humming(z, ids, w, bank)
    z2, ids2, w2, _ = _inputs(N, E, L, k, False)
    z.copy_(z2)
    ids.copy_(ids2)
    w.copy_(w2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = moe_experts_humming(z2, ids2, w2, bank)
    # humming's split-K / stream-K partial sums may combine in a different order from call to call: FP32 output
    # equal to ~1e-7 of its scale, not bitwise (H100, 2026-12-06: 8.9e-08 at a scale of ~0.3)
    diff, scale = (out - want).abs().max().item(), want.abs().max().item()
    assert torch.isfinite(out).all() and diff <= 1e-5 * scale, f"seed {seed}: replay differs by {diff:.3e} ({scale:.3e})"


def test_standard_graph_executor_serves_experts_through_humming(seed):
    from k3_fastpath.presets import preset
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.runtime.options import DecodeOptions
    from verify.checks.context_fill import fill_reference
    from verify.checks.equivalence import build_synthetic_model, compare_greedy

    model = build_synthetic_model(preset("k3-tiny").config, 0, "stable", "cuda")
    ex = DecodeExecutor(model, backend="standard_graph", max_len=64, max_batch=8, buckets=(1, 2, 4, 8),
                        options=DecodeOptions(pdl=False, standard_mxfp4_experts=True))
    assert ex.fast and ex.use_graphs, ex.model_reason
    batch = 3
    ref = model.new_cache(batch, 64)
    first = fill_reference(model, ref, None, 12, seed)
    cache = ex.new_cache(batch, 64)
    ex.copy_cache(cache, ref)
    r = compare_greedy(lambda t: model.decode(t, ref), lambda t: ex.decode(t, cache), first, 16)
    assert not r["topk_violations"], f"seed {seed}: {r['topk_violations'][:3]}"
    assert r["nonfinite_steps"] == 0 and r["kl_mean"] <= 0.01, f"seed {seed}: {r['kl_mean']}"
    recs = list(ex.trace.records)
    assert all(rec.graph and rec.fallback is None for rec in recs)
    ops = {o["op"]: o["reason"] for o in recs[-1].standard_ops}
    assert "humming-kernels" in ops["moe_experts"], ops
