"""Forgeries of the reference, weights, kernels, equivalence and full-context verdicts fail ``bundle verify``.

On copies of the committed H200 standard-tier bundle (every one of these checks passed there): a status
flipped and the bundle re-sealed consistently (manifest verdict and reasons, summary.md, SHA256SUMS all
made to agree, as a forger would) must fail on the rescorer alone, which re-derives each status from the
records with the rule the check itself used (``verify.checks.status_rules``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from verify.bundle import schema
from verify.bundle.schema import (
    SumEntry,
    compute_verdict,
    format_sums,
    render_summary,
    sha256_file,
    walk_bundle,
)
from verify.bundle.verify import verify_bundle
from verify.checks.status_rules import RULES
from verify.result import CheckResult

REPO = Path(__file__).resolve().parents[1]
STANDARD = REPO / "bundles" / "runs" / "2026-12-01-h200-session7" / "standard"
# not in the standard tier: bench.kernels (tests/test_bench_rescore.py forges it) and perf.serving
# (tests/test_serving_rules.py); audit.records is what bundle audit writes (tests/test_bundle_audit.py);
# equivalence.fp64 joined the tier after this bundle (tests/test_equivalence_fp64.py forges its records);
# equivalence.spec_decode is in no tier yet (tests/test_equivalence_spec.py forges its records);
# features.spec_acceptance, features.spec_sampling and features.decode_sampling came after this bundle
# (tests/test_spec_features.py forges their records and flips their status in a written bundle);
# equivalence.vllm_route needs vLLM's GPU build (tests/test_vllm_route_check.py does both)
STANDARD_RULES = sorted(set(RULES) - {"bench.kernels", "perf.serving", "audit.records", "equivalence.fp64",
                                      "equivalence.spec_decode", "features.spec_acceptance",
                                      "features.spec_sampling", "features.decode_sampling",
                                      "equivalence.vllm_route"})


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def forge(root: Path, check_id: str, result: dict | None = None, record=None) -> None:
    """Edit ``check_id``'s result (``result``: fields to set) and/or its records (``record(rows)`` edits
    them in place), then make the manifest's verdict, summary.md and SHA256SUMS agree with the edit."""
    if result:
        rows = _lines(root / schema.RESULTS)
        for r in rows:
            if r["id"] == check_id:
                r.update(result)
        _write(root / schema.RESULTS, rows)
    if record:
        path = root / schema.RECORDS_DIR / f"{check_id}.jsonl"
        rows = _lines(path)
        record(rows)
        _write(path, rows)
    m = json.loads((root / schema.MANIFEST).read_text())
    results = [CheckResult.from_dict(r) for r in _lines(root / schema.RESULTS)]
    m["verdict"], m["verdict_reasons"] = compute_verdict(m["planned_checks"], results, m["state"])
    (root / schema.MANIFEST).write_bytes(schema.dumps_doc(m))
    (root / schema.SUMMARY).write_text(render_summary(m, results))
    files, _ = walk_bundle(root)
    entries = [SumEntry(f, sha256_file(root / f)[0]) for f in files if f != schema.SUMS]
    (root / schema.SUMS).write_bytes(format_sums(entries, sealed=False))


def assert_a_flipped_status_fails_verify(root: Path, res: CheckResult, records: list[dict]) -> None:
    """``res`` and its ``records`` in a bundle written by ``BundleWriter`` at ``root`` verify; the status
    flipped to failed in results.jsonl and re-sealed, ``bundle verify`` re-derives 'passed' and refuses."""
    from verify.bundle.writer import BundleWriter

    w = BundleWriter(root, tool_version="0.1.0", argv=["k3-verify", "run"], tier="t", planned_checks=[res.id],
                     engines=[], config={"preset": "k3-tiny", "device": "cpu"}, seeds={}, env={})
    for r in records:
        w.record(res.id, r)
    w.add_result(res)
    w.finalize()
    assert verify_bundle(root).ok, verify_bundle(root).problems
    forge(root, res.id, result={"status": "failed", "reason": "forged"})
    problems = [p for p in verify_bundle(root).problems if res.id in p]
    assert any("records give 'passed'" in p for p in problems), verify_bundle(root).problems


def _as_the_current_writer_records(root: Path) -> None:
    """The committed bundle was written (commit ad19aac) before three fields joined the records; add them
    with the values the run's own records imply, so the copy reads as this version writes it (a fresh CPU
    run of the reference and weights checks is tested below without this)."""
    det = root / "records" / "reference.determinism.jsonl"
    _write(det, [dict(r, max_logit_diff=0.0, control_differs=True) for r in _lines(det)])
    w = root / "records" / "weights.roundtrip.jsonl"
    rows = _lines(w)
    for r in rows:
        if r.get("step") == "load":
            r.update(digest_expected=None, names_missing=[], names_extra=[], mismatched_names=[],
                     compared_with="the written one", fp32_violations=[])
        if r.get("step") == "mxfp4":
            r["differing"] = []
    _write(w, rows)
    from k3_fastpath import kernels

    res = _lines(root / schema.RESULTS)
    for r in res:
        if r["id"] == "kernels.numerics":
            r["metrics"].update(kernels=list(kernels.names()), expected_launches=list(kernels.launch_names()))
    _write(root / schema.RESULTS, res)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    dest = tmp_path / "standard"
    shutil.copytree(STANDARD, dest)
    _as_the_current_writer_records(dest)
    forge(dest, "reference.determinism")  # re-seal
    return dest


def _only_rescore_problems(root: Path, check_id: str) -> list[str]:
    report = verify_bundle(root)
    assert not report.ok and report.exit_code == 1
    assert all(p.startswith(f"{check_id}: rescore: ") for p in report.problems), report.problems
    return list(report.problems)


def assert_passed_record_forgery_fails(root: Path, check_id: str, edit, why: str) -> None:
    """``edit`` the passed check's records (re-sealed as a forger would): verify must say the records give
    'failed', naming ``why``."""
    forge(root, check_id, record=edit)
    problems = _only_rescore_problems(root, check_id)
    assert "status 'passed', but its" in problems[0] and why in problems[0], problems


def test_the_committed_bundle_verifies_and_every_rule_has_records_there(copy):
    assert verify_bundle(copy).ok
    statuses = {r["id"]: r["status"] for r in _lines(copy / schema.RESULTS)}
    for cid in STANDARD_RULES:
        assert statuses[cid] == "passed" and (copy / "records" / f"{cid}.jsonl").stat().st_size > 0, cid


@pytest.mark.parametrize("check_id", STANDARD_RULES)
def test_a_pass_flipped_to_fail_and_resealed_fails_verify(copy, check_id):
    forge(copy, check_id, result={"status": "failed", "reason": "forged"})
    problems = _only_rescore_problems(copy, check_id)
    assert "status 'failed', but its" in problems[0] and "records give 'passed'" in problems[0]


def _sanitizer_errors(rows):
    rows[1]["errors"] = 3  # racecheck


def _weights_tp_mismatch(rows):
    next(r for r in rows if r.get("step") == "tp" and r.get("applicable"))["mismatched"] = ["lm_head.weight"]


def _numerics_failed_test(rows):
    rows[5]["outcome"] = "failed"


def _compile_error(rows):
    rows[0]["errors"] = ["cute.compile raised"]


def _prefill_over_tolerance(rows):
    rows[2]["max_rel_err"] = 1e-3  # model_f64: far over 1e-8


def _determinism_differs(rows):
    rows[0]["bitwise_equal"] = False


def _full_context_diverges(rows):
    eut = next(r for r in rows if r.get("kind") == "full_context" and r["role"] == "engine_under_test")
    base = next(r for r in rows if r.get("kind") == "full_context" and r["role"] == "baseline")
    base["token_ids"][0] = next(t for t in range(512) if str(t) not in eut["logprobs"][0])  # beyond its top-5


def _equivalence_tokens_and_kl(rows):
    # every fast token rewritten to differ and KL set to 5.0, the step rows and point summaries made to agree
    for r in rows:
        if r.get("kind") == "step":
            r["fast_tokens"] = [t + 1 for t in r["ref_tokens"]]
            r["mismatch_rows"] = list(range(len(r["ref_tokens"])))
            r["kl_mean"] = r["kl_max"] = 5.0
        elif r.get("kind") == "point":
            r["mismatches"] = r["batch"] * r["steps"]
            r["first_divergence"] = [0] * r["batch"]
            r["kl_mean"] = 5.0


def _structured_output_invalid(rows):
    sample = next(r for r in rows if r.get("kind") == "sample" and r["constraint"] == "json_schema")
    sample["text"] = sample["text"][:-1]  # the closing brace cut: not JSON, though the record says valid


def _temperature_cell_rejected(rows):
    next(r for r in rows if r.get("kind") == "frequency")["p_value"] = 1e-12  # (this writer recorded no logits)


def _bandwidth_spread(rows):
    read = next(r for r in rows if r.get("probe") == "read_reduction")
    read["times_ms"][0] *= 1.5  # a repeat 50% slow: the GPU was shared (read_bytes_per_s is from the median)


RECORD_EDITS = {
    "perf.bandwidth_probe": _bandwidth_spread,
    "features.temperature_sampling": _temperature_cell_rejected,
    "features.structured_output": _structured_output_invalid,
    "equivalence.decode": _equivalence_tokens_and_kl,
    "features.full_context": _full_context_diverges,
    "kernels.sanitizer": _sanitizer_errors,
    "weights.roundtrip": _weights_tp_mismatch,
    "kernels.numerics": _numerics_failed_test,
    "kernels.compile": _compile_error,
    "reference.prefill_decode_consistency": _prefill_over_tolerance,
    "reference.determinism": _determinism_differs,
}


def test_every_rule_has_a_record_forgery():
    assert set(RECORD_EDITS) == set(STANDARD_RULES)


@pytest.mark.parametrize("check_id", sorted(RECORD_EDITS))
def test_records_showing_a_failure_under_a_passed_status_fail_verify(copy, check_id):
    """What a run that failed and was then flipped to 'passed' looks like: its records still show why."""
    forge(copy, check_id, record=RECORD_EDITS[check_id])
    problems = _only_rescore_problems(copy, check_id)
    assert "status 'passed', but its" in problems[0] and "records give 'failed'" in problems[0]


@pytest.mark.parametrize("check_id", sorted(RECORD_EDITS))
def test_a_failed_status_must_carry_the_reason_its_records_give(copy, check_id):
    forge(copy, check_id, result={"status": "failed", "reason": "something milder"}, record=RECORD_EDITS[check_id])
    problems = _only_rescore_problems(copy, check_id)
    assert "reason 'something milder' is not what its records give" in problems[0]


def test_a_comparison_record_that_does_not_follow_from_the_generations_fails_verify(copy):
    def edit(rows):
        next(r for r in rows if r.get("kind") == "comparison")["first_divergence"] = 3

    forge(copy, "features.full_context", record=edit)
    problems = _only_rescore_problems(copy, "features.full_context")
    assert "the comparison record (ok True, first divergence 3) does not follow" in problems[0]


def test_a_skipped_result_with_records_fails_verify(copy):
    forge(copy, "kernels.sanitizer", result={"status": "skipped", "reason": "needs a CUDA device"})
    assert "skipped, yet 4 records were written" in _only_rescore_problems(copy, "kernels.sanitizer")[0]


def test_a_fresh_cpu_run_records_all_the_rules_need(tmp_path):
    """The reference and weights checks as this version writes them: the bundle verifies; a flip fails."""
    from verify.output import Output
    from verify.runner import run_tier

    tier = tmp_path / "t.yaml"
    tier.write_text("name: t\ndescription: d\ntarget_s: 600\nchecks:\n"
                    "  - id: reference.determinism\n    budget_s: 120\n"
                    "  - id: weights.roundtrip\n    budget_s: 120\n")
    verdict, root = run_tier(str(tier), tmp_path / "b", "auto", "cpu", 0, Output("json"), argv=["test"])
    assert verdict == "pass" and verify_bundle(root).ok
    for cid in ("reference.determinism", "weights.roundtrip"):
        forge(root, cid, result={"status": "failed", "reason": "forged"})
        assert any(p.startswith(f"{cid}: rescore: status 'failed'") for p in verify_bundle(root).problems), cid
        forge(root, cid, result={"status": "passed", "reason": ""})


def test_the_failed_h200_equivalence_grid_flipped_to_passed_fails_verify(tmp_path):
    """The issue's forgery: session 4's equivalence grid failed (top-k violations at batch 64); its status,
    verdict, summary and sums made to say passed."""
    src = REPO / "bundles" / "runs" / "2026-11-30-h200-session4" / "20261201T000251Z-h200-equivalence-grid"
    dest = tmp_path / "grid"
    shutil.copytree(src, dest)
    assert verify_bundle(dest).ok
    forge(dest, "equivalence.decode", result={"status": "passed", "reason": ""})
    problems = _only_rescore_problems(dest, "equivalence.decode")
    assert "status 'passed', but its" in problems[0] and "step 95 seq 11" in problems[0], problems


SESSION12_PERF = REPO / "bundles" / "runs" / "2026-12-02-h200-session12" / "standard-perf"


@pytest.mark.parametrize("source", [STANDARD, SESSION12_PERF], ids=["session7-standard", "session12-standard-perf"])
def test_the_failed_h200_decode_sweep_flipped_to_passed_fails_verify(tmp_path, source):
    """The issue's second forgery: the standard tier's perf.decode_sweep missed the #5 targets; its status
    (targets untouched), verdict, summary and sums made to say passed. The session-12 sweep is the one whose
    check now declares its eager reference rows information only (for the audit): its rescorer still
    re-derives the status from every row."""
    dest = tmp_path / "standard"
    shutil.copytree(source, dest)
    forge(dest, "perf.decode_sweep", result={"status": "passed", "reason": ""})
    problems = _only_rescore_problems(dest, "perf.decode_sweep")
    assert "status 'passed', but its records give 'failed'" in problems[0], problems


def test_every_registered_check_has_a_rescorer():
    """A check whose status cannot be re-derived is a defect (issue #17): a new check without a rescorer fails here."""
    from verify.bundle.verify import _RESCORERS, load_builtin_rescorers
    from verify.checks.registry import REGISTRY

    load_builtin_rescorers()
    keys = [k for k, _ in _RESCORERS]
    missing = {cid for cid in REGISTRY if not any(cid == k or (k.endswith(".") and cid.startswith(k)) for k in keys)}
    assert not missing, missing


SESSION14_FULL = REPO / "bundles" / "runs" / "2026-12-03-h200-session14" / "full"


def test_the_session14_equivalence_statuses_follow_from_their_records_under_either_later_violation_rule(tmp_path):
    """The H200 full tier at 46061c2: equivalence.decode failed on one near-tie under the per-point rate its
    plan carried, equivalence.fp64 on two out-of-memory points. Each flipped to passed and re-sealed fails
    verify. The same records under the grid rule (``later_violations: grid`` in the plan) give 'passed', so
    the recorded 'failed' is then the forgery; and 4 later violations planted at the batch-2 point (5 in its
    256 row-steps) under a 'passed' status fail verify by the rule's point test."""
    from tests.test_equivalence_cpu import _forge_later_violations

    dest = tmp_path / "full"
    shutil.copytree(SESSION14_FULL, dest)
    assert verify_bundle(dest).ok
    forge(dest, "equivalence.decode", result={"status": "passed", "reason": ""})
    problems = _only_rescore_problems(dest, "equivalence.decode")
    assert "status 'passed', but its" in problems[0] and "0.391% of row-steps" in problems[0], problems
    forge(dest, "equivalence.fp64", result={"status": "passed", "reason": ""})
    assert any(p.startswith("equivalence.fp64: rescore: status 'passed', but its") and "out of memory" in p
               for p in verify_bundle(dest).problems)
    original = {r["id"]: r for r in _lines(SESSION14_FULL / schema.RESULTS)}
    forge(dest, "equivalence.fp64", result={k: original["equivalence.fp64"][k] for k in ("status", "reason")})

    def grid(rows):
        rows[0]["later_violations"] = "grid"

    forge(dest, "equivalence.decode", result={"status": "failed", "reason": "forged"}, record=grid)
    problems = _only_rescore_problems(dest, "equivalence.decode")
    assert "status 'failed', but its" in problems[0] and "records give 'passed'" in problems[0], problems
    forge(dest, "equivalence.decode", result={"status": "passed", "reason": ""})
    assert verify_bundle(dest).ok

    def planted(rows):
        steps = [r["step"] for r in rows if r.get("kind") == "step" and (r["batch"], r["context"]) == (2, "short")
                 and r["step"] >= 20 and 1 not in r["mismatch_rows"]]
        _forge_later_violations(rows, 2, "short", 1, steps[:4])

    assert_passed_record_forgery_fails(dest, "equivalence.decode", planted, "5 later top-5 violations in 256 row-steps")
