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
