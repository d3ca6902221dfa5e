"""``perf.serving``'s plots for ``bundle render`` (the figures of ``verify/bundle/plots.py``'s kind):

- ``serving_pareto.png``: throughput against interactivity, one panel per workload, one line per engine
  role through its concurrencies (median over the repeats): output tokens/s per GPU (per server on a CPU
  server) against P90 interactivity (tokens/s/user), the InferenceX view of a serving system;
- ``serving_cdf.png``: the per-request CDFs of inter-token latency and TTFT, one column per workload, one
  line per (role, concurrency).
Every title says what was measured: serving mixes prefill and decode, so none of it is decode-only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verify.bundle.plots import PlotError, _save, pyplot
from verify.checks.serving_rules import ROLES, median_and_spread, request_itl_ms

_COLORS = {"baseline": "tab:gray", "engine_under_test": "tab:blue"}
MIXED = "serving: prefill + decode mixed, not decode-only"


def _label(ax: Any, xlabel: str, ylabel: str, title: str, legend: int) -> None:
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(f"{title}\n({MIXED})", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend)


def serving_pareto(records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    plt = pyplot()
    points = [r for r in records if r.get("kind") == "point" and isinstance(r.get("metrics"), dict)]
    workloads = sorted({p["workload"] for p in points})
    if not workloads:
        raise PlotError("no perf.serving points")
    per_gpu = any(p["metrics"].get("output_tokens_per_s_per_gpu") for p in points)
    ykey = "output_tokens_per_s_per_gpu" if per_gpu else "output_tokens_per_s"
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.4 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes.flat, workloads, strict=True):
        for role in ROLES:
            xs, ys, cs = [], [], []
            for c in sorted({p["concurrency"] for p in points if p["workload"] == w and p["role"] == role}):
                ms = [p["metrics"] for p in points if (p["workload"], p["role"], p["concurrency"]) == (w, role, c)]
                x, y = median_and_spread(ms, "interactivity_p90")[0], median_and_spread(ms, ykey)[0]
                if x and y:
                    xs.append(x)
                    ys.append(y)
                    cs.append(c)
            if xs:
                ax.plot(xs, ys, marker="o", ms=4, color=_COLORS[role], label=role.replace("_", " "))
                for x, y, c in zip(xs, ys, cs, strict=True):
                    ax.annotate(f"c={c}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        _label(ax, "P90 interactivity (tokens/s/user)", f"output tokens/s {'per GPU' if per_gpu else 'per server'}",
               f"{w}: throughput vs interactivity", legend=6)
    fig.tight_layout()
    return _save(fig, path)


def serving_cdf(records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    plt = pyplot()
    reqs = [r for r in records if r.get("kind") == "request" and r.get("error") is None]
    workloads = sorted({r["workload"] for r in reqs})
    if not workloads:
        raise PlotError("no successful perf.serving requests")
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.4 * len(workloads), 6.4), squeeze=False)
    for col, w in enumerate(workloads):
        for row, (what, value) in enumerate((("inter-token latency (ms)", request_itl_ms),
                                             ("TTFT (ms)", lambda r: r.get("ttft_ms")))):
            ax = axes[row][col]
            for role in ROLES:
                for i, c in enumerate(sorted({r["concurrency"] for r in reqs if r["workload"] == w})):
                    vals = sorted(v for v in (value(r) for r in reqs if (r["workload"], r["role"], r["concurrency"])
                                              == (w, role, c)) if isinstance(v, (int, float)))
                    if vals:
                        ax.step(vals, [(k + 1) / len(vals) for k in range(len(vals))], where="post",
                                color=_COLORS[role], ls=("-", "--", ":", "-.")[i % 4], lw=1,
                                label=f"{role.replace('_', ' ')} c={c}")
            _label(ax, what, "fraction of requests", f"{w}: per-request {what.split(' (')[0]} CDF", legend=5)
    fig.tight_layout()
    return _save(fig, path)
