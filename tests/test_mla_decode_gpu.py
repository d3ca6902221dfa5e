"""GPU numerics of the absorbed MLA decode kernels (H100/H200, sm_90a).
Run: python -m pytest -m gpu tests/test_mla_decode_gpu.py

Contract (STYLE.md rule 6), against the FP64 oracle ``mla_decode_ref(..., compute_dtype=float64,
rounding=False)`` on the same (dequantized) cache:
* y (bf16): max|y - y64| <= 2 x max|y32 - y64| + 1e-3 max|y64|, where y32 is the same-dtype torch
  implementation (FP32 math rounded to bf16 where the model rounds), and elementwise
  |y - y64| <= 2e-2 + 3e-2 |y64| (matches to BF16 rounding, not bitwise);
* context-parallel pieces: the partial (o_lat, lse) of ``mla_decode_partial`` against the FP64 attention:
  max|o - o64| <= 2 x max|bf16(o32) - o64| + 1e-3 max|o64|, |lse - lse64| <= 4e-3 (the kernel rounds the
  probabilities to bf16 for the tensor cores); ``mla_merge`` of several ranks' partials meets the y contract;
* the kernel ran (launch counter +1, no fallback), y was written (NaN-poisoned before), a repeat is bitwise
  identical, positions past each context and pool pages not in the block table are never read: the pool
  is NaN-poisoned everywhere else (bf16 NaN / e4m3 0x7F) and unused block-table entries are -1.
Inputs are fresh random tensors each run; the seed is in every failure message.

Grid: B in (1, 2, 3, 8, 64) x heads 12 (TP8) / 6 (TP16, K3.md failure 1) x BF16 / FP8 caches, ragged
contexts in every batch (1, 63, 64, 65 and random up to 3000); k3-tiny shapes; long contexts (131072 + 17
next to short ones, and the full 1,048,576); a pool whose used pages lie past 2^31 bytes (offset overflow);
no-gate; CUDA-graph capture; the fallback.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from k3_fastpath._lib import counters

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

NAME = "mla_decode"
FP8 = torch.float8_e4m3fn
PAGE = 64
SCALE = 192 ** -0.5
K3_DIMS = (512, 64, 128)
TINY_DIMS = (32, 16, 32)


def _pool(n_pages: int, D: int, fp8: bool, gap: int = 0) -> torch.Tensor:
    """NaN-poisoned pages; ``gap`` > 0: each page followed by ``gap`` pages' worth of other memory (poisoned too),
    as vLLM's block-major cache layouts interleave the layers' pages (the pool is then a strided view)."""
    shape = (n_pages, PAGE * (1 + gap), D)
    if fp8:
        p = torch.empty(shape, dtype=torch.uint8, device="cuda")
        p.fill_(0x7F)  # e4m3 NaN
        return p[:, :PAGE].view(FP8)
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")[:, :PAGE]


def _case(B, H, lens, dims=K3_DIMS, fp8=False, high=False, gate=True, cache_scale=0.5, gap=0):
    R, P, V = dims
    D = R + P
    need = [math.ceil(n / PAGE) for n in lens]
    total = sum(need)
    elem = 1 if fp8 else 2
    low = (2**31 // (PAGE * D * elem) + 1) if high else 0  # pages at or past 2^31 bytes
    n_pages = low + total + 5
    pool = _pool(n_pages, D, fp8, gap)
    ids = (torch.randperm(total + 5, device="cuda")[:total] + low).to(torch.int32)
    table = torch.full((B, max(max(need), 1) + 2), -1, dtype=torch.int32, device="cuda")
    scale_t = torch.tensor([cache_scale if fp8 else 1.0], dtype=torch.float32, device="cuda")
    i = 0
    for b in range(B):
        if need[b]:
            pg = ids[i: i + need[b]]
            i += need[b]
            table[b, : need[b]] = pg
            for c0 in range(0, need[b], 4096):  # chunks bound the FP32 temporaries at 1M positions
                sel = pg[c0: c0 + 4096].long()
                vals = torch.randn(len(sel), PAGE, D, device="cuda")
                if fp8:  # through the byte view: float8 index_put is not implemented everywhere
                    pool.view(torch.uint8)[sel] = (vals / scale_t).clamp(-448, 448).to(FP8).view(torch.uint8)
                else:
                    pool[sel] = vals.bfloat16()
            tail = lens[b] - (need[b] - 1) * PAGE
            if tail < PAGE:  # re-poison the last page past the context
                last = int(pg[-1])
                if fp8:
                    pool.view(torch.uint8)[last, tail:] = 0x7F
                else:
                    pool[last, tail:] = float("nan")
    dev = "cuda"
    return {"q_lat": (torch.randn(B, H, R, device=dev) * 1.5).bfloat16(),
            "q_pe": (torch.randn(B, H, P, device=dev) * 1.5).bfloat16(),
            "cache": pool, "block_table": table,
            "ctx_len": torch.tensor(lens, dtype=torch.int32, device=dev),
            "w_uv": (torch.randn(H, V, R, device=dev) * R**-0.5).bfloat16(),
            "gate": torch.randn(B, H * V, device=dev).bfloat16() if gate else None,
            "cache_scale": scale_t if fp8 else None}


def _args(c):
    return (c["q_lat"], c["q_pe"], c["cache"], c["block_table"], c["ctx_len"], c["w_uv"], c["gate"])


def _lens(B: int, top: int = 3000) -> list[int]:
    fixed = [1, 63, 64, 65, 128]
    out = [random.choice(fixed) if random.random() < 0.4 else random.randint(1, top) for _ in range(B)]
    if B >= 3:
        out[0], out[1] = 1, top  # context 1 and the longest in the same batch
    return out


def _run_checked(c, what, max_ctx=None):
    from k3_fastpath.kernels import mla_decode as k

    B, H, _ = c["q_lat"].shape
    V = c["w_uv"].shape[1]
    ys = []
    for _ in range(2):
        out = torch.full((B, H * V), float("nan"), dtype=torch.bfloat16, device="cuda")
        snap = counters.snapshot()
        y = k.mla_decode(*_args(c), softmax_scale=SCALE, cache_scale=c["cache_scale"], max_ctx=max_ctx, out=out)
        after = counters.snapshot()
        assert after["fallbacks"].get(NAME, {}) == snap["fallbacks"].get(NAME, {}), \
            f"fell back: {after['fallbacks'].get(NAME)} {what}"
        assert after["launches"].get(NAME, 0) == snap["launches"].get(NAME, 0) + 1, f"did not launch {what}"
        assert y.data_ptr() == out.data_ptr()
        torch.cuda.synchronize()
        ys.append(y.clone())
    assert torch.equal(ys[0], ys[1]), f"repeat not bitwise identical {what}"
    return ys[0]


def _check_y(y, c, what):
    from k3_fastpath.kernels import mla_decode as k

    kw = dict(softmax_scale=SCALE, cache_scale=c["cache_scale"])
    y64 = k.mla_decode_ref(*_args(c), compute_dtype=torch.float64, rounding=False, **kw)
    y32 = k.mla_decode_ref(*_args(c), compute_dtype=torch.float32, rounding=True, **kw)
    assert not torch.isnan(y).any(), f"NaN in y (not written, or a stale position was read) {what}"
    yd = y.double()
    bad = (yd - y64).abs() > 2e-2 + 3e-2 * y64.abs()
    assert not bad.any(), f"{int(bad.sum())} elements outside 3e-2/2e-2, max err {(yd - y64).abs().max():.3g} {what}"
    e_fast, e_torch = (yd - y64).abs().max().item(), (y32.double() - y64).abs().max().item()
    atol = 1e-3 * y64.abs().max().item()
    assert e_fast <= 2 * e_torch + atol, f"y err {e_fast:.3g} > 2 x torch {e_torch:.3g} + {atol:.3g} {what}"
    return e_fast, e_torch


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
@pytest.mark.parametrize("H", (12, 6))
@pytest.mark.parametrize("B", (1, 2, 3, 8, 64))
def test_mla_decode_ragged(B, H, fp8, seed):
    lens = _lens(B)
    c = _case(B, H, lens, fp8=fp8)
    what = f"B={B} H={H} fp8={fp8} lens={lens if B <= 8 else '...'} seed={seed}"
    _check_y(_run_checked(c, what), c, what)


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
@pytest.mark.parametrize("B", (1, 3))
def test_mla_decode_tiny(B, fp8, seed):
    lens = _lens(B, top=300)
    c = _case(B, 4, lens, dims=TINY_DIMS, fp8=fp8)
    what = f"tiny B={B} fp8={fp8} lens={lens} seed={seed}"
    _check_y(_run_checked(c, what), c, what)


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_mla_decode_strided_pages(fp8, seed):
    """vLLM's block-major layouts: a layer's pages 3 pages apart (the other two poisoned); the kernel reads
    through the page stride and never touches the memory between."""
    B, H = 8, 6
    lens = _lens(B)
    c = _case(B, H, lens, fp8=fp8, gap=2)
    assert not c["cache"].is_contiguous()
    what = f"strided pages B={B} H={H} fp8={fp8} lens={lens} seed={seed}"
    _check_y(_run_checked(c, what), c, what)


def test_mla_decode_no_gate(seed):
    c = _case(3, 12, [700, 1, 129], gate=False)
    what = f"no gate seed={seed}"
    _check_y(_run_checked(c, what), c, what)


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_mla_decode_long_context(fp8, seed):
    """131,089 positions next to short contexts in one batch (many splits of one sequence, empty splits of
    the others)."""
    lens = [131072 + 17, 5, 3000]
    c = _case(3, 12, lens, fp8=fp8)
    what = f"long fp8={fp8} seed={seed}"
    _check_y(_run_checked(c, what, max_ctx=max(lens)), c, what)


@pytest.mark.slow
@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_mla_decode_full_context(fp8, seed):
    """The full 1,048,576 positions of one sequence (the most splits the heuristic makes)."""
    c = _case(1, 12, [1_048_576], fp8=fp8)
    what = f"1M fp8={fp8} seed={seed}"
    _check_y(_run_checked(c, what), c, what)


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_mla_decode_offset_overflow(fp8, seed):
    """Every page of the batch lies past 2^31 bytes of the pool (a 32-bit offset would wrap)."""
    free = torch.cuda.mem_get_info()[0]
    if free < 3 * 2**31:
        pytest.skip(reason=f"needs ~6 GiB free GPU memory, {free / 2**30:.0f} GiB free")
    c = _case(2, 6, [1000, 77], fp8=fp8, high=True)
    assert int(c["block_table"][c["block_table"] >= 0].min()) * PAGE * 576 * (1 if fp8 else 2) >= 2**31
    what = f"high pages fp8={fp8} seed={seed}"
    _check_y(_run_checked(c, what), c, what)


def test_mla_decode_partial_and_merge_context_parallel(seed):
    """Each sequence's pages dealt over G = 3 ranks (one rank holds nothing of the second sequence):
    partials against the FP64 attention, their LSE merge against the whole."""
    from k3_fastpath.kernels import mla_decode as k

    B, H, G = 3, 12, 3
    lens = [1500, 40, 2049]
    c = _case(B, H, lens)
    R = c["q_lat"].shape[2]
    parts, lses = [], []
    kw = dict(softmax_scale=SCALE)
    for r in range(G):
        table = torch.full_like(c["block_table"], -1)
        ctx = torch.zeros(B, dtype=torch.int32, device="cuda")
        for b in range(B):
            js = [j for j in range(math.ceil(lens[b] / PAGE)) if j % G == r]
            if js:
                table[b, : len(js)] = c["block_table"][b, js]
            ctx[b] = sum(min(PAGE, lens[b] - j * PAGE) for j in js)
        n0, f0 = counters.launches(NAME), counters.fallbacks(NAME)
        o, lse = k.mla_decode_partial(c["q_lat"], c["q_pe"], c["cache"], table, ctx, **kw)
        assert counters.launches(NAME) == n0 + 1 and counters.fallbacks(NAME) == f0, "partial did not launch"
        o64, lse64 = k.mla_attention_ref(c["q_lat"], c["q_pe"], c["cache"], table, ctx, compute_dtype=torch.float64,
                                         **kw)
        o32, _ = k.mla_attention_ref(c["q_lat"], c["q_pe"], c["cache"], table, ctx, **kw)
        what = f"rank {r} seed={seed}"
        assert torch.equal(torch.isinf(lse), torch.isinf(lse64)), what
        fin = torch.isfinite(lse64)
        assert (lse.double()[fin] - lse64[fin]).abs().max() <= 4e-3, what
        e_fast = (o.double() - o64).abs().max().item()
        e_torch = (o32.bfloat16().double() - o64).abs().max().item()
        assert e_fast <= 2 * e_torch + 1e-3 * o64.abs().max().item(), f"o_lat err {e_fast:.3g} vs {e_torch:.3g} {what}"
        assert not torch.isnan(o).any() and torch.equal(o[~fin], torch.zeros_like(o[~fin])), what
        parts.append(o)
        lses.append(lse)
    assert R == 512
    n0 = counters.launches(f"{NAME}_merge")
    y = k.mla_merge(torch.stack(parts), torch.stack(lses), c["w_uv"], c["gate"])
    assert counters.launches(f"{NAME}_merge") == n0 + 1
    _check_y(y, c, f"merged seed={seed}")


def test_mla_decode_cuda_graph(seed):
    """Precompiled, captured with max_ctx given (no host sync), replayed: bitwise the eager result."""
    from k3_fastpath.kernels import mla_decode as k

    c = _case(8, 12, _lens(8), fp8=True)
    mx = int(c["ctx_len"].max())
    eager = k.mla_decode(*_args(c), softmax_scale=SCALE, cache_scale=c["cache_scale"], max_ctx=mx)
    out = torch.full_like(eager, float("nan"))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        k.mla_decode(*_args(c), softmax_scale=SCALE, cache_scale=c["cache_scale"], max_ctx=mx, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), f"graph replay differs seed={seed}"


def test_mla_decode_falls_back_with_reason(seed):
    from k3_fastpath.kernels import mla_decode as k

    c = _case(2, 6, [100, 3])
    c["q_lat"] = c["q_lat"].float()
    n0 = counters.fallbacks(NAME)
    y = k.mla_decode(*_args(c), softmax_scale=SCALE)
    assert counters.fallbacks(NAME) == n0 + 1 and y.shape == (2, 6 * 128) and not torch.isnan(y).any()
    assert any("q_lat dtype float32" in r for r in counters.snapshot()["fallbacks"][NAME])
