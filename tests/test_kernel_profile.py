"""measure/kernel_profile.py without a GPU: kernel names to ops, per-step totals, busy / idle time from
overlapping intervals. (The CUPTI trace itself runs in perf.decode_sweep with ``kernel_profile: true`` on the
GPU host.)"""

from __future__ import annotations

import random

import pytest

from k3_fastpath.measure.kernel_profile import op_of, summarize_kernels

WGMMA = ("kernel_cutlass_kernel_k3_fastpathkernelsskinny_gemmkernel_wgmmaSkinnyGemmWgmmaKernel_object_at__CopyAtom_"
         "ThrID10_TVLayoutSrc1409601_0")
FMA = "kernel_cutlass_kernel_fma_k3_fastpathkernelsskinny_gemmkernelSkinnyGemmKernel_object_at__tensorptrbf16_0"


@pytest.mark.parametrize("name,op", [
    (WGMMA, "skinny_gemm"), (FMA, "skinny_gemm"),
    ("kernel_cutlass_kernel_k3_fastpathkernelsmoe_expertskernelExpertsKernel_object_at_0", "moe_experts"),
    ("kernel_cutlass_kernel_k3_fastpathkernelsmla_decodekernelSplitKernel_0", "mla_decode"),
    ("kernel_cutlass_kernel_k3_fastpathruntimeprefetch_kernelPrefetch_0", "prefetch"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("Memset (Device)", "memcpy_memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", "other"),
])
def test_op_of(name, op):
    assert op_of(name) == op


def test_summarize_totals_per_step_and_overlap(seed):
    rng = random.Random(seed)
    steps = rng.randint(2, 5)
    events, t = [], 0.0
    want_gemm = want_other = 0.0
    gaps = 0.0
    for _ in range(steps):
        for _ in range(rng.randint(3, 9)):
            d = rng.uniform(1, 50)
            name = WGMMA if rng.random() < 0.6 else "void at::native::elementwise_kernel"
            events.append((name, t, t + d))
            if name == WGMMA:
                want_gemm += d
            else:
                want_other += d
            gap = rng.uniform(0, 5)
            gaps += gap
            t += d + gap
        gaps -= gap  # no idle time counted after a step's last kernel ... unless another step follows
        t += 10.0
        gaps += 10.0 + gap
    gaps -= 10.0 + gap
    # a PDL-style overlap: a kernel starting inside the first one adds launches and kernel time, not busy time
    s0, e0 = events[0][1], events[0][2]
    events.append((FMA, s0, (s0 + e0) / 2))
    r = summarize_kernels(events, steps)
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    assert r["ops"]["skinny_gemm"]["us"] == pytest.approx((want_gemm + (e0 - s0) / 2) / steps)
    assert r["ops"].get("other", {"us": 0.0})["us"] == pytest.approx(want_other / steps)
    assert r["span_us"] == pytest.approx(span / steps)
    assert r["busy_us"] == pytest.approx((span - gaps) / steps)
    assert r["idle_us"] == pytest.approx(gaps / steps)
    assert r["kernel_us"] >= r["busy_us"]
    assert sum(o["share"] for o in r["ops"].values()) == pytest.approx(1.0)
    assert r["launches"] == pytest.approx(len(events) / steps)
    assert r["top"][0]["us"] >= r["top"][-1]["us"]


def test_no_events_is_an_error():
    with pytest.raises(ValueError, match="no kernel records"):
        summarize_kernels([], 3)
    with pytest.raises(ValueError, match="steps"):
        summarize_kernels([("k", 0, 1)], 0)


def test_launches_per_step_are_exact():
    """Counts are divided once: 5 launches per step over 3 steps read 5.0, not 4.999... (a GPU test compares
    them with the executor's launch counters)."""
    ev = [("kernel_k3_fastpathkernelskda_decodekernel", 10.0 * i, 10.0 * i + 1) for i in range(15)]
    r = summarize_kernels(ev, 3)
    assert r["ops"]["kda_decode"]["launches"] == 5 and r["top"][0]["launches"] == 5


def test_exclusive_time_counts_a_pdl_chain_once(seed):
    """A PDL chain (each kernel starts inside its predecessor and waits) and a kernel hidden on a side stream:
    each kernel's exclusive time is what it adds past every earlier-started one; they sum to the busy time,
    while the plain durations double-count the overlaps."""
    from k3_fastpath.measure.kernel_profile import exclusive_us

    assert exclusive_us([("a", 0, 10), ("b", 4, 15), ("side", 5, 9), ("c", 20, 22)]) == [10, 5, 0, 2]
    rng = random.Random(seed)
    ev, t = [], 0.0
    for i in range(rng.randint(5, 40)):
        s = t - rng.uniform(0, 3) if ev else 0.0  # starts early under PDL
        e = max(s, t) + rng.uniform(1, 20)
        ev.append((WGMMA if i % 2 else FMA, s, e))
        if rng.random() < 0.2:  # a side-stream kernel somewhere inside
            a = rng.uniform(s, e)
            ev.append(("void at::native::elementwise_kernel", a, rng.uniform(a, e + 5)))
        t = e + rng.uniform(0, 2)
    r = summarize_kernels(ev, 1)
    assert sum(o["exclusive_us"] for o in r["ops"].values()) == pytest.approx(r["busy_us"])
    assert all(o["exclusive_us"] <= o["us"] + 1e-9 for o in r["ops"].values())
    assert sum(x["exclusive_us"] for x in r["top"]) == pytest.approx(r["busy_us"])
