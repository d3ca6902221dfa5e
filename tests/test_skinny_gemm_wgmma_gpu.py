"""GPU numerics of the skinny GEMM's TMA + wgmma variant (kernel_wgmma.py; H100/H200, sm_90a).

    python -m pytest -m gpu tests/test_skinny_gemm_wgmma_gpu.py

Contract (STYLE.md rule 6, as tests/test_kernels_gpu.py): matches an FP64 reference to BF16 rounding, not
bitwise: max|fast - ref64| <= 2 * max|torch_same_dtype - ref64| + 1e-3 * max|ref64|, where
torch_same_dtype is cuBLAS with the same input/output dtypes. Every launch is checked to be the wgmma kernel
(``skinny_gemm`` launch counter +1, ``api.VARIANT_LAUNCHES["wgmma"]`` +1, no fallback); outputs are written
into NaN-poisoned buffers with NaN guard rows after row M-1 that must stay NaN (rows >= M never stored;
a store past N in the last row would land there too); repeats are bitwise identical (split-K included:
the second call also proves the arrival counters were reset). Inputs are fresh random tensors; the seed is
in each failure message.

Grid: M in (1, 8, 9, 16) (the 16-row bucket; M <= 8 only with wgmma_min_m 1..8), 17 / 32 (the 32-row bucket: smallest, boundary), 33 / 64 (the
64-row bucket); shapes from the K3 TP8 / TP16 ranks with N % 64 != 0 (6288, 3216), split-K 16 (router),
K = 384 (split 1), two warpgroups (lm_head), and a small 200 x 520 (N % 64 = 8, K % 64 = 8: the TMA unit
zero-fills the K tail and the rows past N).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_gpu import _check_close  # the same FP64 bound as the mma variant's GPU tests

from k3_fastpath._lib import counters
from k3_fastpath.kernels.skinny_gemm import api
from k3_fastpath.kernels.skinny_gemm.config import SkinnyGemmConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

SHAPES = {  # name -> (N, K)
    "tp8_kda_in_proj": (6288, 7168), "tp16_kda_in_proj": (3216, 7168), "tp8_o_proj": (7168, 1536),
    "tp8_mla_q_b": (2304, 1536), "router": (896, 7168), "tp16_shared_down": (7168, 384),
    "tp8_lm_head": (20480, 7168), "odd_200x520": (200, 520),
}
M_GRID = (1, 8, 9, 16, 17, 32, 33, 64)
GUARD = 4  # poisoned rows after the M output rows




_weights: dict[tuple[int, int], torch.Tensor] = {}


def _weight(N: int, K: int) -> torch.Tensor:
    if (N, K) not in _weights:
        _weights[(N, K)] = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
    return _weights[(N, K)]


def _run(x, w, cfg, residual=None, out_dtype=torch.bfloat16, what="", seed=0):
    """One launch of ``cfg`` into a poisoned [M + GUARD, N] buffer; checks it was the wgmma kernel, that the
    guard rows stayed NaN, and returns the [M, N] output."""
    M, N = x.shape[0], w.shape[0]
    buf = torch.full((M + GUARD, N), float("nan"), dtype=out_dtype, device="cuda")
    out = buf[:M]
    before, wg0 = counters.snapshot(), api.VARIANT_LAUNCHES["wgmma"]
    api.skinny_gemm(x, w, residual, out=out, config=cfg)
    torch.cuda.synchronize()
    after = counters.snapshot()
    assert after["fallbacks"].get(api.NAME) == before["fallbacks"].get(api.NAME), f"{what}: fell back"
    assert after["launches"][api.NAME] == before["launches"].get(api.NAME, 0) + 1, f"{what}: no launch"
    assert api.VARIANT_LAUNCHES["wgmma"] == wg0 + 1, f"{what}: not the wgmma kernel"
    assert torch.isnan(buf[M:]).all(), f"{what}: rows >= M were written seed={seed}"
    return out


def _refs(x, w, residual, out_dtype):
    ref64 = x.double() @ w.double().t()
    if out_dtype == torch.float32:
        same = x.float() @ w.float().t()
        same = same + residual.float() if residual is not None else same
    else:
        same = x @ w.t()
        same = same + residual if residual is not None else same
    return (ref64 + residual.double() if residual is not None else ref64), same


@pytest.mark.parametrize("M", M_GRID)
@pytest.mark.parametrize("name", list(SHAPES))
def test_wgmma_matches_fp64_and_is_deterministic(name, M, seed):
    N, K = SHAPES[name]
    cfg = SkinnyGemmConfig.wgmma_for(M, N, K)
    w = _weight(N, K)
    x = torch.randn(M, K, device="cuda").bfloat16()
    what = f"{name} {N}x{K} M={M} {cfg}"
    y1 = _run(x, w, cfg, what=what, seed=seed)
    y2 = _run(x, w, cfg, what=what, seed=seed)
    assert torch.equal(y1, y2), f"{what}: not bitwise deterministic seed={seed}"
    ref64, same = _refs(x, w, None, torch.bfloat16)
    _check_close(y1, same, ref64, what, seed)


@pytest.mark.parametrize("M", (17, 64))
@pytest.mark.parametrize("residual,out_fp32", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("name", ["tp8_o_proj", "tp16_shared_down", "odd_200x520", "router"])
def test_wgmma_epilogues(name, residual, out_fp32, M, seed):
    N, K = SHAPES[name]
    cfg = SkinnyGemmConfig.wgmma_for(M, N, K, out_fp32=out_fp32, residual=residual)
    out_dtype = torch.float32 if out_fp32 else torch.bfloat16
    w = _weight(N, K)
    x = torch.randn(M, K, device="cuda").bfloat16()
    res = torch.randn(M, N, device="cuda").bfloat16() if residual else None
    what = f"{name} M={M} residual={residual} fp32={out_fp32}"
    y = _run(x, w, cfg, res, out_dtype, what=what, seed=seed)
    assert y.dtype == out_dtype
    assert torch.equal(y, _run(x, w, cfg, res, out_dtype, what=what, seed=seed)), f"{what}: not deterministic"
    ref64, same = _refs(x, w, res, out_dtype)
    _check_close(y, same, ref64, what, seed)


def _knob_variants(M: int, N: int, K: int) -> list[SkinnyGemmConfig]:
    base = SkinnyGemmConfig.wgmma_for(M, N, K)
    out = []
    for kw in (dict(split_k=1), dict(split_k=2), dict(split_k=4), dict(split_k=16), dict(stages=2),
               dict(stages=3), dict(warps_n=8, stages=4), dict(rows_per_warp=2, stages=4),
               dict(warps_n=8, rows_per_warp=2, stages=3), dict(k_unroll=2, stages=4), dict(k_unroll=4, stages=3)):
        try:
            out.append(dataclasses.replace(base, **kw))
        except ValueError:
            pass
    return out


@pytest.mark.parametrize("M", (24, 64))
@pytest.mark.parametrize("name", ["tp16_kda_in_proj", "tp8_o_proj", "odd_200x520"])
def test_wgmma_knobs(name, M, seed):
    """Every knob the bench sweeps (split-K, pipeline depth, one/two warpgroups, 64-row tiles per warpgroup,
    K per stage) computes the same GEMM; split-K changes the FP32 sum order, so agreement is to the
    contract, not bitwise."""
    N, K = SHAPES[name]
    w = _weight(N, K)
    x = torch.randn(M, K, device="cuda").bfloat16()
    ref64, same = _refs(x, w, None, torch.bfloat16)
    for cfg in _knob_variants(M, N, K):
        if cfg.split_k > -(-K // cfg.block_k):
            continue
        _check_close(_run(x, w, cfg, what=f"{name} {cfg}", seed=seed), same, ref64, f"{name} M={M} {cfg}", seed)


def test_pdl_launch_gives_the_same_bits(seed):
    """The PDL config only moves W requests ahead of griddepcontrol.wait: same algorithm, same bits."""
    N, K = SHAPES["tp8_kda_in_proj"]
    w, x = _weight(N, K), torch.randn(40, K, device="cuda").bfloat16()
    res = torch.randn(40, N, device="cuda").bfloat16()
    cfg = SkinnyGemmConfig.wgmma_for(40, N, K, residual=True)
    y = _run(x, w, cfg, res, what="no pdl", seed=seed)
    y_pdl = _run(x, w, dataclasses.replace(cfg, pdl=True), res, what="pdl", seed=seed)
    assert torch.equal(y, y_pdl), f"PDL launch differs seed={seed}"


@pytest.mark.parametrize("min_m,routes", [(None, ((40, "wgmma"), (4, "wgmma"), (3, "fma"), (1, "fma"))),
                                          (17, ((40, "wgmma"), (17, "wgmma"), (16, "mma"), (2, "fma"))),
                                          (0, ((40, "mma"), (9, "mma"), (2, "fma"))),
                                          (1, ((1, "wgmma"), (8, "wgmma"), (40, "wgmma")))])
def test_threshold_routes_to_wgmma(seed, min_m, routes):
    """skinny_gemm without a config launches wgmma for M >= 4 by default; ``wgmma_min_m`` (the decode step's
    ``DecodeOptions.gemm_wgmma_min_m``) moves the threshold (17, 1) or turns it off (0)."""
    kw = {} if min_m is None else {"wgmma_min_m": min_m}
    N, K = SHAPES["tp8_o_proj"]
    w = _weight(N, K)
    for M, variant in routes:
        x = torch.randn(M, K, device="cuda").bfloat16()
        n0 = dict(api.VARIANT_LAUNCHES)
        y = api.skinny_gemm(x, w, **kw)
        assert api.VARIANT_LAUNCHES[variant] == n0.get(variant, 0) + 1, f"M={M}: expected {variant}"
        ref64, same = _refs(x, w, None, torch.bfloat16)
        _check_close(y, same, ref64, f"wgmma_min_m {min_m} M={M}", seed)


def test_cuda_graph_replay_matches_eager(seed):
    N, K = SHAPES["tp8_mla_q_b"]  # split-K 4: the workspace and counters are replayed too
    w = _weight(N, K)
    x = torch.randn(48, K, device="cuda").bfloat16()
    cfg = SkinnyGemmConfig.wgmma_for(48, N, K)
    assert cfg.split_k > 1
    eager = api.skinny_gemm(x, w, config=cfg).clone()
    out = torch.full_like(eager, float("nan"))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        api.skinny_gemm(x, w, out=out, config=cfg)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"graph replay differs from eager seed={seed}"
