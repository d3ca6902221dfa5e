"""The MLA decode kernel's oracle (``kernels/mla_decode/reference.py``) against the model reference, on a CPU.

Contracts:
* one decode step of ``GatedMLA`` (absorbed form, k3-tiny shapes, ragged contexts) equals o_proj of
  ``mla_decode_ref`` over the same cache viewed as 64-position pages: FP64 to 1e-10; BF16 model with an
  FP8 cache (scale 0.5) to BF16 rounding (the oracle rounds where the model rounds);
* the LSE merge of context-parallel partials (positions dealt page by page over 3 ranks, one rank holding
  nothing of a sequence) equals the unsplit attention to 1e-12 (FP64);
* an empty sequence (ctx_len 0) gives o_lat 0, lse -inf, y 0 (no NaN);
* the split heuristic covers every position once with at most MAX_SPLITS splits; the support gate names
  its reasons. Fresh random weights and inputs each run; the seed is printed.
"""

from __future__ import annotations

import math
import secrets

import pytest
import torch

from k3_fastpath.kernels import mla_decode as k
from k3_fastpath.kernels.mla_decode.config import MAX_SPLITS, TILE, choose_splits
from k3_fastpath.presets import preset
from k3_fastpath.reference.mla import FP8, GatedMLA, MLACache

CFG = preset("k3-tiny").config
LAYER = CFG.mla_layer_ids[0]
PAGE = 64


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _module(gen, dtype) -> GatedMLA:
    m = GatedMLA(CFG, LAYER, dtype=torch.float64)
    for p in m.parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[1]))
    return m.to(dtype)


def _decode_both(gen, dtype, cache_dtype, scale=None):
    """Prefill ragged prompts, then one decode token: (model output [B, hidden], our composition's)."""
    B, max_len = 3, 2 * PAGE
    m = _module(gen, dtype)
    cache = MLACache.empty(CFG, B, max_len, cache_dtype, scale=scale)
    lengths = torch.tensor([70, 1, 127])[:B] - 1  # prompt lengths; the decode token makes 70 / 1 / 127
    prompt = torch.randn(B, int(lengths.max()), CFG.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    m(prompt, cache, torch.zeros(B, dtype=torch.long), lengths, mode="plain")
    x = torch.randn(B, 1, CFG.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    want = m(x, cache, lengths, mode="absorbed")[:, 0]

    q_nope, q_pe = m.project_q(x)
    w_uk, w_uv = k.split_kv_b(m.kv_b_proj.weight, m.num_heads, m.nope, m.v_dim)
    q_lat = k.absorb_q(q_nope[:, 0], w_uk)
    pages = cache.latent.view(B * max_len // PAGE, PAGE, -1)
    table = k.slot_block_table(torch.arange(B), max_len, PAGE)
    ctx = (lengths + 1).to(torch.int32)
    fp64 = dtype == torch.float64
    y = k.mla_decode_ref(q_lat, q_pe[:, 0], pages, table, ctx, w_uv, m.g_proj(x)[:, 0], softmax_scale=m.softmax_scale,
                         cache_scale=cache.scale, compute_dtype=torch.float64 if fp64 else torch.float32,
                         rounding=not fp64)
    return want, m.o_proj(y.to(dtype))


def test_matches_gated_mla_fp64(gen):
    want, got = _decode_both(gen, torch.float64, torch.float64)
    assert (got - want).abs().max() <= 1e-10 * want.abs().max(), (got - want).abs().max()


def test_matches_gated_mla_bf16_fp8_cache(gen):
    want, got = _decode_both(gen, torch.bfloat16, FP8, scale=0.5)
    err = (got.double() - want.double()).abs().max() / want.double().abs().max()
    assert err <= 2e-2, err


def _pages_of(B, lens, D, gen):
    """A pool holding B sequences' positions in shuffled 64-position pages."""
    need = [math.ceil(n / PAGE) for n in lens]
    perm = torch.randperm(sum(need) + 2, generator=gen)
    pool = torch.randn(len(perm), PAGE, D, generator=gen, dtype=torch.float64)
    table = torch.full((B, max(need) + 1), -1, dtype=torch.int32)
    i = 0
    for b in range(B):
        table[b, : need[b]] = perm[i: i + need[b]].to(torch.int32)
        i += need[b]
    return pool, table


def test_merge_of_context_parallel_partials(gen):
    B, H, R, P, V, G = 4, 3, 32, 16, 8, 3
    lens = [200, 64, 1, 0]
    pool, table = _pages_of(B, lens, R + P, gen)
    q_lat = torch.randn(B, H, R, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(B, H, P, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(H, V, R, generator=gen, dtype=torch.float64)
    gate = torch.randn(B, H * V, generator=gen, dtype=torch.float64)
    ctx = torch.tensor(lens, dtype=torch.int32)
    kw = dict(softmax_scale=0.2, compute_dtype=torch.float64)
    full = k.mla_decode_ref(q_lat, q_pe, pool, table, ctx, w_uv, gate, rounding=False, **kw)
    o_full, lse_full = k.mla_attention_ref(q_lat, q_pe, pool, table, ctx, **kw)
    parts, lses = [], []
    for r in range(G):  # rank r holds the pages j with j % G == r of every sequence (the partial page last)
        rt = torch.full_like(table, -1)
        rc = torch.zeros(B, dtype=torch.int32)
        for b in range(B):
            js = [j for j in range(math.ceil(lens[b] / PAGE)) if j % G == r]
            rt[b, : len(js)] = table[b, js]
            rc[b] = sum(min(PAGE, lens[b] - j * PAGE) for j in js)
        o, lse = k.mla_attention_ref(q_lat, q_pe, pool, rt, rc, **kw)
        parts.append(o)
        lses.append(lse)
    o_m, lse_m = k.mla_merge_ref(torch.stack(parts), torch.stack(lses))
    assert torch.equal(torch.isinf(lse_m), torch.isinf(lse_full))
    fin = torch.isfinite(lse_full)
    assert (lse_m[fin] - lse_full[fin]).abs().max() <= 1e-12
    assert (o_m - o_full).abs().max() <= 1e-12
    y = k.mla_merge_ref(torch.stack(parts), torch.stack(lses), w_uv, gate, rounding=False)
    assert (y - full).abs().max() <= 1e-12
    assert torch.equal(full[3], torch.zeros_like(full[3])) and torch.equal(o_full[3], torch.zeros_like(o_full[3]))
    assert torch.isinf(lse_full[3]).all() and not torch.isnan(full).any()


def test_split_heuristic_covers_every_position():
    for B in (1, 8, 64):
        for groups in (1, 6):
            for ctx in (1, 63, 64, 65, 1024, 32768, 131072, 1_048_576):
                s, per = choose_splits(B, groups, ctx)
                tiles = math.ceil(ctx / TILE)
                assert 1 <= s <= MAX_SPLITS and (s - 1) * per < tiles <= s * per, (B, groups, ctx, s, per)
    assert choose_splits(1, 1, 131072)[0] >= 64  # one sequence spreads over the SMs
    assert choose_splits(64, 1, 1024)[0] <= 4


def test_configs_fit_shared_memory():
    from k3_fastpath.kernels.mla_decode.config import SMEM_LIMIT

    for H, fp8 in ((12, False), (12, True), (6, False), (6, True), (96, True), (4, False)):
        c = k.MLADecodeConfig.from_heuristic(H, 576, fp8)
        assert c.smem_bytes(576) <= SMEM_LIMIT and c.heads_per_cta == (16 if H > 8 else 8), c
    assert k.MLADecodeConfig.from_heuristic(12, 576, False).stages == 2
    assert k.MLADecodeConfig.from_heuristic(12, 576, True).stages == 3


def test_support_gate_reasons():
    B, H, R, P = 2, 4, 32, 16
    bf = torch.bfloat16
    ql, qp = torch.zeros(B, H, R, dtype=bf), torch.zeros(B, H, P, dtype=bf)
    cache = torch.zeros(4, 64, R + P, dtype=bf)
    bt, ctx = torch.zeros(B, 2, dtype=torch.int32), torch.ones(B, dtype=torch.int32)
    w = torch.zeros(H, 32, R, dtype=bf)
    assert "page_size" in k.is_supported(ql, qp, torch.zeros(4, 32, R + P, dtype=bf), bt, ctx, w).reason
    assert k.is_supported(ql, qp, torch.zeros(4, 64, R, dtype=bf), bt, ctx, w).reason == (
        "cache shape [4, 64, 32] (needs [pages, page_size, R+P] = [4, 64, 48])")
    assert "cache_scale" in k.is_supported(ql, qp, cache.to(FP8), bt, ctx, w).reason
    assert "cache dtype" in k.is_supported(ql, qp, cache.float(), bt, ctx, w).reason
    assert not k.is_supported(ql, qp, cache, bt, ctx, w)  # CPU tensors never reach the kernel
    got = k.mla_decode(ql, qp, cache, bt, ctx, w, softmax_scale=0.1)  # served by the reference
    assert got.shape == (B, H * 32) and got.dtype == bf
