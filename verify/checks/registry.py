"""Every check ``k3-verify`` knows, registered next to its code by ``@check``.

A check is a function ``fn(ctx: CheckContext, *, name=default, ...) -> CheckResult`` in a module of
``verify/checks/``, declared where it is defined::

    @check("reference.determinism", "two identical runs give bitwise identical logits",
           imports=("torch",))
    def determinism(ctx, *, batch: int = 2, prompt_len: int = 10, decode_steps: int = 4): ...

The function's keyword parameters are the check's parameters and their defaults are the only defaults
(``CheckDecl.params_type`` is a frozen dataclass built from them); a tier YAML holds overrides, validated
against those fields. ``requires`` names what the machine must have (``verify.requirements.unmet``:
cuda, sm90, cutlass, compute-sanitizer): an unmet one makes the check ``skipped`` with the reason.
``imports`` names the Python modules the check needs, ``tools`` the programs it runs
(``verify.requirements.TOOLS``: aiperf); the run's preflight records a check whose module or tool is
missing as ``error`` with how to install it, before any GPU work starts.

``REGISTRY`` maps id -> ``CheckDecl``; reading it imports every module of this package once (the
declarations are the modules themselves, so there is no second list to keep).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_NOT_CHECK_MODULES = frozenset({"registry"})


@dataclass(frozen=True)
class CheckDecl:
    id: str
    module: str  # the defining module, e.g. verify.checks.reference
    function: str
    description: str
    requires: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()  # Python modules the check needs (the preflight's list)
    tools: tuple[str, ...] = ()  # programs the check runs (``verify.requirements.TOOLS``; the preflight's too)
    params_type: type | None = None  # frozen dataclass of the parameters, defaults from the signature
    # record -> True for a record no status rule gates: ``bundle audit`` lists its timing disagreements
    # without counting them (its other fields still compare bitwise, so the predicate's inputs do too)
    information_only: Callable[[Mapping[str, Any]], bool] | None = None

    @property
    def params(self) -> dict[str, Any]:
        """{name: default} of every parameter (a fresh copy: mutable defaults are never shared)."""
        if self.params_type is None:
            return {}
        return {f.name: _default(f) for f in dataclasses.fields(self.params_type)}

    def resolve_params(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults with ``overrides`` applied; an unknown name raises ``KeyError`` naming it."""
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            raise KeyError(f"check {self.id!r} has no parameter(s) {', '.join(unknown)} "
                           f"(its parameters: {', '.join(self.params) or 'none'})")
        return dataclasses.asdict(self.params_type(**{**self.params, **overrides})) if self.params_type else {}

    def load(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.function)


def _default(f: dataclasses.Field) -> Any:
    import copy

    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return copy.deepcopy(f.default)


_DECLS: dict[str, CheckDecl] = {}


def params_dataclass(check_id: str, fn: Callable[..., Any]) -> type:
    """A frozen dataclass of ``fn``'s keyword parameters (after ``ctx``), each with its default."""
    fields = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"check {check_id}: {fn.__name__} takes **/*args; declare each parameter")
        if p.default is inspect.Parameter.empty:
            raise TypeError(f"check {check_id}: parameter {p.name!r} of {fn.__name__} has no default")
        d = p.default
        if isinstance(d, (list, dict, set)):
            fields.append((p.name, Any, dataclasses.field(default_factory=lambda d=d: type(d)(d))))
        else:
            fields.append((p.name, Any, dataclasses.field(default=d)))
    name = "".join(w.capitalize() for w in check_id.replace(".", "_").split("_")) + "Params"
    return dataclasses.make_dataclass(name, fields, frozen=True)


def check(check_id: str, description: str, *, requires: tuple[str, ...] = (), imports: tuple[str, ...] = (),
          tools: tuple[str, ...] = (), information_only: Callable[[Mapping[str, Any]], bool] | None = None
          ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as check ``check_id`` (see the module docstring)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        module = fn.__module__
        if check_id in _DECLS and (_DECLS[check_id].module, _DECLS[check_id].function) != (module, fn.__name__):
            raise ValueError(f"check {check_id} is registered twice ({_DECLS[check_id].module} and {module})")
        _DECLS[check_id] = CheckDecl(check_id, module, fn.__name__, description, tuple(requires), tuple(imports),
                                     tuple(tools), params_dataclass(check_id, fn), information_only)
        return fn
    return deco


def check_modules() -> list[str]:
    """Every module of ``verify.checks`` (each may register checks)."""
    import verify.checks as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_CHECK_MODULES)


class _Registry(Mapping[str, CheckDecl]):
    """id -> CheckDecl, loading every check module on first use."""

    _loaded = False

    def _load(self) -> dict[str, CheckDecl]:
        if not self._loaded:
            for m in check_modules():
                importlib.import_module(f"verify.checks.{m}")
            type(self)._loaded = True
        return _DECLS

    def __getitem__(self, key: str) -> CheckDecl:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._load()))

    def __len__(self) -> int:
        return len(self._load())


REGISTRY: Mapping[str, CheckDecl] = _Registry()
