"""Registry of the CuTe DSL kernels (one folder each: config.py, kernel.py, api.py, reference.py).

Every kernel package exports (``REQUIRED_EXPORTS``):

* ``NAME``: the name its launches and fallbacks are counted under (``_lib.counters``);
* ``is_supported(...) -> Support``: False (with a reason) sends a call to the reference;
* ``compile_kernel(dtype, *static_shapes, config)``: the compile function; its arguments are the
  compile-cache key (``compile_rmsnorm_residual(dtype, H, config)``, ``compile_skinny_gemm(dtype, N, K,
  config)``, ``compile_attn_res_mix(dtype, S, H, config)``);
* ``compile_variants(preset) -> list[dict]``: every compile-function call a decode step of the preset
  needs; ``precompile(preset)`` runs them;
* ``op``: the torch-facing function; ``reference``: its FP32 oracle (``reference.py``).

Importing this package (or any kernel's api) needs torch but not cutlass-dsl: ``kernel.py`` is imported
only when something is compiled.
"""

from __future__ import annotations

import importlib
from types import ModuleType

KERNELS = ("rmsnorm_residual", "skinny_gemm", "attn_res_mix", "kda_decode", "moe_router", "mla_decode",
           "moe_experts", "situ_glu")
REQUIRED_EXPORTS = ("NAME", "is_supported", "compile_kernel", "compile_variants", "precompile", "op", "reference")


def names() -> tuple[str, ...]:
    return KERNELS


def api(name: str) -> ModuleType:
    """The kernel package ``k3_fastpath.kernels.<name>``."""
    if name not in KERNELS:
        raise KeyError(f"unknown kernel {name!r}; registered: {', '.join(KERNELS)}")
    return importlib.import_module(f"{__name__}.{name}")


def all_kernels() -> dict[str, ModuleType]:
    return {n: api(n) for n in KERNELS}
