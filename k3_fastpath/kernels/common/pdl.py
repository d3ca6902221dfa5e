"""The order a kernel keeps around ``griddepcontrol.wait``, stated where its tensors are named (trace time).

A kernel built for programmatic dependent launch (PDL) starts while its predecessor still runs: before
``griddepcontrol.wait`` it may read only weights (never written by a step); everything a step writes (the
predecessor's outputs, its own outputs, caches, routing ids) only after it (K3.md failure 2). A kernel says
which of its parameters is which when its body starts:

    order = PdlOrder(self.cfg.pdl)
    mW = order.weight(mW)                      # readable (or prefetched into L2) before the wait
    mX, mO = order.after_wait(mX, mO)          # AfterWait handles: no access before order.wait()
    ... weight loads ...
    order.wait()                               # griddepcontrol.wait in the PDL build; opens the activations
    x_row = mX[row, None]                      # an AfterWait used before order.wait() fails the trace
    order.launch_dependents()                  # griddepcontrol.launch_dependents (only after the wait)

The non-PDL build traces the same order (``wait`` emits nothing there), so an after-wait access moved above
the wait fails every compile, on a CPU too. What an ``AfterWait`` guards is access to its tensor (indexing, item
assignment, ``.tensor``); its shape and layout stay readable, as address arithmetic reads no memory.
``tests/test_pdl_compile.py`` still checks the compiled PTX / SASS of every PDL build (a read the code hides
from these handles is found there).
"""

from __future__ import annotations

from typing import Any

import cutlass.cute as cute
from cutlass.base_dsl.utils.mlir_value_tree import extract_mlir_values, new_from_mlir_values


class PdlOrderError(RuntimeError):
    """A kernel's trace touched an activation before ``griddepcontrol.wait`` (or triggered dependents first)."""


class AfterWait:
    """A kernel parameter that may be touched only after ``griddepcontrol.wait``: anything a step writes (an
    activation, an output, a cache, routing ids) or whose addresses depend on it (the routed experts'
    weights): its tensor is reachable only once its ``PdlOrder`` has waited."""

    def __init__(self, tensor: Any, order: PdlOrder, name: str) -> None:
        self._tensor, self._order, self._name = tensor, order, name

    @property
    def tensor(self) -> Any:
        if not self._order.waited:
            raise PdlOrderError(f"{self._name}: accessed before griddepcontrol.wait (only weights whose "
                                "addresses depend on no activation may be read there)")
        return self._tensor

    def __getitem__(self, index: Any) -> Any:
        return self.tensor[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self.tensor[index] = value

    @property
    def shape(self) -> Any:
        return self._tensor.shape

    # the DSL's value protocol: a handle crosses a dynamic if / loop region as its tensor's values
    def __extract_mlir_values__(self) -> list[Any]:
        return extract_mlir_values(self._tensor)

    def __new_from_mlir_values__(self, values: list[Any]) -> AfterWait:
        return AfterWait(new_from_mlir_values(self._tensor, values), self._order, self._name)

    @property
    def layout(self) -> Any:
        return self._tensor.layout


class PdlOrder:
    """One kernel body's PDL order (see the module doc); ``pdl``: the build launches with the PDL attribute."""

    def __init__(self, pdl: bool) -> None:
        self.pdl = bool(pdl)
        self.waited = False
        self._n = 0

    # the DSL's value protocol: the order holds no device values; every region sees this one object
    def __extract_mlir_values__(self) -> list[Any]:
        return []

    def __new_from_mlir_values__(self, values: list[Any]) -> PdlOrder:
        return self

    def weight(self, tensor: Any) -> Any:
        """A weight parameter, returned as it is: readable before the wait."""
        return tensor

    def after_wait(self, *tensors: Any) -> Any:
        """``AfterWait`` handles for the given parameters (``None`` stays ``None``); one value for one tensor."""
        out = []
        for t in tensors:
            self._n += 1
            out.append(None if t is None else AfterWait(t, self, f"after-wait operand #{self._n}"))
        return out[0] if len(out) == 1 else tuple(out)

    def open(self, *handles: Any) -> Any:
        """The tensors of ``AfterWait`` handles, after the wait (``None`` stays ``None``): for the code past the
        wait that hands them to ``cute.jit`` helpers or reads their iterators."""
        out = tuple(None if h is None else h.tensor for h in handles)
        return out[0] if len(out) == 1 else out

    def wait(self) -> None:
        """``griddepcontrol.wait`` in the PDL build (nothing in the other); the activations open."""
        if self.pdl:
            cute.arch.griddepcontrol_wait()
        self.waited = True

    def launch_dependents(self) -> None:
        """``griddepcontrol.launch_dependents`` in the PDL build: only after the wait."""
        if not self.waited:
            raise PdlOrderError("launch_dependents before griddepcontrol.wait")
        if self.pdl:
            cute.arch.griddepcontrol_launch_dependents()


__all__ = ["AfterWait", "PdlOrder", "PdlOrderError"]
