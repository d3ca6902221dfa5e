"""``verify_bundle``: check a result bundle (directory or .tar.gz) offline, without a GPU.

What it checks, in order (``bundles/FORMAT.md`` is the contract):

1. the input is a directory or a gzip'd tar whose members are plain files at safe relative paths
   (no absolute paths, no '..', no links or devices, no duplicates), holding a manifest.json that is
   JSON with a supported ``schema_version``: otherwise exit 2, one line;
2. SHA256SUMS: every listed file exists and its (sealed prefix) hash matches, nothing unlisted is
   present; a *running* bundle may carry unsealed tails and unsealed files, which are noted and ignored;
3. the manifest schema, every results.jsonl line a valid ``CheckResult``, every record a JSON object,
   results only for planned checks and at most one each, artifacts present and hashed;
4. the verdict recomputed from the results and the state equals the manifest's (and summary.md's);
5. registered rescorers re-derive what they can from the raw records;
6. a signature (``attestation.dsse.json``, ``verify/bundle/attestation.py``) covers exactly these files and
   verifies, by a key in ``trusted_keys`` when given; an unsigned bundle gets the note "unsigned".

Exit codes (the CLI passes them through): 0 valid, whatever the verdict; 1 the bundle does not verify
(tampered, truncated, inconsistent); 2 the input is not a readable bundle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tarfile
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify.bundle.schema import (
    ATTESTATION,
    INCOMPLETE,
    MANIFEST,
    RECORDS_DIR,
    RESULTS,
    RUNNING,
    RUNNING_REASON,
    SUMMARY,
    SUMS,
    BundleError,
    compute_verdict,
    is_append_only,
    is_stream_name,
    is_writer_temp,
    manifest_header_problem,
    manifest_problems,
    parse_sums,
    parts_problems,
    sha256_file,
    verdict_line,
    walk_bundle,
)
from verify.provenance import commit_problem
from verify.result import STATUSES, CheckResult, is_bundle_relpath

EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2
MAX_EXTRACT_BYTES = 8 << 30  # a bundle is JSON, JSONL, logs and small plots; refuse gzip bombs
_MAX_LINE_PROBLEMS = 3  # per file: the first few bad lines, then a count

Records = Mapping[str, list]  # stream name -> its sealed records (JSON objects), in order
Rescorer = Callable[[Records, CheckResult], Sequence[str]]
_RESCORERS: list[tuple[str, Rescorer]] = []


def register_rescorer(check_id_prefix: str, fn: Rescorer) -> Rescorer:
    """Have ``verify_bundle`` call ``fn(records, result)`` for every result whose id starts with
    ``check_id_prefix``; ``fn`` returns problems (one line each; empty when the records back the result).
    ``records`` maps every stream of the bundle to its sealed records. Returns ``fn`` (decorator-friendly)."""
    if not isinstance(check_id_prefix, str) or not callable(fn):
        raise TypeError("register_rescorer(check_id_prefix: str, fn: callable)")
    if (check_id_prefix, fn) not in _RESCORERS:
        _RESCORERS.append((check_id_prefix, fn))
    return fn


def unregister_rescorer(check_id_prefix: str, fn: Rescorer) -> None:
    with contextlib.suppress(ValueError):
        _RESCORERS.remove((check_id_prefix, fn))


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    exit_code: int  # 0 valid, 1 does not verify, 2 unreadable input
    verdict: str | None  # recomputed from the results; None when unreadable
    problems: tuple[str, ...]  # one line each; empty iff ok
    notes: tuple[str, ...] = ()  # tolerated oddities of a running bundle (unsealed tails/files)
    summary: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- input
@contextlib.contextmanager
def open_bundle(path: str | Path) -> Iterator[Path]:
    """Yields the bundle's root directory: ``path`` itself, or a safe extraction of a .tar.gz into a
    temporary directory (removed afterwards). BundleError (exit 2) when neither."""
    p = Path(path)
    if p.is_dir():
        if not (p / MANIFEST).is_file():
            raise BundleError(f"{p}: no {MANIFEST}: not a result bundle directory")
        yield p
        return
    if not p.exists():
        raise BundleError(f"{p}: no such file or directory")
    with open(p, "rb") as f:
        magic = f.read(2)
    if magic != b"\x1f\x8b":
        raise BundleError(f"{p}: not a bundle directory or a .tar.gz (no gzip header)")
    tmp = Path(tempfile.mkdtemp(prefix="k3-bundle-"))
    try:
        yield _extract(p, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract(archive: Path, dest: Path) -> Path:
    total = 0
    seen: set[str] = set()
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for m in tar:
                name = m.name
                while name.startswith("./"):
                    name = name[2:]
                name = name.rstrip("/")
                if m.isdir() and name in ("", "."):
                    continue
                if m.name.startswith("/") or not is_bundle_relpath(name):
                    raise BundleError(f"{archive}: unsafe archive member path {m.name!r}")
                if m.isdir():
                    (dest / name).mkdir(parents=True, exist_ok=True)
                    continue
                if not m.isfile():
                    kind = "link" if (m.issym() or m.islnk()) else "special file"
                    raise BundleError(f"{archive}: archive member {m.name!r} is a {kind}; bundles hold regular files only")
                if name in seen:
                    raise BundleError(f"{archive}: archive member {name!r} appears twice")
                seen.add(name)
                total += m.size
                if total > MAX_EXTRACT_BYTES:
                    raise BundleError(f"{archive}: more than {MAX_EXTRACT_BYTES >> 30} GiB uncompressed")
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                with src, open(target, "xb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except BundleError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise BundleError(f"{archive}: not a readable .tar.gz ({type(e).__name__}: {' '.join(str(e).split())})") from None
    if (dest / MANIFEST).is_file():
        return dest
    tops = list(dest.iterdir())
    if len(tops) == 1 and tops[0].is_dir() and (tops[0] / MANIFEST).is_file():
        return tops[0]
    raise BundleError(f"{archive}: no {MANIFEST} in the archive (at its top or in its one top-level directory)")


# ---------------------------------------------------------------- verification
# (check id prefix, "module:function"): the rescorers kept beside their checks' code, resolved when a bundle
# is verified (nothing registers itself on import; each module is cheap to import: no torch). Every other
# check's rescorer is ``status_rules.rescore`` over its rule in ``status_rules.RULES``.
BUILTIN_RESCORERS = (("perf.decode_sweep", "verify.checks.perf:rescore_decode_sweep"),
                     ("evals.", "verify.evals.rescore:rescore_eval"),
                     ("likelihood.", "verify.evals.likelihood:rescore"))


def load_builtin_rescorers() -> None:
    """Register the rescorers of every check that has one, so each caller of ``verify_bundle`` (the CLI,
    ``bundle compare``, tests) re-derives the same things from the raw records."""
    import importlib

    from verify.checks import status_rules

    for prefix, target in BUILTIN_RESCORERS:
        module, _, fn = target.partition(":")
        register_rescorer(prefix, getattr(importlib.import_module(module), fn))
    for check_id in status_rules.RULES:  # reference.*, weights.roundtrip, kernels.*: status from the records
        register_rescorer(check_id, status_rules.rescore)


def verify_bundle(path: str | Path, *, rescorers: Sequence[tuple[str, Rescorer]] | None = None,
                  repo: str | Path | None = None, trusted_keys: str | Path | None = None) -> VerifyReport:
    """Verify a bundle directory or .tar.gz. ``rescorers`` replaces the registered ones (tests); without it
    the built-in ones (``BUILTIN_RESCORERS``) are loaded first. With ``repo`` (a git repository) the commit
    the bundle names must hold the sources that ran (``verify.provenance.commit_problem``); with
    ``trusted_keys`` (a keys file, ``verify.bundle.signing``) the bundle must be signed by one of them."""
    if rescorers is None:
        load_builtin_rescorers()
    try:
        keys = None
        if trusted_keys is not None:
            from verify.bundle.attestation import load_public_keys

            keys = load_public_keys(Path(trusted_keys))
        with open_bundle(path) as root:
            return _verify_root(root, list(_RESCORERS if rescorers is None else rescorers), repo, keys)
    except BundleError as e:
        return VerifyReport(ok=False, exit_code=e.exit_code, verdict=None, problems=(str(e),))


def _lines(data: bytes, where: str, problems: list[str]) -> list[tuple[int, Any]]:
    """(line number, parsed JSON) for each line of sealed JSONL bytes; bad lines become problems."""
    if data and not data.endswith(b"\n"):
        problems.append(f"{where}: sealed content ends mid-line")
    out, bad = [], 0
    for i, line in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            out.append((i, json.loads(line)))
        except ValueError as e:
            bad += 1
            if bad <= _MAX_LINE_PROBLEMS:
                problems.append(f"{where} line {i}: not JSON ({' '.join(str(e).split())[:100]})")
    if bad > _MAX_LINE_PROBLEMS:
        problems.append(f"{where}: {bad - _MAX_LINE_PROBLEMS} more lines are not JSON")
    return out


def _read_prefix(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _verify_root(root: Path, rescorers: list[tuple[str, Rescorer]], repo: str | Path | None = None,
                 trusted_keys: Sequence[Any] | None = None) -> VerifyReport:
    problems: list[str] = []
    notes: list[str] = []
    mbytes = (root / MANIFEST).read_bytes()
    try:
        manifest = json.loads(mbytes)
    except ValueError as e:
        raise BundleError(f"{MANIFEST} is not valid JSON ({' '.join(str(e).split())[:120]})") from None
    header = manifest_header_problem(manifest)
    if header:
        raise BundleError(header)
    problems += manifest_problems(manifest)
    schema_ok = not problems
    state = manifest.get("state")

    # -- SHA256SUMS
    files, odd = walk_bundle(root)
    problems += [f"{o}: not a regular file (bundles hold no links or special files)" for o in odd]
    sealed, entries = False, []
    if SUMS in files:
        sealed, entries, sum_problems = parse_sums((root / SUMS).read_bytes())
        problems += sum_problems
    else:
        problems.append(f"{SUMS} missing: no file of the bundle can be checked")
    listed: dict[str, list] = {}
    for e in entries:
        listed.setdefault(e.path, []).append(e)
    msha = hashlib.sha256(mbytes).hexdigest()
    manifest_ok = any(e.sha256 == msha and (e.size is None or e.size == len(mbytes)) for e in listed.get(MANIFEST, []))
    if SUMS not in files:
        pass
    elif MANIFEST not in listed:
        problems.append(f"{MANIFEST}: not listed in {SUMS}")
    elif not manifest_ok:
        problems.append(f"{MANIFEST}: sha256 mismatch")
    running = state == RUNNING and sealed and manifest_ok  # only a vouched-for 'running' relaxes anything
    if state == RUNNING and SUMS in files and not sealed:
        problems.append(f"{SUMS}: a running bundle's sums must be in sealed-prefix form")
    sealed_len: dict[str, int] = {MANIFEST: len(mbytes)} if manifest_ok else {}
    broken: set[str] = set()  # listed files that are missing, truncated or changed (already a problem each)
    on_disk = set(files)
    for rel, es in listed.items():
        if rel == MANIFEST:
            continue
        e, full = es[0], root / rel
        if rel not in on_disk:
            problems.append(f"{rel}: listed in {SUMS} but missing")
            broken.add(rel)
            continue
        size = full.stat().st_size
        want = size if e.size is None else e.size
        if size < want:
            problems.append(f"{rel}: {size} bytes, shorter than its sealed {want} (truncated)")
            broken.add(rel)
            continue
        if sha256_file(full, want)[0] != e.sha256:
            problems.append(f"{rel}: sha256 mismatch")
            broken.add(rel)
            continue
        if size > want:
            if running and is_append_only(rel):
                notes.append(f"{rel}: {size - want} unsealed bytes after the sealed {want} ignored "
                             "(the run stopped mid-write)")
            else:
                problems.append(f"{rel}: {size - want} bytes past its sealed length")
        sealed_len[rel] = want
    for rel in files if SUMS in files else []:
        if rel in (SUMS, ATTESTATION) or rel in listed:
            continue
        if sealed and (running or is_writer_temp(rel)):
            notes.append(f"{rel}: not sealed yet, ignored")
        else:
            problems.append(f"{rel}: not listed in {SUMS} (added after the bundle was sealed?)")

    # -- results and records (sealed bytes only)
    results: list[CheckResult] = []
    results_ok = RESULTS in sealed_len
    if RESULTS in sealed_len:
        rp: list[str] = []
        for i, obj in _lines(_read_prefix(root / RESULTS, sealed_len[RESULTS]), RESULTS, rp):
            try:
                results.append(CheckResult.from_dict(obj))
            except ValueError as e:
                rp.append(f"{RESULTS} line {i}: {e}")
        results_ok = not rp
        problems += rp[: 2 * _MAX_LINE_PROBLEMS] + ([f"{RESULTS}: {len(rp) - 2 * _MAX_LINE_PROBLEMS} more problems"]
                                                    if len(rp) > 2 * _MAX_LINE_PROBLEMS else [])
    elif RESULTS not in listed and SUMS in files:
        problems.append(f"{RESULTS}: not listed in {SUMS}" if RESULTS in on_disk else f"{RESULTS} missing")
    records: dict[str, list] = {}
    for rel in sorted(sealed_len):
        if not rel.startswith(RECORDS_DIR + "/"):
            continue
        stream = rel[len(RECORDS_DIR) + 1:]
        if not (stream.endswith(".jsonl") and is_stream_name(stream[:-6])):
            problems.append(f"{rel}: {RECORDS_DIR}/ holds only <stream>.jsonl files")
            continue
        recs = records.setdefault(stream[:-6], [])
        for i, obj in _lines(_read_prefix(root / rel, sealed_len[rel]), rel, problems):
            if isinstance(obj, dict):
                recs.append(obj)
            else:
                problems.append(f"{rel} line {i}: a record must be a JSON object")

    # -- plan, artifacts, verdict
    counts = Counter(r.status for r in results)
    verdict: str | None = None
    reasons: list[str] = []
    if schema_ok and results_ok:  # a results.jsonl that failed its hash or parse is already the problem
        planned = manifest["planned_checks"]
        per_id = Counter(r.id for r in results)
        for cid, n in per_id.items():
            if cid not in planned:
                problems.append(f"{cid}: result for a check the tier did not plan")
            elif n > 1:
                problems.append(f"{cid}: {n} results (a check has at most one)")
        counts["missing"] = sum(1 for c in planned if c not in per_id)
        problems += parts_problems(manifest, [r.id for r in results])
        verdict, reasons = compute_verdict(planned, results, state)
        if state == RUNNING:
            if manifest["verdict"] != INCOMPLETE or manifest["verdict_reasons"] != [RUNNING_REASON]:
                problems.append(f"{MANIFEST}: a running bundle's verdict must be the placeholder "
                                f"'{INCOMPLETE}' with reason {RUNNING_REASON!r}")
        elif manifest["verdict"] != verdict:
            problems.append(f"verdict: {MANIFEST} says {manifest['verdict']!r} but the results give {verdict!r}")
        elif manifest["verdict_reasons"] != reasons:
            diff = next((r for r in reasons if r not in manifest["verdict_reasons"]), None)
            problems.append(f"verdict_reasons: {MANIFEST} does not list the reasons the results give"
                            + (f" ({diff!r})" if diff else ""))
        if state != RUNNING:
            if SUMMARY not in sealed_len:
                if SUMMARY not in listed:
                    problems.append(f"{SUMMARY} missing")
            elif verdict_line(manifest["verdict"]) not in (root / SUMMARY).read_text("utf-8", "replace").splitlines():
                problems.append(f"{SUMMARY}: no line {verdict_line(manifest['verdict'])!r}")
    for r in results:
        for a in r.artifacts:
            if a not in sealed_len:
                problems.append(f"{r.id}: artifact {a} is not in the bundle's sealed files")
        if f"{RECORDS_DIR}/{r.id}.jsonl" in broken:
            continue  # its records failed their hash: re-scoring what is left would only repeat that problem
        for prefix, fn in rescorers:
            if not r.id.startswith(prefix):
                continue
            try:
                found = list(fn(records, r))
            except Exception as e:  # a broken rescorer is a verification failure, never a pass
                found = [f"rescorer {getattr(fn, '__name__', fn)} raised {type(e).__name__}: {e}"]
            problems += [f"{r.id}: rescore: {' '.join(str(p).split())}" for p in found]

    tool = manifest.get("tool") if isinstance(manifest.get("tool"), dict) else {}
    summary = {
        "schema_version": manifest["schema_version"],
        "tool": f"{tool.get('name', '?')} {tool.get('version', '?')}",
        "tier": manifest.get("tier"),
        "state": state,
        "verdict": verdict,
        "manifest_verdict": manifest.get("verdict"),
        "verdict_reasons": reasons,
        "planned": len(manifest["planned_checks"]) if schema_ok else None,
        "counts": {k: counts.get(k, 0) for k in (*STATUSES, "missing")} if verdict else None,
        "files_verified": len(sealed_len),
        "sums_form": "sealed-prefix" if sealed else "standard",
        "records": {k: len(v) for k, v in sorted(records.items())},
    }
    if ATTESTATION in files or trusted_keys is not None:
        from verify.bundle.attestation import attestation_problems

        sig_problems, sig_notes, summary["signature"] = attestation_problems(root, files, trusted_keys)
        problems += sig_problems
        notes += sig_notes
    else:
        notes.append("unsigned")
    if repo is not None:
        source_problem, confirmed = commit_problem(manifest, repo)
        if source_problem:
            problems.append(f"--repo {repo}: {source_problem}")
        summary["source"] = confirmed or None
    return VerifyReport(ok=not problems, exit_code=EXIT_INVALID if problems else EXIT_OK, verdict=verdict,
                        problems=tuple(problems), notes=tuple(notes), summary=summary)


def render_report(report: VerifyReport) -> str:
    """Plain text of a report (what the snapshot tests compare); no paths outside the bundle appear."""
    if report.exit_code == EXIT_UNREADABLE:
        return f"UNREADABLE (exit 2): {report.problems[0] if report.problems else '?'}\n"
    s = report.summary
    head = "VALID (exit 0)" if report.ok else f"INVALID (exit {report.exit_code}): {len(report.problems)} problem(s)"
    c = s.get("counts")
    out = [
        head,
        f"verdict: {report.verdict or 'not computed (results did not verify)'} (manifest: {s.get('manifest_verdict')})",
        f"tier: {s.get('tier')}, state: {s.get('state')}, tool: {s.get('tool')}, schema_version: {s.get('schema_version')}",
        f"checks: {s.get('planned')} planned: "
        + (", ".join(f"{c.get(k, 0)} {k}" for k in (*STATUSES, "missing")) if c else "results not verified"),
        f"files: {s.get('files_verified')} verified against {SUMS} ({s.get('sums_form')} form)",
        "records: " + (", ".join(f"{k}={v}" for k, v in s.get("records", {}).items()) or "none"),
    ]
    for title, items in (("why not pass", s.get("verdict_reasons") or []), ("problems", report.problems),
                         ("notes", report.notes)):
        if items:
            out.append(f"{title}:")
            out += [f"  - {x}" for x in items]
    return "\n".join(out) + "\n"
