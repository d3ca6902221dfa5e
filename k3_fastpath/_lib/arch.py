"""GPU architecture and CuTe DSL availability, without importing either eagerly.

Everything here is safe on a CPU-only machine without ``nvidia-cutlass-dsl``: the DSL is imported on
first use only, and every query answers ``None``/``False`` (with a reason) instead of raising.

* ``is_available()`` / ``unavailable_reason()``: can ``cutlass.cute`` be imported here?
* ``cutlass_version()``: the installed ``nvidia-cutlass-dsl`` version (part of every compile-cache key).
* ``device_arch(device)``: ``"sm_90a"`` for an H100/H200, ``None`` without a CUDA device.
* ``compile_arch()``: the arch kernels are compiled for: ``CUTE_DSL_ARCH`` if set, else the device's,
  else ``sm_90a`` (the fast path's only target; a CPU machine compile-checks for it).
* ``sm90_unsupported_reason(device)`` / ``require_sm90(device)``: the gate the kernels' ``is_supported``
  uses, as a reason string or as a raised ``ArchError``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

TARGET_ARCH = "sm_90a"
SUPPORTED_CAPABILITIES = ((9, 0),)  # H100 / H200; the kernels use sm_90a PTX (mma.sync, setmaxnreg-free)


class ArchError(RuntimeError):
    """The machine cannot run the CuTe DSL fast path (no DSL, no CUDA device, or not sm_90)."""


@functools.lru_cache(maxsize=1)
def _import_cutlass() -> tuple[Any, str | None]:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute as cute
    except Exception as e:  # ImportError, or a broken install raising anything else
        return None, f"nvidia-cutlass-dsl is not importable ({type(e).__name__}: {e})"
    return cute, None


def is_available() -> bool:
    """True when ``cutlass.cute`` imports (kernels can at least be compiled)."""
    return _import_cutlass()[0] is not None


def unavailable_reason() -> str | None:
    """Why the DSL cannot be used here, or ``None`` when it can."""
    return _import_cutlass()[1]


@functools.lru_cache(maxsize=1)
def cutlass_version() -> str | None:
    """Installed ``nvidia-cutlass-dsl`` version, or ``None``."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def device_capability(device: Any = None) -> tuple[int, int] | None:
    """(major, minor) of ``device`` (default: the current device), or ``None`` without CUDA."""
    cuda = _torch_cuda()
    if cuda is None:
        return None
    return tuple(cuda.get_device_capability(device))  # type: ignore[return-value]


def arch_string(capability: tuple[int, int]) -> str:
    """(9, 0) -> 'sm_90a' (the arch-specific 'a' suffix from sm_90 on, as the DSL spells it)."""
    major, minor = capability
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def device_arch(device: Any = None) -> str | None:
    cap = device_capability(device)
    return None if cap is None else arch_string(cap)


@functools.lru_cache(maxsize=1)
def _detected_arch() -> str:
    return device_arch() or TARGET_ARCH


def compile_arch() -> str:
    """The arch to compile for: $CUTE_DSL_ARCH, else the current device's (detected once), else sm_90a."""
    return os.environ.get("CUTE_DSL_ARCH") or _detected_arch()


def sm90_unsupported_reason(device: Any = None) -> str | None:
    """``None`` when the fast path can run on ``device``; otherwise a one-line reason."""
    reason = unavailable_reason()
    if reason:
        return reason
    cap = device_capability(device)
    if cap is None:
        return "needs an sm_90 CUDA device (torch.cuda is unavailable)"
    if cap not in SUPPORTED_CAPABILITIES:
        return f"needs sm_90 (H100/H200); this device is {arch_string(cap)}"
    return None


def require_sm90(device: Any = None) -> None:
    """Raise ``ArchError`` with the reason unless the fast path can run on ``device``."""
    reason = sm90_unsupported_reason(device)
    if reason:
        raise ArchError(f"k3_fastpath kernels unavailable: {reason}")
