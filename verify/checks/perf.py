"""Performance checks. ``perf.bandwidth_probe`` measures what every floor in the bundle is divided by.

Read bandwidth: a read-only reduction over a ``bytes``-sized BF16 buffer (far larger than the 60 MB
L2), timed with CUDA events, 3 warm-ups and 20 timed repeats; the median is the run's read bandwidth.
Also a 2 GiB BF16 GEMV through cuBLAS (``torch.mv``) and the dense BF16 matmul rate (8192^3), so a
reader can tell a slow machine from a slow kernel. The check fails when the repeats spread by more than
10% (a throttling or shared GPU makes every ratio in the bundle meaningless).
"""

from __future__ import annotations

import statistics
from typing import Any

from verify.context import CheckContext

MAX_SPREAD = 0.10


def _time_ms(fn, warmup: int = 3, repeats: int = 20) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def measure_read_bandwidth(nbytes: int = 4 << 30) -> dict[str, Any]:
    """Median read bandwidth (bytes/s) of a read-only reduction over ``nbytes`` of BF16."""
    import torch

    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    times = _time_ms(lambda: x.sum(dtype=torch.float32))
    med = statistics.median(times)
    return {"bytes": nbytes, "median_ms": med, "read_bytes_per_s": nbytes / (med * 1e-3), "times_ms": times}


def _gemv_probe() -> tuple[list[float], float]:
    """cuBLAS BF16 GEMV over 2 GiB of weights: (times in ms, read bytes/s)."""
    import torch

    n = 32768
    k = (2 << 30) // (2 * n)
    w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    v = torch.empty(k, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    times = _time_ms(lambda: torch.mv(w, v))
    return times, w.numel() * 2 / (statistics.median(times) * 1e-3)


def _matmul_probe() -> tuple[list[float], float]:
    """Dense BF16 8192^3 matmul: (times in ms, TFLOP/s)."""
    import torch

    a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    times = _time_ms(lambda: a @ a, warmup=3, repeats=10)
    return times, 2 * 8192**3 / (statistics.median(times) * 1e-3) / 1e12


def bandwidth_probe(ctx: CheckContext, bytes: int) -> Any:
    import torch

    read = measure_read_bandwidth(int(bytes))
    torch.cuda.empty_cache()
    ctx.record({"probe": "read_reduction", **read})
    gemv, gemv_bw = _gemv_probe()
    torch.cuda.empty_cache()
    ctx.record({"probe": "cublas_gemv", "bytes": 2 << 30, "times_ms": gemv, "read_bytes_per_s": gemv_bw})
    mm, tflops = _matmul_probe()
    torch.cuda.empty_cache()
    ctx.record({"probe": "bf16_matmul_8192", "times_ms": mm, "tflops": tflops})
    spread = (max(read["times_ms"]) - min(read["times_ms"])) / statistics.median(read["times_ms"])
    metrics = {"read_tb_per_s": read["read_bytes_per_s"] / 1e12, "cublas_gemv_tb_per_s": gemv_bw / 1e12,
               "bf16_matmul_tflops": tflops, "read_spread": spread, "device": torch.cuda.get_device_name(0)}
    problems = []
    if spread > MAX_SPREAD:
        problems.append(f"read-bandwidth repeats spread by {spread:.1%} (> {MAX_SPREAD:.0%}): the GPU is shared "
                        f"or throttling; perf ratios from this run would be noise")
    return ctx.verdict(problems, metrics)
