"""``k3-verify bundle audit`` (verify/bundle/audit.py) on a CPU bundle: the re-execution agrees with an honest
bundle (exit 0, an audit bundle that verifies); a fabricated record that every rescorer accepts -- a
plausible digest or error value, re-sealed -- is found (exit 1); a GPU check here cannot run (exit 2)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_status_rescore import forge

from verify.bundle.audit import AUDIT_CHECK, compare_records, counted, recorded_spread
from verify.bundle.verify import verify_bundle

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "verify.cli"]
TIER = ("name: t\ndescription: d\ntarget_s: 600\nchecks:\n"
        "  - id: reference.determinism\n    budget_s: 120\n"
        "  - id: weights.roundtrip\n    budget_s: 120\n")


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory) -> Path:
    from verify.output import Output
    from verify.runner import run_tier

    d = tmp_path_factory.mktemp("audit")
    tier = d / "t.yaml"
    tier.write_text(TIER)
    verdict, root = run_tier(str(tier), d / "bundle", "auto", "cpu", 0, Output("json"), argv=["test"])
    assert verdict == "pass" and verify_bundle(root).ok
    plan = json.loads((root / "manifest.json").read_text())["config"]["check_plan"]
    assert set(plan) == {"reference.determinism", "weights.roundtrip"} and plan["weights.roundtrip"]["budget_s"] == 120
    return root


def _audit(bundle: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "bundle", "audit", str(bundle), "-o", str(out), "--sample", "50", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


def test_an_honest_bundle_audits_clean_and_the_audit_bundle_verifies(cpu_bundle, tmp_path):
    r = _audit(cpu_bundle, tmp_path / "audit")
    assert r.returncode == 0, r.stdout + r.stderr
    assert verify_bundle(tmp_path / "audit").ok
    recs = [json.loads(x) for x in (tmp_path / "audit" / "records" / f"{AUDIT_CHECK}.jsonl").read_text().splitlines()]
    audited = {x["check"]: x for x in recs if x["kind"] == "audited"}
    assert set(audited) == {"reference.determinism", "weights.roundtrip"}
    assert all(a["disagreements"] == 0 and a["sampled"] for a in audited.values())
    assert (tmp_path / "audit" / "artifacts" / AUDIT_CHECK / "rerun.tar.gz").is_file()


def test_a_fabricated_record_that_rescorers_accept_is_found(cpu_bundle, tmp_path):
    import shutil

    bundle = tmp_path / "forged"
    shutil.copytree(cpu_bundle, bundle)

    def edit(rows):  # one hex digit of the load step's digest changed: well-formed, every rule still passes
        load = next(r for r in rows if r.get("step") == "load")
        load["digest"] = load["digest"][:-1] + ("0" if load["digest"][-1] != "0" else "1")
    forge(bundle, "weights.roundtrip", record=edit)
    assert verify_bundle(bundle).ok, verify_bundle(bundle).problems  # the rescorer cannot tell
    r = _audit(bundle, tmp_path / "audit", "--checks", "weights.roundtrip")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "weights.roundtrip record" in r.stdout and "digest" in r.stdout
    assert verify_bundle(tmp_path / "audit").ok  # the audit's own verdict is re-derived
    res = json.loads((tmp_path / "audit" / "results.jsonl").read_text().splitlines()[0])
    assert res["status"] == "failed"
    forge(tmp_path / "audit", AUDIT_CHECK, result={"status": "passed", "reason": ""})  # the audit's own forgery
    assert any("records give 'failed'" in p for p in verify_bundle(tmp_path / "audit").problems)


@pytest.mark.parametrize("change", ["dropped", "added"])
def test_a_record_dropped_or_added_that_verify_accepts_is_found(cpu_bundle, tmp_path, change):
    import shutil

    bundle = tmp_path / "forged"
    shutil.copytree(cpu_bundle, bundle)

    def edit(rows):  # a TP split row removed, or one repeated: the roundtrip rule still passes
        i = next(k for k, r in enumerate(rows) if r.get("step") == "tp")
        rows.pop(i) if change == "dropped" else rows.insert(i, dict(rows[i]))
    forge(bundle, "weights.roundtrip", record=edit)
    assert verify_bundle(bundle).ok
    r = _audit(bundle, tmp_path / "audit", "--checks", "weights.roundtrip", "--sample", "1")
    assert r.returncode == 1 and "the record counts differ" in r.stdout, r.stdout + r.stderr


def test_a_gpu_check_cannot_be_audited_on_a_cpu(tmp_path):
    bundle = REPO / "bundles" / "runs" / "2026-12-01-h200-session8" / "full-context"
    r = _audit(bundle, tmp_path / "audit")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "check_plan" in r.stdout or "cannot run here" in r.stdout


def test_compare_records_rules():
    a = [{"step": "load", "digest": "x", "read_s": 1.0, "started_at": "t1", "rows": [1, 2]}]
    same = [{"step": "load", "digest": "x", "read_s": 1.2, "started_at": "t2", "rows": [1, 2]}]
    assert compare_records(a, same, [0], 0.25, 0.0) == []  # a timing within 25%, a timestamp ignored
    slow = [dict(same[0], read_s=2.0)]
    assert compare_records(a, slow, [0], 0.25, 0.0)[0]["field"] == "read_s"
    other = [dict(same[0], rows=[1, 3])]
    assert compare_records(a, other, [0], 0.25, 0.0)[0]["field"] == "rows[1]"
    assert compare_records(a, [], [0], 0.25, 0.0)[0]["why"] == "the re-run wrote 0 records"
    near = [{"v": 1.0 + 1e-9}]
    assert compare_records([{"v": 1.0}], near, [0], 0.25, 0.0) and not compare_records([{"v": 1.0}], near, [0], 0.25,
                                                                                          1e-6)


def test_timings_nested_in_a_timing_field_wall_times_and_the_records_own_spread():
    """What the H200 audit of the standard tier showed (bundles/runs/2026-12-02-h200-session10): a decode-sweep
    point's per-layer-type and per-section times live in dicts whose own keys name no unit; a point's wall
    seconds and the timer's description (which quotes its measured overhead) are not measurements of the
    code; an eager row's timings vary run to run as much as its own p10..p90 spread."""
    a = [{"floor_us_by_layer_type": {"kda": 100.0}, "section_us": {"L3": {"mlp": 50.0}}, "seconds": 11.4,
          "point_wall_s": 9.5, "per_layer_type_timer": "graphs (sections add +0.9%)", "tokens": [1, 2]}]
    b = [{"floor_us_by_layer_type": {"kda": 112.0}, "section_us": {"L3": {"mlp": 55.0}}, "seconds": 16.2,
          "point_wall_s": 3.9, "per_layer_type_timer": "graphs (sections add +1.4%)", "tokens": [1, 2]}]
    assert compare_records(a, b, [0], 0.25, 0.0) == []
    b[0]["section_us"]["L3"]["mlp"] = 80.0
    assert [d["field"] for d in compare_records(a, b, [0], 0.25, 0.0)] == ["section_us.L3.mlp"]
    b[0]["tokens"] = [1, 3]  # a non-timing field inside the same record stays bitwise
    assert "tokens[1]" in [d["field"] for d in compare_records(a, b, [0], 0.25, 0.0)]
    eager = [{"step_us_median": 100.0, "step_us_p10": 80.0, "step_us_p90": 120.0}]  # its own spread: 40%
    assert recorded_spread(eager[0]) == pytest.approx(0.4)
    assert compare_records(eager, [dict(eager[0], step_us_median=135.0)], [0], 0.25, 0.0) == []
    assert compare_records(eager, [dict(eager[0], step_us_median=170.0)], [0], 0.25, 0.0)[0]["why"] == "timing beyond 40%"


def test_nested_timings_use_their_recorded_spread_and_the_steps_scale():
    """What the recompared H200 audit left (27 disagreements): eager per-layer-type breakdowns vary run to run
    beyond 25%, a ~25-75 us embedding section by 2x. The sweep now records each nested timing's spread
    (``timing_spread``); the larger of both runs' spreads widens that field's tolerance, a nested microsecond
    timing may differ by 1% of the step, per-sample lists are not compared element by element, and a
    difference beyond all of that is still found."""
    base = {"step_us_median": 5000.0, "step_us_p10": 4990.0, "step_us_p90": 5010.0,
            "step_us_samples": [4990.0, 5000.0, 5010.0],
            "section_us": {"head.in": 25.0, "L3.mlp": 400.0}, "per_layer_type_us": {"moe": 1000.0},
            "pct_of_floor_by_layer_type": {"moe": 0.5},
            "timing_spread": {"per_layer_type_us": {"moe": 0.05}, "pct_of_floor_by_layer_type": {"moe": 0.05},
                              "section_us": {"head.in": 0.1, "L3.mlp": 0.02}}}
    rerun = copy.deepcopy(base)
    rerun["section_us"]["head.in"] = 70.0  # 2.8x, but 45 us < 1% of the 5 ms step
    rerun["step_us_samples"] = [4995.0, 5000.0, 5020.0]
    rerun["per_layer_type_us"]["moe"] = 1450.0  # 45% off: within the re-run's own recorded spread below
    rerun["pct_of_floor_by_layer_type"]["moe"] = 0.5 / 1.45
    rerun["timing_spread"]["per_layer_type_us"]["moe"] = 0.5
    rerun["timing_spread"]["pct_of_floor_by_layer_type"]["moe"] = 0.5
    assert compare_records([base], [rerun], [0], 0.25, 0.0) == []
    rerun["section_us"]["L3.mlp"] = 560.0  # +160 us, 40%: beyond its 2% spread, 25% and 50 us
    rerun["per_layer_type_us"]["moe"] = 2100.0  # 52% of the larger value: beyond the 50% spread
    found = compare_records([base], [rerun], [0], 0.25, 0.0)
    assert [d["field"] for d in found] == ["per_layer_type_us.moe", "section_us.L3.mlp"], found
    assert found[1]["why"] == "timing beyond 25% and 50 us"


def test_timings_of_information_only_records_are_listed_not_counted():
    """A record its check declares information only (the sweep's eager reference rows: ``CheckDecl.
    information_only``) on both sides: a timing beyond every tolerance is an ``informational`` disagreement,
    which neither the exit code nor the audit's status rule counts; its other fields still compare bitwise,
    and a fast row made to look like a reference row counts (with the timings that would have excused)."""
    from verify.checks.perf import eager_reference_row
    from verify.checks.registry import REGISTRY
    from verify.checks.status_rules import audit_problems

    assert REGISTRY["perf.decode_sweep"].information_only is eager_reference_row
    base = {"backend": "reference", "timer": "eager", "batch": 8, "step_us_median": 5e5,
            "per_layer_type_us": {"kda": 12955.0}}
    rerun = copy.deepcopy(base)
    rerun["per_layer_type_us"]["kda"] = 20846.0  # +61%, what the session-12 H200 audit saw
    found = compare_records([base], [rerun], [0], 0.25, 0.0, eager_reference_row)
    assert [(d["field"], d.get("informational")) for d in found] == [("per_layer_type_us.kda", True)]
    assert counted(found) == [] and counted(compare_records([base], [rerun], [0], 0.25, 0.0)) != []
    rows = [{"kind": "audited", "check": "perf.decode_sweep", "disagreements": 1, "informational": 1},
            {"kind": "disagreement", "check": "perf.decode_sweep", **found[0]}]
    assert audit_problems(rows) == []
    assert audit_problems([{**rows[0], "informational": 0}, rows[1]])  # the count must be the records'
    assert audit_problems([rows[0], {**rows[1], "field": "batch"}])  # not a timing: never informational
    rerun["batch"] = 9  # not a timing: counted even in an information-only record
    got = counted(compare_records([base], [rerun], [0], 0.25, 0.0, eager_reference_row))
    assert [d["field"] for d in got] == ["batch"]
    forged = {**base, "per_layer_type_us": {"kda": 20846.0}}
    honest = {**forged, "backend": "fast", "timer": "cuda_graph_replay", "per_layer_type_us": {"kda": 12955.0}}
    got = counted(compare_records([forged], [honest], [0], 0.25, 0.0, eager_reference_row))
    assert {d["field"] for d in got} == {"backend", "timer", "per_layer_type_us.kda"}


def test_an_audit_compared_with_an_earlier_re_run_executes_nothing(cpu_bundle, tmp_path):
    """``--rerun B``: the comparison redone against a re-run made before (here the honest audit's attached
    re-run), on B's device, nothing executed; the forged copy against the same re-run is found."""
    first = _audit(cpu_bundle, tmp_path / "a1", "--checks", "weights.roundtrip")
    assert first.returncode == 0, first.stdout + first.stderr
    rerun = tmp_path / "a1" / "artifacts" / AUDIT_CHECK / "rerun.tar.gz"
    again = _audit(cpu_bundle, tmp_path / "a2", "--checks", "weights.roundtrip", "--rerun", str(rerun))
    assert again.returncode == 0 and "1 check(s) compared" in again.stdout, again.stdout + again.stderr
    m = json.loads((tmp_path / "a2" / "manifest.json").read_text())
    assert m["config"]["rerun_from"]["path"] == str(rerun) and "--rerun" in m["argv"]
    assert verify_bundle(tmp_path / "a2").ok
    import shutil

    forged = tmp_path / "forged"
    shutil.copytree(cpu_bundle, forged)

    def edit(rows):
        load = next(r for r in rows if r.get("step") == "load")
        load["digest"] = load["digest"][:-1] + ("0" if load["digest"][-1] != "0" else "1")
    forge(forged, "weights.roundtrip", record=edit)
    found = _audit(forged, tmp_path / "a3", "--checks", "weights.roundtrip", "--rerun", str(rerun))
    assert found.returncode == 1 and "digest differs" in found.stdout, found.stdout + found.stderr

def test_the_gpu_hosts_plant_script_forges_a_copy_that_still_verifies(cpu_bundle, tmp_path):
    """scripts/gpu/plant_record.py (the H200 run's fabricated record): its copy verifies, the record changed,
    and the audit of that copy finds it (exit 1); the original is untouched."""
    r = subprocess.run([sys.executable, str(REPO / "scripts/gpu/plant_record.py"), str(cpu_bundle), str(tmp_path / "f")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "verify of the forged copy: OK" in r.stdout, r.stdout + r.stderr
    assert "weights.roundtrip: record" in r.stdout
    assert verify_bundle(cpu_bundle).ok
    a = _audit(tmp_path / "f", tmp_path / "audit", "--checks", "weights.roundtrip")
    assert a.returncode == 1 and "digest" in a.stdout, a.stdout + a.stderr


H200_RUN = REPO / "bundles" / "runs" / "2026-12-02-h200-session10"


@pytest.mark.skipif(not (H200_RUN / "standard").exists(), reason="the committed H200 audit")
def test_the_committed_h200_audits_say_what_they_found(tmp_path):
    """On the H200: the forged copy's fabricated digest was found (exit 1, one disagreement); the honest
    standard bundle's equivalence.decode re-ran bitwise in every sampled record and every CUDA-graph step
    time of perf.decode_sweep within the tolerance; what disagrees is eager reference rows' breakdowns and
    the ~50 us embedding section. Redone offline from the committed re-run with today's rules, two eager
    reference breakdowns remain, informational: the audit agrees."""
    def rows(d):
        return [json.loads(x) for x in (d / "records" / f"{AUDIT_CHECK}.jsonl").read_text().splitlines()]

    forged = rows(H200_RUN / "audit-forged-h200")
    assert [(r["check"], r["field"]) for r in forged if r["kind"] == "disagreement"] == [("weights.roundtrip", "digest")]
    recompared = rows(H200_RUN / "audit-standard-recompared")
    audited = {r["check"]: r for r in recompared if r["kind"] == "audited"}
    assert audited["equivalence.decode"]["disagreements"] == 0 and len(audited["equivalence.decode"]["sampled"]) == 50
    sweep = [json.loads(x) for x in (H200_RUN / "standard" / "records" / "perf.decode_sweep.jsonl").read_text().splitlines()]
    for d in (r for r in recompared if r["kind"] == "disagreement"):
        row = sweep[d["index"]]
        assert row["backend"] == "reference" or d["field"] == "section_us.head.in", d
    again = _audit(H200_RUN / "standard", tmp_path / "a", "--checks", "equivalence.decode,perf.decode_sweep", "--sample",
                   "50", "--rerun", str(H200_RUN / "audit-standard-h200" / "artifacts" / AUDIT_CHECK / "rerun.tar.gz"))
    # under today's rules (a nested microsecond timing may differ by 1% of its step; the eager reference rows
    # are information only): what is left of the 27 is a subset of them, all on eager reference rows and
    # informational (that bundle predates the sweep's timing_spread), so the audit agrees
    assert again.returncode == 0, again.stdout
    now = [r for r in rows(tmp_path / "a") if r["kind"] == "disagreement"]
    assert now and {(r["index"], r["field"]) for r in now} <= {(r["index"], r["field"]) for r in recompared
                                                               if r["kind"] == "disagreement"}
    assert all(sweep[r["index"]]["backend"] == "reference" and r.get("informational") for r in now), now


SESSION12 = REPO / "bundles" / "runs" / "2026-12-02-h200-session12"


@pytest.mark.skipif(not (SESSION12 / "audit-forged").exists(), reason="the committed session-12 H200 audits")
def test_the_session12_h200_audits_say_what_they_found():
    """On the H200 at 23a0583: the planted equivalence.decode error (a step's largest logit error halved,
    within its point's maximum, re-sealed) was found by re-executing the check (one counted disagreement,
    the other plant is in a check not audited); the re-executed decode sweep's 10 disagreements are all on
    eager reference rows, which the sweep now marks information_only (that bundle predates the flag), and no
    sweep gate reads them: scaling their timings leaves the perf rules' problems unchanged."""
    from verify.checks.perf import _sweep_targets

    def rows(d, check=AUDIT_CHECK):
        return [json.loads(x) for x in (d / "records" / f"{check}.jsonl").read_text().splitlines()]

    forged = [r for r in rows(SESSION12 / "audit-forged") if r["kind"] == "disagreement"]
    assert [(r["check"], r["field"]) for r in forged] == [("equivalence.decode", "max_abs_err")]
    sweep = rows(SESSION12 / "standard-perf", "perf.decode_sweep")
    found = [r for r in rows(SESSION12 / "audit-standard-perf") if r["kind"] == "disagreement"]
    assert len(found) == 10 and all(sweep[r["index"]]["backend"] == "reference" for r in found), found
    points = [r for r in sweep if all(k in r for k in ("batch", "context", "backend"))]
    _, problems = _sweep_targets(points, [])
    assert problems and problems[0].startswith("fast step 3.12x its floor at batch 64 context 32768")
    scaled = copy.deepcopy(points)
    for r in scaled:
        if r["backend"] == "reference":
            r["step_us_median"] *= 3.0
            r["per_layer_type_us"] = {k: 3 * v for k, v in r["per_layer_type_us"].items()}
    assert _sweep_targets(scaled, [])[1] == problems


@pytest.mark.skipif(not (SESSION12 / "audit-standard-perf-recompared").exists(), reason="the committed recompare")
def test_the_session12_sweep_audit_recompared_under_the_information_only_rule(tmp_path):
    """The H200 re-run of the sweep, compared again offline (``--rerun``: nothing executed) now that the
    check declares its eager reference rows information only: the 10 disagreements are informational, none
    counted, the audit agrees (exit 0); the committed recompare says the same."""
    rerun = SESSION12 / "audit-standard-perf" / "artifacts" / AUDIT_CHECK / "rerun.tar.gz"
    again = _audit(SESSION12 / "standard-perf", tmp_path / "a", "--checks", "perf.decode_sweep", "--rerun", str(rerun))
    assert again.returncode == 0 and "0 disagreement(s) (+10 informational" in again.stdout, again.stdout + again.stderr
    for d in (tmp_path / "a", SESSION12 / "audit-standard-perf-recompared"):
        recs = [json.loads(x) for x in (d / "records" / f"{AUDIT_CHECK}.jsonl").read_text().splitlines()]
        found = [r for r in recs if r["kind"] == "disagreement"]
        assert len(found) == 10 and all(r.get("informational") for r in found)
        assert verify_bundle(d).ok


@pytest.mark.skipif(not (SESSION12 / "audit-standard-perf-recompared").exists(), reason="the committed recompare")
@pytest.mark.parametrize("forgery", ["status flipped", "informational on a non-timing field",
                                     "informational flag dropped", "informational count edited"])
def test_a_forged_audit_with_informational_disagreements_fails_verify(tmp_path, forgery):
    """The audit's status follows from its records: a passing audit (10 informational disagreements) flipped to
    failed, a counted disagreement disguised as informational (its field renamed to one that is not a
    timing), an informational flag dropped under a passed status, or the audited row's informational count
    edited, each re-sealed, fails ``bundle verify``."""
    import shutil

    from verify.checks.status_rules import audit_problems

    copy = tmp_path / "audit"
    shutil.copytree(SESSION12 / "audit-standard-perf-recompared", copy)
    assert verify_bundle(copy).ok

    def first_info(rows):
        return next(r for r in rows if r.get("kind") == "disagreement" and r.get("informational"))

    def edit(rows):
        if forgery == "informational on a non-timing field":
            first_info(rows)["field"] = "backend"
        elif forgery == "informational flag dropped":
            del first_info(rows)["informational"]
        elif forgery == "informational count edited":
            next(r for r in rows if r.get("kind") == "audited")["informational"] = 9
    if forgery == "status flipped":
        forge(copy, AUDIT_CHECK, result={"status": "failed", "reason": "forged"})
    else:
        forge(copy, AUDIT_CHECK, record=edit)
        rows = [json.loads(x) for x in (copy / "records" / f"{AUDIT_CHECK}.jsonl").read_text().splitlines()]
        assert audit_problems(rows), forgery
    report = verify_bundle(copy)
    assert not report.ok and report.exit_code == 1, (forgery, report.problems)
