"""The KDA verify step's contract on the CPU (the reference the kernel falls back to and is tested against):
``kda_decode(..., slot_out=, tokens=T)`` equals T decode steps in order, bitwise; the state after token t
lands at ``slot_out[b*T + t]``; the sequences' own slots and every other slot are untouched; a padded token
(slot_out 0) writes nothing; an empty sequence gets zeros; bad arguments are refused."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.kernels import kda_decode as k

H, D = 2, 32


def _case(B: int, T: int, N: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    C = H * D

    def r(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    prm = (r(C, 4, scale=0.5, dtype=torch.float32), r(C, 4, scale=0.5, dtype=torch.float32),
           r(C, 4, scale=0.5, dtype=torch.float32), torch.rand(H, generator=g).mul(15).add(1).log(),
           r(C, scale=0.5, dtype=torch.float32), 1 + r(D, scale=0.1, dtype=torch.float32))
    inp = [r(B * T, C) for _ in range(4)] + [r(B * T, C, scale=2.0), r(B * T, H, scale=2.0)]
    pools = [r(N, 3, C) for _ in range(3)] + [r(N, H, D, D, scale=0.05, dtype=torch.float32)]
    return prm, inp, pools


def _decode(inp, prm, slot, pools, **kw):
    return k.op(*inp, *prm, slot, *pools, eps=1e-5, lower_bound=-5.0, **kw)


@pytest.mark.parametrize("T", (1, 3, 8))
def test_verify_equals_sequential_decode(T):
    B, N = 4, 1 + 4 + 4 * 8
    prm, inp, pools = _case(B, T, N, seed=T)
    slot = torch.tensor([3, 1, 0, 4], dtype=torch.int32)  # out slots: 5 .. N-1
    out_slots = torch.arange(N - B * T, N, dtype=torch.int32)
    out_slots[T - 1] = 0  # sequence 0's last token is padding
    before = [p.clone() for p in pools]
    y = _decode(inp, prm, slot, pools, slot_out=out_slots, tokens=T)
    seq = [p.clone() for p in before]
    written = torch.zeros(N, dtype=torch.bool)
    for t in range(T):
        rows = torch.arange(B) * T + t
        y_t = _decode([x[rows] for x in inp], prm, slot, seq)
        assert torch.equal(y[rows], y_t), f"token {t}: y differs from a decode step"
        for b in range(B):
            o, s = int(out_slots[b * T + t]), int(slot[b])
            if o and s:
                written[o] = True
                for p, q in zip(pools, seq, strict=True):
                    assert torch.equal(p[o], q[s]), f"token {t} sequence {b}: state at slot_out differs"
    assert torch.equal(y[2 * T: 3 * T], torch.zeros_like(y[2 * T: 3 * T])), "empty sequence's rows not zero"
    assert not written[slot.long()].any()
    for p, q in zip(pools, before, strict=True):
        assert torch.equal(p[~written], q[~written]), "a slot outside slot_out changed (the sequences' own included)"


def test_verify_refuses_bad_arguments():
    prm, inp, pools = _case(2, 3, 12, seed=0)
    slot = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="need slot_out"):
        _decode(inp, prm, slot, pools, tokens=3)
    with pytest.raises(ValueError, match="tokens per sequence"):
        k.KDADecodeConfig.from_heuristic(32, tokens=9)
    s = k.is_supported(*inp, *prm, slot, *pools, slot_out=torch.arange(3, 9, dtype=torch.int32), tokens=4)
    assert not s and "shape" in s.reason, s.reason


def test_vllm_layout_is_the_pool_step_on_views():
    """``kda_decode_vllm`` on vLLM's packed conv window and [V, K] state (vLLM pads with -1) is the pool step:
    y bitwise equal, each cache bitwise the pool's after conversion, padded and unused slots untouched; on a
    CPU it is served by the reference and counted as a fallback of ``kda_decode``."""
    from vllm_layout import kda_pages

    from k3_fastpath._lib import counters
    from k3_fastpath.kernels.kda_decode.reference import vllm_views

    B, N = 5, 9
    prm, inp, pools = _case(B, 1, N, seed=11)
    slot = torch.tensor([3, -1, 7, 0, 1], dtype=torch.int32)
    conv, state = kda_pages(torch.cat(pools[:3], dim=-1), pools[3].transpose(-1, -2))  # vLLM's padded pages
    conv0, state0 = conv.clone(), state.clone()
    n0 = counters.fallbacks(k.NAME)
    y_pool = _decode(inp, prm, slot, pools)
    y = k.kda_decode_vllm(*inp, *prm, slot, conv, state, eps=1e-5, lower_bound=-5.0)
    assert counters.fallbacks(k.NAME) == n0 + 2
    assert torch.equal(y, y_pool)
    assert torch.equal(y[[1, 3]], torch.zeros_like(y[[1, 3]])), "padded rows (-1, 0) not zero"
    for got, want in zip(vllm_views(conv, state), pools, strict=True):
        assert torch.equal(got, want)
    live = torch.zeros(N, dtype=torch.bool)
    live[[3, 7, 1]] = True
    assert not torch.equal(conv[live], conv0[live]) and not torch.equal(state[live], state0[live])
    assert torch.equal(conv[~live], conv0[~live]) and torch.equal(state[~live], state0[~live])
