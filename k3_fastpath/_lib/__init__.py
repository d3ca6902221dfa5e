"""Shared machinery for the CuTe DSL kernels: arch detection, torch->CuTe conversion, compile cache,
execution-trace counters. Importable without cutlass-dsl or a GPU (the DSL is imported lazily)."""

from . import arch, counters
from .arch import is_available, require_sm90

__all__ = ["arch", "counters", "is_available", "require_sm90"]
