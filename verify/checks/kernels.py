"""Kernel checks: every CuTe DSL kernel compiles, is numerically right on the GPU, and is sanitizer-clean.

``kernels.compile`` (no GPU needed): compile every decode variant of every registered kernel for the
tier's presets (``CUTE_DSL_ARCH=sm_90a`` on a CPU) and record per (kernel, preset) the variant count,
seconds and errors.

``kernels.numerics`` (H100/H200): run the GPU kernel test modules (``GPU_KERNEL_TESTS``: the union of the
kernel specs' ``gpu_tests``) under the ``verify.pytest_records`` plugin: each test compares a kernel with
the FP64 reference on fresh random inputs with NaN-poisoned outputs, asserts its launch counter moved and
no fallback was counted, and repeats bitwise. Every test's outcome and counter deltas become records; the
check fails on any failed test, on any skipped one (a skip on an H200 means the envelope shrank), when no
test ran at all, and when a registered kernel's launch counter (each of its spec's ``launch_names``) never
moved.

``kernels.sanitizer``: ``compute-sanitizer --tool T`` over ``k3_fastpath.runtime.sanitize_driver``,
which launches every kernel once on small shapes; clean means "ERROR SUMMARY: 0 errors" and the
driver's own "all kernels launched" line (a driver that silently fell back would prove nothing).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from k3_fastpath import kernels as registry
from verify.checks import status_rules as rules
from verify.checks.registry import check
from verify.context import CheckContext

REPO = Path(__file__).resolve().parents[2]


@check("kernels.compile", "every CuTe DSL kernel compiles for sm_90a at every decode shape of the presets",
       requires=("cutlass",))
def compile_all(ctx: CheckContext, presets: list[str] = ["k3-tp8-rank", "k3-tp16-rank"]) -> Any:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    rows = registry.compile_report(list(presets))
    for r in rows:
        ctx.record(r)
    metrics = {"variants": sum(r["variants"] for r in rows), "seconds": round(sum(r["seconds"] for r in rows), 1),
               "presets": list(presets), "kernels": sorted({r["kernel"] for r in rows})}
    return ctx.verdict(rules.compile_problems(rows), metrics)


# every registered kernel's GPU test files (its spec's gpu_tests), derived: never a hand-kept list
GPU_KERNEL_TESTS = registry.gpu_test_files()


def _pytest_gpu(ctx: CheckContext, test_files: tuple[str, ...], extra: list[str]) -> list[dict[str, Any]]:
    rec_file = ctx.tmp_dir / f"{ctx.check_id}.pytest.jsonl"
    rec_file.unlink(missing_ok=True)
    env = {**os.environ, "K3_PYTEST_RECORDS": str(rec_file), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "verify.pytest_records", "-m", "gpu", "-q", "-rs",
           "-p", "no:cacheprovider", *(str(REPO / f) for f in test_files), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.budget_s)
    log = ctx.artifact_path("pytest.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + "\n" + proc.stderr)
    return [json.loads(line) for line in rec_file.read_text().splitlines()] if rec_file.exists() else []


@check("kernels.numerics",
       "every fast kernel vs the FP64 reference on an H200, launch counters asserted, bitwise repeat",
       requires=("cuda", "sm90", "cutlass"), imports=("pytest",))
def numerics(ctx: CheckContext) -> Any:
    tests = _pytest_gpu(ctx, GPU_KERNEL_TESTS, [])
    for t in tests:
        ctx.record(t)
    kernels = list(registry.names())
    other_skips = [f"{t['test']}: {t.get('reason', '')}"[:300] for t in tests if t["outcome"] == "skipped"
                   and not any(t["test"].split("::")[-1].startswith(f"test_{k}") for k in kernels)]
    # what the rule needs besides the records: the kernels and every launch name they count under
    metrics = {"tests": len(tests), "passed": sum(t["outcome"] == "passed" for t in tests),
               "launches_by_kernel": rules.launches_by_kernel(tests), "skipped_non_numerics": other_skips,
               "kernels": kernels, "expected_launches": list(registry.launch_names())}
    return ctx.verdict(rules.numerics_problems(tests, metrics), metrics,
                       artifacts=[f"artifacts/{ctx.check_id}/pytest.log"])


# memcheck/synccheck/initcheck end with "ERROR SUMMARY: N errors"; racecheck with
# "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error")
_API_ERROR = re.compile(r"Program hit (CUDA_ERROR_\w+) \(error \d+\) due to .*? on CUDA API call to (\w+)\.")
# Driver entry-point probes: cuda-python's cydriver resolves every binding lazily with cuGetProcAddress, and
# the driver answers CUDA_ERROR_INVALID_VALUE / NOT_FOUND for entry points it does not export. memcheck
# counts these host API return codes in its ERROR SUMMARY; they involve no kernel and no device memory.
_TOLERATED_API = {("CUDA_ERROR_INVALID_VALUE", "cuGetProcAddress_v2"), ("CUDA_ERROR_NOT_FOUND", "cuGetProcAddress_v2")}


def classify_sanitizer_errors(out: str, total: int) -> tuple[int, dict[str, int]]:
    """(errors that count, tolerated API probes by "error on api") from a compute-sanitizer log whose summary
    says ``total``: every error counts except the driver entry-point probes in ``_TOLERATED_API``."""
    tolerated: dict[str, int] = {}
    for err, api in _API_ERROR.findall(out):
        if (err, api) in _TOLERATED_API:
            key = f"{err} on {api}"
            tolerated[key] = tolerated.get(key, 0) + 1
    return total - sum(tolerated.values()), tolerated


@check("kernels.sanitizer",
       "compute-sanitizer memcheck/racecheck/synccheck/initcheck clean on small shapes of every kernel",
       requires=("cuda", "sm90", "cutlass", "compute-sanitizer"))
def sanitizer(ctx: CheckContext, tools: list[str] = ["memcheck"]) -> Any:
    from verify.requirements import compute_sanitizer_path

    exe = compute_sanitizer_path()
    metrics: dict[str, Any] = {}
    for tool in tools:
        cmd = [exe, "--tool", tool, "--error-exitcode", "3", sys.executable, "-m",
               "k3_fastpath.runtime.sanitize_driver"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=ctx.budget_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        out = proc.stdout + proc.stderr
        log = ctx.artifact_path(f"{tool}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out)
        m = _SUMMARY.findall(out)
        errors = int(next(g for g in m[-1] if g)) if m else None
        tolerated: dict[str, int] = {}
        if errors:
            errors, tolerated = classify_sanitizer_errors(out, errors)
        launched = "sanitize_driver: all kernels launched" in out
        overlap = "sanitize_driver: executor step with the side stream ran" in out
        ctx.record({"tool": tool, "returncode": proc.returncode, "errors": errors, "tolerated_api_probes": tolerated,
                    "all_kernels_launched": launched, "executor_step_with_side_stream": overlap})
        metrics[f"{tool}_errors"] = errors
    return ctx.verdict(rules.sanitizer_problems(ctx.recorded, metrics, ctx.check_id), metrics, artifacts=[f"artifacts/{ctx.check_id}/{t}.log" for t in tools])
