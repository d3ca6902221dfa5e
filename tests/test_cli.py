"""The ``k3-verify`` CLI end to end on a CPU: run -> bundle -> verify, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU_CHECKS = {"kernels.numerics", "kernels.sanitizer", "equivalence.decode", "perf.bandwidth_probe"}


def cli(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "COLUMNS": "250", **(env or {})}  # rich wraps at the terminal width
    e.pop("K3_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=e)


def test_help_is_instant_and_does_not_import_torch():
    code = "import sys, verify.cli; assert 'torch' not in sys.modules, 'torch imported at CLI import'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    t0 = time.monotonic()
    r = cli("--help")
    assert r.returncode == 0 and "run" in r.stdout and "bundle" in r.stdout
    assert time.monotonic() - t0 < 10


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("k3-verify ")


def test_list_json_names_every_tier_and_check():
    r = cli("list", "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {t["tier"] for t in doc["tiers"]} == {"smoke", "standard", "full"}
    ids = {c["check"] for c in doc["checks"]}
    assert {"reference.prefill_decode_consistency", "weights.roundtrip", "reference.determinism"} <= ids
    here = {c["check"]: c["here"] for c in doc["checks"]}
    if "CUDA" not in here["kernels.numerics"]:
        pytest.skip(reason="a CUDA device is present: the CPU expectations below do not apply")
    assert here["kernels.numerics"] == "needs a CUDA device"


def test_env_json_has_the_essentials():
    r = cli("env", "--format", "json")
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)["env"]
    for key in ("torch", "gpus", "packages", "git", "cpu", "image"):
        assert key in env


@pytest.fixture(scope="module")
def smoke_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "bundle"
    r = cli("run", "--tier", "smoke", "--output", str(out), "--format", "json")
    return out, r


def test_smoke_on_cpu_is_incomplete_with_gpu_checks_skipped(smoke_bundle):
    out, r = smoke_bundle
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    if any(res["check"] in GPU_CHECKS and res["status"] != "skipped" for res in doc["results"]):
        pytest.skip(reason="GPU checks ran: this machine has a CUDA device")
    assert doc["verdict"] == "incomplete"
    by_id = {res["check"]: res for res in doc["results"]}
    for cid in GPU_CHECKS:
        assert by_id[cid]["status"] == "skipped" and "needs" in by_id[cid]["reason"]
    for cid in ("reference.prefill_decode_consistency", "reference.determinism", "weights.roundtrip"):
        assert by_id[cid]["status"] == "passed", by_id[cid]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verdict"] == "incomplete" and manifest["tier"] == "smoke"
    assert any("needs a CUDA device" in r for r in manifest["verdict_reasons"])
    assert (out / "records" / "reference.prefill_decode_consistency.jsonl").stat().st_size > 0


def test_bundle_verify_accepts_the_run_dir_and_archive(smoke_bundle):
    out, _ = smoke_bundle
    for target in (out, Path(f"{out}.tar.gz")):
        r = cli("bundle", "verify", str(target))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "verdict incomplete" in r.stdout
    r = cli("bundle", "show", str(out), "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["bundle"]["manifest"]["tier"] == "smoke"


def test_tampered_run_bundle_fails_verification(smoke_bundle, tmp_path):
    import shutil

    out, _ = smoke_bundle
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    res = copy / "results.jsonl"
    lines = [json.loads(x) for x in res.read_text().splitlines()]
    for rec in lines:
        if rec["status"] == "skipped":
            rec["status"], rec["reason"] = "passed", ""
    res.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = cli("bundle", "verify", str(copy))
    assert r.returncode == 1 and "FAILED" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "--tier", "nonsense"), "unknown tier"),
        (("run", "--tier", "smoke", "--preset", "k4-huge"), "config"),
        (("run", "--tier", "smoke", "--device", "tpu"), "--device"),
        (("run", "--tier", "smoke", "--max-model-len", "1"), "--max-model-len"),
        (("bundle", "verify", "/nonexistent/bundle"), "nonexistent"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    r = cli(*args, "--format", "text") if args[0] == "run" else cli(*args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3-verify: error:"), r.stderr
    assert message in lines[0]


def test_bad_tier_writes_nothing(tmp_path):
    bad = tmp_path / "tier.yaml"
    bad.write_text("name: x\ndescription: y\ntarget_s: 10\nchecks:\n  - id: no.such.check\n    budget_s: 1\n")
    out = tmp_path / "out"
    r = cli("run", "--tier", str(bad), "--output", str(out))
    assert r.returncode == 2 and "no.such.check" in r.stderr
    assert not out.exists()


def test_garbage_bundle_is_exit_2(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(os.urandom(300))
    r = cli("bundle", "verify", str(junk))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_refuses_a_non_empty_output_dir(tmp_path):
    (tmp_path / "x").write_text("keep me")
    r = cli("run", "--tier", "smoke", "--output", str(tmp_path))
    assert r.returncode == 2 and "not empty" in r.stderr
    assert (tmp_path / "x").read_text() == "keep me"


def test_sigterm_leaves_a_valid_incomplete_bundle(tmp_path):
    out = tmp_path / "b"
    p = subprocess.Popen([sys.executable, "-m", "verify.cli", "run", "--tier", "smoke", "--output", str(out)],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    res = out / "results.jsonl"
    while time.monotonic() < deadline and not (res.exists() and res.read_text().strip()):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    r = cli("bundle", "verify", str(out), "--format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "incomplete"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "interrupted"


def test_a_failing_check_fails_the_run(tmp_path, monkeypatch):
    """Exit 1 and verdict fail when a check fails (a check is patched to fail; the runner must not hide it)."""
    from typer.testing import CliRunner

    import verify.checks.reference as ref
    from verify import cli as cli_mod

    def broken(ctx, **params):
        return ctx.failed("deliberately broken for this test", {"x": 1})

    monkeypatch.setattr(ref, "determinism", broken)
    tier = tmp_path / "t.yaml"
    tier.write_text("name: t\ndescription: d\ntarget_s: 100\nchecks:\n"
                    "  - id: reference.determinism\n    budget_s: 100\n")
    runner = CliRunner()
    res = runner.invoke(cli_mod.app, ["run", "--tier", str(tier), "--output", str(tmp_path / "b"), "--format", "json"],
                        standalone_mode=False)
    assert isinstance(res.exception, cli_mod._Exit) and res.exception.code == 1
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["verdict"] == "fail"


def test_gpu_run_tiers_load():
    """Every tier file the GPU driver script runs (scripts/gpu/*.yaml) names known checks and parameters."""
    from pathlib import Path

    from verify.tiers import load_tier

    files = sorted((Path(__file__).parent.parent / "scripts" / "gpu").glob("*.yaml"))
    assert len(files) >= 5
    for f in files:
        assert load_tier(str(f)).checks, f
