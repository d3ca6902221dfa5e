"""Gated NoPE MLA reference (k3_fastpath.reference.mla).

Contracts:
* at FP64 the ``plain`` and ``absorbed`` forms agree to 1e-12 and both match an independent oracle written
  here from the formulas (explicit per-sequence / per-query / per-head loops, no cache) to 1e-10, for
  ragged lengths, continuation after an earlier prefill and token-by-token decode;
* padded tokens write nothing and output exactly 0; stale (NaN-poisoned) cache slots are never read;
* an FP8 latent cache changes the output by a small, nonzero amount, more than a BF16 cache does.
Fresh random weights and inputs each run; the seed is printed.
"""

from __future__ import annotations

import math
import secrets

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.mla import FP8, GatedMLA, MLACache

CFG = preset("k3-tiny").config
LAYER = CFG.mla_layer_ids[0]


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _module(gen, dtype=torch.float64) -> GatedMLA:
    m = GatedMLA(CFG, LAYER, dtype=torch.float64)
    with torch.no_grad():
        for _name, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[1]))
    return m.to(dtype)


def _x(gen, b, t, dtype=torch.float64):
    return torch.randn(b, t, CFG.hidden_size, generator=gen, dtype=torch.float64).to(dtype)


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def _oracle(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Plain gated NoPE MLA of ONE sequence ``x [L, H]`` at positions 0..L-1, FP64, explicit loops."""
    w = {k: v.double() for k, v in m.state_dict().items()}
    eps = CFG.rms_norm_eps
    nh, dn, dr, dv, r = (CFG.num_attention_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim,
                         CFG.kv_lora_rank)
    x = x.double()
    n = x.shape[0]
    q, c, kpe = [], [], []
    for t in range(n):
        qa = _rms(w["q_a_proj.weight"] @ x[t], w["q_a_layernorm.weight"], eps)
        q.append((w["q_b_proj.weight"] @ qa).view(nh, dn + dr))
        kv = w["kv_a_proj_with_mqa.weight"] @ x[t]
        c.append(_rms(kv[:r], w["kv_a_layernorm.weight"], eps))
        kpe.append(kv[r:])
    kvb = w["kv_b_proj.weight"].view(nh, dn + dv, r)
    out = torch.zeros(n, CFG.hidden_size, dtype=torch.float64)
    for t in range(n):
        heads = []
        for hh in range(nh):
            keys = range(t + 1)
            logits = []
            for s in keys:
                k_nope = kvb[hh, :dn] @ c[s]
                logits.append(float(q[t][hh, :dn] @ k_nope + q[t][hh, dn:] @ kpe[s]) / math.sqrt(dn + dr))
            mx = max(logits)
            e = [math.exp(z - mx) for z in logits]
            o = sum((e[s] / sum(e)) * (kvb[hh, dn:] @ c[s]) for s in keys)
            heads.append(o)
        o = torch.cat(heads) * torch.sigmoid(w["g_proj.weight"] @ x[t])
        out[t] = w["o_proj.weight"] @ o
    return out


def _cache(b, max_len, dtype=torch.float64, poison=True, scale=None):
    c = MLACache.empty(CFG, b, max_len, dtype, scale=scale)
    if poison and dtype != FP8:
        c.latent.fill_(float("nan"))  # stale slots: must never reach an output
    return c


def _run(m, x, lengths, cache, start, mode):
    with torch.no_grad():
        return m(x, cache, torch.as_tensor(start), torch.as_tensor(lengths), mode=mode)


@pytest.mark.parametrize("mode", ["plain", "absorbed"])
def test_matches_oracle_ragged_fp64(gen, mode):
    m = _module(gen)
    lengths = [7, 3, 1, 0]
    x = _x(gen, 4, 7)
    out = _run(m, x, lengths, _cache(4, 12), [0, 0, 0, 0], mode)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        if n:
            torch.testing.assert_close(out[b, :n], _oracle(m, x[b, :n]), rtol=1e-10, atol=1e-10)
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:])), "padded tokens must output exactly 0"


def test_absorbed_equals_plain_fp64(gen):
    m = _module(gen)
    lengths = [6, 2, 5]
    x = _x(gen, 3, 6)
    ca, cb = _cache(3, 9), _cache(3, 9)
    a = _run(m, x, lengths, ca, [0, 0, 0], "plain")
    b = _run(m, x, lengths, cb, [0, 0, 0], "absorbed")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert a.abs().max() > 1e-2
    torch.testing.assert_close(ca.latent, cb.latent, equal_nan=True, rtol=0, atol=0)
    # continuation from different starting points
    x2 = _x(gen, 3, 3)
    a2 = _run(m, x2, [3, 1, 2], ca, [6, 2, 5], "plain")
    b2 = _run(m, x2, [3, 1, 2], cb, [6, 2, 5], "absorbed")
    torch.testing.assert_close(a2, b2, rtol=1e-12, atol=1e-12)


def test_continuation_and_decode_match_one_shot(gen):
    """Prefill a ragged first part, continue with a ragged second part, then decode token by token."""
    m = _module(gen)
    total = [8, 5, 6]
    first = [3, 5, 1]
    x = _x(gen, 3, 8)
    ref = [_oracle(m, x[b, :total[b]]) for b in range(3)]
    cache = _cache(3, 10)
    out1 = _run(m, x[:, :5], first, cache, [0, 0, 0], "plain")
    second = [2, 0, 4]
    x2 = torch.stack([x[b, first[b]:first[b] + 4] if first[b] + 4 <= 8 else torch.cat(
        [x[b, first[b]:], x.new_zeros(first[b] + 4 - 8, x.shape[-1])]) for b in range(3)])
    out2 = _run(m, x2, second, cache, first, "plain")
    pos = [f + s for f, s in zip(first, second, strict=True)]
    for b in range(3):
        torch.testing.assert_close(out1[b, :first[b]], ref[b][:first[b]], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out2[b, :second[b]], ref[b][first[b]:pos[b]], rtol=1e-10, atol=1e-10)
    # decode the rest one token per step, each sequence at its own position; finished ones inactive
    while any(p < t for p, t in zip(pos, total, strict=True)):
        active = [p < t for p, t in zip(pos, total, strict=True)]
        xt = torch.stack([x[b, min(pos[b], 7)] for b in range(3)]).unsqueeze(1)
        o = _run(m, xt, [int(a) for a in active], cache, pos, "auto")
        for b in range(3):
            if active[b]:
                torch.testing.assert_close(o[b, 0], ref[b][pos[b]], rtol=1e-10, atol=1e-10)
                pos[b] += 1
            else:
                assert torch.equal(o[b, 0], torch.zeros_like(o[b, 0]))


def test_padded_tokens_write_nothing(gen):
    m = _module(gen)
    cache = _cache(2, 8)
    _run(m, _x(gen, 2, 5), [5, 2], cache, [1, 3], "plain")
    written = ~torch.isnan(cache.latent).all(-1)
    expect = torch.zeros(2, 8, dtype=torch.bool)
    expect[0, 1:6] = True
    expect[1, 3:5] = True
    assert torch.equal(written, expect)
    with pytest.raises(IndexError):
        _run(m, _x(gen, 2, 4), [4, 0], cache, [6, 0], "plain")


def test_bf16_close_to_fp64_and_forms_agree(gen):
    """BF16 module and cache: both forms within BF16 rounding of the FP64 oracle, neither much worse."""
    m64 = _module(gen)
    m16 = GatedMLA(CFG, LAYER, torch.bfloat16)
    m16.load_state_dict(m64.state_dict())
    m64.load_state_dict(m16.state_dict())  # the oracle uses the BF16-rounded weights
    x = _x(gen, 2, 6).bfloat16()
    ref = _run(m64, x.double(), [6, 4], _cache(2, 8), [0, 0], "plain")
    errs = {}
    for mode in ("plain", "absorbed"):
        out = _run(m16, x, [6, 4], _cache(2, 8, torch.bfloat16), [0, 0], mode)
        assert out.dtype == torch.bfloat16
        errs[mode] = float((out.double() - ref).abs().max() / ref.abs().max())
    assert errs["plain"] < 3e-2 and errs["absorbed"] < 3e-2, errs
    assert errs["absorbed"] <= 2 * errs["plain"] + 1e-2, errs


def test_fp8_cache_error_small_but_nonzero(gen):
    m = _module(gen)
    x = _x(gen, 2, 6)
    lengths = [6, 5]
    ref = _run(m, x, lengths, _cache(2, 6), [0, 0], "plain")
    c16 = _cache(2, 6, torch.bfloat16)
    out16 = _run(m, x, lengths, c16, [0, 0], "absorbed")
    c8 = _cache(2, 6, FP8)
    out8 = _run(m, x, lengths, c8, [0, 0], "absorbed")
    assert c8.latent.dtype == FP8 and c8.scale.dtype == torch.float32 and float(c8.scale) == 1.0
    scale = ref.abs().max()
    e16 = float((out16 - ref).abs().max() / scale)
    e8 = float((out8 - ref).abs().max() / scale)
    assert 0 < e16 < e8 < 0.1, (e16, e8)
    # the per-tensor scale: stored = latent / scale
    c8s = _cache(2, 6, FP8, scale=0.25)
    out8s = _run(m, x, lengths, c8s, [0, 0], "plain")
    lat = m.project_latent(x).detach()
    stored = c8s.latent[0, :6].double()
    assert ((stored - lat[0] / 0.25).abs() <= (lat[0] / 0.25).abs() * 2 ** -3 + 2 ** -9).all()
    assert float((out8s - ref).abs().max() / scale) < 0.1


def test_cache_validation():
    with pytest.raises(ValueError):
        MLACache.empty(CFG, 1, 4, torch.bfloat16, scale=2.0)
    with pytest.raises(ValueError):
        MLACache.empty(CFG, 1, 4, FP8, scale=0.0)
    c = MLACache.empty(CFG, 2, 4, FP8)
    assert c.latent.shape == (2, 4, CFG.kv_lora_rank + CFG.qk_rope_head_dim)
