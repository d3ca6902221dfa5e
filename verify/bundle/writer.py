"""``BundleWriter``: streams a run into a result bundle that verifies at every instant.

The bundle (``bundles/FORMAT.md``) appears atomically: the first manifest, an empty results.jsonl and a
SHA256SUMS are written into a hidden sibling directory, which is then renamed onto ``root``. From then
on every change keeps the directory valid even if the process is SIGKILLed between any two syscalls:

1. ``record`` / ``add_result`` / ``log`` append one line to an append-only file (results.jsonl,
   records/<stream>.jsonl, logs/run.log) with unbuffered ``os.write``;
2. then rewrite SHA256SUMS atomically (temp file + ``os.replace``) in *sealed-prefix* form: for each
   append-only file, the SHA-256 of its first N bytes (kept incrementally, so a record costs O(its size)).

A kill between 1 and 2 leaves bytes past the sealed length: the verifier ignores that unsealed tail
while the manifest says ``running``. ``finalize`` (or leaving the ``with`` block) truncates unsealed
tails, writes summary.md, swaps in the final manifest in two sealed steps (SHA256SUMS lists the old and
the new manifest hash for the instant between), writes SHA256SUMS in standard ``sha256sum -c`` form and
then ``<root>.tar.gz`` (deterministic: sorted entries, mtime 0, uid/gid 0).

Durability: data reaches the OS page cache before each seal (a killed process loses nothing sealed);
files are fsynced only at finalize, so only a finalized bundle is guaranteed to survive a power cut.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import signal
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from verify.bundle.schema import (
    ARTIFACTS_DIR,
    ATTESTATION,
    FINISHED,
    INTERRUPTED,
    MANIFEST,
    RECORDS_DIR,
    RESULTS,
    RUN_LOG,
    RUNNING,
    SUMMARY,
    SUMS,
    TOOL_NAME,
    BundleError,
    SumEntry,
    build_manifest,
    compute_verdict,
    dumps_doc,
    dumps_line,
    format_sums,
    is_append_only,
    is_stream_name,
    is_writer_temp,
    render_summary,
    sha256_file,
    walk_bundle,
)
from verify.result import CheckResult, is_bundle_relpath, is_check_id, json_value, utc_now

# Test-only: called with a label at every point where a kill would leave a distinct on-disk state
# (tests/test_bundle.py SIGKILLs the process at each of them in turn).
_crash_hook: Callable[[str], None] | None = None


def _crash(point: str) -> None:
    if _crash_hook is not None:
        _crash_hook(point)


def tarball_path(root: Path) -> Path:
    """``<dir>.tar.gz`` next to the bundle directory."""
    root = Path(root)
    return root.with_name(root.name + ".tar.gz")


def write_tarball(root: Path, dest: Path | None = None) -> Path:
    """A deterministic tar.gz of ``root`` (members ``<dirname>/<path>``, regular files only, sorted,
    mtime 0, uid/gid 0, mode 0644, gzip header without name or time). Atomic: temp + rename."""
    root = Path(root)
    dest = Path(dest) if dest else tarball_path(root)
    files, odd = walk_bundle(root)
    if odd:
        raise BundleError(f"{root}: {odd[0]} is not a regular file; a bundle holds regular files only", 1)
    tmp = dest.with_name(f".{dest.name}.tmp")
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for rel in files:
                    path = root / rel
                    info = tarfile.TarInfo(f"{root.name}/{rel}")
                    info.size = path.stat().st_size
                    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
        raw.flush()
        os.fsync(raw.fileno())
    _crash("tar:temp")
    os.replace(tmp, dest)
    return dest


def _sum_entries(root: Path) -> list[SumEntry]:
    from verify.bundle.schema import parse_sums

    _, entries, problems = parse_sums((root / SUMS).read_bytes())
    if problems:
        raise BundleError(f"{root}: {problems[0]}", 1)
    return entries


def _results(root: Path, sealed_len: int | None) -> list[CheckResult]:
    import json

    data = (root / RESULTS).read_bytes()
    data = data if sealed_len is None else data[:sealed_len]
    return [CheckResult.from_dict(json.loads(line)) for line in data.splitlines() if line.strip()]


def sealed_results(root: str | os.PathLike) -> list[CheckResult]:
    """The results in the sealed part of a bundle's results.jsonl (what ``BundleWriter.resume`` keeps)."""
    root = Path(root)
    size = next((e.size for e in _sum_entries(root) if e.path == RESULTS), None)
    return _results(root, size)


class BundleWriter:
    """Writes one run's bundle under ``root`` (which must not exist, or be an empty directory).

    ``planned_checks`` are the tier's check ids in order; ``engines`` a list of names (or objects);
    ``config``, ``seeds`` and ``env`` JSON objects recorded as given. ``now`` returns ISO-8601 UTC
    timestamps (defaults to the clock; the golden bundle passes a fixed one).
    """

    def __init__(self, root: str | os.PathLike, *, tool_version: str, argv: Sequence[str], tier: str,
                 planned_checks: Sequence[str], engines: Sequence[Any], config: Mapping[str, Any],
                 seeds: Mapping[str, Any], env: Mapping[str, Any], tool_name: str = TOOL_NAME,
                 now: Callable[[], str] | None = None, part: Mapping[str, Any] | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        self.tarball = tarball_path(self.root)
        self._now = now or utc_now
        self._lock = threading.RLock()
        planned = list(planned_checks)
        bad = [c for c in planned if not is_check_id(c)]
        if bad:
            raise ValueError(f"planned check id {bad[0]!r} is not a valid check id")
        if len(set(planned)) != len(planned):
            raise ValueError("planned_checks lists a check twice")
        self._planned = planned
        self._manifest = build_manifest(
            tool_version=tool_version, argv=[str(a) for a in argv], tier=tier, planned_checks=planned,
            engines=list(engines), config=dict(config), seeds=dict(seeds), env=dict(env),
            started_at=self._now(), tool_name=tool_name)
        if part is not None:  # the run's first part (``resume`` appends the later ones)
            self._manifest["parts"] = [json_value(dict(part, started_at=self._manifest["started_at"]), "part")]
        self._results: list[CheckResult] = []
        self._seals: dict[str, tuple[Any, int]] = {}  # append-only path -> (sha256 of sealed prefix, length)
        self._whole: dict[str, SumEntry] = {}  # whole files sealed so far (manifest, artifacts of results)
        self._fds: dict[str, int] = {}
        self.state = RUNNING
        self.verdict: str | None = None
        self.verdict_reasons: list[str] | None = None
        self._refuse_existing()
        self._create()

    @classmethod
    def resume(cls, root: str | os.PathLike, part: Mapping[str, Any],
               now: Callable[[], str] | None = None) -> BundleWriter:
        """Reopen an unfinished bundle (state ``running`` or ``interrupted``) to run its remaining checks as a
        new part: unsealed tails are dropped, summary.md and the tarball removed (finalize writes them again),
        and a signature removed (it covered the bundle as it was),
        the manifest goes back to ``running`` with ``part`` appended to ``parts``. The caller checks first
        that the bundle verifies and that the part may join it (``verify.runner``); BundleError otherwise."""
        import json

        from verify.bundle.schema import RUNNING_REASON

        self = cls.__new__(cls)
        self.root = Path(os.path.abspath(root))
        self.tarball = tarball_path(self.root)
        self._now = now or utc_now
        self._lock = threading.RLock()
        manifest = json.loads((self.root / MANIFEST).read_bytes())
        if manifest.get("state") not in (RUNNING, INTERRUPTED):
            raise BundleError(f"{self.root}: state {manifest.get('state')!r}: only a running or interrupted "
                              "bundle can be resumed")
        entries = _sum_entries(self.root)
        self._planned = list(manifest["planned_checks"])
        self._seals, self._whole, self._fds = {}, {}, {}
        for e in entries:
            if e.path in (MANIFEST, SUMMARY):
                continue
            path = self.root / e.path
            size = e.size if e.size is not None else path.stat().st_size
            if is_append_only(e.path):
                with open(path, "r+b") as f:
                    f.truncate(size)  # an unsealed tail of the killed part
                h = hashlib.sha256((self.root / e.path).read_bytes())
                self._seals[e.path] = (h, size)
            else:
                self._whole[e.path] = SumEntry(e.path, e.sha256, size)
        self._seals.setdefault(RESULTS, (hashlib.sha256(), 0))
        self._results = _results(self.root, self._seals[RESULTS][1])
        for name in os.listdir(self.root):
            if is_writer_temp(name):
                os.unlink(self.root / name)
        for stale in (self.root / SUMMARY, self.root / ATTESTATION, self.tarball):  # a signature of the old part too
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        parts = list(manifest.get("parts") or [])
        parts.append(json_value(dict(part, started_at=self._now()), "part"))
        self._manifest = dict(manifest, state=RUNNING, ended_at=None, verdict="incomplete",
                              verdict_reasons=[RUNNING_REASON], parts=parts)
        mdata = dumps_doc(self._manifest)
        new_m = SumEntry(MANIFEST, hashlib.sha256(mdata).hexdigest(), len(mdata))
        old = (self.root / MANIFEST).read_bytes()
        old_m = SumEntry(MANIFEST, hashlib.sha256(old).hexdigest(), len(old))
        self.state = RUNNING
        self.verdict = None
        self.verdict_reasons = None
        self._atomic_write(SUMS, self._sealed_sums(pending_manifest=old_m), "resume:old")
        self._whole[MANIFEST] = old_m
        self._atomic_write(SUMS, self._sealed_sums(pending_manifest=new_m), "resume:pending")
        self._atomic_write(MANIFEST, mdata, "resume:manifest")
        self._whole[MANIFEST] = new_m
        self._seal()
        return self

    @property
    def done_checks(self) -> tuple[str, ...]:
        """Ids of the checks that already have a result (skipped by a resumed run)."""
        return tuple(r.id for r in self._results)

    # ------------------------------------------------------------ creation
    def _refuse_existing(self) -> None:
        r = self.root
        if r.is_symlink() or (r.exists() and not r.is_dir()):
            raise BundleError(f"refusing to write a bundle at {r}: it exists and is not a directory")
        if r.is_dir() and any(r.iterdir()):
            raise BundleError(f"refusing to write a bundle into {r}: the directory exists and is not empty "
                              "(pick a new output directory)")
        if self.tarball.exists():
            raise BundleError(f"refusing to write a bundle at {r}: {self.tarball} already exists")

    def _create(self) -> None:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.root.name}.", suffix=".partial", dir=self.root.parent))
        try:
            os.chmod(staging, 0o755)
            data = dumps_doc(self._manifest)
            (staging / MANIFEST).write_bytes(data)
            (staging / RESULTS).write_bytes(b"")
            self._whole[MANIFEST] = SumEntry(MANIFEST, hashlib.sha256(data).hexdigest(), len(data))
            self._seals[RESULTS] = (hashlib.sha256(), 0)
            (staging / SUMS).write_bytes(self._sealed_sums())
            _crash("create:staged")
            try:
                os.rename(staging, self.root)  # atomic; replaces an empty directory on POSIX
            except OSError:
                if self.root.is_dir() and not any(self.root.iterdir()):
                    os.rmdir(self.root)
                    os.rename(staging, self.root)
                else:
                    raise
        except BaseException:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
            raise
        _crash("create:done")

    # ------------------------------------------------------------ sealing
    def _sealed_sums(self, pending_manifest: SumEntry | None = None) -> bytes:
        entries = [SumEntry(p, h.hexdigest(), n) for p, (h, n) in self._seals.items()]
        entries += list(self._whole.values())
        if pending_manifest is not None:
            entries.append(pending_manifest)
        return format_sums(entries, sealed=True)

    def _atomic_write(self, name: str, data: bytes, label: str, fsync: bool = False) -> None:
        tmp = self.root / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        _crash(f"{label}:temp")
        os.replace(tmp, self.root / name)
        _crash(label)

    def _seal(self) -> None:
        self._atomic_write(SUMS, self._sealed_sums(), "seal")

    def _append(self, rel: str, data: bytes) -> None:
        if self.state != RUNNING:
            raise BundleError(f"{self.root}: the bundle is already finalized ({self.state}); cannot write {rel}", 1)
        fd = self._fds.get(rel)
        if fd is None:
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._fds[rel] = fd
            self._seals.setdefault(rel, (hashlib.sha256(), 0))
            _crash("append:created")
        h, n = self._seals[rel]
        size = os.fstat(fd).st_size
        if size < n:
            raise BundleError(f"{self.root / rel} shrank below its sealed length ({size} < {n} bytes)", 1)
        try:
            if size > n:  # an earlier append was cut off after its write: drop the unsealed bytes
                os.ftruncate(fd, n)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            with contextlib.suppress(OSError):  # never leave a torn line under later sealed data
                os.ftruncate(fd, n)
            raise
        _crash("append:written")
        h2 = h.copy()
        h2.update(data)
        self._seals[rel] = (h2, n + len(data))  # one assignment: the in-memory seal is never half-updated
        self._seal()

    # ------------------------------------------------------------ public API
    def record(self, stream: str, obj: Mapping[str, Any]) -> None:
        """Append one raw record (a JSON object) to ``records/<stream>.jsonl``; on disk and sealed on return."""
        if not is_stream_name(stream):
            raise ValueError(f"record stream {stream!r} is not a valid name (letters, digits, _ . - : [ ] = , +)")
        if not isinstance(obj, Mapping):
            raise ValueError(f"a record must be a JSON object (a dict), got {type(obj).__name__}")
        line = dumps_line(json_value(obj, f"record for {stream}"))
        with self._lock:
            self._append(f"{RECORDS_DIR}/{stream}.jsonl", line)

    def add_result(self, result: CheckResult) -> None:
        """Append one check's result to results.jsonl, sealing the artifacts it names in the same step."""
        if not isinstance(result, CheckResult):
            raise TypeError(f"add_result takes a CheckResult, got {type(result).__name__}")
        with self._lock:
            if result.id not in self._planned:
                raise ValueError(f"{result.id}: not a planned check of tier {self._manifest['tier']!r}")
            if any(r.id == result.id for r in self._results):
                raise ValueError(f"{result.id}: a result was already added")
            for rel in result.artifacts:
                self._seal_artifact(result.id, rel)
            self._append(RESULTS, dumps_line(result.to_dict()))
            self._results.append(result)

    def _seal_artifact(self, check_id: str, rel: str) -> None:
        if rel in (MANIFEST, SUMS, SUMMARY, RESULTS) or is_writer_temp(rel):
            raise ValueError(f"{check_id}: artifact {rel!r} names a file the bundle itself owns")
        if is_append_only(rel):
            if rel not in self._seals:
                raise ValueError(f"{check_id}: artifact {rel!r} was never written")
            return
        path = self.root / rel
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"{check_id}: artifact {rel!r} is not a regular file in the bundle "
                             "(write it at writer.artifact_path(name) first)")
        sha, size = sha256_file(path)
        self._whole[rel] = SumEntry(rel, sha, size)

    def log(self, text: str) -> None:
        """Append a timestamped entry to logs/run.log."""
        text = str(text)
        with self._lock:
            self._append(RUN_LOG, f"{self._now()} {text}{'' if text.endswith(chr(10)) else chr(10)}".encode())

    def artifact_path(self, name: str) -> Path:
        """Where to write artifact ``name`` (``artifacts/<name>``; parents created). Reference it in a
        result as ``f"artifacts/{name}"``; it is sealed when that result is added (and at finalize)."""
        if not is_bundle_relpath(name):
            raise ValueError(f"artifact name {name!r} must be a relative path without '..'")
        path = self.root / ARTIFACTS_DIR / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def results(self) -> tuple[CheckResult, ...]:
        return tuple(self._results)

    # ------------------------------------------------------------ finalize
    def finalize(self, state: str = FINISHED) -> str:
        """Seal the bundle as ``finished`` or ``interrupted`` and write the tarball; returns the verdict.
        A second call returns the verdict of the first."""
        if state not in (FINISHED, INTERRUPTED):
            raise ValueError(f"finalize state must be {FINISHED!r} or {INTERRUPTED!r}, got {state!r}")
        with self._lock:
            if self.state != RUNNING:
                return self.verdict
            for rel, fd in list(self._fds.items()):  # drop any unsealed tail, then close
                os.ftruncate(fd, self._seals[rel][1])
                os.close(fd)
                del self._fds[rel]
            _crash("finalize:truncated")
            verdict, reasons = compute_verdict(self._planned, self._results, state)
            ended = self._now()
            final = dict(self._manifest, ended_at=ended, state=state, verdict=verdict, verdict_reasons=reasons)
            if final.get("parts"):
                final["parts"] = [*final["parts"][:-1], dict(final["parts"][-1], ended_at=ended, state=state)]
            mdata = dumps_doc(final)
            for name in os.listdir(self.root):
                if is_writer_temp(name):
                    os.unlink(self.root / name)
            self._atomic_write(SUMMARY, render_summary(final, self._results).encode(), "finalize:summary",
                               fsync=True)
            files, odd = walk_bundle(self.root)
            if odd:
                raise BundleError(f"{self.root}: {odd[0]} is not a regular file; a bundle holds regular files only", 1)
            entries = []
            for rel in files:
                if rel == SUMS:
                    continue
                sha, size = sha256_file(self.root / rel)
                entries.append(SumEntry(rel, sha, size))
                fd = os.open(self.root / rel, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            new_m = SumEntry(MANIFEST, hashlib.sha256(mdata).hexdigest(), len(mdata))
            # the instant between the two files: SHA256SUMS vouches for the old and the new manifest
            self._atomic_write(SUMS, format_sums(entries + [new_m], sealed=True), "finalize:pending", fsync=True)
            self._atomic_write(MANIFEST, mdata, "finalize:manifest", fsync=True)
            final_entries = [SumEntry(e.path, e.sha256) for e in entries if e.path != MANIFEST]
            final_entries.append(SumEntry(MANIFEST, new_m.sha256))
            self._atomic_write(SUMS, format_sums(final_entries, sealed=False), "finalize:sums", fsync=True)
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._manifest = final
            self.state, self.verdict, self.verdict_reasons = state, verdict, reasons
            write_tarball(self.root, self.tarball)
            _crash("finalize:done")
            return verdict

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.state != RUNNING:
            return False
        if exc_type is None:
            self.finalize(FINISHED)
            return False
        try:
            self.finalize(INTERRUPTED)
        except BaseException as e2:  # keep the original exception; say why the bundle stayed 'running'
            if hasattr(exc, "add_note"):
                exc.add_note(f"the bundle at {self.root} could not be finalized ({type(e2).__name__}: {e2}); "
                             "it stays a valid 'running' bundle")
        return False


class Terminated(KeyboardInterrupt):
    """SIGTERM delivered as an exception, so ``with BundleWriter(...)`` finalizes as ``interrupted``."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"received signal {signum}")


def install_sigterm_handler() -> Any:
    """Make SIGTERM raise ``Terminated`` (a KeyboardInterrupt) in the main thread; returns the previous
    handler (pass it to ``signal.signal`` to restore). A no-op returning None outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def handle_sigterm() -> Iterator[None]:
    """``with handle_sigterm(), BundleWriter(...) as w:`` — SIGTERM interrupts the run like Ctrl-C."""
    prev = install_sigterm_handler()
    try:
        yield
    finally:
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)
