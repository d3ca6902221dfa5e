"""The ``evals.*`` bundle rescorer on constructed records (no engine): it accepts records that back their
result, and catches an edited score, an edited response, a claimed metric the records do not give, and a
``passed`` that a gate contradicts; ``k3-verify bundle verify`` (a fresh process) has it registered."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verify.bundle import schema
from verify.bundle.schema import SumEntry, format_sums, sha256_file, walk_bundle
from verify.bundle.writer import BundleWriter
from verify.evals.gates import compare, headline, load_thresholds
from verify.evals.rescore import rescore_eval
from verify.result import CheckResult

CID = "evals.gsm8k"


def _sample(side: str, i: int, gold: int, said: int | None) -> dict:
    resp = f"so #### {said}" if said is not None else "no idea"
    return {"type": "sample", "task": "k3_gsm8k", "dataset": "gsm8k", "side": side, "doc_id": i,
            "doc_hash": f"d{i}", "prompt_hash": f"p{i}", "target_hash": f"t{i}", "target": {"answer": f"x\n#### {gold}"},
            "repeats": 1, "responses": [resp], "scores": [int(said == gold)], "extraction_failed": [said is None],
            "truncated": [False], "output_tokens": [20], "finish_reasons": ["stop"]}


def _records(seed: int, n: int = 60, lose: int = 0):
    rng = random.Random(seed)
    th = load_thresholds("gsm8k")
    golds = [rng.randrange(1000) for _ in range(n)]
    base = [_sample("baseline", i, g, g if rng.random() < 0.8 else g + 1) for i, g in enumerate(golds)]
    fast = [dict(s, side="under_test") for s in base]
    right = [i for i, s in enumerate(base) if s["scores"] == [1]]
    for i in right[:lose]:  # the fast path gets these wrong
        fast[i] = _sample("under_test", i, golds[i], golds[i] + 2)
    metrics, problems = compare("k3_gsm8k", base, fast, th, seed)
    config = {"type": "config", "dataset": "gsm8k", "tasks": ["k3_gsm8k"], "thresholds": th.as_dict(), "seed": seed}
    status = "failed" if problems else "passed"
    result = CheckResult(id=CID, status=status, reason=problems[0] if problems else "",
                         metrics={**headline({"k3_gsm8k": metrics}), "tasks": {"k3_gsm8k": metrics}})
    return [config, *base, *fast], result


def test_rescorer_accepts_records_that_back_the_result(seed) -> None:
    for lose in (0, 30):
        recs, result = _records(seed, lose=lose)
        assert result.status == ("passed" if lose == 0 else "failed")
        assert rescore_eval({CID: recs}, result) == []


def test_rescorer_catches_edits(seed) -> None:
    recs, result = _records(seed)
    i = next(k for k, r in enumerate(recs) if r.get("type") == "sample" and r["scores"] == [0])
    edited = [dict(r) for r in recs]
    edited[i]["scores"] = [1]
    found = rescore_eval({CID: edited}, result)
    assert any("recorded scores [1] but the responses re-score to [0]" in p for p in found), found
    # edit the response *and* its score consistently: accuracy no longer matches the result's metrics
    edited = [dict(r) for r in recs]
    edited[i]["responses"] = ["#### " + edited[i]["target"]["answer"].split("#### ")[1]]
    edited[i]["scores"] = [1]
    found = rescore_eval({CID: edited}, result)
    assert any("accuracy" in p and "the records give" in p for p in found), found
    # a claimed metric the records do not give
    claimed = json.loads(json.dumps(result.metrics))
    claimed["tasks"]["k3_gsm8k"]["under_test"]["accuracy"] += 0.05
    found = rescore_eval({CID: recs}, CheckResult(id=CID, status="passed", reason="", metrics=claimed))
    assert found == [f"k3_gsm8k: result says under_test.accuracy={claimed['tasks']['k3_gsm8k']['under_test']['accuracy']!r}, "
                     f"the records give {result.metrics['tasks']['k3_gsm8k']['under_test']['accuracy']!r}"]


def test_rescorer_checks_the_headline_scalars(seed) -> None:
    recs, result = _records(seed)
    claimed = dict(result.metrics, **{"k3_gsm8k:baseline_accuracy": 0.99})
    found = rescore_eval({CID: recs}, CheckResult(id=CID, status="passed", reason="", metrics=claimed))
    assert len(found) == 1 and found[0].startswith("result says k3_gsm8k:baseline_accuracy=0.99, the records give")
    claimed = {k: v for k, v in result.metrics.items() if k != "k3_gsm8k:p_value"}
    found = rescore_eval({CID: recs}, CheckResult(id=CID, status="passed", reason="", metrics=claimed))
    assert found == ["the result lacks the metric k3_gsm8k:p_value"]


def test_rescorer_catches_a_pass_the_gates_contradict(seed) -> None:
    recs, result = _records(seed, lose=30)
    assert result.status == "failed"
    forged = CheckResult(id=CID, status="passed", reason="", metrics=result.metrics)
    found = rescore_eval({CID: recs}, forged)
    assert any(p.startswith("result passed but the records fail a gate: k3_gsm8k: accuracy") for p in found), found
    recs_ok, passed = _records(seed)
    assert passed.status == "passed"
    framed = CheckResult(id=CID, status="failed", reason="forged", metrics=passed.metrics)
    assert any(p == "result failed (forged) but the records pass every gate"
               for p in rescore_eval({CID: recs_ok}, framed))
    assert rescore_eval({CID: [r for r in recs if r["type"] != "sample"]}, result)[0].startswith("no sample records")
    assert rescore_eval({}, CheckResult(id=CID, status="skipped", reason="x")) == []


def _bundle(root: Path, recs: list, result: CheckResult) -> None:
    w = BundleWriter(root, tool_version="0.1.0", argv=["t"], tier="t", planned_checks=[CID], engines=[],
                     config={}, seeds={"global": 0}, env={})
    for r in recs:
        w.record(CID, r)
    w.add_result(result)
    w.finalize(state="finished")


def test_cli_bundle_verify_runs_the_eval_rescorer(tmp_path, seed) -> None:
    recs, result = _records(seed)
    _bundle(tmp_path / "b", recs, result)
    p = tmp_path / "b" / "records" / f"{CID}.jsonl"
    lines = p.read_text().splitlines()
    k = next(i for i, line in enumerate(lines) if json.loads(line).get("scores") == [0])
    rec = json.loads(lines[k])
    rec["scores"] = [1]
    lines[k] = json.dumps(rec, separators=(",", ":"))
    p.write_text("\n".join(lines) + "\n")
    root = tmp_path / "b"
    files, _ = walk_bundle(root)
    (root / schema.SUMS).write_bytes(format_sums([SumEntry(f, sha256_file(root / f)[0]) for f in files
                                                  if f != schema.SUMS], sealed=False))
    exe = Path(sys.executable).with_name("k3-verify")
    if not exe.exists():
        pytest.skip(reason="needs the k3-verify console script (pip install -e .)")
    r = subprocess.run([str(exe), "bundle", "verify", str(root)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "evals.gsm8k: rescore:" in r.stdout and "re-score to [0]" in r.stdout


def test_the_mde_is_re_derived_when_claimed_and_older_results_without_it_still_verify(seed) -> None:
    recs, result = _records(seed)
    claimed = json.loads(json.dumps(result.metrics))
    claimed["tasks"]["k3_gsm8k"]["mde"]["mde"] /= 2  # a forger halves the detectable drop
    found = rescore_eval({CID: recs}, CheckResult(id=CID, status=result.status, reason=result.reason, metrics=claimed))
    assert len(found) == 1 and found[0].startswith("k3_gsm8k: result says mde.mde="), found
    claimed = dict(result.metrics, **{"k3_gsm8k:mde": 0.01})
    found = rescore_eval({CID: recs}, CheckResult(id=CID, status=result.status, reason=result.reason, metrics=claimed))
    assert len(found) == 1 and found[0].startswith("result says k3_gsm8k:mde=0.01"), found
    older = json.loads(json.dumps(result.metrics))  # written before the MDE was recorded
    del older["tasks"]["k3_gsm8k"]["mde"], older["k3_gsm8k:mde"]
    assert rescore_eval({CID: recs}, CheckResult(id=CID, status=result.status, reason=result.reason, metrics=older)) == []


def test_each_sides_accuracy_interval_is_re_derived_when_claimed(seed) -> None:
    """Both sides carry their accuracy's 95% interval (Wilson for 0/1 items), per task and as headline
    scalars; a narrowed interval fails the rescore; results written before it still verify."""
    recs, result = _records(seed)
    ci = result.metrics["tasks"]["k3_gsm8k"]["baseline"]["accuracy_ci"]
    assert ci["method"] == "wilson" and ci["lo"] < ci["accuracy"] < ci["hi"]
    assert result.metrics["k3_gsm8k:baseline_accuracy_ci"] == [ci["lo"], ci["hi"]]
    claimed = json.loads(json.dumps(result.metrics))
    claimed["tasks"]["k3_gsm8k"]["under_test"]["accuracy_ci"]["lo"] += 0.05  # a forger narrows it
    found = rescore_eval({CID: recs}, CheckResult(id=CID, status=result.status, reason=result.reason, metrics=claimed))
    assert len(found) == 1 and found[0].startswith("k3_gsm8k: result says under_test.accuracy_ci.lo="), found
    older = json.loads(json.dumps(result.metrics))
    for side in ("baseline", "under_test"):
        del older["tasks"]["k3_gsm8k"][side]["accuracy_ci"], older[f"k3_gsm8k:{side}_accuracy_ci"]
    assert rescore_eval({CID: recs}, CheckResult(id=CID, status=result.status, reason=result.reason, metrics=older)) == []


RUNS = Path(__file__).resolve().parents[1] / "bundles/runs"
SENTINEL_EVALS = [  # (bundle, check, the status a forger writes): the committed results are the other one
    ("2026-12-03-h200-session16/sentinel-evals-5adb41a", "evals.gsm8k", "failed"),
    ("2026-12-03-h200-session16/sentinel-evals-5adb41a", "evals.mrcr", "passed"),
    ("2026-12-06-h100-session22/sentinel-evals-8e3ddfd", "evals.gsm8k", "failed"),
    # MRCR at two lengths (``lengths``: tasks k3_mrcr_2needle@2000c and @41000c)
    ("2026-12-06-h100-session22/sentinel-evals-mrcr-8e3ddfd", "evals.mrcr", "passed"),
]


@pytest.mark.parametrize("bundle,check_id,forged", SENTINEL_EVALS)
def test_the_sentinel_evals_with_a_flipped_status_fail_verify(tmp_path, bundle, check_id, forged) -> None:
    """The committed sentinel evals (scored with ``model: sentinel``) with a status flipped and the bundle
    re-sealed as a forger would: caught by the rescorer alone."""
    from test_status_rescore import forge

    from verify.bundle.verify import verify_bundle

    root = tmp_path / "b"
    shutil.copytree(RUNS / bundle, root)
    assert verify_bundle(root).ok
    forge(root, check_id, result={"status": forged, "reason": "forged"})
    report = verify_bundle(root)
    assert report.exit_code == 1 and report.problems, report.problems
    assert all(p.startswith(f"{check_id}: rescore: ") for p in report.problems), report.problems
    assert any(("records pass every gate" if forged == "failed" else "records fail a gate") in p
               for p in report.problems), report.problems
