"""GPU numerics of the routed-expert kernels (H100/H200, sm_90a). Run: python -m pytest -m gpu tests/test_moe_experts_gpu.py

Contract (STYLE.md rule 6), against the FP64 oracle ``moe_experts_ref(..., compute_dtype=float64,
rounding=False)`` on the same (exactly dequantised) weights:
* FP32 output (the weighted expert sum): max|out - ref64| <= 2 x max|ref32 - ref64| + 1e-3 max|ref64|,
  ref32 being the same-dtype torch implementation (bf16 GEMMs, FP32 GLU and sum: ``LatentMoE.routed``'s
  arithmetic); with the latent norm (bf16 output) the same rule; elementwise 3e-2 / 2e-2 on the normed one;
* the kernel ran (launch counter +1, no fallback), the output was written (NaN-poisoned before), a repeat
  is bitwise identical (the plan's sort and every sum have a fixed order), a CUDA-graph replay equals the
  eager call.
Fresh random inputs each run (weights quantised to MXFP4 from N(0, 1/K)); the seed is in every message.

Grid: batch 1, 2, 3, 8, 64 with uniform routing (distinct random experts per token) at the TP8 slice
(896 experts, I = 384) and TP16 (I = 192); a hot expert chosen by all 64 tokens (several token passes);
BF16 experts; k3-tiny's shapes; the fallback.
"""

from __future__ import annotations

import pytest
import torch

from k3_fastpath import mxfp4
from k3_fastpath._lib import counters

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

NAME = "moe_experts"
BETA, LBETA, EPS = 4.0, 25.0, 1e-5
_CACHE: dict = {}


def _experts(E: int, I: int, L: int, fmt: str):
    """Random experts of one shape, built once per session (896 x 2.2 MB at TP8)."""
    from k3_fastpath.kernels.moe_experts import ExpertWeights

    key = (E, I, L, fmt)
    if key not in _CACHE:
        g = torch.Generator(device="cuda").manual_seed(1234 + E + I + L)

        def mat(rows, K):
            w = torch.randn(E * rows, K, device="cuda", generator=g) / K**0.5
            if fmt == "bf16":
                return w.view(E, rows, K).bfloat16()
            p, s = mxfp4.quantize(w)
            return p.view(E, rows, K // 2), s.view(E, rows, K // 32)

        _CACHE[key] = ExpertWeights(fmt, mat(I, L), mat(I, L), mat(L, I))
    return _CACHE[key]


def _routing(N: int, k: int, E: int, hot: bool = False):
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(N)]).int()
    if hot:
        ids[:, 0] = 7  # every token routes to expert 7 (N tokens on one expert: several passes)
    w = torch.rand(N, k, device="cuda") + 0.1
    return ids, w / w.sum(dim=1, keepdim=True)


def _run(N, E, I, L, k, fmt="mxfp4", norm=False, hot=False, seed=0):
    from k3_fastpath.kernels import moe_experts as m

    experts = _experts(E, I, L, fmt)
    z = torch.randn(N, L, device="cuda").bfloat16()
    ids, w = _routing(N, k, E, hot)
    nw = (1 + 0.1 * torch.randn(L, device="cuda")).bfloat16() if norm else None
    what = f"N={N} E={E} I={I} L={L} fmt={fmt} norm={norm} hot={hot} seed={seed}"
    outs = []
    for _ in range(2):
        out = torch.full((N, L), float("nan"), device="cuda", dtype=torch.bfloat16 if norm else torch.float32)
        snap = counters.snapshot()
        got = m.moe_experts(z, ids, w, experts, beta=BETA, linear_beta=LBETA, norm_weight=nw, eps=EPS, out=out)
        after = counters.snapshot()
        assert after["fallbacks"].get(NAME, {}) == snap["fallbacks"].get(NAME, {}), \
            f"fell back: {after['fallbacks'].get(NAME)} {what}"
        assert after["launches"].get(NAME, 0) == snap["launches"].get(NAME, 0) + 1, f"did not launch {what}"
        assert got.data_ptr() == out.data_ptr()
        torch.cuda.synchronize()
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1]), f"repeat not bitwise identical {what}"
    out = outs[0]
    assert not torch.isnan(out).any(), f"NaN in the output (not written?) {what}"
    kw = dict(beta=BETA, linear_beta=LBETA, norm_weight=nw, eps=EPS)
    r64 = m.moe_experts_ref(z, ids, w, experts, compute_dtype=torch.float64, rounding=False, **kw)
    r32 = m.moe_experts_ref(z, ids, w, experts, **kw)
    e_fast, e_torch = (out.double() - r64).abs().max().item(), (r32.double() - r64).abs().max().item()
    atol = 1e-3 * r64.abs().max().item()
    assert e_fast <= 2 * e_torch + atol, f"err {e_fast:.3g} > 2 x torch {e_torch:.3g} + {atol:.3g} {what}"
    if norm:
        bad = (out.double() - r64).abs() > 2e-2 + 3e-2 * r64.abs()
        assert not bad.any(), f"{int(bad.sum())} normed elements outside 3e-2/2e-2 {what}"
    return out


@pytest.mark.parametrize("N", (1, 2, 3, 8, 64))
@pytest.mark.parametrize("I", (384, 192), ids=("tp8", "tp16"))
def test_moe_experts_mxfp4(N, I, seed):
    _run(N, 896, I, 3584, 16, seed=seed)


@pytest.mark.parametrize("N", (1, 8))
def test_moe_experts_latent_norm(N, seed):
    _run(N, 896, 384, 3584, 16, norm=True, seed=seed)


def test_moe_experts_hot_expert(seed):
    """All 64 tokens on one expert: 64 tokens = 4 passes of 16 over its weights (and 63 cold experts)."""
    _run(64, 896, 384, 3584, 16, hot=True, seed=seed)


@pytest.mark.parametrize("N", (1, 8, 64))
def test_moe_experts_bf16_weights(N, seed):
    _run(N, 64, 384, 3584, 16, fmt="bf16", seed=seed)


@pytest.mark.parametrize("N", (1, 5))
def test_moe_experts_tiny(N, seed):
    _run(N, 16, 128, 64, 4, norm=True, seed=seed)


def test_moe_experts_cuda_graph(seed):
    from k3_fastpath.kernels import moe_experts as m

    experts = _experts(896, 384, 3584, "mxfp4")
    z = torch.randn(8, 3584, device="cuda").bfloat16()
    ids, w = _routing(8, 16, 896)
    eager = m.moe_experts(z, ids, w, experts)
    out = torch.full_like(eager, float("nan"))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        m.moe_experts(z, ids, w, experts, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), f"graph replay differs seed={seed}"


def test_moe_experts_falls_back_with_reason(seed):
    from k3_fastpath.kernels import moe_experts as m

    experts = _experts(16, 128, 64, "mxfp4")
    z = torch.randn(65, 64, device="cuda").bfloat16()
    ids, w = _routing(65, 4, 16)
    n0 = counters.fallbacks(NAME)
    out = m.moe_experts(z, ids, w, experts)
    assert counters.fallbacks(NAME) == n0 + 1 and out.shape == (65, 64) and not torch.isnan(out).any()
    assert any("N=65" in r for r in counters.snapshot()["fallbacks"][NAME])
