"""One CUDA graph per batch bucket: capture after warm-up, replay per step.

A decode step of K3 is hundreds of launches, many of them on weights under 16 MB, where launch latency
rather than bandwidth sets the time; a graph replays the whole step with one host call. Rules:

* every kernel is compiled before capture: the executor warms each bucket up eagerly first, and
  ``capture`` fails if anything was compiled during it (``compile_cache`` itself raises on a miss while
  capturing: ``CompileDuringCaptureError``);
* graphs share one memory pool (captured from the largest bucket down, as vLLM does): they never run
  concurrently, and everything a step keeps lives in the executor's static buffers, not in the pool;
* replay allocates nothing and never synchronises with the host (tests/test_executor_gpu.py checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._lib import compile_cache, counters


def capturing(device: Any) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (an engine capturing our step)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def step_in_place(ops: Any, caches: Any, run: Callable[[Any], None], trace: Any, backend: str, device: Any,
                  batch: int) -> None:
    """One step on caches an engine owns (``DecodeExecutor`` / ``TPFastDecoder.decode_in_place``): ``run(calls)``
    with a fresh ``OpCalls`` over ``ops``, then one trace record of what it launched; a step captured into the
    engine's graph ran nothing yet (``graph``, ``count`` 0; its replays are counted by the caller's router).
    Every layer of ``caches`` must carry its step indices (``slot`` / ``paged``)."""
    from .fast_step import OpCalls
    from .trace import StepRecord

    bare = [i for i, c in enumerate(caches.layers) if getattr(c, "slot", None) is None
            and getattr(c, "paged", None) is None]
    if bare:
        raise ValueError(f"in-place step: layers {bare} carry no step indices (slot / paged)")
    before = counters.snapshot()
    calls = OpCalls(ops)
    run(calls)
    kernels, fallbacks = counter_delta(before, counters.snapshot())
    cap = capturing(device)
    trace.record(StepRecord(0, backend, batch, None, kernels=kernels, standard_ops=calls.standard_ops(),
                            kernel_fallbacks=fallbacks, graph=cap, count=0 if cap else 1))


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``batch`` rows, or None when it exceeds every bucket."""
    for b in sorted(buckets):
        if batch <= b:
            return b
    return None


@dataclass
class CapturedStep:
    """A captured bucket: its graph and what one replay launches (counted once, at capture)."""

    bucket: int
    graph: Any
    kernels: dict[str, int]
    standard_ops: list[dict[str, Any]]
    kernel_fallbacks: dict[str, dict[str, int]]
    capture_s: float = 0.0


@dataclass
class BucketGraphs:
    device: torch.device
    graphs: dict[int, CapturedStep] = field(default_factory=dict)
    pool: Any = None

    def capture(self, bucket: int, step: Callable[[], Any], describe: Callable[[], dict[str, Any]]) -> CapturedStep:
        """Capture ``step()`` (already warmed up for this bucket) into a graph. ``describe()`` returns the
        step's standard ops (read after the capture call, which runs the Python once)."""
        import time

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        before = counters.snapshot()
        compiled_before = len(compile_cache.records())
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(g, pool=self.pool):
            step()
        torch.cuda.synchronize(self.device)
        compiled = compile_cache.records()[compiled_before:]
        if compiled:
            names = ", ".join(sorted({r.key.kernel for r in compiled}))
            raise RuntimeError(f"bucket {bucket}: {len(compiled)} kernel(s) compiled during graph capture ({names}); "
                               "warm the bucket up before capturing")
        kernels, fallbacks = counter_delta(before, counters.snapshot())
        cap = CapturedStep(bucket, g, kernels, describe()["standard_ops"], fallbacks, time.perf_counter() - t0)
        self.graphs[bucket] = cap
        return cap

    def replay(self, bucket: int) -> CapturedStep:
        cap = self.graphs[bucket]
        cap.graph.replay()
        return cap

    def __contains__(self, bucket: int) -> bool:
        return bucket in self.graphs


def _fallback_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for op, reasons in after["fallbacks"].items():
        for reason, n in reasons.items():
            d = n - before["fallbacks"].get(op, {}).get(reason, 0)
            if d:
                out.setdefault(op, {})[reason] = d
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(kernel launches, kernel fallbacks) between two ``counters.snapshot()``s."""
    kernels = {k: n - before["launches"].get(k, 0) for k, n in after["launches"].items()
               if n - before["launches"].get(k, 0)}
    return kernels, _fallback_delta(before, after)
