"""Result bundles: the golden example, tampered copies of it, garbage input, crash safety, verdict rules.

The verifier's report on the golden bundle and on each tampered copy is compared with a snapshot under
tests/snapshots/ (``K3_UPDATE_SNAPSHOTS=1`` rewrites them). Crash safety is tested by SIGKILLing a writer:
at every crash point of a small run (fork, the writer's test hook kills itself) and at random moments of
a long run in a subprocess. Every such bundle must verify (exit 0) as ``running``/``incomplete``, or as
finalized when the kill came after finalize.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import make_golden_bundle as golden
import pytest

from verify.bundle import schema
from verify.bundle import writer as writer_mod
from verify.bundle.schema import SumEntry, compute_verdict, format_sums, sha256_file, walk_bundle
from verify.bundle.show import load_bundle, show_bundle
from verify.bundle.verify import register_rescorer, render_report, unregister_rescorer, verify_bundle
from verify.bundle.writer import BundleWriter, write_tarball
from verify.result import CheckResult

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
GOLDEN = golden.GOLDEN


def snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"bundle_{name}.txt"
    if os.environ.get("K3_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}; run with K3_UPDATE_SNAPSHOTS=1 to write it"
    assert text == path.read_text(), f"report differs from {path} (K3_UPDATE_SNAPSHOTS=1 rewrites it)"


def reseal(root: Path) -> None:
    """What a forger does: recompute SHA256SUMS (standard form) over the directory as it is now."""
    files, _ = walk_bundle(root)
    entries = [SumEntry(f, sha256_file(root / f)[0]) for f in files if f != schema.SUMS]
    (root / schema.SUMS).write_bytes(format_sums(entries, sealed=False))


def edit_results(root: Path, check_id: str, **changes) -> None:
    path = root / schema.RESULTS
    lines = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d["id"] == check_id:
            d.update(changes)
        lines.append(json.dumps(d, separators=(",", ":")))
    path.write_text("\n".join(lines) + "\n")


def tar_dir(root: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    return dest


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A fresh copy of the golden bundle directory."""
    dst = tmp_path / "golden-smoke"
    shutil.copytree(GOLDEN, dst)
    return dst


def small_writer(root: Path, planned=("a.one", "a.two", "a.three"), **kw) -> BundleWriter:
    args = dict(tool_version="0.0.0", argv=["k3-verify", "run"], tier="t", planned_checks=list(planned),
                engines=["builtin:reference"], config={"preset": "k3-tiny"}, seeds={"global": 0}, env={"gpu": None})
    args.update(kw)
    return BundleWriter(root, **args)


# ------------------------------------------------------------------ the golden bundle
def test_golden_is_reproducible(tmp_path: Path) -> None:
    out = golden.make_golden_bundle(tmp_path / "golden-smoke")
    files, _ = walk_bundle(out)
    assert files == walk_bundle(GOLDEN)[0]
    for f in files:
        assert (out / f).read_bytes() == (GOLDEN / f).read_bytes(), f"{f} differs: rerun tests/make_golden_bundle.py"
    # same tar bytes; the gzip stream itself depends on the zlib build
    new, committed = out.with_name("golden-smoke.tar.gz"), GOLDEN.with_name("golden-smoke.tar.gz")
    assert gzip.decompress(new.read_bytes()) == gzip.decompress(committed.read_bytes())


def test_golden_report_snapshot() -> None:
    report = verify_bundle(GOLDEN)
    assert report.ok and report.exit_code == 0 and report.verdict == "incomplete"
    assert report.problems == () and report.notes == ("unsigned",)
    snapshot("golden", render_report(report))


def test_golden_tarball_verifies_identically() -> None:
    d, t = verify_bundle(GOLDEN), verify_bundle(GOLDEN.with_name("golden-smoke.tar.gz"))
    assert t == d and render_report(t) == render_report(d)


def test_golden_show() -> None:
    info = show_bundle(GOLDEN)
    assert info["manifest"]["tier"] == "smoke" and info["manifest"]["verdict"] == "incomplete"
    assert [r["status"] for r in info["results"]] == ["passed", "passed", "passed", "skipped"]
    assert info["counts"] == {"passed": 3, "failed": 0, "skipped": 1, "error": 0, "missing": 0}
    assert info["records"] == {"reference.determinism": 1, "reference.prefill_decode_consistency": 4,
                               "weights.roundtrip": 4}
    assert show_bundle(GOLDEN.with_name("golden-smoke.tar.gz")) == info
    assert len(load_bundle(GOLDEN).results) == 4


# ------------------------------------------------------------------ tampered copies -> exit 1
def _flip_record_byte(root: Path) -> None:
    p = root / "records/reference.determinism.jsonl"
    data = bytearray(p.read_bytes())
    data[data.index(b"203")] = ord("9")
    p.write_bytes(bytes(data))


def _skip_to_passed(root: Path) -> None:
    edit_results(root, "kernels.numerics", status="passed", reason="")


def _forge_pass_everywhere(root: Path) -> None:
    _skip_to_passed(root)
    m = json.loads((root / schema.MANIFEST).read_text())
    m.update(verdict="pass", verdict_reasons=[])
    (root / schema.MANIFEST).write_bytes(schema.dumps_doc(m))
    reseal(root)


TAMPERS = {
    "record_byte": _flip_record_byte,
    "file_added": lambda r: (r / "artifacts" / "extra.txt").write_text("hi\n"),
    "record_file_removed": lambda r: (r / "records/reference.prefill_decode_consistency.jsonl").unlink(),
    "summary_removed": lambda r: (r / schema.SUMMARY).unlink(),
    "sums_removed": lambda r: (r / schema.SUMS).unlink(),
    "result_passed": _skip_to_passed,
    "result_passed_resealed": lambda r: (_skip_to_passed(r), reseal(r)),
    "manifest_pass_resealed": lambda r: (_forge_pass_everywhere(r), (r / schema.SUMMARY).unlink(), reseal(r)),
    "summary_edited_resealed": lambda r: ((r / schema.SUMMARY).write_text(
        (r / schema.SUMMARY).read_text().replace("**incomplete**", "**pass**")), reseal(r)),
    "artifact_removed_resealed": lambda r: ((r / "artifacts/reference.determinism/tokens.csv").unlink(), reseal(r)),
    "bad_result_line_resealed": lambda r: (edit_results(r, "weights.roundtrip", duration_s=-1), reseal(r)),
    "symlink_added": lambda r: os.symlink("/etc/passwd", r / "artifacts" / "link"),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_tampered_copy_fails(bundle: Path, tmp_path: Path, name: str) -> None:
    TAMPERS[name](bundle)
    report = verify_bundle(bundle)
    assert report.exit_code == 1 and not report.ok and report.problems
    snapshot(f"tampered_{name}", render_report(report))
    if name != "symlink_added":  # the same bytes in a tarball give the same report
        assert verify_bundle(tar_dir(bundle, tmp_path / "t.tar.gz")) == report


def test_consistent_forgery_verifies_but_rescorer_catches_it(bundle: Path) -> None:
    """FORMAT.md: SHA256SUMS is not a signature. Editing results, manifest, summary and sums together
    passes the hashes; what stands against it is re-deriving each status from the records."""
    _forge_pass_everywhere(bundle)
    (bundle / schema.SUMMARY).write_text((bundle / schema.SUMMARY).read_text().replace("**incomplete**", "**pass**"))
    reseal(bundle)
    hashes_only = verify_bundle(bundle, rescorers=[])
    assert hashes_only.exit_code == 0 and hashes_only.verdict == "pass"
    report = verify_bundle(bundle)  # the built-in rescorers
    assert report.exit_code == 1 and report.problems == (
        "kernels.numerics: rescore: status 'passed', but its 0 records give 'failed' "
        "(no kernel test ran (see artifacts pytest.log))",)


def _determinism_rescorer(records, result):
    runs = records.get("reference.determinism", [])
    if any(r["bitwise_equal"] for r in runs) != result.metrics.get("identical_runs"):
        return ["identical_runs does not follow from the record's bitwise_equal"]
    return []


def test_registered_rescorer_rederives_metrics(bundle: Path) -> None:
    register_rescorer("reference.determinism", _determinism_rescorer)
    try:
        assert verify_bundle(bundle).ok
        p = bundle / "records/reference.determinism.jsonl"
        rec = json.loads(p.read_text())
        rec["bitwise_equal"] = False
        p.write_text(json.dumps(rec) + "\n")
        reseal(bundle)
        report = verify_bundle(bundle)
        assert report.exit_code == 1
        snapshot("rescorer_problem", render_report(report))
    finally:
        unregister_rescorer("reference.determinism", _determinism_rescorer)
    assert verify_bundle(bundle, rescorers=[]).ok  # no rescorer: the hashes alone pass the re-sealed copy
    assert not verify_bundle(bundle).ok  # the built-in one re-derives the status from the same record

    def broken(records, result):
        raise KeyError("tokens")

    report = verify_bundle(bundle, rescorers=[("weights.", broken)])
    assert report.problems == ("weights.roundtrip: rescore: rescorer broken raised KeyError: 'tokens'",)


# ------------------------------------------------------------------ tarball variants
def _tar_with(dest: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(dest, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return dest


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind=tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def test_tarball_tampered_inside(bundle: Path, tmp_path: Path) -> None:
    _flip_record_byte(bundle)
    report = verify_bundle(tar_dir(bundle, tmp_path / "x.tar.gz"))
    assert report.exit_code == 1
    assert report.problems == ("records/reference.determinism.jsonl: sha256 mismatch",)


def test_tarball_with_manifest_at_top_level(bundle: Path, tmp_path: Path) -> None:
    dest = tmp_path / "flat.tar.gz"
    with tarfile.open(dest, "w:gz") as tar:
        for f in walk_bundle(bundle)[0]:
            tar.add(bundle / f, arcname=f)
    assert render_report(verify_bundle(dest)) == render_report(verify_bundle(GOLDEN))


MANIFEST_BYTES = (GOLDEN / "manifest.json").read_bytes()
UNSAFE_TARS = {
    "dotdot": [_file("b/manifest.json", MANIFEST_BYTES), _file("b/../../evil.txt", b"x")],
    "absolute": [_file("/tmp/evil.txt", b"x")],
    "symlink": [_file("b/manifest.json", MANIFEST_BYTES), _link("b/results.jsonl", "/etc/passwd")],
    "hardlink": [_file("b/manifest.json", MANIFEST_BYTES), _link("b/x", "b/manifest.json", tarfile.LNKTYPE)],
    "duplicate": [_file("b/manifest.json", MANIFEST_BYTES), _file("b/manifest.json", b"{}")],
    "no_manifest": [_file("b/results.jsonl", b"")],
    "manifest_not_json": [_file("b/manifest.json", b"{not json")],
}


@pytest.mark.parametrize("name", sorted(UNSAFE_TARS))
def test_unsafe_or_empty_tarball_is_unreadable(tmp_path: Path, name: str) -> None:
    path = _tar_with(tmp_path / "b.tar.gz", UNSAFE_TARS[name])
    report = verify_bundle(path)
    assert report.exit_code == 2 and not report.ok and len(report.problems) == 1 and "\n" not in report.problems[0]
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/evil.txt").exists()


# ------------------------------------------------------------------ garbage input -> exit 2, one line
def _garbage(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / "in"
    if kind == "random_bytes":
        p.write_bytes(random.Random(0).randbytes(4096))
    elif kind == "empty_file":
        p.write_bytes(b"")
    elif kind == "empty_dir":
        p.mkdir()
    elif kind == "missing":
        pass
    elif kind == "gzip_not_tar":
        p.write_bytes(gzip.compress(b"hello, not a tar"))
    elif kind == "truncated_tarball":
        p.write_bytes(GOLDEN.with_name("golden-smoke.tar.gz").read_bytes()[:300])
    else:
        shutil.copytree(GOLDEN, p)
        m = p / "manifest.json"
        m.write_bytes({"manifest_not_json": b"{oops", "manifest_a_list": b"[1, 2]\n",
                       "schema_v99": MANIFEST_BYTES.replace(b'"schema_version": 1', b'"schema_version": 99'),
                       "no_manifest": None}[kind] or b"")
        if kind == "no_manifest":
            m.unlink()
    return p


GARBAGE = ["random_bytes", "empty_file", "empty_dir", "missing", "gzip_not_tar", "truncated_tarball",
           "manifest_not_json", "manifest_a_list", "schema_v99", "no_manifest"]


@pytest.mark.parametrize("kind", GARBAGE)
def test_garbage_input_is_unreadable(tmp_path: Path, kind: str) -> None:
    report = verify_bundle(_garbage(tmp_path, kind))
    assert report.exit_code == 2 and report.verdict is None and len(report.problems) == 1
    assert "\n" not in report.problems[0] and report.problems[0]
    assert render_report(report).startswith("UNREADABLE (exit 2): ")


# ------------------------------------------------------------------ the writer
def test_writer_refuses_non_empty_dir_and_existing_tarball(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(schema.BundleError, match="not empty"):
        small_writer(tmp_path / "full")
    (tmp_path / "file").write_text("x")
    with pytest.raises(schema.BundleError, match="not a directory"):
        small_writer(tmp_path / "file")
    (tmp_path / "old.tar.gz").write_text("x")
    with pytest.raises(schema.BundleError, match="already exists"):
        small_writer(tmp_path / "old")
    (tmp_path / "empty").mkdir()
    small_writer(tmp_path / "empty").finalize()  # an empty directory is fine
    assert verify_bundle(tmp_path / "empty").ok


def test_writer_validates_input(tmp_path: Path) -> None:
    w = small_writer(tmp_path / "b")
    with pytest.raises(ValueError, match="not a planned check"):
        w.add_result(CheckResult("b.other", "passed"))
    w.add_result(CheckResult("a.one", "passed"))
    with pytest.raises(ValueError, match="already added"):
        w.add_result(CheckResult("a.one", "passed"))
    with pytest.raises(ValueError, match="not a regular file"):
        w.add_result(CheckResult("a.two", "passed", artifacts=["artifacts/nope.png"]))
    with pytest.raises(ValueError, match="NaN"):
        w.record("a.two", {"err": float("nan")})
    with pytest.raises(ValueError, match="not a valid name"):
        w.record("../x", {})
    with pytest.raises(ValueError, match="relative"):
        w.artifact_path("../x")
    assert w.finalize() == "incomplete" and w.finalize() == "incomplete"
    with pytest.raises(schema.BundleError, match="finalized"):
        w.record("a.two", {"late": True})
    assert verify_bundle(w.root).ok


def test_finalized_pass_and_tarball_verify_identically(tmp_path: Path) -> None:
    with small_writer(tmp_path / "run", planned=["a.one", "a.two"]) as w:
        w.record("a.one", {"step": 0, "ms": 1.25})
        w.artifact_path("a.one/plot.txt").write_text("plot\n")
        w.add_result(CheckResult("a.one", "passed", metrics={"p50_ms": 1.25}, artifacts=["artifacts/a.one/plot.txt"]))
        w.add_result(CheckResult("a.two", "passed"))
    assert w.state == "finished" and w.verdict == "pass"
    d, t = verify_bundle(w.root), verify_bundle(w.tarball)
    assert d.ok and d.verdict == "pass" and t == d
    assert (w.root / "SHA256SUMS").read_text().splitlines()[0].endswith("  artifacts/a.one/plot.txt")
    first = w.tarball.read_bytes()  # deterministic: the same directory tars to the same bytes
    assert write_tarball(w.root, tmp_path / "again.tar.gz").read_bytes() == first


def test_failed_check_gives_fail(tmp_path: Path) -> None:
    w = small_writer(tmp_path / "b")
    w.add_result(CheckResult("a.one", "failed", reason="max_abs_err 0.5 > 0.25"))
    assert w.finalize() == "fail"
    r = verify_bundle(w.root)
    assert r.ok and r.verdict == "fail" and "a.one: failed: max_abs_err 0.5 > 0.25" in r.summary["verdict_reasons"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_context_manager_finalizes_interrupted(tmp_path: Path, exc: type) -> None:
    with pytest.raises(exc):
        with small_writer(tmp_path / "b") as w:
            w.add_result(CheckResult("a.one", "passed"))
            raise exc("boom")
    m = json.loads((w.root / "manifest.json").read_text())
    assert m["state"] == "interrupted" and m["verdict"] == "incomplete"
    assert m["verdict_reasons"][0] == schema.INTERRUPTED_REASON
    assert verify_bundle(w.root).ok and verify_bundle(w.tarball).ok


def test_running_bundle_tolerates_only_unsealed_bytes(tmp_path: Path) -> None:
    w = small_writer(tmp_path / "b")
    w.record("a.one", {"i": 0})
    w.add_result(CheckResult("a.one", "passed"))
    (w.root / "results.jsonl").open("ab").write(b'{"id":"a.two","status":"pas')  # a kill mid-write
    (w.root / "records" / "a.two.jsonl").write_text('{"i": 1}\n')  # a stream not sealed yet
    r = verify_bundle(w.root)
    assert r.ok and r.verdict == "incomplete" and r.summary["state"] == "running" and len(r.notes) == 3 and r.notes[-1] == "unsigned"
    snapshot("running_unsealed", render_report(r))
    data = (w.root / "records" / "a.one.jsonl").read_bytes()
    (w.root / "records" / "a.one.jsonl").write_bytes(data.replace(b"0", b"7"))  # sealed bytes: caught
    assert verify_bundle(w.root).problems == ("records/a.one.jsonl: sha256 mismatch",)
    (w.root / "records" / "a.one.jsonl").write_bytes(data)
    w.record("a.one", {"i": 2})  # the writer drops the torn tail before its next append
    w.add_result(CheckResult("a.two", "skipped", reason="needs a CUDA device"))
    assert w.finalize() == "incomplete" and verify_bundle(w.root).ok


def test_finished_bundle_tolerates_no_tail(bundle: Path) -> None:
    (bundle / "results.jsonl").open("ab").write(b'{"id":')
    assert verify_bundle(bundle).problems == ("results.jsonl: sha256 mismatch",)


# ------------------------------------------------------------------ crash safety: SIGKILL anywhere
def _crash_scenario(root: Path) -> None:
    w = small_writer(root, now=golden.FixedClock())
    w.record("a.one", {"x": 1})
    w.log("hello")
    w.artifact_path("a.one/plot.txt").write_text("plot\n")
    w.add_result(CheckResult("a.one", "passed", artifacts=["artifacts/a.one/plot.txt"]))
    w.record("a.two", {"y": 2})
    w.record("a.two", {"y": 3})
    w.add_result(CheckResult("a.two", "skipped", reason="needs a CUDA device"))
    w.finalize()


def _check_killed_bundle(root: Path, where: str) -> str:
    if not root.exists() or not any(root.iterdir()):
        return "absent"
    r = verify_bundle(root)
    assert r.exit_code == 0, f"killed at {where}: {r.problems}"
    assert r.verdict == "incomplete", where
    if r.summary["state"] == "running":
        assert json.loads((root / "manifest.json").read_bytes())["ended_at"] is None
    return r.summary["state"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_at_every_crash_point(tmp_path: Path) -> None:
    points: list[str] = []
    writer_mod._crash_hook = points.append
    try:
        _crash_scenario(tmp_path / "count")
    finally:
        writer_mod._crash_hook = None
    assert len(points) > 20 and "finalize:pending" in points
    states = []
    for k, where in enumerate(points):
        root = tmp_path / f"k{k}"
        pid = os.fork()
        if pid == 0:  # child: die by SIGKILL at the k-th crash point
            try:
                calls = iter(range(len(points)))

                def hook(point: str, k=k, calls=calls) -> None:
                    if next(calls) == k:
                        os.kill(os.getpid(), signal.SIGKILL)

                writer_mod._crash_hook = hook
                _crash_scenario(root)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child at {where}: {status}"
        states.append(_check_killed_bundle(root, f"#{k} {where}"))
        if states[-1] != "running" and root.exists():
            shutil.rmtree(root)
    assert states[0] == "absent" and states[-1] == "finished"
    assert states.count("running") >= 15 and set(states) == {"absent", "running", "finished"}


KILL_CHILD = r"""
import os, random, sys
sys.path.insert(0, sys.argv[3])
from verify.bundle.writer import BundleWriter
from verify.result import CheckResult
root, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
planned = [f"k.c{i}" for i in range(400)]
w = BundleWriter(root, tool_version="0", argv=["x"], tier="kill", planned_checks=planned, engines=["e"],
                 config={}, seeds={"global": seed}, env={})
print("ready", flush=True)
for i in range(10**6):
    w.record(f"k.c{i % 5}", {"i": i, "pad": "x" * rng.choice([10, 2000, 300000])})
    if i % 3 == 0 and i // 3 < len(planned):
        arts = []
        if i % 2:
            w.artifact_path(f"{i}.txt").write_text("a" * rng.randrange(100000))
            arts = [f"artifacts/{i}.txt"]
        w.add_result(CheckResult(planned[i // 3], rng.choice(["passed", "skipped"]), reason="r", artifacts=arts))
    if i % 4 == 0:
        w.log(f"step {i}")
"""


def test_sigkill_subprocess_at_random_moments(tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for n in range(6):
        root = tmp_path / f"run{n}"
        child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(root), str(rng.randrange(1 << 30)), str(REPO)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        child.send_signal(signal.SIGKILL)
        child.wait()
        r = verify_bundle(root)
        assert r.exit_code == 0, f"seed {seed}, run {n}: {r.problems}"
        assert r.verdict == "incomplete" and r.summary["state"] == "running", f"seed {seed}, run {n}"
        shutil.rmtree(root)


SIGTERM_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from verify.bundle.writer import BundleWriter, handle_sigterm
from verify.result import CheckResult
with handle_sigterm(), BundleWriter(sys.argv[1], tool_version="0", argv=["x"], tier="t", planned_checks=["a.b", "a.c"],
                                    engines=[], config={}, seeds={}, env={}) as w:
    w.add_result(CheckResult("a.b", "passed"))
    print("ready", flush=True)
    while True:
        w.record("a.c", {"t": time.time()})
        time.sleep(0.001)
"""


def test_sigterm_finalizes_interrupted(tmp_path: Path) -> None:
    root = tmp_path / "b"
    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, str(root), str(REPO)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=30)
    assert child.returncode != 0 and "Terminated" in err
    m = json.loads((root / "manifest.json").read_text())
    assert m["state"] == "interrupted" and m["verdict"] == "incomplete"
    assert verify_bundle(root).ok and verify_bundle(tmp_path / "b.tar.gz").ok


# ------------------------------------------------------------------ verdict rules and CheckResult
def R(cid: str, status: str, reason: str = "r") -> CheckResult:
    return CheckResult(cid, status, "" if status == "passed" else reason)


@pytest.mark.parametrize("results, state, verdict, reasons", [
    ([R("a.x", "passed"), R("a.y", "passed")], "finished", "pass", []),
    ([R("a.x", "passed"), R("a.y", "skipped", "needs a CUDA device")], "finished", "incomplete",
     ["a.y: skipped: needs a CUDA device"]),
    ([R("a.x", "passed")], "finished", "incomplete", ["a.y: missing: no result recorded"]),
    ([R("a.x", "passed"), R("a.y", "passed")], "interrupted", "incomplete", [schema.INTERRUPTED_REASON]),
    ([R("a.x", "passed"), R("a.y", "passed")], "running", "incomplete", [schema.RUNNING_REASON]),
    ([R("a.x", "failed", "bad"), R("a.y", "skipped", "s")], "finished", "fail", ["a.x: failed: bad", "a.y: skipped: s"]),
    ([R("a.x", "error", "boom")], "interrupted", "fail",
     [schema.INTERRUPTED_REASON, "a.x: error: boom", "a.y: missing: no result recorded"]),
    ([R("a.x", "passed"), R("a.x", "passed"), R("a.y", "passed")], "finished", "incomplete",
     ["a.x: 2 results (expected exactly one): passed, passed"]),
    ([R("a.x", "passed"), R("a.y", "passed"), R("a.z", "passed")], "finished", "incomplete",
     ["a.z: not a planned check of this tier (passed)"]),
])
def test_verdict_rules(results, state, verdict, reasons) -> None:
    assert compute_verdict(["a.x", "a.y"], results, state) == (verdict, reasons)


def test_check_result_round_trip_and_validation() -> None:
    r = CheckResult("perf.decode[bs=8]", "failed", "too slow", metrics={"p50": 1.5, "hist": (1, 2)},
                    artifacts=["artifacts/p.png"], duration_s=2, started_at="2026-11-30T14:22:20.5+00:00",
                    ended_at="2026-11-30T14:22:22.500Z")
    d = r.to_dict()
    assert d["metrics"]["hist"] == [1, 2] and d["duration_s"] == 2.0 and CheckResult.from_dict(d) == r
    assert CheckResult.from_dict(json.loads(json.dumps(d))) == r
    for bad in [dict(status="ok"), dict(status="skipped", reason=""), dict(reason="two\nlines"),
                dict(metrics={"x": float("inf")}), dict(metrics={1: 2}), dict(artifacts=["../x"]),
                dict(duration_s=-1.0), dict(started_at="yesterday"), dict(id="has space"),
                dict(started_at="2026-11-30T14:00:00Z", ended_at="2026-11-30T13:00:00Z")]:
        with pytest.raises(ValueError):
            CheckResult(**{**dict(id="a.b", status="failed", reason="r"), **bad})
    with pytest.raises(ValueError, match="unknown keys"):
        CheckResult.from_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match="lacks"):
        CheckResult.from_dict({k: v for k, v in d.items() if k != "metrics"})


def test_bundle_package_imports_no_torch() -> None:
    code = "import sys, verify.bundle, verify.result; sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
