"""The status rule of ``equivalence.fp64`` (``verify/checks/equivalence_fp64.py``), from its records alone.

Records: one ``plan`` (points, planted controls, ``max_ratio``, ``steps``, ``emulated``), per point a ``step``
row per decode step (``standard_err``: the BF16 standard path's error per sequence; ``fast_err``: per side,
the fast path's error per sequence; side ``"clean"`` is the fast path as built, every other side is a
planted control), then the point's ``point`` summary (or a ``not_run`` record with the reason).

An error is ``row_error``: the relative RMS logit error of one sequence's row against the FP64 run, each
row centred first (a constant offset does not change a softmax). A side's error over a point is the median
over all its (step, sequence) errors (robust to the few rows where a BF16 routing near-tie picks another
expert, which dominate a mean); its ratio is that median over the standard path's. The gate: the clean
fast path's ratio at most ``max_ratio`` at every point (STYLE.md: within 2x of the standard path's error
against the same FP64 run), and every planted control's ratio above it (the gate sees that planted error
at that point; one that passes is a gate too blunt to trust).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

Records = Sequence[Mapping[str, Any]]
CLEAN = "clean"
STANDARD = "standard"


def row_error(side: Any, oracle: Any) -> list[float]:
    """Per row of ``[B, V]`` logits: ``||c(side) - c(oracle)|| / ||c(oracle)||`` in FP64, ``c`` = centred."""
    o = oracle.double()
    o = o - o.mean(-1, keepdim=True)
    s = side.double()
    s = s - s.mean(-1, keepdim=True)
    return ((s - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-300)).tolist()


def control_name(op: str, scale: float) -> str:
    """The side name of a planted control: the op and its output scale, e.g. ``kda_step x1.03``."""
    return f"{op} x{scale:g}"


def point_summary(rows: Records, max_ratio: float) -> dict[str, Any]:
    """Medians and ratios of one point's step rows (what the check records and this rule recomputes)."""
    std = [e for r in rows for e in r.get("standard_err") or []]
    sides: dict[str, list[float]] = {}
    for r in rows:
        for name, errs in (r.get("fast_err") or {}).items():
            sides.setdefault(name, []).extend(errs)
    std_med = statistics.median(std) if std else math.nan
    out: dict[str, Any] = {"standard_median": std_med, "samples": len(std), "sides": {}}
    for name, errs in sides.items():
        med = statistics.median(errs) if errs else math.nan
        ratio = med / std_med if std_med > 0 else math.inf
        out["sides"][name] = {"median": med, "ratio": ratio, "samples": len(errs),
                              "over_limit": not ratio <= max_ratio}
    return out


def _close(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and (a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15))


def _point_problems(where: str, point: Mapping[str, Any], rows: Records, plan: Mapping[str, Any],
                    controls: list[str]) -> list[str]:
    problems = []
    steps, batch = plan.get("steps"), point.get("batch")
    if len(rows) != steps:
        return [f"{where}: {len(rows)} step rows for {steps} steps"]
    bad = [r.get("step") for r in rows if len(r.get("standard_err") or []) != batch
           or any(len(v) != batch for v in (r.get("fast_err") or {}).values())]
    if bad:
        problems.append(f"{where}: step(s) {bad[:5]} do not hold one error per sequence of batch {batch}")
    want = point_summary(rows, plan["max_ratio"])
    if want["samples"] == 0:
        return problems + [f"{where}: no error samples"]
    recorded = point.get("sides") or {}
    if not _close(point.get("standard_median"), want["standard_median"]):
        problems.append(f"{where}: standard_median {point.get('standard_median')!r} is not its steps' "
                        f"median {want['standard_median']:.6g}")
    expected = [CLEAN, *controls]
    if sorted(want["sides"]) != sorted(expected):
        problems.append(f"{where}: step rows hold sides {sorted(want['sides'])}, the plan says {sorted(expected)}")
    for name, got in want["sides"].items():
        rec = recorded.get(name) or {}
        for field in ("median", "ratio"):
            if not _close(rec.get(field), got[field]):
                problems.append(f"{where}: {name} {field} {rec.get(field)!r} is not its steps' {got[field]:.6g}")
        if name == CLEAN and got["over_limit"]:
            problems.append(f"{where}: the fast path's logit error against FP64 is {got['ratio']:.2f}x the standard "
                            f"path's (median {got['median']:.3g} vs {want['standard_median']:.3g}; limit "
                            f"{plan['max_ratio']:g}x)")
        elif name != CLEAN and not got["over_limit"]:
            problems.append(f"{where}: planted control {name} passes the gate ({got['ratio']:.2f}x <= "
                            f"{plan['max_ratio']:g}x): the gate does not see that error here")
    nonfinite = [r.get("step") for r in rows if r.get("nonfinite")]
    if nonfinite:
        problems.append(f"{where}: non-finite logits at step(s) {nonfinite[:5]}")
    from k3_fastpath.runtime.trace import fast_path_problems

    problems += [f"{where}: {p}" for p in fast_path_problems(point.get("trace") or {}, expect_fast=not plan["emulated"])]
    return problems


def _key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return (r.get("batch"), r.get("context"), r.get("kv_cache"))


def fp64_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """``equivalence.fp64``: every planned point run and within the gate, every planted control caught at
    the point it was planted at (the plan's ``controls_at``), the recorded medians and ratios those of the
    step rows."""
    plan = next((r for r in records if r.get("kind") == "plan"), None)
    if plan is None:
        return ["no plan record"]
    controls = [control_name(c["op"], c["scale"]) for c in plan.get("controls") or []]
    at = tuple(plan.get("controls_at") or ()) or None
    steps: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "step":
            steps.setdefault(_key(r), []).append(r)
    problems, seen = [], set()
    for r in records:
        where = f"batch {r.get('batch')} context {r.get('context')} kv {r.get('kv_cache')}"
        if r.get("kind") == "not_run":
            seen.add(_key(r))
            problems.append(f"{where}: {r.get('why')}")
        elif r.get("kind") == "point":
            seen.add(_key(r))
            problems += _point_problems(where, r, steps.get(_key(r), []), plan,
                                        controls if at is not None and _key(r) == at else [])
    planned = [tuple(p) for p in plan.get("points") or []]
    problems += [f"batch {b} context {c} kv {k}: no record of this planned point" for b, c, k in planned
                 if (b, c, k) not in seen]
    if not planned:
        problems.append("the plan holds no point")
    return problems
