"""``equivalence.fp64`` on a CPU (the check itself needs an H200): the fast step emulated (every kernel served
by its FP32 reference rounded to BF16) on k3-tiny's default draw, against an FP64 copy of the reference,
beside the BF16 reference (the standard path). The gate passes the clean fast path and fails a planted error
of a few percent in one op, both as a control the check runs itself and as an error in the fast path under
test; the status follows from the records by the rule ``bundle verify`` applies, and forged records fail it.
Weights and prompts are drawn from the ``seed`` fixture's seed."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from check_tools import cpu_context

from k3_fastpath.runtime import fast_ops
from verify.checks.equivalence_fp64 import fp64, plant_error
from verify.checks.fp64_rules import CLEAN, fp64_problems, row_error
from verify.checks.status_rules import rescore
from verify.result import CheckResult

CONTROLS = [{"op": "kda_step", "scale": 1.05}, {"op": "moe_experts", "scale": 1.05}]


def _run(seed: int, tmp_path: Path, **kw) -> tuple[CheckResult, list[dict]]:
    ctx, sink = cpu_context("equivalence.fp64", seed, tmp_path)
    args = {"batches": [8], "contexts": ["short"], "kv_caches": ["bf16"], "steps": 6, "prompt_len": 8,
            "emulate": True, "controls": CONTROLS, **kw}
    return fp64(ctx, **args), sink.rows


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """One clean run with both KV caches (seed 0: module-scoped, shared by the record tests below)."""
    return _run(0, tmp_path_factory.mktemp("fp64"), kv_caches=["bf16", "fp8"])


def test_row_error_is_relative_and_ignores_a_constant_offset(seed):
    o = torch.randn(3, 100, dtype=torch.float64)
    assert row_error(o + 7.0, o) == pytest.approx([0.0] * 3, abs=1e-12)
    err = row_error(o * 1.01, o)
    assert err == pytest.approx([0.01] * 3, rel=1e-9)


def test_clean_fast_path_passes_and_planted_errors_fail_the_gate(clean_run):
    res, recs = clean_run
    assert res.status == "passed", res.reason
    points = [r for r in recs if r["kind"] == "point"]
    assert [(p["kv_cache"], sorted(p["sides"])) for p in points] == [
        ("bf16", sorted([CLEAN, "kda_step x1.05", "moe_experts x1.05"])), ("fp8", [CLEAN])]
    for p in points:
        assert p["sides"][CLEAN]["ratio"] <= 2.0
        assert p["trace"]["fast_steps"] == 6 and p["trace"]["fallbacks"] == {}
    assert all(v["ratio"] > 2.0 for n, v in points[0]["sides"].items() if n != CLEAN), points[0]["sides"]
    plan = recs[0]
    assert plan["kind"] == "plan" and plan["fp8_scale"] == 0.25 and plan["controls_at"] == [8, "short", "bf16"]
    assert fp64_problems(recs) == []
    assert rescore({"equivalence.fp64": recs}, res) == []


def test_an_error_in_the_fast_path_under_test_fails(seed, tmp_path, monkeypatch):
    """The fast path itself carries the planted 5% (every executor's table): the clean side fails the gate."""
    table = fast_ops.op_table

    def bad_table(*a, **k):
        t = table(*a, **k)
        ex = SimpleNamespace(ops=t)
        plant_error(ex, "kda_step", 1.05)
        return ex.ops

    monkeypatch.setattr("k3_fastpath.runtime.executor.op_table", bad_table)
    res, recs = _run(seed, tmp_path, controls=[])
    assert res.status == "failed"
    assert "the fast path's logit error against FP64 is" in res.reason, res.reason
    assert fp64_problems(recs)[0] in res.reason


def test_forged_records_fail_the_rule(clean_run):
    res, recs = clean_run
    steps = [i for i, r in enumerate(recs) if r["kind"] == "step"]
    # a clean error made smaller: the point's recorded median no longer follows from its steps
    forged = copy.deepcopy(recs)
    forged[steps[0]]["fast_err"][CLEAN] = [e * 0.1 for e in forged[steps[0]]["fast_err"][CLEAN]]
    forged[steps[1]]["fast_err"][CLEAN] = [e * 0.1 for e in forged[steps[1]]["fast_err"][CLEAN]]
    forged[steps[2]]["fast_err"][CLEAN] = [e * 0.1 for e in forged[steps[2]]["fast_err"][CLEAN]]
    forged[steps[3]]["fast_err"][CLEAN] = [e * 0.1 for e in forged[steps[3]]["fast_err"][CLEAN]]
    assert any("clean median" in p and "is not its steps'" in p for p in fp64_problems(forged))
    # a step dropped, a control's side removed, the plan's points changed
    assert "5 step rows for 6 steps" in fp64_problems(recs[:steps[0]] + recs[steps[0] + 1:])[0]
    forged = copy.deepcopy(recs)
    for i in steps[:6]:
        del forged[i]["fast_err"]["moe_experts x1.05"]
    assert any("the plan says" in p for p in fp64_problems(forged))
    forged = copy.deepcopy(recs)
    forged[0]["points"].append([64, "short", "bf16"])
    assert fp64_problems(forged) == ["batch 64 context short kv bf16: no record of this planned point"]
    # a failed status over these records, or a failing point whose ratio is edited under the limit
    flipped = CheckResult(id=res.id, status="failed", reason="x", metrics=res.metrics)
    assert rescore({"equivalence.fp64": recs}, flipped)[0].startswith("status 'failed', but its")
    forged = copy.deepcopy(recs)
    point = next(r for r in forged if r["kind"] == "point")
    point["sides"]["kda_step x1.05"]["ratio"] = 1.0
    assert any("kda_step x1.05 ratio 1.0 is not its steps'" in p for p in fp64_problems(forged))


def test_bad_parameters_fail_before_anything_runs(tmp_path):
    res, recs = _run(0, tmp_path, fp8_scale=1.0)
    assert res.status == "failed" and "non-unit" in res.reason and recs == []
    res, recs = _run(0, tmp_path, controls=[{"op": "kda_step", "scale": 1.0}])
    assert res.status == "failed" and "S != 1" in res.reason and recs == []
    with pytest.raises(ValueError, match="no op 'nope'"):
        plant_error(SimpleNamespace(ops=fast_ops.op_table()), "nope", 1.1)


def test_zero_samples_are_a_problem():
    plan = {"kind": "plan", "points": [[8, "short", "bf16"]], "controls": [], "controls_at": None,
            "max_ratio": 2.0, "steps": 0, "emulated": True}
    point = {"kind": "point", "batch": 8, "context": "short", "kv_cache": "bf16", "standard_median": math.nan,
             "sides": {}, "trace": {}}
    assert fp64_problems([plan, point]) == ["batch 8 context short kv bf16: no error samples"]
    assert fp64_problems([{**plan, "points": []}]) == ["the plan holds no point"]


SESSION10 = Path(__file__).resolve().parents[1] / "bundles" / "runs" / "2026-12-02-h200-session10" / "standard"


@pytest.mark.parametrize("status", ["passed", "failed"])
def test_a_flipped_status_in_the_committed_h200_bundle_fails_verify(tmp_path, status):
    """The H200 bundle's equivalence.fp64 ended `error` (over budget, one of two points run). Flipped in
    results.jsonl and re-sealed, `bundle verify` re-derives it from the 18 records and refuses: `passed`
    contradicts the missing FP8 point and the missed controls, `failed` with a made-up reason is not theirs."""
    import shutil

    from test_status_rescore import forge

    from verify.bundle.verify import verify_bundle

    dest = tmp_path / "b"
    shutil.copytree(SESSION10, dest)
    assert verify_bundle(dest).ok
    forge(dest, "equivalence.fp64", result={"status": status, "reason": "forged" if status == "failed" else ""})
    problems = [p for p in verify_bundle(dest).problems if "equivalence.fp64" in p]
    assert problems, verify_bundle(dest).problems
    want = "records give 'failed'" if status == "passed" else "is not what its records give"
    assert any(want in p for p in problems), problems
