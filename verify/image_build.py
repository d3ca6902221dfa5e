"""The build context of a k3-verify image, staged on the host so that ``docker build`` needs no network.

Why staging: a contributor's GPU image and the maintainers' CPU image must build the same way on a
machine whose containers reach no package index (CI here; air-gapped GPU hosts). Everything the
Dockerfile installs is therefore put into the build context first:

```
<context>/Dockerfile          images/Dockerfile (gpu) or images/Dockerfile.cpu (cpu)
<context>/src/                the project's sources (pyproject.toml, README.md, k3_fastpath/, verify/,
                              evals/, tests/): installed editable, so the GPU checks that run the
                              kernel tests (kernels.numerics) find tests/ next to the code
<context>/wheels/             every wheel the install needs, built or downloaded on the host
```

How the wheels are made (``stage_wheels``): the host's ``pip wheel`` resolves the project with its
extras for the *base image's* Python (probed by running the base, see ``verify.images.probe_base``):

1. Packages the base already has, when the image's venv sees them (the GPU image's venv has
   ``--system-site-packages``: torch and vLLM come from the vLLM base), are given to pip as *stub
   wheels*: metadata-only wheels at the exact installed version, pinned by a constraints file. pip
   resolves against them (so a conflict with the base shows up here, on the host) and never downloads
   them; the stubs are removed afterwards.
2. The CPU image pins torch to the CPU build (``TORCH_CPU``; from ``/opt/wheels`` when it lies there,
   else the PyTorch CPU index), like ``scripts/bootstrap``: an unpinned torch would be a CUDA build.
3. When the host's Python/platform differs from the image's, the wheels from step 1 that are pure
   Python are kept and the rest are fetched for the image's tags with ``pip download --only-binary``.

A ``--wheelhouse`` directory keeps the wheels between builds; pip is tried offline against it first.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
IMAGES_DIR = REPO_ROOT / "images"
DOCKERFILES = {"gpu": IMAGES_DIR / "Dockerfile", "cpu": IMAGES_DIR / "Dockerfile.cpu"}
DEFAULT_TAGS = {"gpu": "k3-verify:gpu", "cpu": "k3-verify:cpu"}
# What each image installs unless told otherwise. GPU: the kernel toolchain (exact cutlass-dsl pin in
# pyproject's `kernels` extra) and lm-eval/xgrammar; pytest because kernels.numerics runs the GPU kernel
# tests. CPU: `report` so maintainers can render bundles (plots); no CUDA, no kernels extra (the smoke
# tier then lists kernels.compile as skipped with its reason).
DEFAULT_EXTRAS = {"gpu": "gpu,eval", "cpu": "report"}


class StagingError(Exception):
    """The build context could not be staged (pip failed, a source is missing): one line for the user."""


def cutlass_pin(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """The exact nvidia-cutlass-dsl version of pyproject's `kernels` extra (one place to bump it)."""
    m = re.search(r'"nvidia-cutlass-dsl==([0-9][^"]*)"', pyproject.read_text())
    if not m:
        raise StagingError(f"{pyproject}: no exact nvidia-cutlass-dsl==<version> pin")
    return m.group(1)


# The vLLM base is a CUDA 13 build: cutlass-dsl's cu13 libraries, as on the GPU host
# (../shared/gpuhost/stage-wheels); images/Dockerfile's ARG default says the same (a test checks).
DEFAULT_EXTRA_REQUIREMENTS = {"gpu": "pytest>=8.0 nvidia-cutlass-dsl[cu13]=={cutlass}", "cpu": ""}


def default_extra_requirements(kind: str) -> str:
    template = DEFAULT_EXTRA_REQUIREMENTS[kind]
    return template.format(cutlass=cutlass_pin()) if "{cutlass}" in template else template
DEFAULT_PYTHON = {"gpu": "python3", "cpu": "python3.11"}
# the venv of the GPU image sees the base's packages (torch, vLLM); the CPU image's venv is isolated
SEES_BASE_PACKAGES = {"gpu": True, "cpu": False}
TORCH_CPU = "2.13.0"  # scripts/bootstrap installs the same CPU build
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SOURCE_TOPS = ("k3_fastpath", "verify", "evals", "tests")
SOURCE_FILES = ("pyproject.toml", "README.md")
BUILD_REQUIREMENTS = ("setuptools>=68", "wheel")  # pyproject's build-system, installed from the wheelhouse

_PEP440 = re.compile(r"^(\d+!)?\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[a-z0-9]+(\.[a-z0-9]+)*)?$",
                     re.IGNORECASE)


@dataclass(frozen=True)
class BaseInfo:
    """What ``probe_base`` found in the base image: its Python, libc, machine and installed packages."""

    python: str  # the interpreter the Dockerfile calls (python3, python3.11)
    version: tuple[int, int, int]
    glibc: str | None  # "2.36"; None for musl or unknown
    machine: str
    dists: dict[str, str] = field(default_factory=dict)  # canonical name -> version

    @property
    def minor(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dockerfile_default_base(dockerfile: Path) -> str:
    """The ``ARG BASE_IMAGE=...`` default of a Dockerfile: the one place the pinned base is written."""
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"\s*ARG\s+BASE_IMAGE=(\S+)\s*$", line)
        if m:
            return m.group(1).strip("\"'")
    raise StagingError(f"{dockerfile}: no 'ARG BASE_IMAGE=<image>' line")


def count_build_steps(dockerfile: Path) -> int:
    """Instructions in a Dockerfile = the classic builder's 'Step k/N' total (drives the progress bar)."""
    n = 0
    continued = False
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not continued and (not line or line.startswith("#")):
            continue
        if not continued:
            n += 1
        continued = line.endswith("\\")
    return n


def parse_extras(extras: str) -> list[str]:
    names = [e.strip() for e in extras.split(",") if e.strip()]
    bad = [e for e in names if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", e)]
    if bad:
        raise StagingError(f"--extras: not an extra name: {bad[0]!r} (comma-separated, e.g. gpu,eval)")
    return names


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    """The project's files to copy into the image (relative paths): tracked and untracked-but-not-ignored
    files of a git checkout, or a plain walk of a copied tree; never caches or build outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              *SOURCE_TOPS, *SOURCE_FILES], cwd=root, capture_output=True, check=True,
                             timeout=60).stdout.decode()
        rels = [Path(p) for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        rels = [Path(f) for f in SOURCE_FILES]
        for top in SOURCE_TOPS:
            rels += [p.relative_to(root) for p in (root / top).rglob("*") if p.is_file()]
    keep = [r for r in rels if "__pycache__" not in r.parts and r.suffix != ".pyc" and (root / r).is_file()]
    missing = [f for f in SOURCE_FILES if Path(f) not in keep]
    if missing:
        raise StagingError(f"{root}: not a k3-verify source tree ({missing[0]} missing)")
    return sorted(set(keep))


def copy_sources(dest: Path, root: Path = REPO_ROOT) -> int:
    files = source_files(root)
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)
    return len(files)


def git_identity(root: Path = REPO_ROOT) -> tuple[str, bool | None]:
    """(commit, dirty) of the tree being built; K3_SOURCE_COMMIT when there is no checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=20).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", *SOURCE_TOPS, *SOURCE_FILES], cwd=root,
                                capture_output=True, text=True, check=True, timeout=60).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("K3_SOURCE_COMMIT", "unknown"), None


def write_stub_wheel(directory: Path, name: str, version: str) -> Path:
    """A metadata-only wheel standing for a package the base image already has (see module docstring)."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                            "Summary: stub: provided by the base image\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: k3-verify image build\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
        z.writestr(f"{info}/RECORD", "".join(f"{a},,\n" for a in files) + f"{info}/RECORD,,\n")
    return path


def platform_tags(base: BaseInfo) -> list[str]:
    """pip --platform values for a glibc Linux base: manylinux_2_X down to 2_17 plus the legacy aliases."""
    if not base.glibc:
        raise StagingError(f"the base image's libc is not glibc ({base.machine}): cannot pick wheel tags")
    major, minor = (int(x) for x in base.glibc.split(".")[:2])
    tags = [f"manylinux_{major}_{m}_{base.machine}" for m in range(minor, 16, -1)]
    return tags + [f"manylinux2014_{base.machine}", f"linux_{base.machine}"]


def _host_matches(base: BaseInfo) -> bool:
    libc, ver = platform.libc_ver()
    host_glibc = tuple(int(x) for x in ver.split(".")[:2]) if libc == "glibc" and ver else None
    base_glibc = tuple(int(x) for x in base.glibc.split(".")[:2]) if base.glibc else None
    return (sys.platform == "linux" and platform.machine() == base.machine
            and sys.version_info[:2] == base.version[:2]
            and host_glibc is not None and base_glibc is not None and host_glibc <= base_glibc)


def _torch_cpu_sources() -> list[str]:
    local = Path("/opt/wheels")
    if local.is_dir() and any(local.glob(f"torch-{TORCH_CPU}*.whl")):
        return ["--find-links", str(local)]
    return ["--extra-index-url", TORCH_CPU_INDEX]


def _pip(args: list[str], log) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    log(" ".join(cmd))
    return subprocess.run(cmd, capture_output=True, text=True)


def _pip_failure(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines()
             if ln.startswith("ERROR") or "conflict" in ln.lower()]
    return (lines[0] if lines else (proc.stderr.strip().splitlines() or ["pip failed"])[-1])[:400]


@dataclass
class WheelPlan:
    kind: str
    extras: list[str]
    extra_requirements: list[str]
    base: BaseInfo


def stub_version(version: str) -> str:
    """The stub's version: the base's, plus a local label no index carries, so that pip can only pick the
    stub for the pin (a public 2.2.6 would otherwise beat a stub 2.2.6 by its more specific wheel tag).
    PEP 440: a specifier without a local label ignores it, so every requirement the real version meets,
    the stub meets too."""
    return f"{version}{'.' if '+' in version else '+'}k3base"


_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")


def stage_wheels(plan: WheelPlan, src: Path, wheel_dir: Path, scratch: Path, cache: Path | None = None,
                 log=lambda s: None) -> list[str]:
    """Fill ``wheel_dir`` with exactly the wheels ``pip install --no-index -e src[extras]`` needs in the
    image; ``cache`` (a kept wheelhouse) is tried offline first and receives the new wheels. Returns the
    wheel file names. Raises StagingError with pip's first error line."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    stubs = scratch / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    pins = []
    stub_names = set()
    if SEES_BASE_PACKAGES[plan.kind]:
        for name, version in sorted(plan.base.dists.items()):
            # never stub what the image's pip must install from the wheelhouse itself: the project, and the
            # build requirements (pip's isolated build env does not see the base's site-packages)
            if _PEP440.match(version) and name not in ("k3-verify", "pip", "setuptools", "wheel"):
                stub_names.add(write_stub_wheel(stubs, name, stub_version(version)).name)
                pins.append(f"{name}=={stub_version(version)}")
    extra_src: list[str] = []
    if plan.kind == "cpu":
        pins.append(f"torch=={TORCH_CPU}+cpu")
        extra_src = _torch_cpu_sources()
    constraints = scratch / "constraints.txt"
    constraints.write_text("".join(p + "\n" for p in pins))
    project = f"{src}[{','.join(plan.extras)}]" if plan.extras else str(src)
    reqs = [*BUILD_REQUIREMENTS, project, *plan.extra_requirements]
    links = ["-c", str(constraints), "--find-links", str(stubs)]
    if cache:
        cache.mkdir(parents=True, exist_ok=True)
        links += ["--find-links", str(cache)]
    if _host_matches(plan.base):  # the host's pip builds/fetches exactly what the image's pip will want
        cmd = ["wheel", "--wheel-dir", str(wheel_dir), *links]
    else:  # fetch binaries for the image's tags; sdist-only packages are built here when pure Python
        pure = scratch / "pure-wheels"
        pure.mkdir()
        cmd = ["download", "--dest", str(wheel_dir), "--only-binary=:all:", "--python-version", plan.base.minor,
               "--implementation", "cp", "--abi", f"cp{plan.base.version[0]}{plan.base.version[1]}",
               *[x for tag in platform_tags(plan.base) for x in ("--platform", tag)], *links,
               "--find-links", str(pure)]
    proc = _pip([*cmd, "--no-index", *reqs], log) if cache else None  # offline first
    built: set[str] = set()
    while proc is None or proc.returncode != 0:
        proc = _pip([*cmd, *extra_src, *reqs], log)
        if proc.returncode == 0 or cmd[0] == "wheel":
            break
        m = _NO_MATCH.search(proc.stderr + proc.stdout)
        if not m or m.group(1) in built:
            break
        built.add(m.group(1))  # no wheel for the image's Python: build one on the host; fine if pure
        w = _pip(["wheel", "--no-deps", "--wheel-dir", str(pure), *links, *extra_src, m.group(1)], log)
        impure = [p.name for p in pure.glob("*.whl") if not p.name.endswith("-none-any.whl")]
        if w.returncode != 0 or impure:
            raise StagingError(f"{m.group(1)}: no wheel for Python {plan.base.minor} on the index and "
                               f"{'it is not pure Python' if impure else 'building one failed'}: run image "
                               f"build from a Python {plan.base.minor} environment")
    if proc.returncode != 0:
        raise StagingError(f"pip {cmd[0]} for the image's Python {plan.base.minor} failed: {_pip_failure(proc)}")
    for w in wheel_dir.glob("*.whl"):
        if w.name in stub_names or w.name.startswith("k3_verify-"):
            w.unlink()  # stubs stand for the base's packages; the project installs from src/
        elif cache and not (cache / w.name).exists():
            shutil.copy2(w, cache / w.name)
    return sorted(w.name for w in wheel_dir.glob("*.whl"))


def wheelhouse_sha256(wheel_dir: Path, names: list[str]) -> str:
    h = hashlib.sha256()
    for n in sorted(names):
        h.update(n.encode() + b"\0" + hashlib.sha256((wheel_dir / n).read_bytes()).digest())
    return h.hexdigest()


def build_args(kind: str, base_image: str, base_digest: str, python: str, extras: list[str],
               extra_requirements: list[str], wheels_sha: str, root: Path = REPO_ROOT) -> dict[str, str]:
    """The Dockerfile ARGs that make up the image's identity (they become ENV K3_IMAGE_BUILD_ARGS, which
    every bundle's manifest records under env.image.build_args)."""
    commit, dirty = git_identity(root)
    return {
        "BASE_IMAGE": base_image,
        "K3_BASE_DIGEST": base_digest,
        "PYTHON": python,
        "K3_EXTRAS": ",".join(extras),
        "K3_EXTRA_REQUIREMENTS": " ".join(extra_requirements),
        "K3_SOURCE_COMMIT": commit,
        "K3_SOURCE_DIRTY": {True: "true", False: "false", None: "unknown"}[dirty],
        "K3_BUILD_DATE": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "K3_WHEELHOUSE_SHA256": wheels_sha,
    }


def stage_context(ctx: Path, plan: WheelPlan, wheelhouse: Path | None, log=lambda s: None) -> dict[str, Any]:
    """Stage Dockerfile + src/ + wheels/ into ``ctx`` (which must be empty or absent)."""
    if ctx.exists() and any(ctx.iterdir()):
        raise StagingError(f"build context directory {ctx} exists and is not empty")
    ctx.mkdir(parents=True, exist_ok=True)
    shutil.copy2(DOCKERFILES[plan.kind], ctx / "Dockerfile")
    n_src = copy_sources(ctx / "src")
    scratch = ctx.parent / f".{ctx.name}.scratch"
    try:
        names = stage_wheels(plan, ctx / "src", ctx / "wheels", scratch, wheelhouse, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for leftover in ("build", "k3_verify.egg-info"):  # from pip building the project's metadata in src/
        shutil.rmtree(ctx / "src" / leftover, ignore_errors=True)
    return {"source_files": n_src, "wheels": names, "wheelhouse_sha256": wheelhouse_sha256(ctx / "wheels", names)}


def write_identity_preview(ctx: Path, args: dict[str, str]) -> None:
    """The build args next to the staged context, for a manual ``docker build`` (images/README.md)."""
    (ctx / "build-args.json").write_text(json.dumps(args, indent=2, sort_keys=True) + "\n")
