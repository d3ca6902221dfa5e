"""The per-kernel profiles a ``perf.decode_sweep`` run records (``kernel_profile: true``), read back from a
bundle and rendered as the summary's table: per point and backend, the step's span, the GPU's idle share,
and the ops with the most device time (``k3_fastpath/runtime/kernel_profile.py`` says how they are taken)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verify.bundle.readers import SWEEP_CHECK, BundleData

TOP_OPS = 4


@dataclass(frozen=True)
class KernelProfile:
    label: str  # the point: tp, routing, batch, context
    backend: str
    span_us: float
    busy_us: float
    ops: dict[str, dict[str, float]]  # op -> {us, launches, share}, most device time first
    launches: float


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def kernel_profiles(data: BundleData) -> tuple[list[KernelProfile], list[str]]:
    """(profiles, notes) from the sweep's point records that carry a ``kernel_profile``; a profile that
    recorded an error, or lacks its numbers, becomes a note."""
    out: list[KernelProfile] = []
    notes: list[str] = []
    for stream, recs in sorted(data.streams(SWEEP_CHECK).items()):
        for i, r in enumerate(recs, start=1):
            kp = r.get("kernel_profile")
            if not isinstance(kp, dict):
                continue
            label = f"tp={r.get('tp', 1)} {r.get('routing', 'uniform')} batch={r.get('batch')} ctx={r.get('context')}"
            where = f"records/{stream}.jsonl record {i}"
            if "error" in kp:
                notes.append(f"{where}: kernel profile not taken: {kp['error']}")
                continue
            span, busy, ops = _num(kp.get("span_us")), _num(kp.get("busy_us")), kp.get("ops")
            if span is None or busy is None or not isinstance(ops, dict) or span <= 0:
                notes.append(f"{where}: kernel_profile without span_us / busy_us / ops; skipped")
                continue
            clean = {str(k): {f: float(v.get(f, 0.0)) for f in ("us", "launches", "share")}
                     for k, v in ops.items() if isinstance(v, dict)}
            out.append(KernelProfile(label, str(r.get("backend")), span, busy,
                                     dict(sorted(clean.items(), key=lambda kv: -kv[1]["us"])),
                                     _num(kp.get("launches")) or 0.0))
    return out, notes


def profile_section(profiles: list[KernelProfile]) -> list[str]:
    """Markdown lines (none without profiles): one row per point and backend."""
    if not profiles:
        return []
    rows = []
    for p in profiles:
        top = ", ".join(f"{op} {o['us'] / 1000:.2f} ms ({o['share']:.0%}, {o['launches']:.0f}x)"
                        for op, o in list(p.ops.items())[:TOP_OPS])
        rows.append(f"| {p.label} | {p.backend} | {p.span_us / 1000:.2f} | {1 - p.busy_us / p.span_us:.1%} | "
                    f"{p.launches:.0f} | {top} |")
    return ["### Where the step's device time goes (kernel_profile, CUPTI over graph replays)", "",
            "Kernel times overlap under PDL (a kernel waiting in griddepcontrol.wait is counted as running), so "
            "op times can add to more than the span; idle = the share of the span with no kernel running.", "",
            "| point | backend | span ms | GPU idle | kernels | ops with the most device time |",
            "|---|---|---|---|---|---|", *rows, ""]
