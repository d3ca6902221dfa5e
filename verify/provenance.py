"""Source identity: which code a bundle ran, and the check that a commit is that code.

A bundle names its code by ``source_tree_sha256`` (``tree_sha256`` below: sha256 over every ``.py`` and
``.yaml`` under ``k3_fastpath/``, ``verify/`` and ``evals/``, by relative path), computed from the files that
ran. The commit is resolved against that hash, never taken on trust:

- ``commit``: the checkout's HEAD when HEAD's own sources hash to the running tree's (the code that ran is
  exactly a commit, whatever else is uncommitted), else ``null``;
- ``head``: the checkout's HEAD when there is one (a GPU host's copied tree may carry a stale ``.git``);
- ``claimed_commit``: ``K3_SOURCE_COMMIT`` when set (what the person who started the run says it is), a
  claim that ``k3-verify bundle verify --repo DIR`` confirms or refutes by hashing that commit's sources in
  ``DIR`` (``commit_tree_sha256``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SOURCE_TOPS = ("k3_fastpath", "verify", "evals")
SOURCE_SUFFIXES = (".py", ".yaml")


def _is_source(rel: str) -> bool:
    parts = rel.split("/")
    return parts[0] in SOURCE_TOPS and rel.endswith(SOURCE_SUFFIXES) and "__pycache__" not in parts


def _digest(files: Iterable[tuple[str, bytes]]) -> str:
    """The hash over (relative path, bytes) pairs, top by top, each top's files in path-component order."""
    by_top: dict[str, list[tuple[list[str], str, bytes]]] = {t: [] for t in SOURCE_TOPS}
    for rel, data in files:
        by_top[rel.split("/")[0]].append((rel.split("/"), rel, data))
    h = hashlib.sha256()
    for top in SOURCE_TOPS:
        for _, rel, data in sorted(by_top[top], key=lambda x: x[0]):
            h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def tree_sha256(root: str | Path) -> str:
    """The source hash of the files on disk under ``root`` (tracked or not: what would run)."""
    root = Path(root)
    rels = []
    for top in SOURCE_TOPS:
        base = root / top
        if base.is_dir():
            rels += [p.relative_to(root).as_posix() for p in base.rglob("*") if p.is_file()]
    return _digest((rel, (root / rel).read_bytes()) for rel in rels if _is_source(rel))


class ProvenanceError(RuntimeError):
    """A commit cannot be read from a repository (one line: which commit, which repository, why)."""


def _git(repo: Path, *args: str, data: bytes | None = None) -> bytes:
    try:
        r = subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProvenanceError(f"git {args[0]} in {repo}: {e}") from None
    if r.returncode != 0:
        raise ProvenanceError(f"git {args[0]} in {repo}: {' '.join(r.stderr.decode(errors='replace').split())[:200]}")
    return r.stdout


def commit_tree_sha256(repo: str | Path, commit: str) -> tuple[str, str]:
    """(full commit id, source hash of that commit's tree) in the git repository ``repo``."""
    repo = Path(repo)
    full = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").decode().strip()
    listing = _git(repo, "ls-tree", "-r", "-z", full, "--", *SOURCE_TOPS).split(b"\0")
    blobs: list[tuple[str, str]] = []
    for entry in filter(None, listing):
        meta, rel = entry.decode().split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob" and mode != "120000" and _is_source(rel):
            blobs.append((rel, sha))
    out = _git(repo, "cat-file", "--batch", data="".join(f"{sha}\n" for _, sha in blobs).encode())
    files, pos = [], 0
    for rel, _ in blobs:
        nl = out.index(b"\n", pos)
        size = int(out[pos:nl].split()[2])
        files.append((rel, out[nl + 1: nl + 1 + size]))
        pos = nl + 1 + size + 1
    return full, _digest(files)


def capture(root: str | Path, running_sha256: str) -> dict[str, Any]:
    """The ``env.git`` record of a run from ``root`` whose sources hash to ``running_sha256``."""
    root = Path(root)
    claimed = os.environ.get("K3_SOURCE_COMMIT") or None
    d: dict[str, Any] = {"commit": None, "head": None, "claimed_commit": claimed}
    try:
        head = _git(root, "rev-parse", "HEAD").decode().strip()
    except ProvenanceError as e:
        d["note"] = f"no git checkout at {root}: {e}"
        return d
    d["head"] = head
    try:
        _, at_head = commit_tree_sha256(root, head)
    except ProvenanceError as e:
        d["note"] = str(e)
        return d
    if at_head == running_sha256:
        d["commit"] = head
    else:
        d["note"] = f"the sources that ran differ from HEAD {head[:12]}'s: commit unknown"
    try:
        status = _git(root, "status", "--porcelain", "--untracked-files=normal").decode()
        d["dirty"] = bool(status.strip())
    except ProvenanceError:
        d["dirty"] = None
    return d


def commit_problem(manifest: dict[str, Any], repo: str | Path) -> tuple[str | None, str]:
    """(problem or None, what was confirmed) for ``bundle verify --repo``: a commit the bundle names must exist
    in ``repo`` with sources that hash to the bundle's ``source_tree_sha256`` (every part ran that tree).
    Candidates in order: ``env.git.commit``, ``env.git.claimed_commit``, and for bundles written before the
    claim had its own field, ``env.env_vars.K3_SOURCE_COMMIT``."""
    env = manifest.get("env") or {}
    git = env.get("git") or {}
    want = env.get("source_tree_sha256")
    if not want:
        return "the bundle records no source_tree_sha256: its code cannot be identified", ""
    for i, part in enumerate(manifest.get("parts") or []):
        if part.get("source_tree_sha256") != want:
            return f"part {i} ran source tree {str(part.get('source_tree_sha256'))[:16]}, not {want[:16]}", ""
    candidates = [(f, c) for f, c in (("env.git.commit", git.get("commit")),
                                      ("env.git.claimed_commit", git.get("claimed_commit")),
                                      ("env.env_vars.K3_SOURCE_COMMIT", (env.get("env_vars") or {}).get("K3_SOURCE_COMMIT")))
                  if isinstance(c, str) and c]
    if not candidates:
        return "the bundle names no commit (env.git.commit and env.git.claimed_commit are null)", ""
    tried = []
    for field, commit in candidates:
        try:
            full, got = commit_tree_sha256(repo, commit)
        except ProvenanceError as e:
            tried.append(f"{field} {commit[:12]}: {e}")
            continue
        if got == want:
            return None, f"source: commit {full[:12]} ({field}) has the sources that ran ({want[:16]})"
        tried.append(f"{field} {full[:12]}: its sources hash to {got[:16]}")
    return f"no commit the bundle names has the sources that ran ({want[:16]}): {'; '.join(tried)}", ""


def commit_label(git: Any) -> str | None:
    """How a bundle's ``env.git`` names its code for people: ``<commit>[ (dirty)]``, ``claimed <commit>``
    (``K3_SOURCE_COMMIT``, unconfirmed until ``bundle verify --repo``), or None."""
    if not isinstance(git, dict):
        return None
    if git.get("commit"):
        return f"{str(git['commit'])[:12]}{' (dirty)' if git.get('dirty') else ''}"
    if git.get("claimed_commit"):
        return f"claimed {str(git['claimed_commit'])[:12]}"
    return None
