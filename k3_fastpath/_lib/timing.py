"""CUDA-graph timing for the kernel benches (GPU only; imported lazily by the bench scripts).

``graph_time_us(fns)`` captures ``len(fns)`` calls (one per function, typically the same op on distinct
weight copies so the L2 cannot serve them: "cold L2") into one CUDA graph, replays it ``iters`` times
between CUDA events and returns per-call statistics in microseconds. Capturing several calls into one
graph amortises the graph-launch overhead the same way a captured decode step does.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any


def _timed(run: Callable[[], Any], calls: int, iters: int) -> dict[str, float]:
    """Per-call statistics (us) of ``run`` (which makes ``calls`` calls) between CUDA events, ``iters`` times."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return {"median_us": statistics.median(times), "p10_us": times[len(times) // 10],
            "p90_us": times[(9 * len(times)) // 10]}


def _call_all(fns: Sequence[Callable[[], Any]]) -> None:
    for f in fns:
        f()


def graph_time_us(fns: Sequence[Callable[[], Any]], iters: int = 30, warmup: int = 2) -> dict[str, float]:
    import torch

    for _ in range(warmup):
        _call_all(fns)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _call_all(fns)
    g.replay()
    torch.cuda.synchronize()
    return _timed(g.replay, len(fns), iters)


def eager_time_us(fns: Sequence[Callable[[], Any]], iters: int = 10, warmup: int = 2) -> dict[str, float]:
    """Per-call median of eager launches between CUDA events: for references that cannot be captured in a
    CUDA graph (host synchronisation, data-dependent shapes). Includes launch overhead, so a graph-timed
    kernel against an eager reference flatters the kernel: the rows say which timer each column used."""
    import torch

    for _ in range(warmup):
        _call_all(fns)
    torch.cuda.synchronize()
    return _timed(lambda: _call_all(fns), len(fns), iters)


def copies_for_cold_l2(nbytes: int, l2_bytes: int = 60 * 2**20, factor: float = 3.0) -> int:
    """How many distinct copies of an ``nbytes`` operand to cycle through so L2 cannot hold them."""
    return max(1, min(64, int(-(-factor * l2_bytes // max(nbytes, 1)))))


def read_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Achievable HBM read bandwidth measured the same way (a bf16 sum over ``nbytes``), in GB/s."""
    import torch

    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)  # never time zeros
    stats = graph_time_us([lambda: torch.sum(buf, dtype=torch.float32)], iters=10)
    return nbytes / (stats["median_us"] * 1e-6) / 1e9
