"""``torch.compile`` for the strong standard path's glue (``standard_op_table(compiled_glue=True)``), safe
inside the executor's own CUDA graphs.

Issue #5's reference standard path is "cuBLAS + fla + torch's grouped GEMM + compiled glue". Eager glue
makes a decode step launch-bound: an RMSNorm is ~8 kernels, the KDA conv update ~24, the experts' sort /
offsets / combine ~20, per layer, 93 layers at TP16 (the standard step measured ~10x its HBM floor at batch
1 on an H200, the issue's reference ~2.9x). Here each glue function (``standard_ops.GLUE_FNS``: RMSNorm, the
AttnRes mix + norm, the KDA conv update + row mask, the router's selection, the experts' dispatch / SiTU-GLU /
combine + latent norm) is wrapped ONCE per process by ``GlueFn`` with ``torch.compile(fullgraph=True,
dynamic=False, mode="default")``: inductor fuses it into one or a few Triton kernels. No CUDA graphs of its
own ("reduce-overhead" would nest graphs): the executor captures the whole step, inductor's kernels with it.

When it compiles: at the first call with a new static key (tensor shapes, strides, dtypes, devices, tensor
types, the non-tensor arguments' values, grad mode) outside CUDA-graph capture, i.e. during
``DecodeExecutor._warm_up``, which runs every bucket eagerly before capturing it: one compile per (function,
key), shared by every executor of the process (a second executor hits the cache).

Capture safety (a compile during capture would launch autotuning benchmarks and synchronise):

1. a call while the current stream captures whose key was not compiled raises ``CompileDuringCaptureError``
   before dynamo sees it;
2. a call while capturing with a compiled key runs under ``torch.compiler.set_stance("fail_on_recompile")``:
   a dynamo guard failing for a reason the key does not cover (a global, a tensor subclass) raises, re-raised
   as ``CompileDuringCaptureError`` with dynamo's guard message, instead of recompiling;
3. dynamo's per-function recompile limit (8 by default; the AttnRes mix alone has one key per source count
   per bucket, ~56 at K3 TP16) is raised once, at the first compile (``raise_recompile_limits``): hitting it
   would make dynamo skip the function's code for good, i.e. silently run it eagerly.

Fallbacks, never a failed step: a non-CUDA tensor runs the eager function (torch.compile on a CPU needs a C++
toolchain and minutes; the CPU standard path is for numerics); a device torch.compile cannot serve
(``compile_unavailable``) runs eagerly; a compile that raises (at warm-up) switches that function to eager
for the process (``GlueFn.failed`` says why; the first failing call is served by the eager function).
``GlueSet`` is one op table's view of the glue: it routes calls and has the table's ``standard_reason``
strings say what served each op (``GLUE_COMPILED`` / ``GLUE_EAGER``), which the trace lists per step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._lib.compile_cache import CompileDuringCaptureError

COMPILE_KWARGS: dict[str, Any] = {"fullgraph": True, "dynamic": False, "mode": "default"}
RECOMPILE_LIMIT = 4096  # keys per glue function (buckets x source counts x shapes: a few hundred at most)
GLUE_COMPILED = "glue: torch.compile"
GLUE_EAGER = "glue: eager"


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on a machine that never touched CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def compile_unavailable(device: torch.device | str) -> str | None:
    """Why compiled glue cannot serve tensors on ``device`` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"{device.type} tensors: compiled glue serves CUDA tensors only (torch.compile on a CPU needs a "
                f"C++ toolchain and minutes per shape)")
    if not callable(getattr(torch, "compile", None)):
        return f"torch {torch.__version__} has no torch.compile"
    if not callable(getattr(getattr(torch, "compiler", None), "set_stance", None)):
        return f"torch {torch.__version__} has no torch.compiler.set_stance (it forbids recompiles during capture)"
    try:
        from torch.utils._triton import has_triton

        if not has_triton():
            return "triton (inductor's GPU code generator) is not usable here"
    except Exception as e:  # noqa: BLE001 - any import problem means: no inductor
        return f"inductor is not importable ({type(e).__name__}: {e})"
    return None


_LIMITS_RAISED = False


def raise_recompile_limits() -> None:
    """Raise dynamo's recompile limits (process-wide, only ever upward) to ``RECOMPILE_LIMIT`` keys per
    function: each static shape is one cache entry of the same code object (see the module docstring, 3)."""
    global _LIMITS_RAISED
    if _LIMITS_RAISED:
        return
    import torch._dynamo.config as cfg

    for name, want in (("recompile_limit", RECOMPILE_LIMIT), ("cache_size_limit", RECOMPILE_LIMIT),
                       ("accumulated_recompile_limit", 16 * RECOMPILE_LIMIT),
                       ("accumulated_cache_size_limit", 16 * RECOMPILE_LIMIT)):
        try:
            if getattr(cfg, name) < want:
                setattr(cfg, name, want)
        except AttributeError:  # another torch names it differently; the other spelling covers it
            pass
    _LIMITS_RAISED = True


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("T", type(a).__name__, tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device), a.requires_grad)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(_arg_key(x) for x in a))
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype)):
        return ("V", type(a).__name__, a)
    return ("O", type(a).__name__, id(a))


def shape_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What one compiled version of a glue function is specialised on (dynamo guards at least these)."""
    return (tuple(_arg_key(a) for a in args), tuple((k, _arg_key(v)) for k, v in sorted(kwargs.items())),
            torch.is_grad_enabled())


def _describe(key: tuple) -> str:
    parts = [f"{k[4]}{list(k[2])}".replace("torch.", "") if k[0] == "T" else repr(k[-1]) for k in key[0]]
    return "(" + ", ".join(parts) + ")"


class GlueFn:
    """One glue function: ``torch.compile``d per static key outside capture, replayed from dynamo's cache
    inside it (see the module docstring). Call it with CUDA tensors; ``GlueSet`` routes the rest eagerly."""

    def __init__(self, name: str, fn: Callable[..., Any], compile_kwargs: dict[str, Any] | None = None) -> None:
        self.name = name
        self.fn = fn
        self.compile_kwargs = dict(COMPILE_KWARGS if compile_kwargs is None else compile_kwargs)
        self.keys: set[tuple] = set()  # keys compiled (and run once) outside capture
        self.failed: str | None = None  # set once a compile raised: eager from then on, for the process
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return self.fn(*args, **kwargs)
        key = shape_key(args, kwargs)
        if _capturing():
            return self._call_capturing(key, args, kwargs)
        if key in self.keys:
            return self._compiled(*args, **kwargs)
        return self._compile_and_call(key, args, kwargs)

    def _call_capturing(self, key: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
        if key not in self.keys:
            raise CompileDuringCaptureError(
                f"compiled glue {self.name}{_describe(key)}: not compiled before CUDA-graph capture (a compile "
                f"inside capture would break it); run the bucket eagerly first (DecodeExecutor._warm_up)")
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._compiled(*args, **kwargs)
        except RuntimeError as e:
            if "fail_on_recompile" not in str(e):
                raise
            raise CompileDuringCaptureError(
                f"compiled glue {self.name}{_describe(key)}: dynamo would recompile during CUDA-graph capture: "
                f"{' '.join(str(e).split())[:400]}") from e

    def _compile_and_call(self, key: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
        if len(self.keys) >= RECOMPILE_LIMIT - 1:
            self.failed = f"{self.name}: more than {RECOMPILE_LIMIT - 1} static shapes; eager from here on"
            return self.fn(*args, **kwargs)
        try:
            if self._compiled is None:
                raise_recompile_limits()
                self._compiled = torch.compile(self.fn, **self.compile_kwargs)
            out = self._compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compile failure: serve eagerly, say why
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.failed = f"torch.compile of {self.name}{_describe(key)} raised {type(e).__name__}: {first}"
            warnings.warn(f"compiled glue: {self.failed}; {self.name} runs eagerly from now on", stacklevel=3)
            return self.fn(*args, **kwargs)
        self.keys.add(key)
        return out


_SHARED: dict[str, GlueFn] = {}


def shared_glue(name: str, fn: Callable[..., Any]) -> GlueFn:
    """The process-wide ``GlueFn`` of ``name`` (every op table shares its compiled versions)."""
    g = _SHARED.get(name)
    if g is None:
        g = _SHARED[name] = GlueFn(name, fn)
    elif g.fn is not fn:
        raise ValueError(f"compiled glue {name!r} is already registered for another function ({g.fn!r})")
    return g


def shared_glue_fns() -> dict[str, GlueFn]:
    return dict(_SHARED)


class GlueSet:
    """The glue of one op table: ``glue(name, *args)`` runs glue function ``name`` eagerly (not ``compiled``,
    a non-CUDA tensor, a device torch.compile cannot serve, a failed compile) or through its shared
    ``GlueFn``. ``device``: the table's device (None: taken from the first call). ``on_change`` is called
    when what serves the glue changed (the device became known, a compile failed), so the table can
    rewrite its ops' reasons (``status``)."""

    def __init__(self, fns: dict[str, Callable[..., Any]], compiled: bool, device: torch.device | str | None = None
                 ) -> None:
        self.eager = dict(fns)
        self.compiled = compiled
        self.shared = {n: shared_glue(n, f) for n, f in fns.items()} if compiled else {}
        self.device: torch.device | None = None
        self.unavailable: str | None = None
        self.on_change: Callable[[], None] | None = None
        self._failed_seen: set[str] = set()
        if device is not None:
            self._set_device(torch.device(device))

    def _set_device(self, device: torch.device) -> None:
        self.device = device
        self.unavailable = compile_unavailable(device) if self.compiled else None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def __call__(self, name: str, *args: Any) -> Any:
        if not self.compiled:
            return self.eager[name](*args)
        dev = args[0].device if args and isinstance(args[0], torch.Tensor) else None
        if self.device is None and dev is not None:
            self._set_device(dev)
            self._changed()
        if dev is None or dev.type != "cuda" or self.unavailable is not None:
            return self.eager[name](*args)
        g = self.shared[name]
        out = g(*args)
        if g.failed is not None and name not in self._failed_seen:
            self._failed_seen.add(name)
            self._changed()
        return out

    def status(self, names: tuple[str, ...]) -> str:
        """What serves glue functions ``names``: ``GLUE_COMPILED (...)``, ``GLUE_EAGER (why)`` or both."""
        if not self.compiled:
            return f"{GLUE_EAGER} (compiled glue not requested)"
        if self.device is None:
            return f"{GLUE_COMPILED} on CUDA tensors, eager elsewhere ({', '.join(names)}; no call seen yet)"
        if self.unavailable is not None:
            return f"{GLUE_EAGER} ({self.unavailable})"
        failed = [self.shared[n].failed for n in names if self.shared[n].failed is not None]
        ok = [n for n in names if self.shared[n].failed is None]
        compiled = (f"{GLUE_COMPILED} (inductor, fullgraph, static shapes, compiled at warm-up: "
                    f"{', '.join(ok)})") if ok else ""
        if not failed:
            return compiled
        eager = f"eager ({'; '.join(failed)})"
        return f"{compiled} + {eager}" if compiled else f"glue: {eager}"


__all__ = ["COMPILE_KWARGS", "GLUE_COMPILED", "GLUE_EAGER", "GlueFn", "GlueSet", "compile_unavailable",
           "shape_key", "shared_glue", "shared_glue_fns"]
