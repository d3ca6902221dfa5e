"""The one place torch tensors become CuTe tensors (and the compile-time fakes that match them).

A kernel is compiled once against *fake* tensors (``fake_tensor``) whose batch dimension is symbolic,
and launched with *real* tensors converted by ``to_cute``. The two must describe the same MLIR type:
same dtype, same static extents, the same dimensions marked dynamic, same assumed alignment. Both are
row-major (compact, last dimension contiguous): the kernels rely on it for 16-byte vector access.

``to_cute(t, align=16, dynamic_dims=(0,))`` checks what the kernel will assume (contiguity, alignment
of the base pointer) and raises ``ValueError`` rather than handing the kernel a tensor it would read
wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# torch dtype name -> cutlass numeric class name (resolved lazily: cutlass may be absent)
_DTYPES = {
    "torch.bfloat16": "BFloat16",
    "torch.float16": "Float16",
    "torch.float32": "Float32",
    "torch.int32": "Int32",
    "torch.int64": "Int64",
    "torch.uint8": "Uint8",
}


def cute_dtype(dtype: Any) -> Any:
    """torch dtype (or a cutlass numeric class, returned as is) -> cutlass numeric class."""
    import cutlass

    if isinstance(dtype, type):
        return dtype
    name = _DTYPES.get(str(dtype))
    if name is None:
        raise ValueError(f"no CuTe dtype for {dtype}")
    return getattr(cutlass, name)


def dtype_name(dtype: Any) -> str:
    """A stable short name for a compile-cache key: 'bf16', 'fp32', ..."""
    s = str(dtype).replace("torch.", "").replace("<class 'cutlass.base_dsl.typing.", "").rstrip("'>")
    return {"bfloat16": "bf16", "BFloat16": "bf16", "float16": "fp16", "Float16": "fp16",
            "float32": "fp32", "Float32": "fp32", "int32": "i32", "Int32": "i32"}.get(s, s)


def to_cute(t: Any, align: int = 16, dynamic_dims: Sequence[int] = (0,)) -> Any:
    """Wrap a contiguous torch tensor as a CuTe tensor (zero copy, via DLPack).

    ``align``: byte alignment the kernel may assume for the base pointer (checked here).
    ``dynamic_dims``: dimensions whose extent varies between calls (the decode batch); they are
    marked dynamic so one compiled kernel serves every extent. Every other extent is static and must
    equal the one the kernel was compiled for.
    """
    from cutlass.cute.runtime import from_dlpack

    if not t.is_contiguous():
        raise ValueError(f"to_cute needs a contiguous tensor (shape {tuple(t.shape)}, stride {t.stride()})")
    if align > 1 and t.data_ptr() % align:
        raise ValueError(f"to_cute: base pointer {t.data_ptr():#x} is not {align}-byte aligned")
    canonical, acc = [], 1
    for n in reversed(t.shape):
        canonical.insert(0, acc)
        acc *= n
    if list(t.stride()) != canonical:  # contiguous but with odd strides on size-1 dims (e.g. after .t())
        t = t.as_strided(t.shape, canonical)
    ct = from_dlpack(t.detach(), assumed_align=align)
    for d in dynamic_dims:
        if d >= t.dim():
            raise ValueError(f"to_cute: dynamic dim {d} out of range for a {t.dim()}-d tensor")
        ct = ct.mark_compact_shape_dynamic(mode=d, stride_order=tuple(range(t.dim())))
    return ct


def fake_tensor(dtype: Any, shape: Sequence[int | None], align: int = 16) -> Any:
    """A compile-time stand-in for a row-major tensor; ``None`` extents are symbolic (dynamic).

    Matches what ``to_cute(t, align, dynamic_dims=[i for i, s in enumerate(shape) if s is None])``
    produces for a contiguous ``t`` of that dtype.
    """
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    dims = tuple(cute.sym_int() if s is None else int(s) for s in shape)
    order = tuple(range(len(dims) - 1, -1, -1))  # last mode contiguous (row-major)
    return make_fake_compact_tensor(cute_dtype(dtype), dims, stride_order=order, assumed_align=align)


def fake_stream() -> Any:
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream()


def current_stream(device: Any = None) -> Any:
    """torch's current CUDA stream as the ``CUstream`` a compiled CuTe function takes."""
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
