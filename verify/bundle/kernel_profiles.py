"""The per-kernel profiles a ``perf.decode_sweep`` run records (``kernel_profile: true``), read back from a
bundle and rendered as the summary's table: per point and backend, the step's span, the GPU's idle share,
and the ops with the most device time (``k3_fastpath/measure/kernel_profile.py`` says how they are taken)."""

from __future__ import annotations

from dataclasses import dataclass

from verify.bundle.readers import SWEEP_CHECK, BundleData, _num

TOP_OPS = 4


@dataclass(frozen=True)
class KernelProfile:
    label: str  # the point: tp, routing, batch, context
    backend: str
    span_us: float
    busy_us: float
    ops: dict[str, dict[str, float]]  # op -> {us, exclusive_us (where recorded), launches, share}, largest first
    launches: float


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
            clean = {str(k): {f: float(v[f]) for f in ("us", "exclusive_us", "launches", "share")
                              if _num(v.get(f)) is not None}
                     for k, v in ops.items() if isinstance(v, dict)}
            excl = all("exclusive_us" in o for o in clean.values())
            order = "exclusive_us" if excl else "us"
            out.append(KernelProfile(label, str(r.get("backend")), span, busy,
                                     dict(sorted(clean.items(), key=lambda kv: -kv[1].get(order, 0.0))),
                                     _num(kp.get("launches")) or 0.0))
    return out, notes


def profile_section(profiles: list[KernelProfile]) -> list[str]:
    """Markdown lines (none without profiles): one row per point and backend."""
    if not profiles:
        return []
    rows = []
    for p in profiles:
        if all("exclusive_us" in o for o in p.ops.values()):  # what each op adds to the step, of the busy time
            top = ", ".join(f"{op} {o['exclusive_us'] / 1000:.2f} ms excl. ({o['exclusive_us'] / p.busy_us:.0%}, "
                            f"{o['launches']:.0f}x)" for op, o in list(p.ops.items())[:TOP_OPS])
        else:  # profiles recorded before exclusive times: each kernel's own interval, of all kernel time
            top = ", ".join(f"{op} {o['us'] / 1000:.2f} ms ({o.get('share', 0.0):.0%}, {o['launches']:.0f}x)"
                            for op, o in list(p.ops.items())[:TOP_OPS])
        rows.append(f"| {p.label} | {p.backend} | {p.span_us / 1000:.2f} | {1 - p.busy_us / p.span_us:.1%} | "
                    f"{p.launches:.0f} | {top} |")
    return ["### Where the step's device time goes (kernel_profile, CUPTI over graph replays)", "",
            "Per op: its exclusive time (what it adds past every earlier-started kernel; the ops add up to the "
            "busy time) and its share of the busy time. Profiles without exclusive times show each kernel's own "
            "interval, which under PDL includes waiting in griddepcontrol.wait for its predecessor (op times then "
            "add to more than the span). Idle = the share of the span with no kernel running.", "",
            "| point | backend | span ms | GPU idle | kernels | ops with the most device time |",
            "|---|---|---|---|---|---|", *rows, ""]
