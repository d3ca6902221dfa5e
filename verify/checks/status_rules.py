"""The pass/fail rules of the reference, weights, kernels, equivalence and bandwidth-probe checks, as
functions of their raw records, and ``RULES``: every check id's rule, those kept beside their checks
(``feature_rules``, ``bench_rules``, ``serving_rules``, ``fp64_rules``, ``spec_rules``) included.

Each rule takes a check's records (and, where the check states them, its result's metrics) and returns
the problems, in the order the check reports them. The check computes its verdict by calling the same
rule on the records it just wrote, and ``bundle verify`` calls it again on the bundle's records
(``RESCORERS``): a result whose status or reason does not follow from its records fails verification,
so flipping a status and re-sealing the bundle is caught. Nothing here imports torch (equivalence's trace rule is ``k3_fastpath.runtime.trace``'s, imported there).

A record field an older writer did not record leaves the sub-rule that needs it out (the bundle is read
as that writer wrote it); every bundle this version writes carries all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verify.checks.bench_rules import bench_kernels_problems
from verify.checks.feature_rules import (
    full_context_problems,
    structured_output_problems,
    temperature_sampling_problems,
)
from verify.checks.fp64_rules import fp64_problems
from verify.checks.record_fields import is_timing_path
from verify.checks.serving_rules import serving_problems
from verify.checks.spec_rules import spec_acceptance_problems, spec_decode_problems, spec_sampling_problems
from verify.checks.vllm_route_rules import vllm_route_problems

F64_TOL = 1e-8  # relative to the logits' scale: the two paths are the same math in float64
# bf16: decode and prefill round at different places (chunked vs recurrent KDA, plain vs absorbed MLA), and
# a routing near-tie can flip one position's experts, so a pointwise bound would be flaky on synthetic
# weights. The bound is on the MEDIAN per-position relative gap (observed 1-2% on k3-tiny).
BF16_MEDIAN_TOL = 0.05
TOLERANCES = {"max_rel_err": F64_TOL, "median_rel_err": BF16_MEDIAN_TOL}

Records = Sequence[Mapping[str, Any]]


def verdict_reason(problems: Sequence[str]) -> str:
    """A failed result's reason: the first problem, and how many more there are."""
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


# ------------------------------------------------------------------------------------------ reference
def prefill_decode_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    cases = [r for r in records if "case" in r]
    problems = [] if cases else ["no prefill/decode case ran"]
    for r in cases:
        stat = r.get("statistic")
        tol = TOLERANCES.get(stat)
        if tol is None or r.get("tolerance") != tol:
            problems.append(f"{r['case']} batch {r.get('batch')}: tolerance {r.get('tolerance')!r} for {stat!r} is "
                            f"not the check's ({tol!r})")
            continue
        value = r.get(stat)
        if not isinstance(value, (int, float)) or not value <= tol:
            problems.append(f"{r['case']} batch {r['batch']} lengths {r['lengths']}: decode vs prefill {stat} "
                            f"{value:.3g} > {tol:g}" if isinstance(value, (int, float)) else
                            f"{r['case']} batch {r.get('batch')}: no {stat} recorded")
    return problems


def determinism_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    if not records:
        return ["no run was recorded"]
    r = records[-1]
    problems = []
    if not r.get("bitwise_equal"):
        diff = r.get("max_logit_diff")
        problems.append(f"two runs on {r.get('weights')} differ: max logit difference "
                        + (f"{diff:.3g}" if isinstance(diff, (int, float)) else "not recorded"))
    if "control_differs" in r and not r["control_differs"]:
        problems.append(f"{r.get('control')} gave the same logits as {r.get('weights')}: the check is blind")
    return problems


# ------------------------------------------------------------------------------------------ weights
def roundtrip_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    steps = {r.get("step"): r for r in records if r.get("step") in ("load", "mxfp4")}
    if "load" not in steps:
        return ["no load step was recorded"]
    load, problems = steps["load"], []
    if load.get("digest_expected") is not None and load.get("digest") != load["digest_expected"]:
        problems.append(f"{load.get('checkpoint')}: digest {load.get('digest')} differs from {load['digest_expected']}, "
                        "read at the start of the run: the checkpoint changed during the run")
    if load.get("names_missing") or load.get("names_extra"):
        problems.append(f"loaded names differ from the manifest: missing {load.get('names_missing')}, "
                        f"extra {load.get('names_extra')}")
    if "mismatched_names" in load:
        problems += [f"{n}: loaded tensor differs from {load.get('compared_with')}" for n in load["mismatched_names"]]
    elif load.get("mismatched"):
        problems.append(f"{load['mismatched']} loaded tensors differ")
    problems += [f"{n}: loaded as {dtype}, the checkpoint stores F32" for n, dtype in load.get("fp32_violations", [])]
    mx = steps.get("mxfp4", {})
    if "differing" in mx:
        problems += [f"{n}: MXFP4 dequantisation differs from the independent decoder by {err:.3g}"
                     for n, err in mx["differing"]]
    elif mx.get("max_abs_diff"):
        problems.append(f"MXFP4 dequantisation differs from the independent decoder by {mx['max_abs_diff']:.3g}")
    tps = [r for r in records if r.get("step") == "tp"]
    for r in tps:
        if r.get("applicable") is False:
            continue
        if r.get("load_error"):
            problems.append(f"tp {r['tp_size']}: loading the rank slices failed: {r['load_error']}")
            continue
        problems += [f"tp {r['tp_size']}: {n}: rank slices do not reassemble to the full tensor"
                     for n in (r.get("mismatched") or [])[:5]]
    if tps and all(r.get("applicable") is False for r in tps):
        problems.append(f"none of tp_sizes {[r['tp_size'] for r in tps]} splits this model: no TP slice was checked")
    return problems


# ------------------------------------------------------------------------------------------ kernels
def compile_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    problems = [] if records else ["no kernel was compiled"]
    for r in records:
        problems += [f"{r['kernel']} ({r['preset']}): {e}" for e in r.get("errors", [])]
        if r.get("variants") == 0:
            problems.append(f"{r['kernel']} ({r['preset']}): no variants to compile: the kernel serves no shape")
    return problems


def numerics_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """Any failed test; a skipped test of a kernel (on an H200 the envelope shrank); no test passed; a
    launch name of the registry (``metrics.expected_launches``) that no test moved."""
    metrics = metrics or {}
    kernels = metrics.get("kernels") or metrics.get("expected_launches") or []
    problems = []
    for t in records:
        name = t["test"].split("::")[-1]
        if t.get("outcome") == "failed":
            problems.append(f"{t['test']}: {t.get('reason', 'failed')}")
        elif t.get("outcome") == "skipped" and any(name.startswith(f"test_{k}") for k in kernels):
            problems.append(f"{t['test']}: skipped on a GPU ({t.get('reason', '')})")
    if not any(t.get("outcome") == "passed" for t in records):
        problems.append("no kernel test ran (see artifacts pytest.log)")
    launched = launches_by_kernel(records)
    problems += [f"{k}: no GPU test launched this kernel" for k in metrics.get("expected_launches") or []
                 if k not in launched]
    return problems


def launches_by_kernel(records: Records) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in records:
        for k, n in ((t.get("counters") or {}).get("launches") or {}).items():
            out[k] = out.get(k, 0) + n
    return out


def sanitizer_problems(records: Records, metrics: Mapping[str, Any] | None = None, check_id: str = "kernels.sanitizer"
                       ) -> list[str]:
    problems = [] if records else ["no sanitizer tool ran"]
    for r in records:
        tool, errors = r.get("tool"), r.get("errors")
        if errors is None:
            problems.append(f"{tool}: no ERROR SUMMARY in compute-sanitizer output (exit {r.get('returncode')})")
        elif errors:
            problems.append(f"{tool}: {errors} error(s), see artifacts/{check_id}/{tool}.log")
        elif r.get("returncode") != 0 and not r.get("tolerated_api_probes"):
            problems.append(f"{tool}: exit code {r.get('returncode')} with 0 errors reported")
        if not r.get("all_kernels_launched"):
            problems.append(f"{tool}: the driver did not launch every kernel (a fallback proves nothing)")
        if "executor_step_with_side_stream" in r and not r["executor_step_with_side_stream"]:
            problems.append(f"{tool}: the executor step with the shared experts on the side stream did not run")
    return problems


# ------------------------------------------------------------------------------------------ perf
MAX_SPREAD = 0.10  # (max - min) / median of the read-bandwidth repeats: above it the GPU is shared or throttling


def bandwidth_probe_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """perf.bandwidth_probe: the read-reduction repeats' spread, and each probe's rate from its own samples."""
    import statistics

    probes = {r.get("probe"): r for r in records}
    read = probes.get("read_reduction")
    if not read or not read.get("times_ms"):
        return ["no read-bandwidth repeats were recorded"]
    problems = []
    for name, nbytes in (("read_reduction", read.get("bytes")), ("cublas_gemv", (probes.get("cublas_gemv") or {}).get("bytes"))):
        r = probes.get(name)
        if r and r.get("times_ms") and nbytes:
            rate = nbytes / (statistics.median(r["times_ms"]) * 1e-3)
            if not math.isclose(rate, float(r.get("read_bytes_per_s") or 0.0), rel_tol=1e-6):
                problems.append(f"{name}: read_bytes_per_s {r.get('read_bytes_per_s')} but its samples give {rate:.6g}")
    times = read["times_ms"]
    spread = (max(times) - min(times)) / statistics.median(times)
    if spread > MAX_SPREAD:
        problems.append(f"read-bandwidth repeats spread by {spread:.1%} (> {MAX_SPREAD:.0%}): the GPU is shared "
                        f"or throttling; perf ratios from this run would be noise")
    return problems


# ------------------------------------------------------------------------------------------ equivalence
MAX_MEAN_KL = 0.01
# After a sequence's first divergence both sides keep decoding the reference's token, so a later mismatch is
# a near-tie of two correct BF16 paths as often as not: the rule (each side's token in the other's
# top-5) binds at the first divergence; later violations are bounded by rate. H200, k3-mini, 256 steps:
# 4 later violations in 64 x 256 row-steps (0.024%) at batch 64, none at batch 1-8, none at a first divergence.
# The rate is the grid's (a plan with ``later_violations: "grid"``): one near-tie in a batch-2 point of 128
# steps is 0.39% of its 256 row-steps (H200, 2026-12-03-h200-session14), so a per-point rate cannot hold the
# bound at small batches; a point fails on its own only when its count is improbable at the allowed rate
# (binomial upper tail below ``POINT_EXCESS_P``: at 0.2%, 4 in 128 row-steps, 5 in 256, 9 in 1,024, 31 in
# 8,192).
MAX_LATER_VIOLATION_RATE = 0.002
POINT_EXCESS_P = 1e-3


def binomial_upper_tail(k: int, n: int, p: float) -> float:
    """P[X >= k] for X ~ Binomial(n, p) (log-space terms: n in the tens of thousands)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    below = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                for i in range(k))
    return max(0.0, 1.0 - below)


def _point_problems(where: str, point: Mapping[str, Any], steps: Records, plan: Mapping[str, Any]
                    ) -> tuple[list[str], int, int]:
    """One grid point's problems, its numbers re-derived from its step rows where they hold them; with its
    later violations and row-steps (for the grid's rate)."""
    problems = []
    rows = sorted(steps, key=lambda r: r.get("step", 0))
    batch = int(point.get("batch") or 0)
    first: list[int | None] = [None] * batch
    mismatches = 0
    for r in rows:
        diff = [i for i, (a, b) in enumerate(zip(r.get("ref_tokens") or [], r.get("fast_tokens") or [], strict=False))
                if a != b]
        if diff != list(r.get("mismatch_rows") or []):
            problems.append(f"{where}: step {r.get('step')} records mismatch rows {r.get('mismatch_rows')}, its tokens "
                            f"give {diff}")
        mismatches += len(diff)
        for i in diff:
            if i < batch and first[i] is None:
                first[i] = r.get("step")
    if len(rows) != point.get("steps"):
        problems.append(f"{where}: {len(rows)} step rows for {point.get('steps')} steps")
    if (mismatches, first) != (point.get("mismatches"), point.get("first_divergence")):
        problems.append(f"{where}: the point says {point.get('mismatches')} mismatches, first divergence "
                        f"{point.get('first_divergence')}; its steps give {mismatches}, {first}")
    kls = [r.get("kl_mean") for r in rows]
    if kls and all(isinstance(k, (int, float)) and math.isfinite(k) for k in kls):
        kl_mean = sum(kls) / len(kls)
        if not math.isclose(kl_mean, float(point.get("kl_mean") or 0.0), rel_tol=1e-6, abs_tol=1e-12):
            problems.append(f"{where}: the point's mean KL {point.get('kl_mean')!r} is not its steps' mean {kl_mean:.6g}")
    else:
        kl_mean = float(point.get("kl_mean") or 0.0)
    violations = list(point.get("topk_violations") or [])
    for v in violations:
        row = next((r for r in rows if r.get("step") == v.get("step")), None)
        seq = v.get("seq")
        if row is None or seq not in (row.get("mismatch_rows") or []):
            problems.append(f"{where}: a top-k violation at step {v.get('step')} seq {seq} where the tokens agree")
    top_k = plan["top_k"]
    if "later_violation_rate" not in point:  # the writer's rule then: every violation fails the point
        problems += [f"{where}: step {v.get('step')} seq {v.get('seq')}: reference token {v.get('ref_token')} / fast "
                     f"token {v.get('fast_token')} not in each other's top-{top_k}" for v in violations]
        violations = []
    firsts = [v for v in violations if isinstance(v.get("seq"), int) and v["seq"] < batch and v.get("step") == first[v["seq"]]]
    for v in firsts[:5]:
        problems.append(f"{where}: first divergence of seq {v['seq']} at step {v['step']}: reference token "
                        f"{v['ref_token']} / fast token {v['fast_token']} not in each other's top-{top_k}")
    later, row_steps = len(violations) - len(firsts), len(rows) * batch
    rate = plan["max_later_violation_rate"]
    if plan.get("later_violations") == "grid":
        tail = binomial_upper_tail(later, row_steps, rate)
        if tail < POINT_EXCESS_P:
            problems.append(f"{where}: {later} later top-{top_k} violations in {row_steps} row-steps: "
                            f"P = {tail:.1e} at the allowed {rate * 100:g}% (< {POINT_EXCESS_P:g})")
    elif later / max(row_steps, 1) > rate:  # a plan without the key: the rate per point
        problems.append(f"{where}: {later / max(row_steps, 1):.3%} of row-steps after a first divergence have "
                        f"tokens outside each other's top-{top_k} (> {rate:.1%})")
    nonfinite = sum(not r.get("finite", True) for r in rows)
    if nonfinite:
        problems.append(f"{where}: non-finite fast logits at {nonfinite} step(s)")
    if kl_mean > plan["max_mean_kl"]:
        problems.append(f"{where}: mean KL(reference || fast) {kl_mean:.3g} > {plan['max_mean_kl']:g}")
    from k3_fastpath.runtime.trace import fast_path_problems

    problems += [f"{where}: {p}" for p in fast_path_problems(point.get("trace") or {}, expect_fast=not plan["emulated"])]
    return problems, later, row_steps


def equivalence_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """equivalence.decode: per grid point (in the order run) why it did not run, or its problems from its
    step rows and point summary (``_point_problems``), with the thresholds of the ``plan`` record (older
    bundles: the metrics' ``top_k`` / ``max_mean_kl``, the default later-violation rate); the later-violation
    rate over the grid's row-steps (a plan with ``later_violations: "grid"``; per point without); then every planned
    point must be accounted for."""
    m = metrics or {}
    plan = next((r for r in reversed(records) if r.get("kind") == "plan"), None) or {
        "top_k": m.get("top_k", 5), "max_mean_kl": m.get("max_mean_kl", MAX_MEAN_KL),
        "max_later_violation_rate": MAX_LATER_VIOLATION_RATE, "emulated": bool(m.get("emulated"))}
    steps: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "step":
            steps.setdefault((r.get("batch"), r.get("context")), []).append(r)
    problems, seen = [], set()
    grid_later = grid_row_steps = 0
    for r in records:
        where = f"batch {r.get('batch')} context {r.get('context')}"
        if r.get("kind") == "not_run":
            seen.add((r.get("batch"), r.get("context")))
            problems.append(f"{where}: {r.get('why')}")
        elif r.get("kind") == "point":
            seen.add((r.get("batch"), r.get("context")))
            rows = [x for x in steps.get((r.get("batch"), r.get("context")), []) if x.get("attempt", 1) == r.get("attempt", 1)]
            point_problems, later, row_steps = _point_problems(where, r, rows, plan)
            problems += point_problems
            grid_later += later
            grid_row_steps += row_steps
    rate = plan["max_later_violation_rate"]
    if plan.get("later_violations") == "grid" and grid_later > rate * grid_row_steps:
        problems.append(f"the grid: {grid_later / grid_row_steps:.3%} of {grid_row_steps} row-steps after a first "
                        f"divergence have tokens outside each other's top-{plan['top_k']} (> {rate * 100:g}%)")
    if "batches" in plan:
        missing = [(b, c) for c in plan["contexts"] for b in plan["batches"] if (b, c) not in seen]
        problems += [f"batch {b} context {c}: no record of this planned point" for b, c in missing]
    elif not seen:
        problems.append("no grid point was recorded")
    return problems


# ------------------------------------------------------------------------------------------ bundle audit
def _short(v: Any) -> str:
    t = repr(v)
    return t if len(t) <= 60 else t[:57] + "..."


def audit_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """``audit.records`` (verify/bundle/audit.py): every disagreement (``informational`` ones aside: timings of a
    record no status rule gates; a field that is not a timing cannot be one) and every check that could not
    run; each audited row's counts of disagreements and informational ones must be the records'."""
    problems = []
    for r in records:
        if r.get("kind") == "disagreement" and not (r.get("informational") and is_timing_path(r.get("field") or "")):
            problems.append(f"{r.get('check')} record {r.get('index')}: {r.get('field') or '(record)'} {r.get('why')} "
                            f"(bundle {_short(r.get('bundle'))}, re-run {_short(r.get('rerun'))})"
                            + (" (marked informational, but not a timing)" if r.get("informational") else ""))
        elif r.get("kind") == "cannot_run":
            problems.append(f"{r.get('check')}: {r.get('why')}")
    audited = [r for r in records if r.get("kind") == "audited"]
    for a in audited:
        found = [r for r in records if r.get("kind") == "disagreement" and r.get("check") == a.get("check")]
        info = sum(1 for r in found if r.get("informational"))
        if a.get("disagreements") != len(found):
            problems.append(f"{a.get('check')}: the audited record counts {a.get('disagreements')} disagreements, "
                            f"{len(found)} are recorded")
        if a.get("informational", 0) != info:
            problems.append(f"{a.get('check')}: the audited record counts {a.get('informational', 0)} informational "
                            f"disagreements, {info} are marked")
    if not audited and not problems:
        problems.append("no check was audited")
    return problems


RULES: dict[str, Callable[[Records, Mapping[str, Any] | None], list[str]]] = {
    "reference.prefill_decode_consistency": prefill_decode_problems,
    "reference.determinism": determinism_problems,
    "weights.roundtrip": roundtrip_problems,
    "kernels.compile": compile_problems,
    "kernels.numerics": numerics_problems,
    "kernels.sanitizer": sanitizer_problems,
    "features.full_context": full_context_problems,
    "features.structured_output": structured_output_problems,
    "features.temperature_sampling": temperature_sampling_problems,
    "perf.bandwidth_probe": bandwidth_probe_problems,
    "equivalence.decode": equivalence_problems,
    "equivalence.fp64": fp64_problems,
    "equivalence.spec_decode": spec_decode_problems,
    "equivalence.vllm_route": vllm_route_problems,
    "features.spec_acceptance": spec_acceptance_problems,
    "features.spec_sampling": spec_sampling_problems,
    "features.decode_sampling": spec_sampling_problems,
    "bench.kernels": bench_kernels_problems,
    "perf.serving": serving_problems,
    "audit.records": audit_problems,
}


# Whether the records hold every field the rule reads (bundles written before the rule was shared carry
# fewer): only then does a failed status with no problem in its records count as a contradiction.
COMPLETE: dict[str, Callable[[Records, Mapping[str, Any]], bool]] = {
    "reference.determinism": lambda recs, m: bool(recs) and "control_differs" in recs[-1],
    "weights.roundtrip": lambda recs, m: any("mismatched_names" in r for r in recs),
    "kernels.numerics": lambda recs, m: "expected_launches" in m,
    # points without later_violation_rate: a writer that failed every top-k violation, in its own wording
    "equivalence.decode": lambda recs, m: all("later_violation_rate" in r for r in recs if r.get("kind") == "point"),
    # kernel benches that raised were a problem without a row, and fallbacks were judged on an unrecorded snapshot
    "bench.kernels": lambda recs, m: any("counters_before" in r for r in recs),
}


def rescore(records: Mapping[str, list], result: Any) -> list[str]:
    """``bundle verify``'s rescorer for the checks of ``RULES``: the status and reason re-derived from the
    result's records. A skipped result has no records; an error (a crash, over budget, a preflight miss)
    states why it has no verdict and is taken as it is."""
    rule = RULES.get(result.id)
    if rule is None:
        return []
    recs = records.get(result.id, [])
    if result.status == "skipped":
        return [f"skipped, yet {len(recs)} records were written"] if recs else []
    if result.status == "error":
        return []
    problems = rule(recs, result.metrics)
    complete = COMPLETE.get(result.id, lambda r, m: True)(recs, result.metrics)
    if not problems and result.status == "failed" and not complete:
        return []  # an older writer failed it on a rule whose inputs it did not record
    want = "failed" if problems else "passed"
    if result.status != want:
        return [f"status {result.status!r}, but its {len(recs)} records give {want!r}"
                + (f" ({problems[0]})" if problems else "")]
    if problems and complete and result.reason != verdict_reason(problems):  # (an older writer's own wording)
        return [f"reason {result.reason!r} is not what its records give ({verdict_reason(problems)!r})"]
    return []
