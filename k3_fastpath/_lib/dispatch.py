"""What every torch-facing kernel op shares: the ``Support`` verdict and the common tensor checks.

A kernel's ``is_supported(...)`` (its ``_lib.kernel_op.KernelOp``) returns a ``Support``; ``Support(False,
reason)`` sends the call to the kernel's ``reference.py`` and records ``counters.count_fallback(op, reason)``. Reasons are short,
stable strings (they are counted and shown by the CLI): "no cuda device", "dtype float32 (needs
bfloat16)", "M=65 > 64", ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import arch


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


OK = Support(True)


def no(reason: str) -> Support:
    return Support(False, reason)


def check_tensors(tensors: dict[str, Any], dtype: Any, align: int = 16) -> Support:
    """DSL importable, all tensors on one sm_90 CUDA device, of ``dtype``, contiguous and aligned.

    ``None`` entries are skipped (optional operands). ``dtype`` may be a dict name -> dtype.
    """
    reason = arch.unavailable_reason()
    if reason:
        return no("cutlass-dsl unavailable")
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_cuda:
            return no("no cuda device" if device is None else f"{name} not on cuda")
        if device is None:
            device = t.device
        elif t.device != device:
            return no(f"{name} on another device")
        want = dtype[name] if isinstance(dtype, dict) else dtype
        if t.dtype != want:
            return no(f"{name} dtype {str(t.dtype).replace('torch.', '')} (needs {str(want).replace('torch.', '')})")
        if not t.is_contiguous():
            return no(f"{name} not contiguous")
        if t.data_ptr() % align:
            return no(f"{name} not {align}-byte aligned")
    if device is None:
        return no("no tensors")
    import torch

    if device.index is not None and device.index != torch.cuda.current_device():
        return no("tensors not on the current cuda device")  # compiled modules load per current device
    why = arch.sm90_unsupported_reason(device)
    if why:
        return no(why)
    return OK


def validate_row_launch(threads: int, vec_per_thread: int) -> None:
    """The launch shape of a one-CTA-per-row kernel: whole warps, at most 1024 threads, >= 1 vector each."""
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in 32..1024, got {threads}")
    if vec_per_thread < 1:
        raise ValueError("vec_per_thread must be >= 1")
