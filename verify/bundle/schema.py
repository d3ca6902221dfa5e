"""The result-bundle format, version 1, as code: names, the manifest's schema, SHA256SUMS, verdict rules.

``bundles/FORMAT.md`` is the prose of the same contract; the writer and the verifier both use this
module, so what one writes the other reads. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verify.result import PASSED, CheckResult, is_bundle_relpath, is_check_id, is_timestamp

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
TOOL_NAME = "k3-verify"

MANIFEST = "manifest.json"
RESULTS = "results.jsonl"
SUMMARY = "summary.md"
SUMS = "SHA256SUMS"
ATTESTATION = "attestation.dsse.json"  # the signature over the sealed bundle (verify/bundle/attestation.py): not in SUMS
RECORDS_DIR = "records"
LOGS_DIR = "logs"
ARTIFACTS_DIR = "artifacts"
RUN_LOG = "logs/run.log"

RUNNING, FINISHED, INTERRUPTED = "running", "finished", "interrupted"
STATES = (RUNNING, FINISHED, INTERRUPTED)
PASS, FAIL, INCOMPLETE = "pass", "fail", "incomplete"
VERDICTS = (PASS, FAIL, INCOMPLETE)

# A running bundle's manifest carries this placeholder verdict: the verdict is decided by finalize().
RUNNING_REASON = "run not finished (state running: in progress, or killed before it finalized)"
INTERRUPTED_REASON = "run interrupted (state interrupted)"

# First line of SHA256SUMS in sealed-prefix form; the lines after it are "<sha256>  <bytes>  <path>".
SEALED_HEADER = "# k3-verify sealed-prefix 1"

MANIFEST_KEYS = ("schema_version", "tool", "argv", "tier", "planned_checks", "engines", "config", "seeds", "env",
                 "started_at", "ended_at", "state", "verdict", "verdict_reasons")

_STREAM_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-\[\]=,+]{0,199}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TEMP_RE = re.compile(r"^\.[^/]+\.tmp$")


class BundleError(Exception):
    """A bundle cannot be written or read. ``exit_code`` follows the CLI: 2 unreadable input, 1 otherwise."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------- JSON encodings (byte-exact, deterministic)
def dumps_line(obj: Any) -> bytes:
    """One JSONL line (with its newline): compact, keys in the object's order, UTF-8, no NaN."""
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode()


def dumps_doc(obj: Any) -> bytes:
    """A JSON document such as manifest.json: sorted keys, two-space indent, trailing newline."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def is_stream_name(name: Any) -> bool:
    """A records stream name (the file is records/<name>.jsonl); check ids are valid stream names."""
    return isinstance(name, str) and bool(_STREAM_RE.match(name))


def is_append_only(path: str) -> bool:
    """Files the writer only appends to; in a running bundle they may carry an unsealed tail."""
    return path == RESULTS or path.startswith(LOGS_DIR + "/") or (
        path.startswith(RECORDS_DIR + "/") and path.endswith(".jsonl"))


def is_writer_temp(path: str) -> bool:
    """A root-level '.<name>.tmp' file: an atomic write (temp + rename) cut short by a kill."""
    return bool(_TEMP_RE.match(path))


def walk_bundle(root: Path) -> tuple[list[str], list[str]]:
    """(regular files, everything else: links, fifos...) under ``root``, as sorted bundle-relative paths."""
    files, odd = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        for name in dirnames:
            if (Path(dirpath) / name).is_symlink():
                odd.append((rel_dir / name).as_posix())
        for name in filenames:
            full = Path(dirpath) / name
            rel = (rel_dir / name).as_posix()
            (files if full.is_file() and not full.is_symlink() else odd).append(rel)
    key = str.encode
    return sorted(files, key=key), sorted(odd, key=key)


def sha256_file(path: Path, limit: int | None = None) -> tuple[str, int]:
    """(hex digest, bytes hashed) of the file's first ``limit`` bytes (all of it when None)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while limit is None or n < limit:
            chunk = f.read(1 << 20 if limit is None else min(1 << 20, limit - n))
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


# ---------------------------------------------------------------- manifest
def build_manifest(*, tool_version: str, argv: Sequence[str], tier: str, planned_checks: Sequence[str],
                   engines: Sequence[Any], config: dict, seeds: dict, env: dict, started_at: str,
                   ended_at: str | None = None, state: str = RUNNING, verdict: str = INCOMPLETE,
                   verdict_reasons: Sequence[str] = (RUNNING_REASON,), tool_name: str = TOOL_NAME) -> dict:
    from verify.result import json_value

    m = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": tool_name, "version": tool_version},
        "argv": list(argv),
        "tier": tier,
        "planned_checks": list(planned_checks),
        "engines": json_value(list(engines), "engines"),
        "config": json_value(config, "config"),
        "seeds": json_value(seeds, "seeds"),
        "env": json_value(env, "env"),
        "started_at": started_at,
        "ended_at": ended_at,
        "state": state,
        "verdict": verdict,
        "verdict_reasons": list(verdict_reasons),
    }
    problems = manifest_problems(m)
    if problems:
        raise ValueError("invalid manifest: " + "; ".join(problems))
    return m


def manifest_header_problem(m: Any) -> str | None:
    """Why this JSON cannot be read as a version-1 manifest at all (exit 2), or None."""
    if not isinstance(m, dict):
        return f"{MANIFEST} is not a JSON object"
    v = m.get("schema_version")
    if isinstance(v, bool) or not isinstance(v, int):
        return f"{MANIFEST} has no integer schema_version: not a k3-verify bundle"
    if v not in SUPPORTED_SCHEMA_VERSIONS:
        return (f"{MANIFEST} has schema_version {v}; this k3-verify reads "
                f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))} (a newer tool wrote it?)")
    return None


def manifest_problems(m: dict) -> list[str]:
    """Every way a manifest (already past ``manifest_header_problem``) breaks the version-1 schema."""
    p: list[str] = []
    missing = [k for k in MANIFEST_KEYS if k not in m]
    if missing:
        return [f"{MANIFEST}: missing keys {', '.join(missing)}"]

    def bad(key: str, want: str) -> None:
        p.append(f"{MANIFEST}: {key} must be {want}, got {json.dumps(m[key])[:80]}")

    tool = m["tool"]
    if not (isinstance(tool, dict) and isinstance(tool.get("name"), str) and isinstance(tool.get("version"), str)):
        bad("tool", "an object with string name and version")
    if not (isinstance(m["argv"], list) and all(isinstance(a, str) for a in m["argv"])):
        bad("argv", "a list of strings")
    if not (isinstance(m["tier"], str) and m["tier"]):
        bad("tier", "a non-empty string")
    planned = m["planned_checks"]
    if not (isinstance(planned, list) and all(is_check_id(c) for c in planned)):
        bad("planned_checks", "a list of check ids")
    elif len(set(planned)) != len(planned):
        p.append(f"{MANIFEST}: planned_checks lists a check twice")
    if not (isinstance(m["engines"], list) and all(isinstance(e, (str, dict)) for e in m["engines"])):
        bad("engines", "a list of strings or objects")
    for key in ("config", "seeds", "env"):
        if not isinstance(m[key], dict):
            bad(key, "an object")
    if not is_timestamp(m["started_at"]):
        bad("started_at", "an ISO-8601 UTC timestamp")
    if m["state"] not in STATES:
        bad("state", " | ".join(STATES))
    elif m["state"] == RUNNING and m["ended_at"] is not None:
        bad("ended_at", "null while the state is running")
    elif m["state"] != RUNNING and not is_timestamp(m["ended_at"]):
        bad("ended_at", "an ISO-8601 UTC timestamp once the run has ended")
    if m["verdict"] not in VERDICTS:
        bad("verdict", " | ".join(VERDICTS))
    if not (isinstance(m["verdict_reasons"], list) and all(isinstance(r, str) for r in m["verdict_reasons"])):
        bad("verdict_reasons", "a list of strings")
    return p


PART_IDENTITY = (("gpu", "GPU model"), ("source_tree_sha256", "source tree"))


def parts_problems(m: dict, result_ids: Sequence[str]) -> list[str]:
    """How ``manifest.parts`` (optional: one entry per run or ``--resume`` of the bundle) breaks its rule:
    each part names the checks it set out to run, disjoint from the other parts', every result belongs to
    one, and every part ran on the first part's GPU model and source tree (``PART_IDENTITY``)."""
    parts = m.get("parts")
    if parts is None:
        return []
    if not (isinstance(parts, list) and parts and all(isinstance(x, dict) for x in parts)):
        return [f"{MANIFEST}: parts must be a non-empty list of objects"]
    p: list[str] = []
    owner: dict[str, int] = {}
    for i, part in enumerate(parts):
        checks = part.get("checks")
        if not (isinstance(checks, list) and all(isinstance(c, str) for c in checks)):
            p.append(f"{MANIFEST}: parts[{i}].checks must be a list of check ids")
            continue
        for c in checks:  # a resumed part re-plans the check a killed part left without a result
            owner.setdefault(c, i)
        for key, what in PART_IDENTITY:
            if part.get(key) != parts[0].get(key):
                p.append(f"{MANIFEST}: parts[{i}] ran on {what} {part.get(key)!r}, parts[0] on "
                         f"{parts[0].get(key)!r}: one bundle's parts share GPU model and source")
    for cid in result_ids:
        if cid not in owner:
            p.append(f"{cid}: result outside every part's checks")
    return p


# ---------------------------------------------------------------- SHA256SUMS
@dataclass(frozen=True)
class SumEntry:
    path: str
    sha256: str
    size: int | None = None  # sealed-prefix form: the hash covers the first ``size`` bytes


def format_sums(entries: Iterable[SumEntry], sealed: bool) -> bytes:
    """Standard form (``sha256sum -c`` reads it) or sealed-prefix form; lines sorted by path."""
    rows = sorted(entries, key=lambda e: (e.path.encode(), e.sha256))
    if sealed:
        lines = [SEALED_HEADER] + [f"{e.sha256}  {e.size}  {e.path}" for e in rows]
    else:
        lines = [f"{e.sha256}  {e.path}" for e in rows]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def parse_sums(data: bytes) -> tuple[bool, list[SumEntry], list[str]]:
    """(sealed form?, entries, problems). Problems name the line; malformed lines are left out."""
    problems: list[str] = []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False, [], [f"{SUMS} is not UTF-8 text"]
    if text and not text.endswith("\n"):
        problems.append(f"{SUMS}: last line has no newline (truncated?)")
    lines = text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")
    sealed = bool(lines) and lines[0] == SEALED_HEADER
    entries: list[SumEntry] = []
    for n, line in enumerate(lines[1:] if sealed else lines, start=2 if sealed else 1):
        parts = line.split("  ", 2 if sealed else 1)
        ok = len(parts) == (3 if sealed else 2) and _HEX64.match(parts[0]) and is_bundle_relpath(parts[-1])
        if ok and sealed and not (parts[1].isdigit() and parts[1] == str(int(parts[1]))):
            ok = False
        if not ok:
            problems.append(f"{SUMS} line {n}: malformed: {line[:100]!r}")
            continue
        entries.append(SumEntry(parts[-1], parts[0], int(parts[1]) if sealed else None))
    paths = [e.path.encode() for e in entries]
    if paths != sorted(paths):
        problems.append(f"{SUMS}: lines are not sorted by path")
    for path, n in Counter(e.path for e in entries).items():
        # manifest.json twice: the instant finalize() swaps the manifest (FORMAT.md, "Crash safety")
        if n > 1 and not (sealed and path == MANIFEST and n == 2):
            problems.append(f"{SUMS}: {path} listed {n} times")
        if path == SUMS:
            problems.append(f"{SUMS} lists itself")
    return sealed, entries, problems


# ---------------------------------------------------------------- verdict
def compute_verdict(planned: Sequence[str], results: Sequence[CheckResult], state: str) -> tuple[str, list[str]]:
    """(verdict, reasons) from the planned check ids, the results and the run state.

    ``pass``: the run finished and every planned check has exactly one result, all passed.
    ``fail``: any result failed or errored (whatever the state).
    ``incomplete``: otherwise (skips, missing results, duplicates, unplanned results, a run that did not
    finish). Reasons: the state first when it is not finished, then one line per planned check that did
    not pass ("kernels.compile: skipped: needs a CUDA device"), in plan order, then unplanned results.
    """
    by_id: dict[str, list[CheckResult]] = {}
    for r in results:
        by_id.setdefault(r.id, []).append(r)
    reasons: list[str] = []
    if state == RUNNING:
        reasons.append(RUNNING_REASON)
    elif state == INTERRUPTED:
        reasons.append(INTERRUPTED_REASON)
    for cid in planned:
        rs = by_id.get(cid, [])
        if not rs:
            reasons.append(f"{cid}: missing: no result recorded")
        elif len(rs) > 1:
            reasons.append(f"{cid}: {len(rs)} results (expected exactly one): "
                           + ", ".join(r.status for r in rs))
        elif rs[0].status != PASSED:
            reasons.append(f"{cid}: {rs[0].status}: {rs[0].reason}")
    planned_set = set(planned)
    for cid, rs in by_id.items():
        if cid not in planned_set:
            reasons.append(f"{cid}: not a planned check of this tier ({', '.join(r.status for r in rs)})")
    if any(r.status in ("failed", "error") for r in results):
        return FAIL, reasons
    if reasons:
        return INCOMPLETE, reasons
    return PASS, []


def read_state(manifest: dict, results: Sequence[CheckResult]) -> dict:
    """The manifest as every reader shows it (``verify``, ``show``, ``render``, ``compare``): a running
    bundle's placeholder verdict replaced by the one its results give (``compute_verdict``), so a killed
    run reads the same everywhere. A finished or interrupted manifest is returned as it is (``verify``
    checks that its verdict follows from the results)."""
    if manifest.get("state") != RUNNING or not isinstance(manifest.get("planned_checks"), list):
        return manifest
    verdict, reasons = compute_verdict(manifest["planned_checks"], results, RUNNING)
    return dict(manifest, verdict=verdict, verdict_reasons=reasons)


# ---------------------------------------------------------------- summary.md
def verdict_line(verdict: str) -> str:
    """The line of summary.md the verifier checks against the manifest."""
    return f"Verdict: **{verdict}**"


def _cell(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        s = json.dumps(v)
    elif isinstance(v, float):
        s = f"{v:.6g}"
    elif isinstance(v, dict) and isinstance(v.get("name"), str):  # a model, an engine: say which
        digest = v.get("digest")
        s = v["name"] + (f" @ {digest[:12]}" if isinstance(digest, str) else "") + f" {{{len(v)} keys}}"
    elif isinstance(v, (dict, list)):
        s = f"{{{len(v)} keys}}" if isinstance(v, dict) else f"[{len(v)} items]"
    else:
        s = str(v)
    s = " ".join(s.split()).replace("|", "\\|")
    return s if len(s) <= 80 else s[:77] + "..."


def render_summary(manifest: dict, results: Sequence[CheckResult], max_metrics_per_check: int = 20) -> str:
    """summary.md: the verdict, the checks (status, reason, duration), their scalar metrics. Deterministic."""
    m = manifest
    cfg = ", ".join(f"{k}={_cell(v)}" for k, v in sorted(m["config"].items())) or "-"
    engines = ", ".join(e if isinstance(e, str) else json.dumps(e, sort_keys=True) for e in m["engines"]) or "-"
    out = [
        f"# {m['tool']['name']} result bundle: tier {m['tier']}",
        "",
        verdict_line(m["verdict"]),
        "",
        f"- state: {m['state']}",
        f"- tool: {m['tool']['name']} {m['tool']['version']}",
        f"- command: `{' '.join(m['argv'])}`",
        f"- engines: {engines}",
        f"- config: {cfg}",
        f"- seeds: {', '.join(f'{k}={_cell(v)}' for k, v in sorted(m['seeds'].items())) or '-'}",
        f"- started: {m['started_at']}, ended: {m['ended_at'] or '-'}",
        "",
    ]
    if m["verdict_reasons"]:
        out += ["## Why not pass", ""] + [f"- {' '.join(r.split())}" for r in m["verdict_reasons"]] + [""]
    by_id = {r.id: r for r in results}
    order = list(m["planned_checks"]) + [r.id for r in results if r.id not in set(m["planned_checks"])]
    out += ["## Checks", "", "| check | status | reason | duration (s) |", "|---|---|---|---|"]
    for cid in dict.fromkeys(order):
        r = by_id.get(cid)
        if r is None:
            out.append(f"| {cid} | missing | no result recorded | - |")
        else:
            out.append(f"| {cid} | {r.status} | {_cell(r.reason)} | {r.duration_s:.3f} |")
    rows = []
    for r in results:
        for k, v in list(r.metrics.items())[:max_metrics_per_check]:
            rows.append(f"| {r.id} | {_cell(k)} | {_cell(v)} |")
    if rows:
        out += ["", "## Key metrics", "", "| check | metric | value |", "|---|---|---|"] + rows
    return "\n".join(out) + "\n"
