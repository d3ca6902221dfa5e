"""``k3-verify image build`` / ``image run``: the k3-verify container images through the Docker SDK.

Build: connect to the engine (``DOCKER_HOST`` or ``--docker-host``; API version negotiated, never
pinned), make sure the base image is there (pull it unless ``--no-pull``), probe it (its Python, libc
and installed packages decide which wheels to stage), stage the build context on the host
(``verify.image_build``), then build with the classic builder while streaming its log: a rich progress
bar over the Dockerfile's steps and every log line on stderr. The image's identity (base image and
digest, extras, source commit, build date, wheelhouse hash) goes in as build args and ends up in every
bundle's manifest.

Run: the image with the bundle directory mounted at ``/bundles``, the host's uid:gid (bundles belong to
whoever ran it), no network by default, a GPU request when the host has a GPU (``--gpus auto``), and
``K3_IMAGE_DIGEST`` set to the image's id so the bundle records exactly which image ran. The container's
output is streamed; its exit code becomes ours (0 ok, 1 a check failed, 2 usage).

No engine reachable, no docker SDK, a missing image: one line on stderr, exit 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verify.image_build import (
    DEFAULT_EXTRAS,
    DEFAULT_PYTHON,
    DEFAULT_TAGS,
    DOCKERFILES,
    BaseInfo,
    StagingError,
    WheelPlan,
    build_args,
    canonical,
    count_build_steps,
    default_extra_requirements,
    dockerfile_default_base,
    parse_extras,
    stage_context,
)
from verify.output import Output, UserError

KINDS = ("cpu", "gpu")
GPU_MODES = ("auto", "all", "none")
CONTAINER_BUNDLES = "/bundles"

# Runs inside the base image with its own Python (no pip needed): what the wheels must fit.
_PROBE = r"""
import json, platform, sys
try:
    from importlib import metadata
    dists = {}
    for d in metadata.distributions():
        name = d.metadata["Name"]
        if name:
            dists[name] = d.version
except Exception:
    dists = {}
libc, ver = platform.libc_ver()
print("K3PROBE " + json.dumps({"version": list(sys.version_info[:3]), "glibc": ver if libc == "glibc" else None,
                              "machine": platform.machine(), "dists": dists}))
"""


class ImageError(Exception):
    """The build or the run failed (not a usage error): one line, exit 1."""


def _log_line(out: Output, line: str) -> None:
    """A log line on stderr, verbatim (never parsed as rich markup: logs hold brackets)."""
    if not out.is_json:
        out.err_console.print(line, style="dim", markup=False, highlight=False)


def _docker():
    try:
        import docker
    except ImportError:
        raise UserError("the docker Python package is needed for `k3-verify image`: "
                        "pip install 'docker>=7.0' (it is in the dev extra)") from None
    return docker


def connect(docker_host: str | None, timeout: int = 600) -> Any:
    """A docker-py client that has answered a ping; UserError (one line) when no engine is reachable."""
    docker = _docker()
    where = docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = (docker.DockerClient(base_url=docker_host, version="auto", timeout=timeout) if docker_host
                  else docker.from_env(version="auto", timeout=timeout))
        client.ping()
    except Exception as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise UserError(f"no Docker engine reachable at {where} ({reason}); start dockerd or point "
                        f"DOCKER_HOST / --docker-host at its socket") from None
    return client


def pull_ref(ref: str) -> tuple[str, str | None]:
    """(repository, tag or digest) for docker-py's pull; with ``repo:tag@sha256:...`` the digest wins."""
    if "@" in ref:
        repo, digest = ref.split("@", 1)
        last = repo.rsplit("/", 1)[-1]
        if ":" in last:
            repo = repo[: len(repo) - len(last)] + last.split(":", 1)[0]
        return repo, digest
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        return ref[: len(ref) - len(last)] + last.split(":", 1)[0], last.split(":", 1)[1]
    return ref, "latest"


def ensure_base(client: Any, ref: str, pull: bool, out: Output) -> Any:
    docker = _docker()
    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        pass
    except docker.errors.APIError as e:
        raise ImageError(f"cannot inspect base image {ref}: {e.explanation or e}") from None
    if not pull:
        raise UserError(f"base image {ref} is not present in the engine and --no-pull was given")
    repo, tag = pull_ref(ref)
    out.note(f"pulling base image {ref} ...")
    try:
        for ev in client.api.pull(repo, tag=tag, stream=True, decode=True):
            if "error" in ev:
                raise ImageError(f"pulling {ref} failed: {ev['error']}")
            if ev.get("status") and not ev.get("progressDetail"):
                _log_line(out, f"  {ev.get('id', '')} {ev['status']}".rstrip())
        return client.images.get(ref)
    except docker.errors.APIError as e:
        raise ImageError(f"pulling {ref} failed: {e.explanation or e}") from None


def base_digest(image: Any) -> str:
    """The registry digest the base was pulled by (repo@sha256:...), else its local image id."""
    digests = image.attrs.get("RepoDigests") or []
    return digests[0] if digests else image.id


def probe_base(client: Any, ref: str, python: str) -> BaseInfo:
    """Run ``python`` in the base image (no network) and read its version, libc, machine and packages."""
    docker = _docker()
    try:
        raw = client.containers.run(ref, entrypoint=[python, "-c", _PROBE], network_mode="none", remove=True,
                                    stdout=True, stderr=True, user="0")
    except docker.errors.ContainerError as e:
        msg = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        raise UserError(f"base image {ref}: `{python}` failed ({msg[-1] if msg else e}); pass --python") from None
    except docker.errors.APIError as e:
        raise UserError(f"base image {ref}: cannot run `{python}` ({e.explanation or e}); pass --python") from None
    line = next((ln for ln in raw.decode(errors="replace").splitlines() if ln.startswith("K3PROBE ")), None)
    if line is None:
        raise ImageError(f"base image {ref}: the Python probe printed nothing")
    d = json.loads(line[len("K3PROBE "):])
    return BaseInfo(python=python, version=tuple(d["version"]), glibc=d["glibc"], machine=d["machine"],
                    dists={canonical(k): v for k, v in d["dists"].items()})


_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)$")


def stream_build(client: Any, ctx: Path, tag: str, args: dict[str, str], labels: dict[str, str], steps: int,
                 out: Output, nocache: bool) -> tuple[Any, list[str]]:
    """Classic-builder build of ``ctx`` with the log streamed: a progress bar over the steps, each log
    line on stderr. Returns (image, log lines); ImageError with the failing step on failure."""
    log: list[str] = []
    current = ""
    image_id = None
    with out.progress(steps, f"building {tag}") as bar:
        try:
            stream = client.api.build(path=str(ctx), tag=tag, buildargs=args, labels=labels, rm=True,
                                      forcerm=True, nocache=nocache, pull=False, decode=True)
            for ev in stream:
                if "error" in ev:
                    log.append(ev["error"].rstrip())
                    raise ImageError(f"image build failed at {current or 'the start'}: "
                                     f"{' '.join(ev['error'].split())[:300]}")
                text = ev.get("stream", "")
                if "aux" in ev and isinstance(ev["aux"], dict) and ev["aux"].get("ID"):
                    image_id = ev["aux"]["ID"]
                for ln in text.splitlines():
                    if not ln.strip():
                        continue
                    log.append(ln)
                    m = _STEP.match(ln)
                    if m:
                        current = f"step {m.group(1)}/{m.group(2)} ({m.group(3)[:60]})"
                        bar.advance(1, description=f"{tag}: step {m.group(1)}/{m.group(2)}")
                    _log_line(out, ln)
        except _docker().errors.APIError as e:
            raise ImageError(f"image build failed: {e.explanation or e}") from None
    if image_id is None:
        m = next((re.match(r"Successfully built (\w+)", ln) for ln in reversed(log)
                  if ln.startswith("Successfully built")), None)
        image_id = m.group(1) if m else tag
    return client.images.get(image_id), log


@dataclass(frozen=True)
class BuildRequest:
    kind: str
    tag: str | None
    base: str | None
    extras: str | None
    extra_requirements: str | None
    python: str | None
    wheelhouse: Path | None
    stage_only: Path | None
    pull: bool
    nocache: bool
    docker_host: str | None


def _resolve(req: BuildRequest) -> tuple[str, str, list[str], list[str], str]:
    if req.kind not in KINDS:
        raise UserError(f"--kind must be one of {', '.join(KINDS)}, got {req.kind!r}")
    try:
        extras = parse_extras(DEFAULT_EXTRAS[req.kind] if req.extras is None else req.extras)
        base = req.base or dockerfile_default_base(DOCKERFILES[req.kind])
        extra_reqs = (default_extra_requirements(req.kind) if req.extra_requirements is None
                      else req.extra_requirements).split()
    except StagingError as e:
        raise UserError(str(e)) from None
    return base, req.tag or DEFAULT_TAGS[req.kind], extras, extra_reqs, req.python or DEFAULT_PYTHON[req.kind]


def build(req: BuildRequest, out: Output) -> dict[str, Any]:
    base_ref, tag, extras, extra_reqs, python = _resolve(req)
    client = connect(req.docker_host)
    base_image = ensure_base(client, base_ref, req.pull, out)
    info = probe_base(client, base_ref, python)
    out.note(f"base {base_ref}: Python {'.'.join(map(str, info.version))}, glibc {info.glibc}, "
             f"{len(info.dists)} packages installed")
    plan = WheelPlan(kind=req.kind, extras=extras, extra_requirements=extra_reqs, base=info)
    tmp = None
    if req.stage_only:
        ctx = req.stage_only
    else:
        tmp = tempfile.mkdtemp(prefix="k3-image-")
        ctx = Path(tmp) / "context"
    try:
        try:
            staged = stage_context(ctx, plan, req.wheelhouse, log=lambda s: _log_line(out, f"$ {s}"))
        except StagingError as e:
            raise ImageError(str(e)) from None
        out.note(f"staged {staged['source_files']} source files and {len(staged['wheels'])} wheels in {ctx}")
        args = build_args(req.kind, base_ref, base_digest(base_image), python, extras, extra_reqs,
                          staged["wheelhouse_sha256"])
        result: dict[str, Any] = {"kind": req.kind, "tag": tag, "base_image": base_ref, "build_args": args,
                                  "wheels": staged["wheels"], "context": str(ctx)}
        if req.stage_only:
            (ctx / "build-args.json").write_text(json.dumps(args, indent=2, sort_keys=True) + "\n")
            result["staged_only"] = True
            return result
        labels = {"org.k3-verify.kind": req.kind, "org.k3-verify.wheelhouse-sha256": staged["wheelhouse_sha256"]}
        steps = count_build_steps(ctx / "Dockerfile") + len(labels)  # the engine adds one LABEL step each
        image, log = stream_build(client, ctx, tag, args, labels, steps, out, req.nocache)
        result.update(image_id=image.id, size_bytes=image.attrs.get("Size"), log_tail=log[-20:])
        return result
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


# ---- run

def host_has_gpu() -> bool:
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return True
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    import subprocess

    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise UserError(f"--env expects NAME=VALUE, got {p!r}")
        env[k] = v
    return env


@dataclass(frozen=True)
class RunRequest:
    tag: str
    args: list[str]
    bundles: Path
    gpus: str
    network: str
    user: str | None  # None: the host's uid:gid
    env: list[str]
    shm_size: str
    keep: bool
    docker_host: str | None


def container_options(req: RunRequest, image: Any, gpu_present: bool) -> dict[str, Any]:
    """docker-py ``containers.run`` keyword arguments for a run request (no engine call: unit-testable)."""
    if req.gpus not in GPU_MODES:
        raise UserError(f"--gpus must be one of {', '.join(GPU_MODES)}, got {req.gpus!r}")
    env = {"K3_IMAGE_DIGEST": image.id, "K3_IMAGE_REF": req.tag}
    repo_digests = image.attrs.get("RepoDigests") or []
    if repo_digests:
        env["K3_IMAGE_REPO_DIGESTS"] = json.dumps(repo_digests)
    env.update(parse_env(req.env))
    opts: dict[str, Any] = {
        "command": list(req.args), "detach": True, "environment": env, "network_mode": req.network,
        "volumes": {str(req.bundles.resolve()): {"bind": CONTAINER_BUNDLES, "mode": "rw"}},
        "user": req.user if req.user is not None else f"{os.getuid()}:{os.getgid()}",
        "shm_size": req.shm_size, "working_dir": "/",
    }
    if req.gpus == "all" or (req.gpus == "auto" and gpu_present):
        opts["device_requests"] = [_docker().types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return opts


def _bundle_dirs(root: Path) -> set[str]:
    local = root / "local"
    return {p.name for p in local.iterdir() if p.is_dir()} if local.is_dir() else set()


@contextlib.contextmanager
def _stop_on_signal(container: Any) -> Iterator[None]:
    """Ctrl-C / SIGTERM stop the container (SIGTERM inside: the run finalizes an interrupted bundle)."""
    def handler(signum: int, frame: Any) -> None:
        with contextlib.suppress(Exception):
            container.stop(timeout=60)

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(req: RunRequest, out: Output) -> dict[str, Any]:
    if req.gpus not in GPU_MODES:  # bad arguments are reported before any engine is contacted
        raise UserError(f"--gpus must be one of {', '.join(GPU_MODES)}, got {req.gpus!r}")
    parse_env(req.env)
    docker = _docker()
    client = connect(req.docker_host)
    try:
        image = client.images.get(req.tag)
    except docker.errors.ImageNotFound:
        raise UserError(f"image {req.tag} not found in the engine: build it with `k3-verify image build`") from None
    req.bundles.mkdir(parents=True, exist_ok=True)
    before = _bundle_dirs(req.bundles)
    gpu = host_has_gpu() if req.gpus == "auto" else req.gpus == "all"
    opts = container_options(req, image, gpu)
    _log_line(out, f"running {req.tag} ({image.id[:19]}) {' '.join(req.args)}  bundles -> {req.bundles}"
             f"{'  gpus: all' if 'device_requests' in opts else ''}")
    try:
        container = client.containers.run(req.tag, **opts)
    except docker.errors.APIError as e:
        raise ImageError(f"cannot start {req.tag}: {' '.join(str(e.explanation or e).split())[:300]}") from None
    # the container's stdout to ours (to stderr under --format json: stdout is the JSON document), its
    # stderr to our stderr; logs=True replays what it wrote before we attached
    sink = sys.stderr if out.is_json else sys.stdout
    try:
        with _stop_on_signal(container):
            for o, e in container.attach(stdout=True, stderr=True, stream=True, logs=True, demux=True):
                for data, stream in ((o, sink), (e, sys.stderr)):
                    if data:
                        stream.write(data.decode(errors="replace"))
                        stream.flush()
            status = container.wait()
    finally:
        if not req.keep:
            with contextlib.suppress(Exception):
                container.remove(force=True)
    code = int(status.get("StatusCode", 1))
    new = sorted(_bundle_dirs(req.bundles) - before)
    return {"tag": req.tag, "image_id": image.id, "exit_code": code, "gpus": "device_requests" in opts,
            "bundles": [str(req.bundles / "local" / n) for n in new],
            "error": (status.get("Error") or {}).get("Message") if isinstance(status.get("Error"), dict) else None}
