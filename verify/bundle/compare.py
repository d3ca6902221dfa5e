"""``k3-verify bundle compare A B``: what changed from bundle A (before) to bundle B (after).

Four parts, each tolerant of a check that one side lacks ("absent in A"):

1. **checks**: status per check id (passed / failed / skipped / error / missing / absent); passed -> failed
   or error is a regression, failed or error -> passed an improvement;
2. **perf**: step time per ``perf.decode_sweep`` point and backend, our time per ``bench.kernels``
   shape, and the engine under test's P90 inter-token latency and P50 TTFT per ``perf.serving`` workload
   and concurrency (median over the repeats, spread = (max - min) / median over them, the noise floor at
   least what either run declared; serving mixes prefill and decode, labelled so). A delta counts only when it exceeds the noise: ``max(spread A, spread B, noise floor)`` where a
   spread is (p90 - p10) / median of the replay samples (``bundles/COMPARE.md``); smaller deltas are
   reported as ``within noise``;
3. **evals**: accuracy of the engine under test in A and B per ``evals.*`` check; paired over the same
   items (exact McNemar for 0/1 scores, paired bootstrap CI otherwise), unpaired (two-sample z-test,
   bootstrap CI) when the items differ;
4. **verdict**: ``regressed`` if anything regressed, else ``improved`` if anything improved, else
   ``within noise``. CLI exit codes: 0 improved / within noise, 1 regressed, 2 a bundle is unreadable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verify.bundle.readers import (
    BASELINE,
    BENCH_CHECK,
    SWEEP_CHECK,
    UNDER_TEST,
    BundleData,
    bench_rows,
    bootstrap_ci,
    eval_checks,
    eval_samples,
    mcnemar_exact_p,
    read_bundle,
    speedups,
    sweep_points,
    two_sample_z_p,
)
from verify.checks.serving_rules import median_and_spread, points_by_side
from verify.provenance import commit_label

NOISE_FLOOR = 0.02  # a step-time delta under 2% is never called a change (CUDA-graph medians jitter ~1%)
# ... and under 5% when a side recorded no spread (one median per shape, as bench.kernels writes): the two
# committed H200 runs of 2026-11-30 timed unchanged kernels (kda_decode, skinny GEMM at M=1-2) up to 3.8%
# apart (bundles/runs/2026-11-30-h200-kernels, bench-kernels vs kernels-recheck).
NOISE_FLOOR_NO_SPREAD = 0.05
ALPHA = 0.05  # eval deltas: significant at p < 0.05 (or a 95% CI that excludes 0)
IMPROVED, REGRESSED, WITHIN_NOISE = "improved", "regressed", "within noise"
_GOOD = ("passed",)
_BAD = ("failed", "error")


@dataclass(frozen=True)
class CheckChange:
    id: str
    a: str
    b: str
    change: str  # same | regressed | improved | changed


@dataclass(frozen=True)
class PerfDelta:
    source: str  # perf.decode_sweep | bench.kernels
    label: str  # "fast tp=1 uniform batch=8 ctx=1024" | "skinny_gemm kda_in_proj 6288x7168 M=1"
    a_us: float
    b_us: float
    delta: float  # (b - a) / a: positive = slower
    spread_a: float | None
    spread_b: float | None
    noise: float  # the threshold the delta had to exceed
    outcome: str  # improved | regressed | within noise
    extra: dict[str, Any] = field(default_factory=dict)  # speedup / vs-baseline / % of floor, A and B


@dataclass(frozen=True)
class EvalDelta:
    check_id: str
    acc_a: float
    acc_b: float
    delta: float  # acc_b - acc_a of the engine under test
    n_a: int
    n_b: int
    paired: bool
    n_paired: int
    test: str  # mcnemar-exact | paired-bootstrap | two-sample-z
    p_value: float | None
    ci: tuple[float, float]  # 95% CI of the delta
    outcome: str
    discordant: tuple[int, int] | None = None  # (right in A only, right in B only), McNemar's b and c
    baseline_a: float | None = None  # the baseline engine's accuracy in each run (context for the delta)
    baseline_b: float | None = None
    note: str = ""


@dataclass(frozen=True)
class CompareReport:
    a: dict[str, Any]
    b: dict[str, Any]
    checks: tuple[CheckChange, ...]
    perf: tuple[PerfDelta, ...]
    evals: tuple[EvalDelta, ...]
    absent: tuple[str, ...]  # "perf.decode_sweep: absent in B", "bench.kernels: 3 rows only in A", ...
    warnings: tuple[str, ...]  # bundles that do not verify, different GPUs, unreadable records
    noise_floor: float
    noise_floor_no_spread: float
    verdict: str
    reasons: tuple[str, ...]  # what regressed (or improved) in one line each

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == REGRESSED else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        for e in d["evals"]:
            e["ci"] = list(e["ci"])
            e["discordant"] = list(e["discordant"]) if e["discordant"] else None
        return d


# ---------------------------------------------------------------- parts
def _check_changes(a: BundleData, b: BundleData) -> list[CheckChange]:
    out = []
    for cid in dict.fromkeys(list(a.order) + list(b.order)):
        sa, sb = a.status(cid), b.status(cid)
        if sa == sb:
            change = "same"
        elif sa in _GOOD and sb in _BAD:
            change = REGRESSED
        elif sa in _BAD and sb in _GOOD:
            change = IMPROVED
        else:
            change = "changed"
        out.append(CheckChange(cid, sa, sb, change))
    return out


def classify(delta: float, noise: float) -> str:
    """``delta`` = relative change of a time (positive = slower) against the noise threshold."""
    if delta > noise:
        return REGRESSED
    if delta < -noise:
        return IMPROVED
    return WITHIN_NOISE


def noise_threshold(
    spread_a: float | None,
    spread_b: float | None,
    floor: float = NOISE_FLOOR,
    floor_no_spread: float = NOISE_FLOOR_NO_SPREAD,
) -> float:
    """The documented rule (bundles/COMPARE.md): max(spread A, spread B, floor), where the floor is
    ``floor_no_spread`` instead when either side recorded no spread (None)."""
    known = spread_a is not None and spread_b is not None
    return max(spread_a or 0.0, spread_b or 0.0, floor if known else max(floor, floor_no_spread))


def _absent(check_id: str, a: BundleData, b: BundleData, has_a: bool, has_b: bool, what: str) -> str:
    """ "perf.decode_sweep: absent in B (no sweep points; B: skipped)"."""
    sides = [(tag, d) for tag, d, has in (("A", a, has_a), ("B", b, has_b)) if not has]
    cid = check_id.split("[")[0]  # "evals.mrcr[k3_mrcr_2needle]": the status is the check's
    return (
        f"{check_id}: absent in {' and '.join(t for t, _ in sides)} ({what}; "
        + ", ".join(f"{t}: {d.status(cid)}" for t, d in sides)
        + ")"
    )


def _perf_delta(
    source: str,
    label: str,
    a_us: float,
    b_us: float,
    sa: float | None,
    sb: float | None,
    floor: tuple[float, float],
    extra: dict[str, Any],
) -> PerfDelta:
    delta = (b_us - a_us) / a_us
    noise = noise_threshold(sa, sb, *floor)
    return PerfDelta(source, label, a_us, b_us, delta, sa, sb, noise, classify(delta, noise), extra)


def _sweep_deltas(
    a: BundleData, b: BundleData, floor: tuple[float, float], absent: list[str], warnings: list[str]
) -> list[PerfDelta]:
    pa, na = sweep_points(a)
    pb, nb = sweep_points(b)
    warnings += [f"A: {n}" for n in na] + [f"B: {n}" for n in nb]
    if not pa or not pb:
        absent.append(_absent(SWEEP_CHECK, a, b, bool(pa), bool(pb), "no sweep points"))
        return []
    ia = {(p.key, p.backend): p for p in pa}
    ib = {(p.key, p.backend): p for p in pb}
    sp_a, sp_b = speedups(pa), speedups(pb)
    out = []
    for k in sorted(ia.keys() & ib.keys(), key=lambda k: (k[0], k[1] != "fast")):
        x, y = ia[k], ib[k]
        extra = {
            "speedup_a": sp_a.get(k[0]),
            "speedup_b": sp_b.get(k[0]),
            "pct_of_floor_a": x.pct_of_floor,
            "pct_of_floor_b": y.pct_of_floor,
        }
        out.append(
            _perf_delta(
                SWEEP_CHECK, f"{k[1]} {x.label}", x.median_us, y.median_us, x.spread, y.spread, floor, extra
            )
        )
    only_a, only_b = len(ia.keys() - ib.keys()), len(ib.keys() - ia.keys())
    if only_a or only_b:
        absent.append(f"{SWEEP_CHECK}: {only_a} point(s) only in A, {only_b} only in B (not compared)")
    return out


def _bench_deltas(
    a: BundleData, b: BundleData, floor: tuple[float, float], absent: list[str], warnings: list[str]
) -> list[PerfDelta]:
    ra, na = bench_rows(a)
    rb, nb = bench_rows(b)
    warnings += [f"A: {n}" for n in na] + [f"B: {n}" for n in nb]
    if not ra or not rb:
        if ra or rb:
            absent.append(_absent(BENCH_CHECK, a, b, bool(ra), bool(rb), "no timed rows"))
        return []
    ia, ib = {r.key: r for r in ra}, {r.key: r for r in rb}
    out = []
    for k in [r.key for r in ra if r.key in ib]:
        x, y = ia[k], ib[k]
        extra = {
            "baseline": x.baseline,
            "vs_baseline_a": x.vs_baseline,
            "vs_baseline_b": y.vs_baseline,
            "pct_of_floor_a": x.pct_of_floor,
            "pct_of_floor_b": y.pct_of_floor,
        }
        out.append(_perf_delta(BENCH_CHECK, x.label, x.ours_us, y.ours_us, x.spread, y.spread, floor, extra))
    only_a, only_b = len(ia.keys() - ib.keys()), len(ib.keys() - ia.keys())
    if only_a or only_b:
        absent.append(f"{BENCH_CHECK}: {only_a} row(s) only in A, {only_b} only in B (not compared)")
    return out


SERVING_CHECK = "perf.serving"
_SERVING_FIELDS = (("itl_ms_p90", "P90 ITL"), ("ttft_ms_p50", "P50 TTFT"))


def _serving_deltas(
    a: BundleData, b: BundleData, floor: tuple[float, float], absent: list[str]
) -> list[PerfDelta]:
    pa, pb = points_by_side(a.records.get(SERVING_CHECK, [])), points_by_side(b.records.get(SERVING_CHECK, []))
    if not pa or not pb:
        if pa or pb:
            absent.append(_absent(SERVING_CHECK, a, b, bool(pa), bool(pb), "no serving points"))
        return []
    # the noise floor each run declared for its serving numbers (perf.serving's noise_floor) also holds here
    declared = [r.get("noise_floor") for d in (a, b) for r in d.records.get(SERVING_CHECK, [])
                if r.get("kind") == "plan" and isinstance(r.get("noise_floor"), (int, float))]
    floor = (max([floor[0], *declared]), max([floor[1], *declared]))
    out = []
    for w, c in sorted(pa.keys() & pb.keys(), key=lambda k: (str(k[0]), k[1] or 0)):
        ia = median_and_spread(pa[(w, c)], "interactivity_p90")[0]
        ib = median_and_spread(pb[(w, c)], "interactivity_p90")[0]
        for name, what in _SERVING_FIELDS:
            (ma, sa), (mb, sb) = median_and_spread(pa[(w, c)], name), median_and_spread(pb[(w, c)], name)
            if not ma or not mb:
                continue
            extra = {"interactivity_p90_a": ia, "interactivity_p90_b": ib, "mixed": True}
            out.append(_perf_delta(SERVING_CHECK, f"{w} c={c} {what} (mixed prefill+decode)", ma * 1e3, mb * 1e3,
                                   sa, sb, floor, extra))
    only_a, only_b = len(pa.keys() - pb.keys()), len(pb.keys() - pa.keys())
    if only_a or only_b:
        absent.append(f"{SERVING_CHECK}: {only_a} point(s) only in A, {only_b} only in B (not compared)")
    return out


def eval_delta(
    check_id: str,
    sa: dict[str, float],
    sb: dict[str, float],
    binary: bool,
    baseline_a: float | None = None,
    baseline_b: float | None = None,
    seed: int = 0,
) -> EvalDelta:
    """Accuracy delta B - A of one eval from per-item scores. Paired over the shared items when they are
    at least half of each side's items; otherwise unpaired over all items."""
    acc_a, acc_b = sum(sa.values()) / len(sa), sum(sb.values()) / len(sb)
    shared = sorted(sa.keys() & sb.keys())
    note = ""
    if shared and len(shared) * 2 >= max(len(sa), len(sb)):
        diffs = [sb[i] - sa[i] for i in shared]
        if len(shared) < max(len(sa), len(sb)):
            note = (
                f"paired over {len(shared)} shared items; {len(sa) - len(shared)} only in A and "
                f"{len(sb) - len(shared)} only in B left out of the test"
            )
        ci = bootstrap_ci(diffs, seed=seed)
        delta = sum(diffs) / len(diffs)
        if binary:
            b = sum(1 for i in shared if sa[i] == 1.0 and sb[i] == 0.0)
            c = sum(1 for i in shared if sa[i] == 0.0 and sb[i] == 1.0)
            p = mcnemar_exact_p(b, c)
            significant, test, disc = p < ALPHA, "mcnemar-exact", (b, c)
        else:
            p, disc, test = None, None, "paired-bootstrap"
            significant = ci[0] > 0 or ci[1] < 0
        n_paired, paired = len(shared), True
    else:
        va, vb = list(sa.values()), list(sb.values())
        delta = acc_b - acc_a
        ci = bootstrap_ci(va, other=vb, seed=seed)
        p = two_sample_z_p(va, vb)
        significant, test, disc, n_paired, paired = p < ALPHA, "two-sample-z", None, 0, False
        note = f"unpaired: only {len(shared)} item(s) in common"
    outcome = WITHIN_NOISE if not significant or delta == 0 else (IMPROVED if delta > 0 else REGRESSED)
    return EvalDelta(
        check_id,
        acc_a,
        acc_b,
        delta,
        len(sa),
        len(sb),
        paired,
        n_paired,
        test,
        p,
        ci,
        outcome,
        disc,
        baseline_a,
        baseline_b,
        note,
    )


def _eval_deltas(a: BundleData, b: BundleData, absent: list[str], warnings: list[str]) -> list[EvalDelta]:
    out = []
    for cid in sorted(set(eval_checks(a)) | set(eval_checks(b))):
        ea, na = eval_samples(a, cid)
        eb, nb = eval_samples(b, cid)
        warnings += [f"A: {n}" for n in na] + [f"B: {n}" for n in nb]
        for label in sorted(set(ea) | set(eb)):
            sa, sb = ea.get(label), eb.get(label)
            has_a, has_b = sa is not None and sa.n(UNDER_TEST) > 0, sb is not None and sb.n(UNDER_TEST) > 0
            if not (has_a and has_b):
                absent.append(_absent(label, a, b, has_a, has_b, "no samples of the engine under test"))
                continue
            out.append(eval_delta(label, sa.scores[UNDER_TEST], sb.scores[UNDER_TEST], sa.binary and sb.binary,
                                  sa.accuracy(BASELINE), sb.accuracy(BASELINE)))
        if not ea and not eb:
            absent.append(_absent(cid, a, b, False, False, "no samples"))
    return out


def _side(d: BundleData) -> dict[str, Any]:
    m = d.manifest
    commit = commit_label((m.get("env") or {}).get("git") if isinstance(m.get("env"), dict) else None)
    return {
        "path": d.path,
        "name": d.name,
        "tier": m.get("tier"),
        "verdict": m.get("verdict"),
        "state": m.get("state"),
        "started_at": m.get("started_at"),
        "gpu": d.gpu,
        "commit": commit,
    }


# ---------------------------------------------------------------- the whole comparison
def compare_bundles(
    path_a: str | Path,
    path_b: str | Path,
    *,
    noise_floor: float = NOISE_FLOOR,
    noise_floor_no_spread: float = NOISE_FLOOR_NO_SPREAD,
    verify: bool = True,
) -> CompareReport:
    """Compare bundle A (before) with B (after). BundleError (exit 2) when either is unreadable."""
    for f in (noise_floor, noise_floor_no_spread):
        if not 0 <= f < 1:
            raise ValueError(f"a noise floor must be a fraction in [0, 1), got {f}")
    floor = (noise_floor, noise_floor_no_spread)
    a, b = read_bundle(path_a), read_bundle(path_b)
    warnings: list[str] = [f"A: {n}" for n in a.notes] + [f"B: {n}" for n in b.notes]
    if verify:
        from verify.bundle.verify import verify_bundle

        for tag, p in (("A", path_a), ("B", path_b)):
            rep = verify_bundle(p)
            if not rep.ok:
                warnings.append(
                    f"{tag} does not verify ({len(rep.problems)} problem(s), first: {rep.problems[0]}): "
                    "its numbers are not evidence"
                )
    if a.manifest.get("tier") != b.manifest.get("tier"):
        warnings.append(
            f"different tiers: A {a.manifest.get('tier')}, B {b.manifest.get('tier')}: "
            "checks planned by one only show as absent in the other"
        )
    if a.gpu != b.gpu:
        warnings.append(f"different GPUs: A {a.gpu}, B {b.gpu}: perf deltas include the machine")
    absent: list[str] = []
    checks = _check_changes(a, b)
    perf = (_sweep_deltas(a, b, floor, absent, warnings) + _bench_deltas(a, b, floor, absent, warnings)
            + _serving_deltas(a, b, floor, absent))
    evals = _eval_deltas(a, b, absent, warnings)

    bad = [f"{c.id}: {c.a} -> {c.b}" for c in checks if c.change == REGRESSED]
    bad += [
        f"{p.source} {p.label}: {fmt_us(p.a_us)} -> {fmt_us(p.b_us)} ({p.delta:+.1%}, noise {p.noise:.1%})"
        for p in perf
        if p.outcome == REGRESSED
    ]
    bad += [
        f"{e.check_id}: accuracy {e.acc_a:.4f} -> {e.acc_b:.4f} ({e.delta:+.4f}, {e.test} p={_p(e.p_value)})"
        for e in evals
        if e.outcome == REGRESSED
    ]
    good = [f"{c.id}: {c.a} -> {c.b}" for c in checks if c.change == IMPROVED]
    good += [
        f"{p.source} {p.label}: {fmt_us(p.a_us)} -> {fmt_us(p.b_us)} ({p.delta:+.1%}, noise {p.noise:.1%})"
        for p in perf
        if p.outcome == IMPROVED
    ]
    good += [
        f"{e.check_id}: accuracy {e.acc_a:.4f} -> {e.acc_b:.4f} ({e.delta:+.4f}, {e.test} p={_p(e.p_value)})"
        for e in evals
        if e.outcome == IMPROVED
    ]
    verdict = REGRESSED if bad else IMPROVED if good else WITHIN_NOISE
    return CompareReport(
        a=_side(a),
        b=_side(b),
        checks=tuple(checks),
        perf=tuple(perf),
        evals=tuple(evals),
        absent=tuple(absent),
        warnings=tuple(warnings),
        noise_floor=noise_floor,
        noise_floor_no_spread=noise_floor_no_spread,
        verdict=verdict,
        reasons=tuple(bad if bad else good),
    )


# ---------------------------------------------------------------- text
def fmt_us(us: float) -> str:
    """A time for people: "23.70 us", "33.627 ms"."""
    return f"{us / 1e3:.3f} ms" if us >= 1000 else f"{us:.2f} us"


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.3g}"


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render_compare(r: CompareReport, *, show_all: bool = True) -> str:
    """Plain text of a comparison (what the CLI prints and the snapshot tests compare). With
    ``show_all=False`` unchanged checks and perf rows within noise are counted, not listed."""
    out = [
        f"verdict: {r.verdict} (exit {r.exit_code})",
        *(f"{t}: {s['name']} (tier {s['tier']}, verdict {s['verdict']}, {s['gpu']}, commit {s['commit']})"
          for t, s in (("A", r.a), ("B", r.b))),
        f"noise rule: a time delta counts when it exceeds max(spread A, spread B, {r.noise_floor:.0%}); "
        f"spread = (p90 - p10) / median; {r.noise_floor_no_spread:.0%} when a side recorded no spread",
    ]
    if r.reasons:
        out.append(f"{'regressions' if r.verdict == REGRESSED else 'improvements'}:")
        out += [f"  - {x}" for x in r.reasons]
    changed = [c for c in r.checks if c.change != "same"]
    out.append(f"checks: {len(r.checks)}, {len(changed)} changed")
    for c in r.checks if show_all else changed:
        out.append(f"  {c.id}: {c.a} -> {c.b}" + ("" if c.change == "same" else f"  [{c.change}]"))
    for source in (SWEEP_CHECK, BENCH_CHECK, SERVING_CHECK):
        rows = [p for p in r.perf if p.source == source]
        if not rows:
            continue
        counts = {o: sum(1 for p in rows if p.outcome == o) for o in (REGRESSED, IMPROVED, WITHIN_NOISE)}
        out.append(f"{source}: {len(rows)} compared: " + ", ".join(f"{n} {o}" for o, n in counts.items()))
        for p in rows if show_all else [p for p in rows if p.outcome != WITHIN_NOISE]:
            sp = ""
            if p.label.startswith("fast ") and p.extra.get("speedup_a") and p.extra.get("speedup_b"):
                sp = f", speedup {p.extra['speedup_a']:.2f}x -> {p.extra['speedup_b']:.2f}x"
            elif p.extra.get("vs_baseline_a") and p.extra.get("vs_baseline_b"):
                x = p.extra
                sp = f", vs {x['baseline']} {x['vs_baseline_a']:.2f}x -> {x['vs_baseline_b']:.2f}x"
            elif p.extra.get("interactivity_p90_a") and p.extra.get("interactivity_p90_b"):
                x = p.extra
                sp = (f", P90 interactivity {x['interactivity_p90_a']:.1f} -> {x['interactivity_p90_b']:.1f} "
                      "tok/s/user; spread over repeats")
            spread = f"spread {_f(p.spread_a, '.1%')}/{_f(p.spread_b, '.1%')}"
            # a delta past the floor that only the measured spread absorbs: say so
            flag = (
                ": smaller than the spread"
                if p.outcome == WITHIN_NOISE
                and abs(p.delta) > min(r.noise_floor, r.noise_floor_no_spread)
                and p.spread_a is not None
                and p.spread_b is not None
                else ""
            )
            out.append(
                f"  {p.label}: {fmt_us(p.a_us)} -> {fmt_us(p.b_us)} {p.delta:+.1%} [{p.outcome}{flag}] "
                f"({spread}, noise {p.noise:.1%}{sp})"
            )
    for e in r.evals:
        disc = f", discordant {e.discordant[0]}/{e.discordant[1]}" if e.discordant else ""
        base = (
            f", baseline {e.baseline_a:.4f} -> {e.baseline_b:.4f}"
            if e.baseline_a is not None and e.baseline_b is not None
            else ""
        )
        out.append(
            f"{e.check_id}: accuracy {e.acc_a:.4f} (n={e.n_a}) -> {e.acc_b:.4f} (n={e.n_b}) "
            f"{e.delta:+.4f} [{e.outcome}] ({e.test}{', paired n=' + str(e.n_paired) if e.paired else ''}, "
            f"p={_p(e.p_value)}, 95% CI [{e.ci[0]:+.4f}, {e.ci[1]:+.4f}]{disc}{base})"
        )
        if e.note:
            out.append(f"  note: {e.note}")
    if r.absent:
        out.append("not compared:")
        out += [f"  - {x}" for x in r.absent]
    if r.warnings:
        out.append("warnings:")
        out += [f"  - {x}" for x in r.warnings]
    return "\n".join(out) + "\n"
