"""``perf.serving``'s metrics and pass/fail rule, as functions of its per-request records (no torch).

Records (``verify/checks/serving.py`` writes them, in this order):

* ``plan``: roles, workloads, concurrencies, repeats, ``min_requests`` (successful requests a point needs),
  ``max_error_rate``, ``min_speedup`` (or null: the comparison is reported, not gated), ``noise_floor``,
  ``gpus`` (what tokens/s per GPU divides by; null on a CPU server);
* ``request``: one per profiled request (AIPerf's warm-up phase excluded): its point (role, workload,
  concurrency, repeat), ``start_ns``/``end_ns`` (wall clock), ``latency_ms``, ``ttft_ms``, ``gaps_ms``
  (every gap between stream chunks), ``output_tokens`` and ``prompt_tokens`` (the server's counts),
  ``cached_tokens`` (when the server reports them), ``error`` (null when it succeeded), the session and
  turn it belongs to (``verify.aiperf.request_record``);
* ``point``: per (role, workload, concurrency, repeat) the metrics ``point_metrics`` derives from its
  requests, or ``kind: not_run`` with why;
* ``comparison``: per (workload, concurrency) the engine under test against the baseline, from
  ``compare_points``.

Definitions. A request's inter-token latency (ITL) is ``(end - start - ttft) / (output_tokens - 1)``
(AIPerf's), its interactivity ``1e9 / ITL`` tokens/s for that user. Percentiles interpolate linearly
(``verify.bundle.readers.percentile``). **P90 interactivity** is the interactivity of the P90 ITL: what
90% of the point's users got at least (none when that ITL is 0: the tokens came in one burst). A point's window runs from its first request's start to its last
request's end; request throughput, output tokens/s (and per GPU) divide by it.

``serving_problems`` recomputes every point and comparison from the requests and the plan, and judges:
every planned point ran with at least ``min_requests`` successful requests and an error rate at most
``max_error_rate``, and (plans with ``max_burst_share``) at most that share of its multi-token requests
arrived in one chunk (``burst_problem``: otherwise streaming was not measured); with ``min_speedup``, the engine under test's P90 interactivity is at least
``min_speedup`` times the baseline's, less the noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from verify.stats import percentile

Records = Sequence[Mapping[str, Any]]
ROLES = ("baseline", "engine_under_test")
PCTS = (50, 90, 99)
_REL = 1e-9
POINT_KEY = ("role", "workload", "concurrency", "repeat")


def _key(r: Mapping[str, Any], fields=POINT_KEY) -> tuple:
    return tuple(r.get(f) for f in fields)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def request_itl_ms(r: Mapping[str, Any]) -> float | None:
    """A successful request's mean inter-token latency (None with fewer than two output tokens)."""
    n, ttft, lat = r.get("output_tokens"), r.get("ttft_ms"), r.get("latency_ms")
    if r.get("error") is not None or not isinstance(n, int) or n < 2 or not _num(ttft) or not _num(lat):
        return None
    return (lat - ttft) / (n - 1)


def point_metrics(requests: Sequence[Mapping[str, Any]], gpus: int | None) -> dict[str, Any]:
    """The metrics of one point, from its requests (see the module docstring)."""
    ok = [r for r in requests if r.get("error") is None]
    out: dict[str, Any] = {"requests": len(requests), "succeeded": len(ok), "errors": len(requests) - len(ok)}
    if not ok:
        return out
    t0, t1 = min(r["start_ns"] for r in requests), max(r["end_ns"] for r in requests)
    window_s = (t1 - t0) / 1e9
    ttft = sorted(r["ttft_ms"] for r in ok if _num(r.get("ttft_ms")))
    itl = sorted(x for x in (request_itl_ms(r) for r in ok) if x is not None)  # 0: every token in one burst
    tokens = sum(r.get("output_tokens") or 0 for r in ok)
    out.update(window_s=window_s, output_tokens=tokens,
               prompt_tokens=sum(r.get("prompt_tokens") or 0 for r in ok),
               cached_tokens=(sum(r["cached_tokens"] for r in ok) if all(isinstance(r.get("cached_tokens"), int)
                                                                         for r in ok) else None),
               request_throughput_rps=len(ok) / window_s if window_s > 0 else None,
               output_tokens_per_s=tokens / window_s if window_s > 0 else None)
    out["output_tokens_per_s_per_gpu"] = (out["output_tokens_per_s"] / gpus
                                          if gpus and out["output_tokens_per_s"] is not None else None)
    for p in PCTS:
        out[f"ttft_ms_p{p}"] = percentile(ttft, p) if ttft else None
        out[f"itl_ms_p{p}"] = percentile(itl, p) if itl else None
    # interactivity: the users' tokens/s at the ITL percentiles (P90 interactivity = at the P90 ITL)
    for p in (50, 90):
        v = out[f"itl_ms_p{p}"]
        out[f"interactivity_p{p}"] = 1e3 / v if v else None
    return out


def _spread(values: Sequence[float]) -> float | None:
    vals = sorted(v for v in values if isinstance(v, (int, float)))
    if len(vals) < 2:
        return None
    mid = percentile(vals, 50)
    return (vals[-1] - vals[0]) / mid if mid else None


def compare_points(eut: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]], noise_floor: float,
                   min_speedup: float | None) -> dict[str, Any]:
    """The engine under test vs the baseline at one (workload, concurrency), over their repeats' metrics:
    the ratio of the median P90 interactivity (above 1: faster for the users) and of the median P50 TTFT
    (below 1: faster); the noise is the larger repeat-to-repeat spread of the two sides, at least
    ``noise_floor``."""
    def med(points, field):
        vals = sorted(p[field] for p in points if isinstance(p.get(field), (int, float)))
        return percentile(vals, 50) if vals else None

    e, b = med(eut, "interactivity_p90"), med(base, "interactivity_p90")
    te, tb = med(eut, "ttft_ms_p50"), med(base, "ttft_ms_p50")
    spreads = [_spread([p.get("interactivity_p90") for p in side]) for side in (eut, base)]
    noise = max([noise_floor] + [s for s in spreads if s is not None])
    ratio = e / b if e and b else None
    if ratio is None:
        outcome = "not compared"
    elif ratio > 1 + noise:
        outcome = "faster"
    elif ratio < 1 - noise:
        outcome = "slower"
    else:
        outcome = "within noise"
    return {"interactivity_p90_ratio": ratio, "ttft_p50_ratio": te / tb if te and tb else None,
            "spread_engine_under_test": spreads[0], "spread_baseline": spreads[1], "noise": noise,
            "outcome": outcome, "meets_min_speedup": (None if min_speedup is None or ratio is None
                                                       else ratio >= min_speedup * (1 - noise))}


def _mismatch(where: str, recorded: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    problems = []
    for k, v in want.items():
        got = recorded.get(k)
        same = (got == v if not isinstance(v, float) or not isinstance(got, (int, float))
                else math.isclose(got, v, rel_tol=_REL, abs_tol=1e-12))
        if not same:
            problems.append(f"{where}: {k} {got!r} does not follow from its requests ({v!r})")
    return problems


def burst_requests(requests: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(successful multi-token requests whose whole output arrived in one chunk -- latency == TTFT, no
    inter-token latency to measure --, successful multi-token requests)."""
    multi = [r for r in requests if r.get("error") is None and isinstance(r.get("output_tokens"), int)
             and r["output_tokens"] > 1 and _num(r.get("ttft_ms")) and _num(r.get("latency_ms"))]
    return sum(1 for r in multi if r["latency_ms"] - r["ttft_ms"] <= 1e-6), len(multi)


def burst_problem(plan: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> str | None:
    """With the plan's ``max_burst_share`` (plans written before it have none: not judged): a point whose
    share of one-burst requests exceeds it did not measure streaming (its ITL percentiles sit on zeros)."""
    limit = plan.get("max_burst_share")
    if limit is None:
        return None
    burst, multi = burst_requests(requests)
    if multi and burst / multi > limit:
        return (f"{burst} of {multi} requests arrived in one chunk (> {limit:.0%}): the stream was not measured "
                "token by token (client or server coalescing)")
    return None


def point_problem(plan: Mapping[str, Any], m: Mapping[str, Any]) -> str | None:
    """Why a point's metrics do not count (too few successful requests, too many errors), or None."""
    if m["succeeded"] < plan["min_requests"] or not m["requests"]:
        return f"{m['succeeded']} successful requests < {plan['min_requests']}"
    if m["errors"] / m["requests"] > plan["max_error_rate"]:
        return f"{m['errors']} of {m['requests']} requests failed"
    return None


def comparisons(plan: Mapping[str, Any], points: Mapping[tuple, Mapping[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """{(workload, concurrency): ``compare_points`` of the repeats that count} wherever both roles have one;
    ``points`` maps (role, workload, concurrency, repeat) to a point's metrics."""
    out: dict[tuple, dict[str, Any]] = {}
    if set(plan["roles"]) != set(ROLES):
        return out
    for w in plan["workloads"]:
        for c in plan["concurrency"]:
            sides = {role: [m for i in range(plan["repeats"]) if (m := points.get((role, w, c, i))) is not None
                            and point_problem(plan, m) is None] for role in ROLES}
            if all(sides.values()):
                out[(w, c)] = compare_points(sides["engine_under_test"], sides["baseline"], plan["noise_floor"],
                                             plan.get("min_speedup"))
    return out


def serving_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    plan = next((r for r in records if r.get("kind") == "plan"), None)
    if plan is None:
        return ["no plan record"]
    gpus = plan.get("gpus")
    requests: dict[tuple, list] = {}
    for r in records:
        if r.get("kind") == "request":
            requests.setdefault(_key(r), []).append(r)
    points = {_key(r): r for r in records if r.get("kind") in ("point", "not_run")}
    problems: list[str] = []
    recomputed: dict[tuple, dict[str, Any]] = {}
    for role in plan["roles"]:
        for w in plan["workloads"]:
            for c in plan["concurrency"]:
                for i in range(plan["repeats"]):
                    k = (role, w, c, i)
                    where = f"{role} {w} c={c} repeat {i}"
                    p = points.get(k)
                    if p is None:
                        problems.append(f"{where}: no record of this planned point")
                        continue
                    if p.get("kind") == "not_run":
                        problems.append(f"{where}: not run ({p.get('why')})")
                        continue
                    want = point_metrics(requests.get(k, []), gpus)
                    problems += _mismatch(where, p.get("metrics") or {}, want)
                    why = point_problem(plan, want) or burst_problem(plan, requests.get(k, []))
                    if why:
                        problems.append(f"{where}: {why}")
                    recomputed[k] = want
    recorded = {_key(r, ("workload", "concurrency")): r for r in records if r.get("kind") == "comparison"}
    for (w, c), want in comparisons(plan, recomputed).items():
        where = f"comparison {w} c={c}"
        rec = recorded.get((w, c))
        if rec is None:
            problems.append(f"{where}: not recorded")
            continue
        problems += _mismatch(where, rec, want)
        if want["meets_min_speedup"] is False:
            problems.append(f"{where}: P90 interactivity {want['interactivity_p90_ratio']:.2f}x the "
                            f"baseline's < {plan['min_speedup']}x (noise {want['noise']:.0%})")
    return problems


def points_by_side(records: Records, role: str = "engine_under_test") -> dict[tuple[str, int], list[dict[str, Any]]]:
    """{(workload, concurrency): [recorded point metrics, one per repeat]} of ``role`` (what ``bundle
    compare`` and ``bundle render`` read)."""
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "point" and r.get("role") == role and isinstance(r.get("metrics"), dict):
            out.setdefault((r.get("workload"), r.get("concurrency")), []).append(r["metrics"])
    return out


def median_and_spread(points: Sequence[Mapping[str, Any]], field: str) -> tuple[float | None, float | None]:
    """The median over repeats of ``field`` and its repeat-to-repeat spread ((max - min) / median)."""
    vals = sorted(p[field] for p in points if _num(p.get(field)))
    if not vals:
        return None, None
    return percentile(vals, 50), _spread(vals)
