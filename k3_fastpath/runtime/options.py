"""``DecodeOptions``: every launch-level switch of a decode step, one default each, taken whole by the
executor (``DecodeExecutor``) and the TP decoder (``tp_fast.TPFastDecoder``) and recorded whole in their
trace metadata.

    DecodeExecutor(model, max_len=4096, options=DecodeOptions(prefetch=True))
    DecodeOptions.from_mapping({"pdl": False})          # a tier's params: unknown names / wrong types raise

Each backend honours some of the options (``HONOURED``); ``resolve(options, backend)`` gives the options
it runs with: ``None`` means that backend's defaults (``defaults``: PDL only where it exists and is
measured), an explicit ``DecodeOptions`` is taken as given for every option the backend honours, and an
option asking for what the backend cannot do is a ``ValueError`` naming it, never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..kernels.skinny_gemm.config import MAX_M as GEMM_MAX_M
from ..kernels.skinny_gemm.config import WGMMA_MIN_M
from .prefetch import DEFAULT_BUDGET_BYTES


@dataclass(frozen=True)
class DecodeOptions:
    pdl: bool = True  # every kernel of the step launched with programmatic dependent launch (executor.pdl_support)
    prefetch: bool = False  # the next layer's weights into L2 on a side stream (prefetch.py)
    prefetch_budget: int = DEFAULT_BUDGET_BYTES  # bytes prefetched per layer
    shared_stream: bool = True  # the shared experts on a second stream, overlapping the routed experts
    situ_glu_kernel: bool = False  # the shared experts' / dense MLP's SiTU-GLU as one kernel (kernels/situ_glu)
    single_expert_copy: bool = False  # the routed experts kept once, in the kernel's layout (ExpertBank)
    standard_compiled_glue: bool = False  # standard_graph only: its PyTorch glue through torch.compile
    standard_mxfp4_experts: bool = False  # standard_graph only: MXFP4 experts through humming (standard_mxfp4.py)
    gemm_wgmma_min_m: int = WGMMA_MIN_M  # the skinny GEMM's wgmma variant for M >= it (0: never; 1: every M)

    def __post_init__(self) -> None:
        if not 0 <= self.gemm_wgmma_min_m <= GEMM_MAX_M:
            raise ValueError(f"decode option gemm_wgmma_min_m: expected 0 (never) or an M threshold in "
                             f"1..{GEMM_MAX_M}, got {self.gemm_wgmma_min_m!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> DecodeOptions:
        return DecodeOptions.from_mapping({**self.as_dict(), **changes})

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DecodeOptions:
        """Options from a mapping (a tier's params, a variant row): an unknown name or a value of the wrong
        type raises ``ValueError`` naming it."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown decode option(s) {unknown} (known: {', '.join(fields)})")
        for name, v in values.items():
            want = type(getattr(cls(), name))
            if type(v) is not want or (want is int and v < 0):
                raise ValueError(f"decode option {name}: expected {'true or false' if want is bool else 'a count'}, "
                                 f"got {v!r}")
        return cls(**values)


# (backend or runner) -> the options it honours; PDL exists only in the latency_specialized step
HONOURED: dict[str, frozenset[str]] = {
    "latency_specialized": frozenset({"pdl", "prefetch", "prefetch_budget", "shared_stream", "situ_glu_kernel",
                                      "single_expert_copy", "gemm_wgmma_min_m"}),
    "standard_graph": frozenset({"prefetch", "prefetch_budget", "shared_stream", "single_expert_copy",
                                 "standard_compiled_glue", "standard_mxfp4_experts"}),
    "standard": frozenset(),
    "tp:latency_specialized": frozenset({"pdl", "situ_glu_kernel", "gemm_wgmma_min_m"}),
    "tp:standard_graph": frozenset({"standard_compiled_glue", "standard_mxfp4_experts"}),
}


# (backend or runner) -> where its defaults differ from DecodeOptions(): no PDL outside the latency_specialized
# step; the TP decoder's PDL stays off until it is measured at TP2 (issue #24: a fast_pdl row beside fast)
BACKEND_DEFAULTS: dict[str, dict[str, Any]] = {
    "standard_graph": {"pdl": False}, "standard": {"pdl": False},
    "tp:latency_specialized": {"pdl": False}, "tp:standard_graph": {"pdl": False},
}


def defaults(backend: str) -> DecodeOptions:
    """The options ``backend`` runs with when given none: ``DecodeOptions()`` with ``BACKEND_DEFAULTS``."""
    return dataclasses.replace(DecodeOptions(), **BACKEND_DEFAULTS.get(backend, {}))


def resolve(options: DecodeOptions | None, backend: str) -> DecodeOptions:
    """The options ``backend`` runs with (each option it does not honour at its default there, e.g. PDL off
    on the standard backends); ``ValueError`` naming every option set to what ``backend`` cannot do (a value
    that is neither ``DecodeOptions()``'s nor the backend's default, e.g. ``situ_glu_kernel=True`` on
    ``standard_graph``)."""
    if backend not in HONOURED:
        raise ValueError(f"no decode options for backend {backend!r} (known: {', '.join(HONOURED)})")
    base, plain = defaults(backend), DecodeOptions()
    if options is None:
        return base
    if not isinstance(options, DecodeOptions):
        raise TypeError(f"options must be a DecodeOptions, got {type(options).__name__}")
    honoured = HONOURED[backend]
    refused = [f"{k}={v!r}" for k, v in options.as_dict().items()
               if k not in honoured and v != getattr(plain, k) and v != getattr(base, k)]
    if refused:
        raise ValueError(f"backend {backend} cannot honour decode option(s) {', '.join(refused)}")
    return dataclasses.replace(base, **{k: v for k, v in options.as_dict().items() if k in honoured})
