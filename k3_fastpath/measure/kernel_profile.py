"""Where a decode step's device time goes, kernel by kernel: a CUPTI trace (torch.profiler) of graph replays.

``section_timing`` splits a step by layer type; this splits it by kernel, which is what says whether a
layer type is slow because one kernel is far from its bytes' floor, because small glue kernels add up, or
because the GPU idles between launches. ``profile_replays(replay)`` traces ``iters`` replays of a captured
step and returns, per step:

- ``ops``: device time and launches per op: the fast path's kernels by folder name (``skinny_gemm``,
  ``moe_experts``, ...), NCCL, and ``other`` (torch / cuBLAS / Triton kernels: a standard path's library
  calls or a fast step's glue), each with its share of the kernel time; ``us`` is each kernel's own
  interval (under PDL it includes waiting in ``griddepcontrol.wait`` for the predecessor, so PDL chains
  count twice), ``exclusive_us`` the part no earlier-started kernel covers (it adds up to ``busy_us``: what
  each op adds to the step);
- ``top``: the kernels with the most device time, by name (names cut to 160 characters);
- ``busy_us``: the union of the kernels' intervals (kernels overlapping under PDL or on two streams count
  once), ``span_us``: first kernel start to last kernel end, ``idle_us = span - busy``: time the GPU ran
  no kernel of the step (launch latency and dependency waits).

The trace adds no kernel of its own to the step, but CUPTI's activity records cost some microseconds per
kernel: compare a profile's span with the same graph's replay median (the perf sweep records both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

FAST_OPS = ("skinny_gemm", "moe_experts", "moe_router", "mla_decode", "kda_decode", "attn_res_mix",
            "rmsnorm_residual", "prefetch")
TOP = 25
NAME_CHARS = 160


def op_of(kernel_name: str) -> str:
    """The op a kernel belongs to: a fast-path kernel folder (CuTe DSL names carry the defining module's
    path), ``memcpy_memset`` (copy / memset graph nodes), ``nccl`` or ``other``."""
    low = kernel_name.lower()
    if low.startswith(("memcpy", "memset")):
        return "memcpy_memset"
    for op in FAST_OPS:
        if op in low or op.replace("_", "") in low:
            return op
    return "nccl" if "nccl" in low else "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def exclusive_us(events: list[tuple[str, float, float]]) -> list[float]:
    """Per event, the time it alone extends the busy interval: in start order, its end past the latest end
    of every event that started before it (0 when hidden under one). Under PDL a kernel starts while its
    predecessor runs and waits; this counts it from the predecessor's end. The values sum to the busy time."""
    out = [0.0] * len(events)
    reach = float("-inf")
    for i in sorted(range(len(events)), key=lambda i: (events[i][1], events[i][2])):
        _, s, e = events[i]
        out[i] = max(0.0, e - max(s, reach))
        reach = max(reach, e)
    return out


def summarize_kernels(events: Iterable[tuple[str, float, float]], steps: int) -> dict[str, Any]:
    """Per-step totals from ``(name, start_us, end_us)`` kernel records of ``steps`` replays: per op and per
    kernel name the device time (``us``: each kernel's own interval; under PDL it includes the wait for its
    predecessor) and the exclusive time (``exclusive_us``: ``exclusive_us()``, which adds up to ``busy_us``)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    ev = [(n, float(s), float(e)) for n, s, e in events]
    if not ev:
        raise ValueError("no kernel records: the profiler saw no device activity (CUPTI unavailable?)")
    excl = exclusive_us(ev)
    by_name: dict[str, list[float]] = {}
    excl_by_name: dict[str, float] = {}
    ops: dict[str, dict[str, float]] = {}
    for (n, s, e), x in zip(ev, excl, strict=True):
        by_name.setdefault(n, []).append(e - s)
        excl_by_name[n] = excl_by_name.get(n, 0.0) + x
    for n, d in by_name.items():  # sums of whole counts, divided once: 15 launches over 3 steps are 5.0
        o = ops.setdefault(op_of(n), {"us": 0.0, "exclusive_us": 0.0, "launches": 0})
        o["us"] += sum(d)
        o["exclusive_us"] += excl_by_name[n]
        o["launches"] += len(d)
    for o in ops.values():
        o["us"] /= steps
        o["exclusive_us"] /= steps
        o["launches"] /= steps
    busy = _union_us([(s, e) for _, s, e in ev]) / steps
    span = (max(e for _, _, e in ev) - min(s for _, s, _ in ev)) / steps
    kernel_us = sum(o["us"] for o in ops.values())
    for o in ops.values():
        o["share"] = o["us"] / kernel_us if kernel_us else 0.0
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    return {"steps": steps, "kernel_us": kernel_us, "busy_us": busy, "span_us": span, "idle_us": span - busy,
            "launches": len(ev) / steps,
            "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["us"])),
            "top": [{"name": n[:NAME_CHARS], "op": op_of(n), "us": sum(d) / steps,
                     "exclusive_us": excl_by_name[n] / steps, "launches": len(d) / steps,
                     "median_us": sorted(d)[len(d) // 2]} for n, d in top]}


def profile_replays(replay: Callable[[], Any], iters: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Trace ``iters`` calls of ``replay`` (one graph-replayed step each) after ``warmup`` untraced ones;
    ``summarize_kernels`` of the kernels seen, per step."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return {**summarize_kernels(events, iters), "timer": "torch.profiler (CUPTI) over graph replays"}
