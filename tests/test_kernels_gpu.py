"""GPU numerics of the CuTe DSL kernels (H100/H200, sm_90a). Run: python -m pytest -m gpu tests/test_kernels_gpu.py

Contract (STYLE.md rule 6): every output matches an FP64 reference to BF16 rounding, not bitwise:
    max|fast - ref64| <= 2 * max|torch_same_dtype - ref64| + atol,   atol = 1e-3 * max|ref64|
where torch_same_dtype is what a PyTorch implementation with the same input/output dtypes produces
(cuBLAS bf16 GEMM; the FP32-internal reference rounded to bf16). Each test also checks that the fast
kernel ran (its launch counter moved by one, its fallback counter did not), that outputs were written
(buffers are NaN-poisoned first), and that a repeat run is bitwise identical (split-K included).
Inputs are fresh random tensors each run; the seed is in the failure message.

Grid: M in (1, 2, 3, 8, 16, 64): 1 and 2 are the FMA variant, 3 an odd size inside the first mma bucket,
8 / 16 / 64 bucket boundaries; GEMM shapes are every rank_shapes(k3, 8) and rank_shapes(k3, 16) shape.
"""

from __future__ import annotations

import pytest
import torch

from k3_fastpath._lib import compile_cache, counters

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

M_GRID = (1, 2, 3, 8, 16, 64)
EPS = 1e-5




def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).abs().max().item()


def _check_close(fast, torch_same, ref64, what, seed):
    assert not torch.isnan(fast).any(), f"{what}: NaN in output (not written?) seed={seed}"
    e_fast, e_torch = _err(fast, ref64), _err(torch_same, ref64)
    atol = 1e-3 * ref64.abs().max().item()
    assert e_fast <= 2 * e_torch + atol, f"{what}: err {e_fast:.3g} > 2 x torch {e_torch:.3g} + {atol:.3g} seed={seed}"


class _Ran:
    """Asserts the op's kernel launched exactly once and nothing fell back."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.before = counters.snapshot()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        after = counters.snapshot()
        fb = after["fallbacks"].get(self.name, {})
        assert fb == self.before["fallbacks"].get(self.name, {}), f"{self.name} fell back: {fb}"
        n0 = self.before["launches"].get(self.name, 0)
        assert after["launches"].get(self.name, 0) == n0 + 1, f"{self.name} kernel did not launch"
        return False


def _nan(shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


# ------------------------------------------------------------------------------------ rmsnorm_residual
@pytest.mark.parametrize("M", M_GRID)
@pytest.mark.parametrize("H,residual", [(7168, True), (7168, False), (1536, False), (512, False), (128, True)])
def test_rmsnorm_residual(M, H, residual, seed):
    from k3_fastpath.kernels import rmsnorm_residual as k

    x = torch.randn(M, H, device="cuda").bfloat16()
    r = torch.randn(M, H, device="cuda").bfloat16() if residual else None
    w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    outs = []
    for _ in range(2):
        out, ro = _nan((M, H)), _nan((M, H)) if residual else None
        with _Ran("rmsnorm_residual"):
            k.op(x, r, w, EPS, out=out, residual_out=ro)
        outs.append((out, ro))
    (out, ro), (out2, ro2) = outs
    assert torch.equal(out, out2) and (not residual or torch.equal(ro, ro2)), f"not deterministic seed={seed}"
    h = (x.float() + r.float()).bfloat16() if residual else x
    if residual:
        assert torch.equal(ro, h), f"new residual != bf16(x + residual) seed={seed}"
    hd = h.double()
    ref64 = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    _check_close(out, k.reference(x, r, w, EPS)[0], ref64, f"rmsnorm H={H} M={M}", seed)


# ----------------------------------------------------------------------------------------- skinny_gemm
def _gemm_shapes():
    from k3_fastpath.presets import preset

    shapes = {}
    for p in ("k3-tp8-rank", "k3-tp16-rank"):
        for name, nk in preset(p).shapes.gemm_shapes().items():
            shapes.setdefault(nk, f"{p.split('-')[1]}:{name}")
    return [(name, nk) for nk, name in shapes.items()]


_weights: dict[tuple[int, int], torch.Tensor] = {}


def _weight(N, K):
    if (N, K) not in _weights:
        _weights[(N, K)] = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
    return _weights[(N, K)]


@pytest.mark.parametrize("M", M_GRID)
@pytest.mark.parametrize("shape", _gemm_shapes(), ids=lambda s: f"{s[0]}-{s[1][0]}x{s[1][1]}")
def test_skinny_gemm(shape, M, seed):
    from k3_fastpath.kernels import skinny_gemm as k

    N, K = shape[1]
    w = _weight(N, K)
    x = torch.randn(M, K, device="cuda").bfloat16()
    outs = []
    for _ in range(2):
        out = _nan((M, N))
        with _Ran("skinny_gemm"):
            k.op(x, w, out=out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), f"not deterministic {shape} M={M} seed={seed}"
    ref64 = x.double() @ w.double().t()
    _check_close(outs[0], x @ w.t(), ref64, f"gemm {shape} M={M}", seed)


@pytest.mark.parametrize("M", (1, 3, 16, 64))
@pytest.mark.parametrize("N,K", [(7168, 1536), (768, 7168)])
def test_skinny_gemm_residual_fp32_out(N, K, M, seed):
    from k3_fastpath.kernels import skinny_gemm as k

    w = _weight(N, K)
    x = torch.randn(M, K, device="cuda").bfloat16()
    res = torch.randn(M, N, device="cuda").bfloat16()
    out = _nan((M, N), torch.float32)
    with _Ran("skinny_gemm"):
        k.op(x, w, res, out=out)
    ref64 = x.double() @ w.double().t() + res.double()
    same = (x.float() @ w.float().t()) + res.float()  # an FP32-output torch implementation
    _check_close(out, same, ref64, f"gemm+res fp32 {N}x{K} M={M}", seed)
    out_bf = _nan((M, N))
    with _Ran("skinny_gemm"):
        k.op(x, w, res, out=out_bf)
    _check_close(out_bf, (x @ w.t()) + res, ref64, f"gemm+res bf16 {N}x{K} M={M}", seed)


# ---------------------------------------------------------------------------------------- attn_res_mix
@pytest.mark.parametrize("M", M_GRID)
@pytest.mark.parametrize("S", (1, 3, 5, 7, 9))
@pytest.mark.parametrize("norm", (True, False))
def test_attn_res_mix(S, M, norm, seed):
    from k3_fastpath.kernels import attn_res_mix as k

    H = 7168
    src = torch.randn(S, M, H, device="cuda").bfloat16()
    src[0] *= 3  # sources of different scale, as snapshots of a growing residual stream are
    nw = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    pw = (torch.randn(H, device="cuda") / H**0.5).bfloat16()
    ow = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16() if norm else None
    outs = []
    for _ in range(2):
        mix, nrm = _nan((M, H)), (_nan((M, H)) if norm else None)
        with _Ran("attn_res_mix"):
            k.op(src, nw, pw, EPS, out_w=ow, mix_out=mix, normed_out=nrm)
        outs.append((mix, nrm))
    (mix, nrm), (mix2, nrm2) = outs
    assert torch.equal(mix, mix2) and (not norm or torch.equal(nrm, nrm2)), f"not deterministic seed={seed}"
    v = src.double()
    logits = (v * (nw.double() * pw.double())).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + EPS)
    mix64 = (torch.softmax(logits, 0).unsqueeze(-1) * v).sum(0)
    ref_mix, _ = k.reference(src, nw, pw, EPS)
    _check_close(mix, ref_mix, mix64, f"attn_res mix S={S} M={M}", seed)
    if norm:
        md = mix.double()  # the norm is of the rounded mix the kernel produced
        n64 = md * torch.rsqrt(md.pow(2).mean(-1, keepdim=True) + EPS) * ow.double()
        mf = mix.float()
        same = (mf * torch.rsqrt(mf.pow(2).mean(-1, keepdim=True) + EPS) * ow.float()).bfloat16()
        _check_close(nrm, same, n64, f"attn_res norm S={S} M={M}", seed)


# -------------------------------------------------------------------------------- graphs and caching
def test_cuda_graph_replay_matches_eager_and_capture_never_compiles(seed):
    from k3_fastpath.kernels import attn_res_mix, rmsnorm_residual, skinny_gemm

    M, H, N = 8, 7168, 3216
    x = torch.randn(M, H, device="cuda").bfloat16()
    r = torch.randn(M, H, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    wg = _weight(N, H)
    src = torch.randn(3, M, H, device="cuda").bfloat16()

    def step():
        normed, h = rmsnorm_residual.op(x, r, w, EPS)
        y = skinny_gemm.op(normed, wg)
        mix, _ = attn_res_mix.op(src, w, w, EPS)
        return y, h, mix

    eager = step()  # compiles everything the step needs
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = step()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b), f"graph replay differs from eager seed={seed}"

    w_new = _weight(N + 16, H)  # a shape never compiled
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(compile_cache.CompileDuringCaptureError):
        with torch.cuda.graph(g2):
            skinny_gemm.op(x[:1], w_new)


def test_disk_cache_roundtrip(tmp_path, monkeypatch, seed):
    """Compile -> export to disk -> forget -> load from disk -> same bits. Skips (with the DSL's reason)
    where cutlass-dsl 4.8.1 cannot export; then the disk cache holds only PTX/cubin artefacts."""
    from k3_fastpath.kernels import skinny_gemm

    monkeypatch.setenv("K3_KERNEL_CACHE", str(tmp_path))
    compile_cache.clear_memory()
    x = torch.randn(16, 1536, device="cuda").bfloat16()
    w = _weight(7168, 1536)
    y1 = skinny_gemm.op(x, w)
    status = compile_cache.disk_status().get("export", "")
    if status != "ok":
        pytest.skip(reason=f"export_to_c unavailable on this host: {status}")
    compile_cache.clear_memory()
    y2 = skinny_gemm.op(x, w)
    assert compile_cache.records()[-1].source == "disk"
    assert torch.equal(y1, y2)
    compile_cache.clear_memory()
