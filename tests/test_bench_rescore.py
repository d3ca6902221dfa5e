"""Forgeries of ``bench.kernels``'s verdict fail ``bundle verify`` (``verify/checks/bench_rules.py``).

On a copy of the ``improved`` test bundle (``tests/make_compare_bundles.py``: its bench passes every
target) and of a committed H200 bench bundle (session 2: it failed), each forgery is re-sealed the way a
forger would (``test_status_rescore.forge``) and must fail on the rescorer alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_status_rescore import _only_rescore_problems, assert_passed_record_forgery_fails, forge

from verify.bundle.verify import verify_bundle
from verify.checks.bench_rules import bench_kernels_problems, derived_field_problems

REPO = Path(__file__).resolve().parents[1]
IMPROVED = REPO / "tests" / "data" / "bundles" / "improved"
H200_BENCH = REPO / "bundles" / "runs" / "2026-11-30-h200-session2" / "20261130T171914Z-h200-bench-kernels"
CHECK = "bench.kernels"


@pytest.fixture
def improved(tmp_path: Path) -> Path:
    dest = tmp_path / "improved"
    shutil.copytree(IMPROVED, dest)
    assert verify_bundle(dest).ok
    return dest


def _gemm_m1(rows):
    return next(r for r in rows if r.get("kernel") == "skinny_gemm" and r["M"] == 1)


def _slower_gemm_with_its_ratios(rows):
    """A GEMM timing 30% slower, every ratio recomputed to agree: the records now miss the cuBLAS target."""
    r = _gemm_m1(rows)
    r["heuristic_us"] *= 1.3
    r["pct_of_bw"] = r["floor_us"] / r["heuristic_us"]
    r["tb_per_s"] = r["weight_bytes"] / (r["heuristic_us"] * 1e-6) / 1e12
    r["vs_cublas"] = r["cublas_us"] / r["heuristic_us"]


def _fallback_during_the_bench(rows):
    next(r for r in rows if "counters_after" in r)["counters_after"]["fallbacks"] = {"skinny_gemm": {"shape": 3}}


def _kda_fla_not_measured(rows):
    r = next(r for r in rows if r.get("kernel") == "kda_decode")
    del r["vs_fla"]
    r["fla_full_us"], r["fla_full_reason"] = None, "fla not importable"


def _kernel_bench_error_row(rows):
    rows.append({"kernel": "moe_experts", "error": "RuntimeError: CUDA error: an illegal memory access"})


RECORD_EDITS = {
    "a timing edited, its ratios made to agree": (_slower_gemm_with_its_ratios, "M=1: 75% of read bandwidth < 85%"),
    "a fallback during the bench": (_fallback_during_the_bench, "fallbacks during the bench"),
    "the fla comparison not measured": (_kda_fla_not_measured, "fla comparison not measured"),
    "a kernel bench that raised": (_kernel_bench_error_row, "moe_experts: RuntimeError"),
}


@pytest.mark.parametrize("name", sorted(RECORD_EDITS))
def test_records_showing_a_miss_under_a_passed_status_fail_verify(improved, name):
    assert_passed_record_forgery_fails(improved, CHECK, *RECORD_EDITS[name])


def test_a_ratio_edited_alone_fails_verify(improved):
    """The forgery a rescorer of targets alone misses: a ratio made to pass while its medians say it did not
    (here the other way round: a passing ratio edited, which its medians contradict)."""
    def edit(rows):
        _gemm_m1(rows)["vs_cublas"] = 2.5

    forge(improved, CHECK, record=edit)
    problems = _only_rescore_problems(improved, CHECK)
    assert "vs_cublas 2.5 does not follow from its row" in problems[0], problems


def test_a_pass_flipped_to_fail_and_a_failure_reworded_fail_verify(improved, tmp_path):
    forge(improved, CHECK, result={"status": "failed", "reason": "forged"})
    assert "records give 'passed'" in _only_rescore_problems(improved, CHECK)[0]
    forge(improved, CHECK, result={"status": "failed", "reason": "something milder"},
          record=_fallback_during_the_bench)
    assert "reason 'something milder' is not what its records give" in _only_rescore_problems(improved, CHECK)[0]


def test_the_failed_h200_bench_flipped_to_passed_fails_verify(tmp_path):
    """Session 2's bench missed the MLA and GEMM targets (120 problems); status, verdict, summary and sums made
    to say passed."""
    dest = tmp_path / "bench"
    shutil.copytree(H200_BENCH, dest)
    assert verify_bundle(dest).ok
    forge(dest, CHECK, result={"status": "passed", "reason": ""})
    problems = _only_rescore_problems(dest, CHECK)
    assert "records give 'failed' (mla_decode bf16 ctx=32768 B=8: 55% of the read bandwidth" in problems[0]


def test_the_rule_needs_rows_and_every_derived_field_is_checked():
    assert bench_kernels_problems([{"probe": "read_bandwidth", "gb_per_s": 4000.0}]) == ["no kernel was timed"]
    row = {"kernel": "mla_decode", "cache": "bf16", "ctx": 1024, "B": 1, "bytes": 4e6, "read_bw_gbs": 4000.0,
           "floor_us": 1.0, "ours_us": 2.0, "torch_us": 8.0, "vs_torch": 4.0, "pct_of_floor": 0.5,
           "tb_per_s": 2.0}
    assert derived_field_problems([row]) == []
    for field in ("floor_us", "vs_torch", "pct_of_floor", "tb_per_s"):
        bad = dict(row, **{field: row[field] * 1.01})
        assert [p for p in derived_field_problems([bad]) if f" {field} " in p], field
