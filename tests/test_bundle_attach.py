"""``bundle attach --pr N``: the dry run prints the exact gh commands and comment body (snapshot), a real run
issues exactly those commands (a fake ``gh`` on PATH records them), and gh missing or not authenticated
is one clear line with exit 2 and nothing posted; a failing gh step is exit 1 naming the step.

The fake gh is a small Python script: it appends its argv as one JSON line to $FAKE_GH_LOG and answers
``auth status`` / ``release view`` / ``repo view`` / ``release upload`` as the FAKE_GH_* variables say.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import make_compare_bundles as gold
import pytest

from verify.bundle.attach import RELEASE_TAG
from verify.bundle.render import MAX_CHARS
from verify.bundle.verify import verify_bundle

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
SMOKE = REPO / "bundles" / "example" / "golden-smoke"

FAKE_GH = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GH_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
env = os.environ.get
if args[:2] == ["auth", "status"]:
    if env("FAKE_GH_AUTH_RC", "0") != "0":
        sys.stderr.write("You are not logged into any GitHub hosts. To log in, run: gh auth login\\n")
    sys.exit(int(env("FAKE_GH_AUTH_RC", "0")))
if args[:2] == ["release", "view"]:
    sys.exit(int(env("FAKE_GH_RELEASE_RC", "1")))
if args[:2] == ["repo", "view"]:
    print(env("FAKE_GH_REPO", "acme/k3"))
    sys.exit(0)
if args[:2] == ["release", "upload"]:
    files = args[3:args.index("--clobber")] if "--clobber" in args else []
    if not files or not all(os.path.isfile(p) for p in files):
        sys.stderr.write("upload: file missing\\n")
        sys.exit(1)
    if env("FAKE_GH_UPLOAD_RC", "0") != "0":
        sys.stderr.write("HTTP 422: Validation Failed\\n")
    sys.exit(int(env("FAKE_GH_UPLOAD_RC", "0")))
if args[:2] == ["pr", "comment"]:
    body = open(args[args.index("--body-file") + 1]).read()
    sys.exit(0 if len(body) <= 65536 else 1)
sys.exit(0)
"""


def snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("K3_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}; run with K3_UPDATE_SNAPSHOTS=1 to write it"
    assert text == path.read_text(), f"output differs from {path} (K3_UPDATE_SNAPSHOTS=1 rewrites it)"


@pytest.fixture
def gh(tmp_path: Path):
    """(run the CLI with a fake gh first on PATH, the log of gh calls)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "gh"
    script.write_text(FAKE_GH.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "gh.log"
    log.write_text("")

    def run(*args: str, path: str | None = None, **fake: str) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "COLUMNS": "250",
            "FAKE_GH_LOG": str(log),
            **fake,
            "PATH": path if path is not None else f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        env.pop("K3_DEBUG", None)
        return subprocess.run(
            [sys.executable, "-m", "verify.cli", "bundle", "attach", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    run.calls = calls
    return run


def test_dry_run_prints_the_exact_commands_and_body(gh, tmp_path: Path) -> None:
    work = tmp_path / "work"
    r = gh(str(SMOKE), "--pr", "42", "--repo", "acme/k3", "--work-dir", str(work), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert gh.calls() == [], "a dry run must not call gh"
    body = (work / "render" / "pr-comment.md").read_text()
    assert r.stdout.endswith(body) and len(body) <= MAX_CHARS
    archive = work / "assets" / "golden-smoke.tar.gz"
    assert archive.read_bytes() == SMOKE.with_name("golden-smoke.tar.gz").read_bytes()
    sha, size = hashlib.sha256(archive.read_bytes()).hexdigest(), f"{archive.stat().st_size:,} bytes"
    assert (
        f"(https://github.com/acme/k3/releases/download/{RELEASE_TAG}/golden-smoke.tar.gz) "
        f"({size}, sha256 `{sha}`)"
    ) in body
    # the archive's gzip bytes depend on the zlib that wrote it: keep them out of the snapshot
    text = r.stdout.replace(str(tmp_path), "<TMP>").replace(sha, "<SHA256>").replace(size, "<SIZE> bytes")
    snapshot("attach_dry_run_golden_smoke.txt", re.sub(r"\d[\d,]* characters\):", "<N> characters):", text))


def test_dry_run_json_and_placeholder_links_without_repo(gh, tmp_path: Path) -> None:
    r = gh(str(SMOKE), "--pr", "7", "--work-dir", str(tmp_path / "w"), "--dry-run", "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dry_run"] is True and "OWNER/REPO/releases/download" in doc["body"]
    assert doc["commands"][-1] == ["gh", "pr", "comment", "7", "--body-file", doc["body_file"]]
    text = gh(str(SMOKE), "--pr", "7", "--work-dir", str(tmp_path / "w"), "--dry-run")
    assert "# links name OWNER/REPO: pass --repo for the exact URLs" in text.stdout


def test_real_run_issues_the_dry_run_commands(gh, tmp_path: Path) -> None:
    """A bundle directory without a tarball and with plots: the archive is written, plots go up with it."""
    work = tmp_path / "work"
    plan = json.loads(
        gh(
            str(gold.DATA / "base"),
            "--pr",
            "42",
            "--repo",
            "acme/k3",
            "--work-dir",
            str(work),
            "--dry-run",
            "--format",
            "json",
        ).stdout
    )
    r = gh(str(gold.DATA / "base"), "--pr", "42", "--repo", "acme/k3", "--work-dir", str(work))
    assert r.returncode == 0, r.stderr
    assert "posted the summary" in r.stdout
    calls = gh.calls()
    assert [["gh", *c] for c in calls] == plan["commands"], "the real run must issue what --dry-run printed"
    upload = calls[3]
    assets = sorted(Path(a).name for a in upload[3:-3])
    assert assets == sorted(
        ["base.tar.gz"]
        + [
            f"base--{n}"
            for n in (
                "step_time_vs_batch.png",
                "speedup_heatmap.png",
                "pct_of_floor.png",
                "kernels_pct_of_floor.png",
                "kernels_vs_baseline.png",
                "eval_deltas.png",
            )
        ]
    )
    assert verify_bundle(work / "assets" / "base.tar.gz").ok
    body = (work / "render" / "pr-comment.md").read_text()
    assert (
        f"![decode step time vs batch per context](https://github.com/acme/k3/releases/download/{RELEASE_TAG}/"
        "base--step_time_vs_batch.png)" in body
    )


def test_existing_release_is_not_created_again_and_repo_comes_from_gh(gh, tmp_path: Path) -> None:
    r = gh(
        str(SMOKE),
        "--pr",
        "3",
        "--work-dir",
        str(tmp_path / "w"),
        FAKE_GH_RELEASE_RC="0",
        FAKE_GH_REPO="octo/cat",
    )
    assert r.returncode == 0, r.stderr
    verbs = [c[:2] for c in gh.calls()]
    assert verbs == [
        ["auth", "status"],
        ["repo", "view"],
        ["release", "view"],
        ["release", "upload"],
        ["pr", "comment"],
    ]
    assert all("-R" not in c for c in gh.calls())  # gh's own default repository, as the links say
    assert (
        "https://github.com/octo/cat/releases/download/"
        in (tmp_path / "w" / "render" / "pr-comment.md").read_text()
    )


def test_not_authenticated_is_one_line_exit_2(gh, tmp_path: Path) -> None:
    r = gh(
        str(SMOKE), "--pr", "42", "--repo", "acme/k3", "--work-dir", str(tmp_path / "w"), FAKE_GH_AUTH_RC="1"
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "k3-verify: error: gh is not authenticated (`gh auth status` exit 1: You are not logged into any GitHub "
        "hosts. To log in, run: gh auth login): run `gh auth login` or set GH_TOKEN"
    ]
    assert gh.calls() == [["auth", "status"]]


def test_missing_gh_is_one_line_exit_2(gh, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = gh(str(SMOKE), "--pr", "42", "--work-dir", str(tmp_path / "w"), path=str(empty))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("k3-verify: error: gh (the GitHub CLI) is not on PATH")
    assert gh.calls() == []


def test_failing_upload_is_exit_1_naming_the_step(gh, tmp_path: Path) -> None:
    r = gh(
        str(SMOKE),
        "--pr",
        "42",
        "--repo",
        "acme/k3",
        "--work-dir",
        str(tmp_path / "w"),
        FAKE_GH_UPLOAD_RC="1",
    )
    assert r.returncode == 1
    assert r.stderr.splitlines() == [
        f"k3-verify: error: `gh release upload {RELEASE_TAG} ...` failed (exit 1): "
        "HTTP 422: Validation Failed"
    ]
    assert [c[:2] for c in gh.calls()][-1] == ["release", "upload"]  # no comment after a failed upload


@pytest.mark.parametrize(
    "args,message",
    [
        (("--pr", "0"), "--pr must be a positive"),
        (("--pr", "1", "--repo", "not a repo"), "--repo must look like"),
        (("--pr", "1", "--tag", "../x"), "is not a plain release tag"),
    ],
)
def test_bad_arguments(gh, tmp_path: Path, args: tuple, message: str) -> None:
    r = gh(str(SMOKE), *args, "--work-dir", str(tmp_path / "w"), "--dry-run")
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1
