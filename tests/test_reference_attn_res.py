"""AttnRes reference (k3_fastpath.reference.attn_res) against its formula, written out per token and source.

Contract: FP64 inputs match the explicit-loop FP64 oracle to 1e-12; BF16 inputs match it to BF16 rounding
of the output (the mix itself runs in FP32). Fresh random inputs each run; the seed is printed.
"""

from __future__ import annotations

import math
import secrets

import pytest
import torch

from k3_fastpath.reference.attn_res import apply_attn_res, attn_res_weights


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _inputs(gen, n=5, nb=3, h=48, dtype=torch.float64):
    prefix = torch.randn(n, h, generator=gen, dtype=torch.float64)
    # sources of very different magnitudes: the mix must use the raw values, the logits the normalised ones
    blocks = torch.randn(n, nb, h, generator=gen, dtype=torch.float64) * torch.rand(1, nb, 1, generator=gen,
                                                                                   dtype=torch.float64).mul(20).add(0.5)
    # logits of about unit spread: a mix neither one-hot nor uniform (at 2 / sqrt(h) a row came out 0.9993 one-hot)
    proj = torch.randn(1, h, generator=gen, dtype=torch.float64) * (1 / math.sqrt(h))
    norm = 1 + 0.1 * torch.randn(h, generator=gen, dtype=torch.float64)
    return prefix.to(dtype), blocks.to(dtype), proj.to(dtype), norm.to(dtype)


def _oracle(prefix, blocks, proj, norm, eps):
    """Explicit loops in FP64: per token n, per source i."""
    prefix, blocks, proj, norm = (t.double() for t in (prefix, blocks, proj, norm))
    n, nb, h = blocks.shape
    out = torch.zeros(n, h, dtype=torch.float64)
    weights = torch.zeros(n, nb + 1, dtype=torch.float64)
    for t in range(n):
        sources = [blocks[t, i] for i in range(nb)] + [prefix[t]]
        logits = []
        for v in sources:
            ms = sum(float(v[j]) ** 2 for j in range(h)) / h
            r = 1.0 / math.sqrt(ms + eps)
            logits.append(sum(float(v[j]) * r * float(norm[j]) * float(proj[0, j]) for j in range(h)))
        m = max(logits)
        e = [math.exp(x - m) for x in logits]
        z = sum(e)
        for i, v in enumerate(sources):
            weights[t, i] = e[i] / z
            out[t] += (e[i] / z) * v
    return out, weights


def test_matches_formula_fp64(gen):
    prefix, blocks, proj, norm = _inputs(gen)
    ref, ref_w = _oracle(prefix, blocks, proj, norm, 1e-5)
    out = apply_attn_res(prefix, blocks, proj, norm, 1e-5)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    v = torch.cat([blocks, prefix.unsqueeze(1)], dim=1)
    torch.testing.assert_close(attn_res_weights(v, proj, norm, 1e-5), ref_w, rtol=1e-12, atol=1e-12)
    # the mix is neither one-hot nor uniform with these inputs, so the test can tell a wrong formula apart
    assert (ref_w.max(dim=-1).values < 0.999).all() and (ref_w.std(dim=-1) > 1e-3).all()


def test_list_blocks_equal_stacked_blocks_and_leading_dims(gen):
    prefix, blocks, proj, norm = _inputs(gen, n=6)
    a = apply_attn_res(prefix, blocks, proj, norm, 1e-5)
    b = apply_attn_res(prefix, [blocks[:, i] for i in range(blocks.shape[1])], proj, norm, 1e-5)
    c = apply_attn_res(prefix.view(2, 3, -1), [blocks[:, i].view(2, 3, -1) for i in range(blocks.shape[1])],
                       proj, norm, 1e-5)
    assert torch.equal(a, b)
    torch.testing.assert_close(c.reshape(6, -1), a, rtol=1e-14, atol=1e-14)


def test_bf16_matches_formula_to_bf16_rounding(gen):
    prefix, blocks, proj, norm = _inputs(gen, dtype=torch.bfloat16)
    ref, _ = _oracle(prefix, blocks, proj, norm, 1e-5)
    out = apply_attn_res(prefix, blocks, proj, norm, 1e-5)
    assert out.dtype == torch.bfloat16
    # one BF16 rounding of the output (2^-8 relative) plus FP32 accumulation
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -8 + 1e-3 * ref.abs().max()).all(), float(err.max())


def test_mixes_raw_values_not_normalised_ones(gen):
    """Scaling every source by c leaves the logits unchanged (they are RMS-normalised) and scales the output."""
    prefix, blocks, proj, norm = _inputs(gen)
    c = float(torch.rand((), generator=gen, dtype=torch.float64)) * 50 + 2
    a = apply_attn_res(prefix, blocks, proj, norm, 0.0)
    b = apply_attn_res(prefix * c, blocks * c, proj, norm, 0.0)
    torch.testing.assert_close(b, a * c, rtol=1e-12, atol=1e-12)
    # a zero projection gives uniform weights: the output is the plain mean of the raw sources
    u = apply_attn_res(prefix, blocks, torch.zeros_like(proj), norm, 1e-5)
    torch.testing.assert_close(u, torch.cat([blocks, prefix.unsqueeze(1)], 1).mean(1), rtol=1e-12, atol=1e-12)


def test_softmax_weights_sum_to_one_and_convexity(gen):
    prefix, blocks, proj, norm = _inputs(gen, n=7, nb=4)
    v = torch.cat([blocks, prefix.unsqueeze(1)], dim=1)
    w = attn_res_weights(v, proj, norm, 1e-5)
    assert (w > 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(7, dtype=torch.float64), rtol=1e-14, atol=1e-14)
    # identical sources mix to themselves
    same = prefix.unsqueeze(1).expand(-1, 3, -1)
    torch.testing.assert_close(apply_attn_res(prefix, same, proj, norm, 1e-5), prefix, rtol=1e-13, atol=1e-13)


def test_no_blocks_is_identity(gen):
    prefix, _, proj, norm = _inputs(gen)
    assert torch.equal(apply_attn_res(prefix, [], proj, norm, 1e-5), prefix)


def test_shape_errors(gen):
    prefix, blocks, proj, norm = _inputs(gen)
    with pytest.raises(ValueError):
        apply_attn_res(prefix, blocks[:3], proj, norm, 1e-5)
    with pytest.raises(ValueError):
        apply_attn_res(prefix, blocks, proj[:, :5], norm, 1e-5)
