"""Source identity (verify/provenance.py): the sources' hash is the same from disk and from a commit's tree,
a run records a commit only when HEAD has exactly the sources that ran, and ``bundle verify --repo`` confirms
or refutes the commit a bundle names. On throwaway git repositories and on a committed H200 bundle."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_bundle import reseal

from verify.provenance import capture, commit_problem, commit_tree_sha256, tree_sha256

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "bundles" / "runs" / "2026-12-01-h200-session7" / "standard"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "r"
    for rel, text in (("k3_fastpath/a.py", "A = 1\n"), ("k3_fastpath/a-b/c.py", "C = 2\n"),
                      ("k3_fastpath/a/z.yaml", "z: 1\n"), ("verify/v.py", "V = 3\n"), ("evals/e.yaml", "e: 4\n"),
                      ("docs/readme.md", "not a source\n"), ("verify/notes.txt", "not a source either\n")):
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_text(text)
    _git(r.parent, "init", "-q", str(r))
    _git(r, "add", "-A")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return r


def test_the_hash_of_a_tree_on_disk_equals_the_hash_of_its_commit(repo, monkeypatch):
    head = _git(repo, "rev-parse", "HEAD")
    full, at_head = commit_tree_sha256(repo, head[:8])
    assert full == head and at_head == tree_sha256(repo)
    (repo / "docs" / "readme.md").write_text("changed, not a source\n")
    assert tree_sha256(repo) == at_head  # only .py / .yaml under the three packages count
    # path-component order ("a-b/" sorts after "a/"), as the environment's hash has always ordered them
    assert [r for r, _ in sorted([("a-b/c.py".split("/"), 0), ("a/z.yaml".split("/"), 0)])][0] == ["a", "z.yaml"]
    monkeypatch.delenv("K3_SOURCE_COMMIT", raising=False)
    d = capture(repo, tree_sha256(repo))
    assert d["commit"] == head and d["head"] == head and d["claimed_commit"] is None and d["dirty"] is True


def test_a_changed_source_leaves_the_commit_unknown(repo, monkeypatch):
    head = _git(repo, "rev-parse", "HEAD")
    (repo / "verify" / "v.py").write_text("V = 4\n")
    monkeypatch.setenv("K3_SOURCE_COMMIT", "deadbeef")
    d = capture(repo, tree_sha256(repo))
    assert d["commit"] is None and d["head"] == head and d["claimed_commit"] == "deadbeef"
    assert "differ from HEAD" in d["note"]
    (repo / "k3_fastpath" / "new.py").write_text("N = 1\n")  # an untracked source runs too: also unknown
    _git(repo, "checkout", "-q", "--", "verify/v.py")
    assert capture(repo, tree_sha256(repo))["commit"] is None


def test_a_copy_without_git_records_only_the_claim(repo, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setenv("K3_SOURCE_COMMIT", _git(repo, "rev-parse", "HEAD"))
    d = capture(copy, tree_sha256(copy))
    assert d["commit"] is None and d["head"] is None and d["claimed_commit"] == _git(repo, "rev-parse", "HEAD")


def _manifest(tree: str, **git) -> dict:
    return {"env": {"source_tree_sha256": tree, "git": {"commit": None, "claimed_commit": None, **git}},
            "parts": [{"source_tree_sha256": tree}]}


def test_commit_problem_confirms_or_refutes(repo):
    head = _git(repo, "rev-parse", "HEAD")
    tree = tree_sha256(repo)
    problem, confirmed = commit_problem(_manifest(tree, claimed_commit=head), repo)
    assert problem is None and head[:12] in confirmed and "claimed_commit" in confirmed
    (repo / "verify" / "v.py").write_text("V = 5\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "two")
    problem, _ = commit_problem(_manifest(tree, claimed_commit="HEAD"), repo)
    assert problem and "no commit the bundle names has the sources that ran" in problem
    problem, _ = commit_problem(_manifest(tree, commit="0" * 40), repo)
    assert problem and "cannot be read" not in problem and "0000000000" in problem
    assert "names no commit" in commit_problem(_manifest(tree), repo)[0]
    m = _manifest(tree, claimed_commit=head)
    m["parts"].append({"source_tree_sha256": "f" * 64})
    assert "part 1 ran source tree" in commit_problem(m, repo)[0]


@pytest.mark.skipif(not (REPO / ".git").exists() or not H200.exists(), reason="needs this repository's history")
def test_bundle_verify_repo_on_a_committed_h200_bundle(tmp_path):
    from verify.bundle.verify import verify_bundle

    report = verify_bundle(H200, repo=REPO)
    assert report.ok and "ad19aac5081e" in report.summary["source"], report.problems
    forged = tmp_path / "b"
    shutil.copytree(H200, forged)
    m = json.loads((forged / "manifest.json").read_text())
    m["env"]["env_vars"]["K3_SOURCE_COMMIT"] = "f415d0e71e39795d87edab92da68a9554b5fff11"  # other code
    (forged / "manifest.json").write_text(json.dumps(m))
    reseal(forged)  # what a forger does: the hashes agree again
    assert verify_bundle(forged).ok  # without --repo nothing ties the claim to the code
    report = verify_bundle(forged, repo=REPO)
    assert not report.ok and report.exit_code == 1
    assert any("f415d0e71e39: its sources hash to" in p for p in report.problems), report.problems


SESSION10 = REPO / "bundles" / "runs" / "2026-12-02-h200-session10" / "standard"


@pytest.mark.skipif(not (REPO / ".git").exists() or not SESSION10.exists(), reason="needs this repository's history")
def test_the_session10_h200_bundle_names_the_commit_that_ran():
    """The GPU host's copy has no usable .git: the bundle records commit null, the claim K3_SOURCE_COMMIT and
    the tree hash, and --repo confirms the claimed commit holds exactly those sources (all three parts)."""
    from verify.bundle.verify import verify_bundle

    m = json.loads((SESSION10 / "manifest.json").read_text())
    assert m["env"]["git"]["commit"] is None and m["env"]["git"]["claimed_commit"].startswith("72cc410")
    assert len(m["parts"]) == 3
    report = verify_bundle(SESSION10, repo=REPO)
    assert report.ok and "72cc410b0ed5" in report.summary["source"], report.problems
