"""The torch-facing shell every kernel op shares: a declarative tensor spec for its support check, and a
``KernelOp`` that decides support, counts the launch or the fallback and serves a refused call from the
kernel's reference, written once.

    SPEC = TensorSpec(
        Arg("g", ("M", "I")), Arg("u", ("M", "I")), Arg("out", ("M", "I"), optional=True),
        rules=(Rule("I % VEC == 0", "I={I} not a multiple of {VEC}"), Rule("M > 0", "M=0")),
        constants={"VEC": 8}, dtype=torch.bfloat16)
    OP = KernelOp("situ_glu", SPEC)

    def situ_glu(g, u, ..., out=None):
        return OP(dict(g=g, u=u, out=out), launch=lambda: ..., reference=lambda: situ_glu_ref(g, u, ...),
                  outputs=(out,))

``TensorSpec.check_shapes`` binds each shape symbol at its first tensor (``"M"``), checks every later use
and every expression (``"H*D"``, ``"CONV_W-1"``) against the bound value, then the ``rules`` (expressions
over the symbols, the constants and the scalars passed in); ``check_devices`` then the dtypes and
``dispatch.check_tensors`` (the DSL present, one sm_90 CUDA device, contiguity, alignment). A condition no
expression states (a config that must exist for the shapes) is the op's ``extra``, asked between the two.

``KernelOp`` caches the verdict per call signature (each tensor's shape, dtype, device, contiguity and
alignment, the scalars, the current device): the decision is made once per shape, which in a graph-captured
step is once per bucket at capture, and ``decisions()`` lists what was decided. A refused call runs the
reference, copies its results into the caller's output buffers, and counts ``count_fallback(name, reason)``;
a served call runs the launch and counts ``count_launch(name)``.
"""

from __future__ import annotations

import ast
import operator
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import counters
from .dispatch import OK, Support, check_tensors, no

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
           ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


def evaluate(expr: str, names: Mapping[str, Any]) -> Any:
    """The value of an integer expression (``+ - * // %``, comparisons, ``and`` / ``or`` / ``not``, names, numbers,
    tuples) over ``names``; anything else is a ``ValueError`` (the specs are code, not input)."""
    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, bool, float, str)):
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in names:
                raise KeyError(n.id)
            return names[n.id]
        if isinstance(n, ast.Tuple):
            return tuple(ev(e) for e in n.elts)
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return not ev(n.operand)
        if isinstance(n, ast.BoolOp):
            vals = (ev(v) for v in n.values)
            return all(vals) if isinstance(n.op, ast.And) else any(vals)
        if isinstance(n, ast.Compare):
            left = ev(n.left)
            for op, c in zip(n.ops, n.comparators, strict=True):
                right = ev(c)
                if type(op) not in _CMPOPS or not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        raise ValueError(f"unsupported expression {ast.dump(n)} in {expr!r}")
    return ev(ast.parse(expr, mode="eval"))


@dataclass(frozen=True)
class Arg:
    """One tensor operand: ``shape`` in symbols (a new name binds at its first tensor), expressions over
    bound symbols and constants, or ints (``None``: any shape); ``dtype`` overrides the spec's: one dtype,
    a tuple of the allowed ones, or the name of a scalar that holds it; ``optional``: may be ``None``;
    ``align``: bytes its data pointer must be aligned to (or the name of a scalar that holds them);
    ``strided_rows``: the kernel takes the stride of dim 0 as a parameter, so only each index of dim 0 must be
    contiguous, that stride at least an index's size and a multiple of ``align`` bytes (``rows_view``)."""

    name: str
    shape: tuple[str | int, ...] | None
    dtype: Any = None
    optional: bool = False
    align: int | str = 16
    strided_rows: bool = False


def rows_view(t: Any, align: int = 16) -> Any:
    """A tensor whose indices along dim 0 lie ``t.stride(0)`` elements apart (vLLM's padded cache pages) as the
    contiguous tensor of its first index, ``[1, ...]`` (what a kernel taking that stride as a parameter is
    handed for its base pointer); ``t`` itself when it is contiguous or does not qualify (the contiguity
    check then names it)."""
    if t.is_contiguous() or t.dim() < 1 or t.shape[0] < 1:
        return t
    inner = t[0]
    if not inner.is_contiguous() or t.stride(0) < inner.numel() or (t.stride(0) * t.element_size()) % align:
        return t
    return inner.unsqueeze(0)


@dataclass(frozen=True)
class Rule:
    """A condition over the bound symbols, the constants and the scalars: ``test`` (an expression) must hold,
    else the call is refused with ``reason`` formatted with the same names."""

    test: str
    reason: str


@dataclass(frozen=True)
class TensorSpec:
    """A kernel op's envelope, declared: its tensor operands, the rules over their shapes, the constants the
    expressions use, the default dtype, and ``requires`` pairs (``("residual_out", "residual")``: the first
    given needs the second given)."""

    args: tuple[Arg, ...]
    rules: tuple[Rule, ...] = ()
    constants: Mapping[str, Any] = field(default_factory=dict)
    dtype: Any = None
    requires: tuple[tuple[str, str], ...] = ()

    def __init__(self, *args: Arg, rules: Sequence[Rule] = (), constants: Mapping[str, Any] | None = None,
                 dtype: Any = None, requires: Sequence[tuple[str, str]] = ()) -> None:
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "constants", dict(constants or {}))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "requires", tuple(requires))
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"TensorSpec: an operand is named twice in {names}")

    def dims(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any] | None = None
             ) -> tuple[dict[str, int], Support]:
        """(the bound shape symbols, the shape verdict): every operand's rank and extents, in order (a
        constant's or a scalar's name stands for its value)."""
        known = {**self.constants, **(scalars or {})}
        dims: dict[str, int] = {}
        for a in self.args:
            t = tensors.get(a.name)
            if t is None:
                if not a.optional:
                    return dims, no(f"{a.name} missing")
                continue
            if a.shape is None:
                continue
            want = "[" + ", ".join(str(s) for s in a.shape) + "]"
            if t.dim() != len(a.shape):
                return dims, no(f"{a.name} is {t.dim()}-d (needs {want})")
            for sym, got in zip(a.shape, t.shape, strict=True):
                if isinstance(sym, str) and sym.isidentifier() and sym not in dims and sym not in known:
                    dims[sym] = int(got)
                    continue
                exp = sym if isinstance(sym, int) else evaluate(sym, {**known, **dims})
                if int(got) != exp:
                    return dims, no(f"{a.name} shape {list(t.shape)} (needs {want} = "
                                    f"[{', '.join(str(_value(s, known, dims)) for s in a.shape)}])")
        return dims, OK

    def check(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any] | None = None) -> Support:
        """The spec's verdict on one call: ``check_shapes``, then ``check_devices``."""
        s = self.check_shapes(tensors, scalars)
        return self.check_devices(tensors, scalars) if s else s

    def check_shapes(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any] | None = None) -> Support:
        """Shapes, ``requires`` and rules: everything that depends on the operands' shapes and the scalars."""
        return self.shape_verdict(tensors, scalars)[1]

    def shape_verdict(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any] | None = None
                      ) -> tuple[dict[str, int], Support]:
        """(the bound shape symbols, ``check_shapes``' verdict)."""
        dims, s = self.dims(tensors, scalars)
        if not s:
            return dims, s
        for need, given in self.requires:
            if tensors.get(need) is not None and tensors.get(given) is None:
                return dims, no(f"{need} without {given}")
        names = {**self.constants, **dims, **(scalars or {})}
        for r in self.rules:
            if not evaluate(r.test, names):
                return dims, no(r.reason.format(**names))
        return dims, OK

    def check_devices(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any] | None = None) -> Support:
        """Dtypes, then ``dispatch.check_tensors`` per alignment (the DSL, one sm_90 device, contiguity, alignment)."""
        names = {**self.constants, **(scalars or {})}
        dtypes = {}
        for a in self.args:
            t, want = tensors.get(a.name), a.dtype or self.dtype
            want = names[want] if isinstance(want, str) else want
            if isinstance(want, tuple) and t is not None:
                if t.dtype not in want:
                    return no(f"{a.name} dtype {_dt(t.dtype)} (needs {' or '.join(_dt(d) for d in want)})")
                want = t.dtype
            dtypes[a.name] = want
        aligns = self.aligns(scalars)
        tensors = {**tensors, **{a.name: rows_view(tensors[a.name], aligns[a.name]) for a in self.args
                                 if a.strided_rows and tensors.get(a.name) is not None}}
        for align in sorted(set(aligns.values()), reverse=True):
            group = {a.name: tensors.get(a.name) for a in self.args if aligns[a.name] == align}
            s = check_tensors(group, {k: dtypes[k] for k in group}, align=align)
            if not s and s.reason != "no tensors":
                return s
        devices = {t.device for t in tensors.values() if t is not None and hasattr(t, "device")}
        if len(devices) > 1:
            return no("operands on more than one device")
        return OK

    def aligns(self, scalars: Mapping[str, Any] | None = None) -> dict[str, int]:
        """Each operand's alignment in bytes (a scalar's value where the arg names one)."""
        return {a.name: int((scalars or {})[a.align]) if isinstance(a.align, str) else a.align for a in self.args}


def _dt(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _value(sym: str | int, constants: Mapping[str, Any], dims: Mapping[str, int]) -> Any:
    try:
        return sym if isinstance(sym, int) else evaluate(sym, {**constants, **dims})
    except KeyError:
        return sym


def signature(tensors: Mapping[str, Any], scalars: Mapping[str, Any] | None = None,
              aligns: Mapping[str, int] | None = None) -> tuple[Any, ...]:
    """What a support verdict depends on: per operand its shape, strides, dtype, device, contiguity and whether its
    data pointer is aligned; the scalars; the current CUDA device."""
    import torch

    parts: list[Any] = []
    for name, t in tensors.items():
        if t is None:
            parts.append((name, None))
        else:
            a = (aligns or {}).get(name, 16)
            parts.append((name, tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.is_contiguous(),
                          t.data_ptr() % a == 0))
    cur = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    return (*parts, tuple(sorted((scalars or {}).items())), cur)


class KernelOp:
    """One kernel's op shell (see the module doc): ``support`` (cached per signature) and ``__call__``."""

    MAX_DECISIONS = 4096

    def __init__(self, name: str, spec: TensorSpec, extra: Callable[..., Support] | None = None) -> None:
        self.name = name
        self.spec = spec
        self.extra = extra  # extra(tensors, scalars, dims) -> Support: conditions no expression states
        self._decided: OrderedDict[tuple[Any, ...], Support] = OrderedDict()
        # the operands' alignments, resolved per call only where an arg names a scalar
        self._aligns = None if any(isinstance(a.align, str) for a in spec.args) else spec.aligns()

    def _decide(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> Support:
        dims, s = self.spec.shape_verdict(tensors, scalars)
        if s and self.extra is not None:
            s = self.extra(tensors, scalars, dims)
        return self.spec.check_devices(tensors, scalars) if s else s

    def support(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any] | None = None) -> Support:
        """The verdict for these operands, decided once per signature."""
        scalars = scalars or {}
        key = signature(tensors, scalars, self._aligns or self.spec.aligns(scalars))
        got = self._decided.get(key)
        if got is None:
            got = self._decided[key] = self._decide(tensors, scalars)
            if len(self._decided) > self.MAX_DECISIONS:
                self._decided.popitem(last=False)
        return got

    def decisions(self) -> list[tuple[tuple[Any, ...], Support]]:
        """Every (signature, verdict) decided so far, oldest first."""
        return list(self._decided.items())

    def __call__(self, tensors: Mapping[str, Any], *, launch: Callable[[], Any], reference: Callable[[], Any],
                 outputs: Sequence[Any] = (), scalars: Mapping[str, Any] | None = None) -> Any:
        """``launch()`` when supported (one launch counted), else ``reference()`` with its results copied into
        ``outputs`` (aligned with the results; ``None`` entries and results skipped) and the fallback
        counted with its reason."""
        s = self.support(tensors, scalars)
        if s:
            result = launch()
            counters.count_launch(self.name)
            return result
        counters.count_fallback(self.name, s.reason)
        result = reference()
        single = not isinstance(result, tuple)
        values = [result] if single else list(result)
        for i, buf in enumerate(outputs):
            if buf is not None and i < len(values) and values[i] is not None:
                values[i] = buf.copy_(values[i])
        return values[0] if single else tuple(values)


__all__ = ["Arg", "KernelOp", "Rule", "TensorSpec", "evaluate", "signature"]
