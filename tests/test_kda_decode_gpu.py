"""GPU numerics of the KDA decode kernel (H100/H200, sm_90a). Run: python -m pytest -m gpu tests/test_kda_decode_gpu.py

Contract (K3.md "Tolerances", STYLE.md rule 6), against an FP64 evaluation of the same formula
(``kda_decode_ref_outputs(..., compute_dtype=torch.float64)`` on the pre-call caches):
* output y (bf16): |y - y64| <= 2e-2 + 3e-2 |y64|, and max|y - y64| <= 2 x the error of the FP32 torch
  reference rounded to bf16 + 1e-3 max|y64| (matches to BF16 rounding, not bitwise);
* recurrent state (FP32, in place): |S - S64| <= 2e-3 + 2e-3 |S64|;
* conv state (BF16, in place): bit-exact (it is a shift of BF16 inputs, no arithmetic);
* every pool slot not used by the batch, slot 0 included, bitwise unchanged; empty-slot rows of y are 0;
* the kernel ran (launch counter +1, no fallback), y was written (NaN-poisoned before), and a repeat from
  the same caches is bitwise identical.
Inputs are fresh random tensors each run (non-zero caches; A_log = log U(1, 16)); the seed is in every
failure message.

Grid: B in (1, 2, 3, 8, 64) (1: a single CTA per head; 3: odd; 64: the largest decode batch); heads 12
(TP8) and 6 (TP16; K3.md failure 1 was a 6-head gate); k3-tiny's 4 heads of 32. Slots are a random
permutation of the pool with some 0 (empty) entries; one case uses a pool whose last slot lies past
2^31 state elements (catches 32-bit offset overflow; ~9 GB).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from vllm_layout import kda_pages

from k3_fastpath._lib import counters

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

NAME = "kda_decode"
EPS = 1e-5
LOWER_BOUND = -5.0




def _params(H: int, D: int) -> dict:
    C = H * D
    dev = "cuda"
    return {"conv_q_w": torch.randn(C, 4, device=dev) * 0.5, "conv_k_w": torch.randn(C, 4, device=dev) * 0.5,
            "conv_v_w": torch.randn(C, 4, device=dev) * 0.5,
            "A_log": torch.empty(H, device=dev).uniform_(1, 16).log(),
            "dt_bias": torch.randn(C, device=dev) * 0.5, "o_norm_w": 1 + 0.1 * torch.randn(D, device=dev)}


def _inputs(B: int, H: int, D: int) -> dict:
    C = H * D

    def bf(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).bfloat16()

    return {"q": bf(B, C), "k": bf(B, C), "v": bf(B, C), "g": bf(B, C), "a": bf(B, C, scale=2.0),
            "beta_logits": bf(B, H, scale=2.0)}


def _pools(N: int, H: int, D: int) -> dict:
    C = H * D
    return {"conv_q": torch.randn(N, 3, C, device="cuda").bfloat16(),
            "conv_k": torch.randn(N, 3, C, device="cuda").bfloat16(),
            "conv_v": torch.randn(N, 3, C, device="cuda").bfloat16(),
            "state": torch.randn(N, H, D, D, device="cuda") * 0.05}


def _slots(B: int, N: int, force_last: bool) -> torch.Tensor:
    s = random.sample(range(1, N), B)
    if force_last:
        s[random.randrange(B)] = N - 1 if N - 1 not in s else s[0]
    if B >= 2:  # some empty sequences, never all
        for i in random.sample(range(B), max(1, B // 4)):
            s[i] = 0
    return torch.tensor(s, dtype=torch.int32, device="cuda")


def _call(k, inp, prm, slot, pools, out):
    return k.op(inp["q"], inp["k"], inp["v"], inp["g"], inp["a"], inp["beta_logits"], prm["conv_q_w"],
                prm["conv_k_w"], prm["conv_v_w"], prm["A_log"], prm["dt_bias"], prm["o_norm_w"], slot,
                pools["conv_q"], pools["conv_k"], pools["conv_v"], pools["state"], eps=EPS,
                lower_bound=LOWER_BOUND, out=out)


def _call_vllm(k, inp, prm, slot, pools, out):
    """``kda_decode_vllm`` on vLLM's layout of the same caches (packed conv, [V, K] state, in shared padded
    pages), the results copied back into ``pools`` (the executor's layout) for the checks."""
    from k3_fastpath.kernels.kda_decode.reference import vllm_views

    conv, state = kda_pages(torch.cat([pools["conv_q"], pools["conv_k"], pools["conv_v"]], dim=-1),
                              pools["state"].transpose(-1, -2))
    y = k.kda_decode_vllm(inp["q"], inp["k"], inp["v"], inp["g"], inp["a"], inp["beta_logits"], prm["conv_q_w"],
                          prm["conv_k_w"], prm["conv_v_w"], prm["A_log"], prm["dt_bias"], prm["o_norm_w"], slot,
                          conv, state, eps=EPS, lower_bound=LOWER_BOUND, out=out)
    for n, view in zip(("conv_q", "conv_k", "conv_v", "state"), vllm_views(conv, state), strict=True):
        pools[n].copy_(view)
    return y


def _ref(k, inp, prm, slot, pools, dtype):
    from k3_fastpath.kernels.kda_decode import kda_decode_ref_outputs

    return kda_decode_ref_outputs(inp["q"], inp["k"], inp["v"], inp["g"], inp["a"], inp["beta_logits"],
                                  prm["conv_q_w"], prm["conv_k_w"], prm["conv_v_w"], prm["A_log"], prm["dt_bias"],
                                  prm["o_norm_w"], slot, pools["conv_q"], pools["conv_k"], pools["conv_v"],
                                  pools["state"], eps=EPS, lower_bound=LOWER_BOUND, compute_dtype=dtype)


def _run_and_check(B, H, D, N, seed, force_last=False, vllm=False):
    """``vllm``: the build on vLLM's cache layout (``kda_decode_vllm``), empty rows padded with -1 as vLLM pads."""
    from k3_fastpath.kernels import kda_decode as k

    C = H * D
    prm, inp, pools = _params(H, D), _inputs(B, H, D), _pools(N, H, D)
    slot = _slots(B, N, force_last)
    if vllm:
        slot[slot == 0] = -1
    call = _call_vllm if vllm else _call
    before = {n: t.clone() for n, t in pools.items()}
    r64 = _ref(k, inp, prm, slot, before, torch.float64)
    r32 = _ref(k, inp, prm, slot, before, torch.float32)
    what = f"B={B} H={H} D={D} N={N} slots={slot.tolist() if B <= 8 else '...'} seed={seed}"

    results = []
    for rep in range(2):
        if rep:
            for n, t in pools.items():
                t.copy_(before[n])
        out = torch.full((B, C), float("nan"), dtype=torch.bfloat16, device="cuda")
        snap = counters.snapshot()
        y = call(k, inp, prm, slot, pools, out)
        after = counters.snapshot()
        assert after["fallbacks"].get(NAME, {}) == snap["fallbacks"].get(NAME, {}), \
            f"fell back: {after['fallbacks'].get(NAME)} {what}"
        assert after["launches"].get(NAME, 0) == snap["launches"].get(NAME, 0) + 1, f"did not launch {what}"
        assert y.data_ptr() == out.data_ptr()
        torch.cuda.synchronize()
        results.append((y.clone(), {n: t.clone() for n, t in pools.items()}))
    (y, new), (y2, new2) = results
    assert torch.equal(y, y2), f"y not deterministic {what}"
    for n in new:
        assert torch.equal(new[n], new2[n]), f"{n} not deterministic {what}"

    active, idx = r64["active"], r64["idx"]
    assert not torch.isnan(y).any(), f"NaN in y (not written?) {what}"
    assert torch.equal(y[~active], torch.zeros_like(y[~active])), f"empty-slot rows of y not zero {what}"
    # output
    ya, y64, y32 = y[active].double(), r64["y"][active], r32["y"][active].bfloat16().double()
    bad = (ya - y64).abs() > 2e-2 + 3e-2 * y64.abs()
    assert not bad.any(), f"y: {int(bad.sum())} elements outside 3e-2/2e-2, max err {(ya - y64).abs().max():.3g} {what}"
    e_fast, e_torch = (ya - y64).abs().max().item(), (y32 - y64).abs().max().item()
    atol = 1e-3 * y64.abs().max().item()
    assert e_fast <= 2 * e_torch + atol, f"y err {e_fast:.3g} > 2 x torch {e_torch:.3g} + {atol:.3g} {what}"
    # state
    s, s64 = new["state"][idx].double(), r64["state"]
    serr = (s - s64).abs() - (2e-3 + 2e-3 * s64.abs())
    assert (serr <= 0).all(), f"state err max {(s - s64).abs().max():.3g} {what}"
    # conv state: bit-exact
    for n in ("conv_q", "conv_k", "conv_v"):
        assert torch.equal(new[n][idx], r64[n]), f"{n} not bit-exact {what}"
    # untouched slots (slot 0 included) bitwise unchanged
    keep = torch.ones(N, dtype=torch.bool, device="cuda")
    keep[idx] = False
    for n in new:
        assert torch.equal(new[n][keep], before[n][keep]), f"{n}: an untouched slot changed {what}"
    return e_fast, e_torch


@pytest.mark.parametrize("B", (1, 2, 3, 8, 64))
@pytest.mark.parametrize("H", (12, 6))
def test_kda_decode(B, H, seed):
    _run_and_check(B, H, 128, N=2 * B + 9, seed=seed)


@pytest.mark.parametrize("B", (1, 3, 8, 64))
@pytest.mark.parametrize("H,D", ((6, 128), (12, 128), (4, 32)))
def test_kda_decode_vllm_layout(B, H, D, seed):
    """vLLM's KDA cache tensors in place (the route's decode step): same contract as the executor's pools."""
    _run_and_check(B, H, D, N=2 * B + 9, seed=seed, vllm=True)


@pytest.mark.parametrize("B", (1, 3, 8))
def test_kda_decode_tiny(B, seed):
    _run_and_check(B, 4, 32, N=2 * B + 5, seed=seed)


def test_kda_decode_large_pool(seed):
    """A slot whose state offset exceeds 2^31 elements (6 heads x 128 x 128 = 98304 per slot)."""
    H, D = 6, 128
    N = 2**31 // (H * D * D) + 8
    free = torch.cuda.mem_get_info()[0]
    need = 2.2 * N * (H * D * D * 4 + 3 * 3 * H * D * 2)  # pools + the test's copy of them
    if free < need:
        pytest.skip(reason=f"needs {need / 2**30:.0f} GiB free GPU memory, {free / 2**30:.0f} GiB free")
    _run_and_check(8, H, D, N=N, seed=seed, force_last=True)


def test_kda_decode_steps_track_reference(seed):
    """16 decode steps from a zero cache (the serving start): kernel and FP32 reference stay within the
    state tolerance of each other, step after step (no drift from the k.q / decayed-S formulation)."""
    from k3_fastpath.kernels import kda_decode as k

    B, H, D, N = 4, 12, 128, 8
    prm = _params(H, D)
    pools = {n: t.zero_() for n, t in _pools(N, H, D).items()}
    ref_pools = {n: t.clone() for n, t in pools.items()}
    slot = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device="cuda")
    for step in range(16):
        inp = _inputs(B, H, D)
        y = _call(k, inp, prm, slot, pools, None)
        y_ref = k.reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["a"], inp["beta_logits"], prm["conv_q_w"],
                            prm["conv_k_w"], prm["conv_v_w"], prm["A_log"], prm["dt_bias"], prm["o_norm_w"], slot,
                            ref_pools["conv_q"], ref_pools["conv_k"], ref_pools["conv_v"], ref_pools["state"],
                            eps=EPS, lower_bound=LOWER_BOUND)
        d = (y.double() - y_ref.double()).abs()
        assert (d <= 2e-2 + 3e-2 * y_ref.double().abs()).all(), f"step {step}: y max diff {d.max():.3g} seed={seed}"
        for n in ("conv_q", "conv_k", "conv_v"):
            assert torch.equal(pools[n], ref_pools[n]), f"step {step}: {n} differs seed={seed}"
        ds = (pools["state"] - ref_pools["state"]).abs()
        assert (ds <= 2e-3 + 2e-3 * ref_pools["state"].abs()).all(), f"step {step}: state diff {ds.max():.3g} seed={seed}"
    assert math.isfinite(pools["state"].abs().max().item())


def test_kda_decode_falls_back_with_reason(seed):
    """An FP64 state (outside the envelope) is served by the reference and counted, not silently."""
    from k3_fastpath.kernels import kda_decode as k

    B, H, D, N = 2, 6, 128, 5
    prm, inp, pools = _params(H, D), _inputs(B, H, D), _pools(N, H, D)
    pools["state"] = pools["state"].double()
    slot = torch.tensor([2, 4], dtype=torch.int32, device="cuda")
    n0 = counters.fallbacks(NAME)
    y = _call(k, inp, prm, slot, pools, None)
    assert counters.fallbacks(NAME) == n0 + 1
    assert y.shape == (B, H * D) and not torch.isnan(y).any()
    assert any("state dtype float64" in reason for reason in counters.snapshot()["fallbacks"][NAME])


@pytest.mark.parametrize("T", (2, 4, 8))
@pytest.mark.parametrize("H", (6, 96))
def test_kda_verify_is_sequential_decode(T, H, seed):
    """A verify launch (T tokens per sequence, ``slot_out``) is T decode launches of the same kernel: the conv
    window after token t at ``slot_out[b*T + t]`` bitwise, the recurrent state there to FP32 rounding (the two
    builds contract the state update differently: measured 4.8e-7 at most over 8 tokens, H 96, on an H100),
    every row's y to BF16 rounding; the sequences' own slots and every other slot untouched; a padded token
    (slot_out 0) writes nothing; an empty sequence (slot 0) gets zeros. One launch counted, no fallback;
    outputs NaN-poisoned before the call."""
    from k3_fastpath.kernels import kda_decode as k

    B, D = 5, 128
    N = 1 + B + B * T
    prm, inp, pools = _params(H, D), _inputs(B * T, H, D), _pools(N, H, D)
    perm = random.sample(range(1, N), B + B * T)
    slot = torch.tensor(perm[:B], dtype=torch.int32, device="cuda")
    slot[2] = 0  # an empty sequence
    out_slots = torch.tensor(perm[B:], dtype=torch.int32, device="cuda")
    out_slots[1 * T + T - 1] = 0  # sequence 1: its last token is padding (one draft fewer)
    out_slots[2 * T: 3 * T] = 0
    before = {n: t.clone() for n, t in pools.items()}
    what = f"B={B} H={H} T={T} seed={seed}"
    y = torch.full((B * T, H * D), float("nan"), dtype=torch.bfloat16, device="cuda")
    snap = counters.snapshot()
    k.op(inp["q"], inp["k"], inp["v"], inp["g"], inp["a"], inp["beta_logits"], prm["conv_q_w"], prm["conv_k_w"],
         prm["conv_v_w"], prm["A_log"], prm["dt_bias"], prm["o_norm_w"], slot, pools["conv_q"], pools["conv_k"],
         pools["conv_v"], pools["state"], eps=EPS, lower_bound=LOWER_BOUND, out=y, slot_out=out_slots, tokens=T)
    after = counters.snapshot()
    assert after["fallbacks"].get(NAME, {}) == snap["fallbacks"].get(NAME, {}), f"fell back {what}"
    assert after["launches"].get(NAME, 0) == snap["launches"].get(NAME, 0) + 1, f"did not launch once {what}"
    # the same tokens as T decode launches on a copy of the pools
    seq = {n: t.clone() for n, t in before.items()}
    written = torch.zeros(N, dtype=torch.bool, device="cuda")
    for t in range(T):
        rows = torch.arange(B, device="cuda") * T + t
        y_t = _call(k, {n: x[rows] for n, x in inp.items()}, prm, slot, seq, None)
        dy = (y[rows].float() - y_t.float()).abs()
        assert (dy <= 1e-2 * y_t.float().abs() + 1e-3).all(), f"token {t}: y {dy.max():.3g} off a decode step {what}"
        for b in range(B):
            o = int(out_slots[b * T + t])
            if o and int(slot[b]):
                written[o] = True
                for n in ("conv_q", "conv_k", "conv_v"):
                    assert torch.equal(pools[n][o], seq[n][int(slot[b])]), f"token {t} seq {b}: {n} at slot_out {what}"
                ds = (pools["state"][o] - seq["state"][int(slot[b])]).abs().max().item()
                assert ds <= 2e-6, f"token {t} seq {b}: state at slot_out {ds:.3g} off a decode step's {what}"
    assert torch.equal(y[2 * T: 3 * T], torch.zeros_like(y[2 * T: 3 * T])), f"empty sequence's rows not zero {what}"
    for n in pools:
        assert torch.equal(pools[n][~written], before[n][~written]), f"{n}: a slot not in slot_out changed {what}"
