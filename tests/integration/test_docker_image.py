"""The images for real: a private Docker engine, a locally made base image, `k3-verify image build` of both
Dockerfiles, `k3-verify image run` of the smoke tier with the bundle on a mount, and the bundle verified
outside the container.

Nothing comes from a registry (none is reachable here): the base is a Debian bookworm rootfs made by
mmdebstrap (python3.11, no pip) and `docker import`ed, then tagged with the name images/Dockerfile.cpu
expects (its pinned default, so the default path is what is tested). For images/Dockerfile the test
makes a stand-in for the vLLM base on top of it that, like the real one, *provides torch* (as installed
metadata only: CUDA torch cannot exist here) and builds with --base/--python/--extras "" so nothing
CUDA-only is needed; the staging must then leave torch out of the wheels and the image's venv must see
the base's torch. The engine runs from a temp dir (socket, data-root, exec-root, pidfile), overlay2, no
bridge, no iptables (../shared/design/SERVICES.md), and is stopped by its PID.

Needs root, dockerd and mmdebstrap (scripts/install-services). Under CI a missing tool is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from verify import image_build

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(tempfile.gettempdir()) / "k3-verify-test-cache"  # base tarball + wheelhouse, kept between runs
BASE_PACKAGES = "dash,coreutils,python3.11,python3.11-venv,libstdc++6"  # libstdc++6: torch needs it
CPU_BASE = image_build.dockerfile_default_base(REPO / "images" / "Dockerfile.cpu")
GPU_STANDIN = image_build.dockerfile_default_base(REPO / "images" / "Dockerfile").split("@")[0]
STANDIN_TORCH = "2.13.0+cu129"


def _require_tools() -> None:
    missing = [t for t in ("dockerd", "mmdebstrap") if not shutil.which(t)]
    reason = None
    if os.geteuid() != 0:
        reason = "needs root to start a Docker engine"
    elif missing:
        reason = f"needs {', '.join(missing)}: run scripts/install-services (as root)"
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must run the Docker image test: {reason}")
    if reason:
        pytest.skip(reason=reason)


def cli(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("DOCKER_HOST", None)
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _unmount_under(root: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(str(root))), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


@pytest.fixture(scope="module")
def engine():
    """A private dockerd: yields its unix:// URL; stopped by PID, leftovers unmounted, temp dir removed."""
    _require_tools()
    d = Path(tempfile.mkdtemp(prefix="k3d-", dir="/tmp"))  # short: unix socket paths are capped at 108 bytes
    host = f"unix://{d}/docker.sock"
    log = (d / "dockerd.log").open("wb")
    proc = subprocess.Popen(["dockerd", "--host", host, "--data-root", str(d / "data"), "--exec-root", str(d / "exec"),
                             "--pidfile", str(d / "pid"), "--storage-driver", "overlay2", "--iptables=false",
                             "--ip6tables=false", "--bridge=none"], stdout=log, stderr=subprocess.STDOUT)
    try:
        import docker

        deadline = time.monotonic() + 60
        while True:
            try:
                docker.DockerClient(base_url=host, version="auto", timeout=10).ping()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (d / "dockerd.log").read_text(errors="replace")[-2000:]
                    pytest.fail(f"dockerd did not come up (exit {proc.poll()}):\n{tail}")
                time.sleep(0.3)
        yield host
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        _unmount_under(d)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def client(engine):
    import docker

    c = docker.DockerClient(base_url=engine, version="auto", timeout=900)
    yield c
    c.close()


def _base_tarball() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / f"bookworm-{hashlib.sha256(BASE_PACKAGES.encode()).hexdigest()[:12]}.tar"
    if not tar.exists():
        part = tar.with_name(f"{tar.stem}.part.tar")  # mmdebstrap picks the format by the extension
        r = subprocess.run(["mmdebstrap", "--quiet", "--variant=extract", f"--include={BASE_PACKAGES}", "bookworm",
                            str(part)], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"mmdebstrap failed:\n{r.stderr[-3000:]}"
        part.rename(tar)
    return tar


@pytest.fixture(scope="module")
def local_bases(client, tmp_path_factory):
    """The Debian base tagged as Dockerfile.cpu's default, and the vLLM stand-in tagged as images/Dockerfile's."""
    repo, tag = CPU_BASE.split(":")
    # (with docker-py 7.x, import_image_from_file sends the path as a URL and _from_stream's chunked upload
    # is refused by this engine: hand it the ~90 MB as bytes)
    client.api.import_image_from_data(_base_tarball().read_bytes(), repository=repo, tag=tag)
    ctx = tmp_path_factory.mktemp("standin")
    info = f"/usr/lib/python3/dist-packages/torch-{STANDIN_TORCH}.dist-info"
    (ctx / "Dockerfile").write_text(
        f"FROM {CPU_BASE}\n"
        f"RUN mkdir -p {info} && printf 'Metadata-Version: 2.1\\nName: torch\\nVersion: {STANDIN_TORCH}\\n' "
        f"> {info}/METADATA\n")
    client.images.build(path=str(ctx), tag=GPU_STANDIN, rm=True, pull=False)
    return {"cpu": client.images.get(CPU_BASE), "gpu": client.images.get(GPU_STANDIN)}


def _host_identity() -> tuple[str, str]:
    from verify.environment import source_tree_sha256

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return commit, source_tree_sha256()


def test_cpu_image_runs_the_smoke_tier_into_a_mounted_bundle(engine, local_bases, tmp_path):
    commit, tree_before = _host_identity()
    r = cli("image", "build", "--kind", "cpu", "--docker-host", engine, "--wheelhouse", str(CACHE / "wheels"),
            "--format", "json")
    assert r.returncode == 0, r.stderr[-4000:]
    built = json.loads(r.stdout)["image"]
    assert built["tag"] == "k3-verify:cpu" and built["base_image"] == CPU_BASE
    assert any(w.startswith("torch-2.13.0+cpu-") for w in built["wheels"]), "the CPU image pins the CPU torch"
    assert not any(w.startswith(("nvidia", "triton")) for w in built["wheels"]), "no CUDA in the CPU image"

    bundles = tmp_path / "bundles"
    r = cli("image", "run", "--tag", "k3-verify:cpu", "--docker-host", engine, "--bundles", str(bundles),
            "--format", "json", "--", "run", "--tier", "smoke")
    assert r.returncode == 0, r.stderr[-4000:]
    ran = json.loads(r.stdout)["run"]
    assert ran["exit_code"] == 0 and ran["image_id"] == built["image_id"] and not ran["gpus"]
    assert len(ran["bundles"]) == 1, ran
    bundle = Path(ran["bundles"][0])
    assert bundle.parent == bundles / "local" and bundle.with_suffix(".tar.gz").exists()
    assert bundle.stat().st_uid == os.getuid(), "bundles belong to whoever ran the image"

    for target in (bundle, bundle.with_suffix(".tar.gz")):  # outside the container, with the host's k3-verify
        v = cli("bundle", "verify", str(target), "--format", "json", timeout=300)
        assert v.returncode == 0 and json.loads(v.stdout)["ok"] is True, v.stdout + v.stderr

    m = json.loads((bundle / "manifest.json").read_text())
    image = m["env"]["image"]
    assert image["in_container"] is True and image["digest"] == built["image_id"]
    assert image["build_args"]["kind"] == "cpu" and image["build_args"]["base_image"] == CPU_BASE
    assert image["build_args"]["base_digest"] == local_bases["cpu"].id
    assert image["build_args"]["wheelhouse_sha256"] == built["build_args"]["K3_WHEELHOUSE_SHA256"]
    # no checkout in the image: the commit is only claimed, and `bundle verify --repo` confirms the claim
    assert m["env"]["git"]["commit"] is None and m["env"]["git"]["claimed_commit"] == commit
    if _host_identity()[1] == tree_before:  # (a tree edited while the test ran cannot be compared)
        assert m["env"]["source_tree_sha256"] == tree_before
        from verify.provenance import commit_tree_sha256

        if commit_tree_sha256(REPO, commit)[1] == tree_before:  # the sources were committed when it ran
            v = cli("bundle", "verify", str(bundle), "--repo", str(REPO), timeout=300)
            assert v.returncode == 0 and "has the sources that ran" in v.stdout, v.stdout + v.stderr
    results = {r["id"]: r for r in map(json.loads, (bundle / "results.jsonl").read_text().splitlines())}
    for check in ("reference.prefill_decode_consistency", "reference.determinism", "weights.roundtrip"):
        assert results[check]["status"] == "passed", results[check]
    assert results["kernels.compile"]["status"] == "skipped"
    assert "nvidia-cutlass-dsl" in results["kernels.compile"]["reason"]
    assert m["verdict"] == "incomplete" and m["state"] == "finished"


def test_gpu_dockerfile_builds_on_a_standin_base_and_runs(engine, client, local_bases):
    r = cli("image", "build", "--kind", "gpu", "--base", GPU_STANDIN, "--python", "python3.11", "--extras", "",
            "--extra-requirements", "", "--docker-host", engine, "--wheelhouse", str(CACHE / "wheels"),
            "--format", "json")
    assert r.returncode == 0, r.stderr[-4000:]
    built = json.loads(r.stdout)["image"]
    assert built["tag"] == "k3-verify:gpu"
    assert not any(w.startswith("torch") for w in built["wheels"]), "torch is the base's: never staged"
    assert built["build_args"]["BASE_IMAGE"] == GPU_STANDIN

    r = cli("image", "run", "--tag", "k3-verify:gpu", "--docker-host", engine, "--gpus", "none", "--format", "json",
            "--", "--version", timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["run"]["exit_code"] == 0, r.stderr
    assert "k3-verify 0.1.0" in r.stderr  # the container's output (stdout holds the JSON document)

    # the venv sees the base's packages: torch resolves to the stand-in's, not to a staged wheel
    probe = "import importlib.metadata as m, json; print(json.dumps([m.version('torch'), m.version('k3-verify')]))"
    out = client.containers.run("k3-verify:gpu", entrypoint=["/opt/k3-verify/venv/bin/python", "-c", probe],
                                network_mode="none", remove=True)
    assert json.loads(out) == [STANDIN_TORCH, "0.1.0"]
    env = client.images.get("k3-verify:gpu").attrs["Config"]["Env"]
    args = json.loads(next(e for e in env if e.startswith("K3_IMAGE_BUILD_ARGS=")).split("=", 1)[1])
    assert args["kind"] == "gpu" and args["base_image"] == GPU_STANDIN and args["extras"] == ""


def test_run_surfaces_the_container_exit_code(engine, local_bases, tmp_path):
    """A usage error inside (exit 2) comes out as exit 2, with the container's own message."""
    r = cli("image", "run", "--tag", "k3-verify:cpu", "--docker-host", engine, "--bundles", str(tmp_path),
            "--", "bundle", "verify", "/no/such/bundle", timeout=300)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "/no/such/bundle" in r.stderr


def test_missing_image_and_missing_python_are_one_line_errors(engine, local_bases, tmp_path):
    r = cli("image", "run", "--tag", "k3-verify:nope", "--docker-host", engine, "--bundles", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().startswith("k3-verify: error: image k3-verify:nope not found")
    r = cli("image", "build", "--kind", "cpu", "--python", "python9", "--docker-host", engine,
            "--stage-only", str(tmp_path / "ctx"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "`python9` failed" in r.stderr or "cannot run `python9`" in r.stderr
    r = cli("image", "build", "--kind", "cpu", "--base", f"{CPU_BASE}@sha256:{'0' * 64}", "--no-pull",
            "--docker-host", engine, "--stage-only", str(tmp_path / "ctx2"))
    assert r.returncode == 2 and "is not present in the engine and --no-pull was given" in r.stderr, r.stderr
