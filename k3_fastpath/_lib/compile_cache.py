"""Compile cache for the CuTe DSL kernels: in memory always, on disk as far as cutlass-dsl 4.8.1 allows.

Key (``CompileKey``): kernel name, dtype, static shapes, the kernel's frozen config dataclass, the target
arch, a hash of the source of ``k3_fastpath/kernels`` + ``k3_fastpath/_lib`` and the cutlass-dsl version.
A kernel's compile function takes exactly these (``compile_skinny_gemm(dtype, N, K, config)``) and calls
``get_or_compile(key, build)``; ``build(options)`` runs ``cute.compile(..., options=options)``.

Lookup order on a call:
1. the in-memory dict (the hot path: a dict lookup, nothing else);
2. a miss while the current CUDA stream is capturing a graph raises ``CompileDuringCaptureError``:
   compiling then would stall capture for seconds and is always a missing ``precompile()``;
3. an exported object on disk (``<dir>/<kernel>/<digest>/kernel.o``) loaded with
   ``cute.runtime.load_module``;
4. compile, then write to ``<dir>/<kernel>/<digest>/``: ``key.json`` (the key, compile seconds, export
   status), the PTX and cubin (always; they are what ``nvdisasm`` and the SASS checks read), and an
   exported ``kernel.o``/``kernel.h`` via ``JitCompiledFunction.export_to_c``.

What the disk cache needs, and where it works: ``export_to_c`` writes a C header for the compiled
function's arguments, so every argument of a kernel's ``@cute.jit`` entry must be typed; an untyped
``stream`` made cutlass-dsl 4.8.1 refuse the export ("Unsupported argument for c function argument
generation: stream = FakeStream"): every kernel annotates it ``stream: cuda.CUstream``, and the export
then succeeds on the CPU as well. Loading (``load_module``) JIT-links the host launcher against the CUDA
runtime: on a machine without it (CPU CI) the load fails ("Symbols not found: _cudaLaunchKernelEx ...")
and the function is recompiled (the failure is recorded in ``disk_status()["load"]``). The export +
reload round trip on the GPU host is checked by ``tests/test_kernels_gpu.py::test_disk_cache_roundtrip``;
a failed export is recorded once per process (``disk_status()``) and never retried.

Directory: ``$K3_KERNEL_CACHE`` or ``~/.cache/k3_fastpath``. ``K3_KERNEL_CACHE_DISK=0`` disables disk I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import arch

_PKG_ROOT = Path(__file__).resolve().parent.parent  # k3_fastpath/
_HASHED_DIRS = ("kernels", "_lib")


class CompileDuringCaptureError(RuntimeError):
    """A kernel was not precompiled and the miss happened during CUDA-graph capture."""


@dataclass(frozen=True)
class CompileKey:
    kernel: str
    dtype: str
    shapes: tuple[Any, ...]
    config: Any  # a frozen dataclass (hashable)
    arch: str
    source_hash: str
    cutlass_version: str

    @classmethod
    def make(cls, kernel: str, dtype: str, shapes: tuple[Any, ...], config: Any) -> CompileKey:
        return cls(kernel, dtype, tuple(shapes), config, arch.compile_arch(), source_hash(),
                   arch.cutlass_version() or "none")

    def as_dict(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else repr(self.config)
        return {"kernel": self.kernel, "dtype": self.dtype, "shapes": list(self.shapes), "config": cfg,
                "config_type": type(self.config).__name__, "arch": self.arch,
                "source_hash": self.source_hash, "cutlass_version": self.cutlass_version}

    def digest(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:20]


@dataclass
class CompileRecord:
    key: CompileKey
    source: str  # "compiled" | "disk"
    seconds: float


_lock = threading.RLock()
_memory: dict[CompileKey, Any] = {}
_records: list[CompileRecord] = []
_disk_status: dict[str, str] = {}  # "export" -> "ok" | reason it failed


def source_hash() -> str:
    """sha256 (16 hex) of every .py under k3_fastpath/kernels and k3_fastpath/_lib, path-sorted."""
    with _lock:
        if _source_hash_cache:
            return _source_hash_cache[0]
        h = hashlib.sha256()
        for sub in _HASHED_DIRS:
            for p in sorted((_PKG_ROOT / sub).rglob("*.py")):
                h.update(str(p.relative_to(_PKG_ROOT)).encode())
                h.update(p.read_bytes())
        _source_hash_cache.append(h.hexdigest()[:16])
        return _source_hash_cache[0]


_source_hash_cache: list[str] = []


def cache_dir() -> Path:
    return Path(os.environ.get("K3_KERNEL_CACHE") or Path.home() / ".cache" / "k3_fastpath")


def disk_enabled() -> bool:
    return os.environ.get("K3_KERNEL_CACHE_DISK", "1").lower() not in ("0", "false", "off", "no")


def disk_status() -> dict[str, str]:
    """What the disk cache managed in this process: {"export": "ok" | "<reason it failed>"}."""
    with _lock:
        return dict(_disk_status)


def is_capturing() -> bool:
    """True while the current CUDA stream captures a graph (False without torch/CUDA)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def entry_dir(key: CompileKey) -> Path:
    return cache_dir() / key.kernel / key.digest()


def _export_prefix(key: CompileKey) -> str:
    return f"k3_{key.kernel}_{key.digest()}"


def _load_from_disk(key: CompileKey) -> Any | None:
    obj = entry_dir(key) / "kernel.o"
    if not (disk_enabled() and obj.is_file()):
        return None
    try:
        import cutlass.cute as cute

        return cute.runtime.load_module(str(obj))[_export_prefix(key)]
    except Exception as e:  # a stale or foreign object file: recompile, and say so in the status
        with _lock:
            _disk_status["load"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return None


def _save_to_disk(key: CompileKey, fn: Any, seconds: float, d: Path) -> None:
    meta = {"key": key.as_dict(), "compile_seconds": round(seconds, 3), "export": "skipped"}
    if _disk_status.get("export", "ok") == "ok":
        try:
            fn.export_to_c(str(d), "kernel", function_prefix=_export_prefix(key))
            meta["export"] = _disk_status["export"] = "ok"
        except Exception as e:
            msg = [re.sub(r"\x1b\[[0-9;]*m", "", m).strip() for m in str(e).strip().splitlines()]
            reason = next((m for m in msg if m.startswith("error:")), msg[0] if msg else "")
            _disk_status["export"] = f"unsupported here: {type(e).__name__}: {reason[:300]}"
            meta["export"] = _disk_status["export"]
            for stale in ("kernel.o", "kernel.h"):
                (d / stale).unlink(missing_ok=True)
    else:
        meta["export"] = _disk_status["export"]
    tmp = d / "key.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
    tmp.replace(d / "key.json")


def compile_options(key: CompileKey, dump_dir: Path | None) -> str:
    opts = f"--gpu-arch {key.arch}"
    if dump_dir is not None:
        opts += f" --keep-ptx --keep-cubin --dump-dir {shlex.quote(str(dump_dir))}"
    return opts


def get_or_compile(key: CompileKey, build: Callable[[str], Any]) -> Any:
    """The compiled function for ``key``; ``build(options)`` compiles it on a miss."""
    fn = _memory.get(key)
    if fn is not None:
        return fn
    if is_capturing():
        raise CompileDuringCaptureError(
            f"kernel {key.kernel} {key.dtype} shapes={key.shapes} config={key.config} is not compiled "
            "and the current stream is capturing a CUDA graph; call k3_fastpath._lib.compile_cache."
            "kernels.precompile(<preset>) (or the kernel's precompile) before capture")
    with _lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        t0 = time.perf_counter()
        fn = _load_from_disk(key)
        source = "disk"
        if fn is None:
            d = entry_dir(key) if disk_enabled() else None
            if d is not None:
                try:
                    d.mkdir(parents=True, exist_ok=True)
                except OSError:
                    d = None
            fn = build(compile_options(key, d))
            source = "compiled"
            if d is not None:
                try:
                    _save_to_disk(key, fn, time.perf_counter() - t0, d)
                except OSError as e:
                    _disk_status["write"] = f"failed: {e}"
        _memory[key] = fn
        _records.append(CompileRecord(key, source, time.perf_counter() - t0))
        return fn


def cached(key: CompileKey) -> bool:
    return key in _memory


def records() -> list[CompileRecord]:
    """Every compile/load this process did, in order, with its wall time."""
    with _lock:
        return list(_records)


def clear_memory() -> None:
    """Forget in-memory compiled functions (tests; the disk cache is untouched)."""
    with _lock:
        _memory.clear()
        _records.clear()


def artifact_paths(key: CompileKey) -> dict[str, Path]:
    """The cubin / PTX files written for ``key`` (present after a compile with the disk cache on)."""
    d = entry_dir(key)
    out: dict[str, Path] = {}
    for ext in ("cubin", "ptx"):
        hits = sorted(d.glob(f"*.{ext}"))
        if hits:
            out[ext] = hits[-1]
    return out
