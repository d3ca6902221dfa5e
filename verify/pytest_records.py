"""A pytest plugin that streams one JSON line per test into a file: outcome, duration, and the fast-path
execution counters that moved during the test (launches per kernel, fallbacks per op and reason).

Used by ``kernels.numerics`` so the bundle records, per kernel test, that it passed *and* which kernel
launched how often: ``pytest -p verify.pytest_records`` with ``K3_PYTEST_RECORDS=<file>``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    launches = {k: v - before["launches"].get(k, 0) for k, v in after["launches"].items()
                if v != before["launches"].get(k, 0)}
    fallbacks: dict[str, dict[str, int]] = {}
    for op, reasons in after["fallbacks"].items():
        for reason, n in reasons.items():
            d = n - before["fallbacks"].get(op, {}).get(reason, 0)
            if d:
                fallbacks.setdefault(op, {})[reason] = d
    return {"launches": launches, "fallbacks": fallbacks}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    from k3_fastpath._lib import counters

    before = counters.snapshot()
    yield
    item.user_properties.append(("counters", _delta(before, counters.snapshot())))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("K3_PYTEST_RECORDS")
    if not path:
        return
    if report.when != "call" and not (report.skipped or report.failed):
        return
    rec: dict[str, Any] = {"test": report.nodeid, "phase": report.when, "outcome": report.outcome,
                           "duration_s": round(report.duration, 4)}
    for k, v in report.user_properties:
        rec[k] = v
    if report.skipped and isinstance(report.longrepr, tuple):
        rec["reason"] = str(report.longrepr[2])
    elif report.failed:
        rec["reason"] = str(report.longrepr).strip().splitlines()[-1][:500] if report.longrepr else ""
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
