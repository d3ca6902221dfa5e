"""``k3-verify bundle attach BUNDLE --pr N``: post a bundle's summary on a pull request, archive attached.

GitHub has no API to attach a file to a PR comment, so the archive and the plots go to a **release**
used as a file store (tag ``k3-verify-bundles`` by default, created once as a pre-release; assets are
named ``<bundle>.tar.gz`` and ``<bundle>--<plot>.png``, re-uploads replace them), and the comment links
to them. A gist was the other choice; gists hold text only, so a .tar.gz cannot go there. The steps,
all through the ``gh`` CLI (``--dry-run`` prints them, and the comment body, without running any):

    gh auth status
    gh release view k3-verify-bundles [-R OWNER/REPO]      # if this fails:
    gh release create k3-verify-bundles [-R ...] --title ... --notes ... --prerelease
    gh release upload k3-verify-bundles <assets> --clobber [-R ...]
    gh pr comment N --body-file <work dir>/pr-comment.md [-R ...]

The comment body is ``bundle render``'s summary (at most 65,536 characters, GitHub's limit) with a first
line linking the archive (and its SHA-256) and the plots linked from the release. Files are prepared in
a work directory next to the bundle (``<bundle>-attach/``; the bundle itself is never modified, it would
no longer verify). gh missing from PATH or not authenticated: one clear line, exit 2, nothing posted.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from verify.bundle.render import MAX_CHARS, render_bundle
from verify.bundle.schema import BundleError
from verify.bundle.writer import tarball_path, write_tarball

RELEASE_TAG = "k3-verify-bundles"
RELEASE_TITLE = "k3-verify result bundles"
RELEASE_NOTES = (
    "Result bundles (.tar.gz) and their plots, attached to pull requests by "
    "`k3-verify bundle attach`. Verify one offline: `k3-verify bundle verify <file>.tar.gz`."
)
REPO_PLACEHOLDER = "OWNER/REPO"
_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class AttachError(Exception):
    """A gh step failed (exit 1); a missing or unauthenticated gh is a UserError (exit 2) instead."""


@dataclass(frozen=True)
class AttachPlan:
    bundle: str
    pr: int
    repo: str | None  # passed as -R; None: gh's default (the repository of the current directory)
    url_repo: str | None  # the OWNER/REPO in the comment's links (None: the OWNER/REPO placeholder)
    tag: str
    work_dir: Path
    archive: Path
    assets: tuple[Path, ...]  # staged copies, named as the release assets
    body_file: Path
    body: str
    check_release: list[str]  # gh release view ...
    create_release: list[str]  # gh release create ... (only when the view fails)
    upload: list[str]
    comment: list[str]

    def commands(self) -> list[list[str]]:
        return [["gh", "auth", "status"], self.check_release, self.create_release, self.upload, self.comment]

    def script(self) -> str:
        """The commands as a shell reader would run them (what --dry-run prints)."""
        return (
            "\n".join(
                [
                    shlex.join(["gh", "auth", "status"]),
                    f"{shlex.join(self.check_release)} >/dev/null 2>&1 || \\",
                    f"  {shlex.join(self.create_release)}",
                    shlex.join(self.upload),
                    shlex.join(self.comment),
                ]
            )
            + "\n"
        )


def asset_url(repo: str | None, tag: str, name: str) -> str:
    return f"https://github.com/{repo or REPO_PLACEHOLDER}/releases/download/{tag}/{name}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def plan_attach(
    bundle: str | Path,
    pr: int,
    *,
    repo: str | None = None,
    url_repo: str | None = None,
    tag: str = RELEASE_TAG,
    work_dir: str | Path | None = None,
    plots: bool = True,
) -> AttachPlan:
    """Render the comment, stage the assets and build the gh commands; runs no gh command. ``repo`` goes
    to gh as ``-R``; ``url_repo`` (default ``repo``) is the OWNER/REPO the comment's links name."""
    if isinstance(pr, bool) or not isinstance(pr, int) or pr <= 0:
        raise ValueError(f"--pr must be a positive pull request number, got {pr!r}")
    for r in (repo, url_repo):
        if r is not None and not _REPO_RE.match(r):
            raise ValueError(f"--repo must look like OWNER/REPO, got {r!r}")
    links = repo or url_repo
    if not _TAG_RE.match(tag):
        raise ValueError(f"--tag {tag!r} is not a plain release tag (letters, digits, _ . -)")
    src = Path(bundle)
    is_tar = src.is_file() and src.name.endswith(".tar.gz")
    if not (src.is_dir() or is_tar):
        raise BundleError(f"{src}: not a bundle directory or a .tar.gz")
    name = src.name[:-7] if is_tar else src.name
    work = Path(work_dir) if work_dir else src.with_name(f"{name}-attach")
    assets_dir = work / "assets"
    if assets_dir.exists():
        shutil.rmtree(assets_dir)
    assets_dir.mkdir(parents=True)
    archive = assets_dir / f"{name}.tar.gz"
    if is_tar:
        shutil.copyfile(src, archive)
    elif tarball_path(src).is_file():
        shutil.copyfile(tarball_path(src), archive)
    else:
        write_tarball(src, archive)  # deterministic, the same bytes finalize would have written
    sha, size = _sha256(archive), archive.stat().st_size

    def image_url(plot: str) -> str:
        return asset_url(links, tag, f"{name}--{plot}")

    preamble = [
        f"**k3-verify result bundle** [`{archive.name}`]({asset_url(links, tag, archive.name)}) "
        f"({size:,} bytes, sha256 `{sha}`): verify it offline with "
        f"`k3-verify bundle verify {archive.name}`.",
        "",
    ]
    rendered = render_bundle(
        src,
        work / "render",
        max_chars=MAX_CHARS,
        plots=plots,
        image_url=image_url,
        preamble=preamble,
        summary_name="pr-comment.md",
    )
    staged = [archive]
    for png in rendered.plots:
        dst = assets_dir / f"{name}--{png.name}"
        shutil.copyfile(png, dst)
        staged.append(dst)
    r = ["-R", repo] if repo else []
    return AttachPlan(
        bundle=str(src),
        pr=pr,
        repo=repo,
        url_repo=links,
        tag=tag,
        work_dir=work,
        archive=archive,
        assets=tuple(staged),
        body_file=rendered.summary,
        body=rendered.summary.read_text(encoding="utf-8"),
        check_release=["gh", "release", "view", tag, *r],
        create_release=[
            "gh",
            "release",
            "create",
            tag,
            *r,
            "--title",
            RELEASE_TITLE,
            "--notes",
            RELEASE_NOTES,
            "--prerelease",
        ],
        upload=["gh", "release", "upload", tag, *map(str, staged), "--clobber", *r],
        comment=["gh", "pr", "comment", str(pr), "--body-file", str(rendered.summary), *r],
    )


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=600, check=False)


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "no output")


def require_gh(run: Runner = _run) -> str:
    """Path of an authenticated ``gh``; UserError (exit 2, one line) when it is missing or logged out."""
    from verify.output import UserError

    gh = shutil.which("gh")
    if gh is None:
        raise UserError(
            "gh (the GitHub CLI) is not on PATH: install it from https://cli.github.com and run "
            "`gh auth login` (or use --dry-run to print the commands)"
        )
    res = run(["gh", "auth", "status"])
    if res.returncode != 0:
        raise UserError(
            f"gh is not authenticated (`gh auth status` exit {res.returncode}: "
            f"{_first_line(res.stderr or res.stdout)}): run `gh auth login` or set GH_TOKEN"
        )
    return gh


def resolve_repo(run: Runner = _run) -> str:
    """OWNER/REPO of the current directory as gh sees it (the comment's links need it); UserError if none."""
    from verify.output import UserError

    res = run(["gh", "repo", "view", "--json", "nameWithOwner", "--jq", ".nameWithOwner"])
    repo = (res.stdout or "").strip()
    if res.returncode != 0 or not _REPO_RE.match(repo):
        raise UserError(
            f"cannot tell which GitHub repository to use (`gh repo view` exit {res.returncode}: "
            f"{_first_line(res.stderr or res.stdout)}): pass --repo OWNER/REPO"
        )
    return repo


def execute(plan: AttachPlan, run: Runner = _run) -> list[str]:
    """Run the plan's gh commands (after ``require_gh``); returns what was done, one line each.
    AttachError (exit 1) naming the command when a step fails."""
    done = []

    def step(argv: list[str]) -> None:
        res = run(argv)
        if res.returncode != 0:
            raise AttachError(
                f"`{shlex.join(argv[:4])} ...` failed (exit {res.returncode}): "
                f"{_first_line(res.stderr or res.stdout)}"
            )
        done.append(shlex.join(argv[:4]))

    if run(plan.check_release).returncode != 0:
        step(plan.create_release)
    step(plan.upload)
    step(plan.comment)
    return done
