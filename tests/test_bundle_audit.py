"""``k3-verify bundle audit`` (verify/bundle/audit.py) on a CPU bundle: the re-execution agrees with an honest
bundle (exit 0, an audit bundle that verifies); a fabricated record that every rescorer accepts -- a
plausible digest or error value, re-sealed -- is found (exit 1); a GPU check here cannot run (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_status_rescore import forge

from verify.bundle.audit import AUDIT_CHECK, compare_records
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
