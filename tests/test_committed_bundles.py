"""Every bundle committed to the repository verifies (CI re-checks GPU evidence without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verify.bundle.verify import verify_bundle

REPO = Path(__file__).resolve().parent.parent


def _committed() -> list[Path]:
    found = []
    for top in sorted((REPO / "bundles").glob("example*")) + sorted((REPO / "bundles" / "runs").glob("*")):
        if (top / "manifest.json").is_file():
            found.append(top)
        found += sorted(p.parent for p in top.glob("*/manifest.json"))
        found += sorted(top.glob("*.tar.gz"))
    return found


@pytest.mark.parametrize("path", _committed(), ids=lambda p: str(p.relative_to(REPO)))
def test_committed_bundle_verifies(path):
    report = verify_bundle(path)
    assert report.ok and report.exit_code == 0, report.problems


def test_there_is_at_least_the_golden_example():
    assert any("example" in str(p) for p in _committed())


def test_verifying_a_full_tier_sized_bundle_takes_under_two_seconds():
    """Rescoring included. The largest committed tier bundle (the H200 standard run of session 12: 16 checks,
    775 equivalence.decode rows) verifies in well under a quarter of 2 s; a full-tier bundle holds about 4x
    its rows (equivalence.decode: 12 points x 256 steps against 6 x 128, the sweep 126 rows against 37), and
    ``verify`` is linear in the rows, so a full-tier bundle stays under 2 s here."""
    import time

    path = REPO / "bundles" / "runs" / "2026-12-02-h200-session12" / "standard"
    verify_bundle(path)  # imports and the rescorers' modules, once
    t = time.perf_counter()
    report = verify_bundle(path)
    elapsed = time.perf_counter() - t
    assert report.ok and elapsed * 4 < 2.0, (report.problems, elapsed)
