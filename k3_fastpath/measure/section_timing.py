"""Per-layer-type times of a graph-captured decode step (fast or standard backend of ``DecodeExecutor``).

A CUDA-graph replay of a whole step has no per-layer hook, so ``time_sections`` captures the same step a
second time as one graph per ``fast_step.Section`` (``head.in``, ``L{n}.attn``, ``L{n}.mlp``, ``head.out``)
over the executor's own plan, op table, pools, static I/O buffers and side stream, then replays the sections
in step order with a CUDA event between consecutive replays. Running the sections in order is exactly one
step (same kernels, same data flow through a static residual buffer), so each section sees the cache and L2
state it would see inside a step: a section's weights were last read one whole step earlier (GBs ago for
k3-mini), i.e. cold.

What it adds over the step graph: one graph launch per section (~20 for k3-mini) instead of one per step,
and the event records between them. ``sections_total_us`` vs ``step_graph_us`` (the bucket's own graph,
timed in the same call) says how much that costs; the per-type times are reported as measured, not
rescaled. The step's cache position is not advanced (like the sweep's timed replays, every replay decodes
the same position).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from ..runtime.fast_step import OpCalls, step_sections
from ..runtime.graphs import bucket_for


class SectionGraphs:
    """One CUDA graph per section of a captured bucket's step (see the module docstring); ``replay_all()``
    is one step. Holds the static residual buffer and the step's MLA index alive while it lives."""

    def __init__(self, ex: Any, tokens: torch.Tensor, cache: Any) -> None:
        if not (ex.fast and ex.graphs is not None):
            raise ValueError(f"section graphs need a graph-captured step backend, got backend={ex.backend!r} "
                             f"fast={ex.fast} graphs={ex.graphs is not None}")
        b = int(tokens.shape[0])
        self.bucket = bucket_for(b, ex.buckets)
        if self.bucket not in ex.graphs:
            raise ValueError(f"bucket {self.bucket} is not captured yet: run ex.decode(tokens, cache) once first")
        plan, pool = ex._plan_or_build(), ex._ensure_pool()
        self.io = io = ex._io_for(self.bucket)
        io.load(tokens, None, cache.slots, cache.lengths)
        calls = OpCalls(ex.ops)
        self.src = torch.empty(plan.num_sources, self.bucket, plan.embed.shape[1], dtype=plan.embed.dtype,
                               device=ex.device)
        prefetcher = ex.prefetcher if ex.prefetcher.enabled else None
        self.sections = step_sections(plan, calls, io, pool, prefetcher, ex.side, src=self.src)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        try:
            with torch.no_grad():
                for sec in self.sections:  # eager warm-up (every kernel is compiled: the bucket's graph exists)
                    sec.run()
                torch.cuda.synchronize(ex.device)
                mempool = torch.cuda.graph_pool_handle()
                for sec in self.sections:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=mempool):
                        sec.run()
                    self.graphs.append(g)
            self.mla_index = io.mla_index  # made by head.in's capture, read by every MLA section's replay
            torch.cuda.synchronize(ex.device)
        finally:
            io.mla_index = None

    def replay_all(self) -> None:
        for g in self.graphs:
            g.replay()


@torch.no_grad()
def time_sections(ex: Any, tokens: torch.Tensor, cache: Any, rounds: int = 10, warmup: int = 2) -> dict[str, Any]:
    """Section and layer-type medians (microseconds) of ``ex``'s step for ``tokens`` on ``cache``.

    ``ex`` is a ``DecodeExecutor`` with a step backend (``latency_specialized`` or ``standard_graph``) on a
    CUDA device whose bucket for ``len(tokens)`` was captured (call ``ex.decode`` once first)."""
    sg = SectionGraphs(ex, tokens, cache)
    sections, graphs, bucket = sg.sections, sg.graphs, sg.bucket
    n = len(sections)
    per: list[list[float]] = [[] for _ in range(n)]
    totals: list[float] = []
    for r in range(warmup + rounds):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i, g in enumerate(graphs):
            g.replay()
            ev[i + 1].record()
        ev[n].synchronize()
        if r >= warmup:
            for i in range(n):
                per[i].append(ev[i].elapsed_time(ev[i + 1]) * 1e3)
            totals.append(ev[0].elapsed_time(ev[n]) * 1e3)
    step = []
    for r in range(warmup + rounds):  # the bucket's own step graph, same process, same state
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        ex.graphs.replay(bucket)
        z.record()
        z.synchronize()
        if r >= warmup:
            step.append(a.elapsed_time(z) * 1e3)
    del sg, graphs
    sec_us = {s.name: statistics.median(t) for s, t in zip(sections, per, strict=True)}
    by_type: dict[str, float] = {}
    type_rounds: dict[str, list[float]] = {}
    for s, t in zip(sections, per, strict=True):
        by_type[s.layer_type] = by_type.get(s.layer_type, 0.0) + sec_us[s.name]
        acc = type_rounds.setdefault(s.layer_type, [0.0] * len(t))
        for r, v in enumerate(t):
            acc[r] += v
    total = statistics.median(totals)
    step_us = statistics.median(step)
    return {"backend": ex.backend, "bucket": bucket, "rounds": rounds, "section_us": sec_us,
            "by_layer_type_us": by_type, "sections_total_us": total, "step_graph_us": step_us,
            "section_overhead": total / step_us - 1.0, "sections": len(sections),
            "section_spread": {s.name: spread(t) for s, t in zip(sections, per, strict=True)},
            "by_layer_type_spread": {k: spread(v) for k, v in type_rounds.items()}}


def pct_of_floor_by_type(by_type_us: dict[str, float], floor_by_type_us: dict[str, float]) -> dict[str, float]:
    """floor / measured per layer type (the types both sides have; floor.py's ``norms`` bytes, the AttnRes
    and RMSNorm weights, are read inside the attention / MLP sections and counted there)."""
    return {k: floor_by_type_us[k] / v for k, v in by_type_us.items() if k in floor_by_type_us and v > 0}


def spread(samples: list[float]) -> float:
    """Run-to-run spread of timing samples, (p10 .. p90) / median with the indices ``perf_sweep.stats`` uses
    (0 for fewer than two samples or a zero median)."""
    xs = sorted(samples)
    med = statistics.median(xs) if xs else 0.0
    if len(xs) < 2 or med <= 0:
        return 0.0
    return (xs[(9 * len(xs)) // 10] - xs[len(xs) // 10]) / med
