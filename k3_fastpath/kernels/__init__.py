"""Registry of the CuTe DSL kernels: one folder each (spec.py, config.py, kernel.py, api.py, reference.py).

A folder of this package is a kernel exactly when it holds a ``spec.py``: its ``SPEC``
(``_lib.kernel_spec.KernelSpec``) is the kernel's one declaration: name and launch counter names, the api
module, the config type, support check, reference and ``compile_variants`` as lazy ``"module:attr"``
targets, the GPU test files that launch it, whether it has a PDL build and what that build reads before
``griddepcontrol.wait``, and whether a default decode step launches it. ``KERNELS`` / ``names()`` are the
folders with a spec, sorted by name; every other list of kernels is derived from the specs: the GPU tests
``kernels.numerics`` runs (``gpu_test_files()``), the launches the sanitizer driver must see
(``launch_names()``), the PDL compile tests, the executor GPU test's default-step kernels.
``tests/test_kernel_specs.py`` checks the specs (``validate_specs``) on a CPU. ``common/`` (no spec) holds
the device helpers several kernels share: the sigmoid, the PDL prologue's weight prefetch, inline PTX.

Every kernel package exports (``REQUIRED_EXPORTS``):

* ``NAME``: the name its launches and fallbacks are counted under (``_lib.counters``);
* ``is_supported(...) -> Support``: False (with a reason) sends a call to the reference;
* ``compile_kernel(dtype, *static_shapes, config)``: the compile function; its arguments are the
  compile-cache key (``compile_rmsnorm_residual(dtype, H, config)``, ``compile_skinny_gemm(dtype, N, K,
  config)``, ``compile_attn_res_mix(dtype, S, H, config)``);
* ``compile_variants(preset) -> list[dict]``: every compile-function call a decode step of the preset
  needs; ``precompile(preset)`` runs them;
* ``op``: the torch-facing function; ``reference``: its FP32 oracle (``reference.py``).

Reading the specs (``spec``, ``all_specs``, ``launch_names``, ``gpu_test_files``) imports neither torch nor
cutlass-dsl: each ``spec.py`` is loaded without its package. Importing a kernel package (``api(name)``)
needs torch but not cutlass-dsl: ``kernel.py`` is imported only when something is compiled.
"""

from __future__ import annotations

import functools
import importlib
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from .._lib.kernel_spec import KernelSpec, load_spec

_DIR = Path(__file__).resolve().parent

KERNELS: tuple[str, ...] = tuple(sorted(p.parent.name for p in _DIR.glob("*/spec.py")))
REQUIRED_EXPORTS = ("NAME", "is_supported", "compile_kernel", "compile_variants", "precompile", "op", "reference")


def names() -> tuple[str, ...]:
    return KERNELS


def _check(name: str) -> None:
    if name not in KERNELS:
        raise KeyError(f"unknown kernel {name!r}; registered: {', '.join(KERNELS)}")


@functools.cache
def spec(name: str) -> KernelSpec:
    """``kernels/<name>/spec.py``'s ``SPEC`` (loaded without importing the kernel package)."""
    _check(name)
    return load_spec(_DIR / name / "spec.py", f"{__name__}.{name}.spec")


def all_specs() -> tuple[KernelSpec, ...]:
    """Every kernel's spec, in ``KERNELS`` order."""
    return tuple(spec(n) for n in KERNELS)


def launch_names() -> tuple[str, ...]:
    """Every counter name a registered kernel's launches count under (spec order, then each spec's)."""
    return tuple(dict.fromkeys(n for s in all_specs() for n in s.launch_names))


def gpu_test_files() -> tuple[str, ...]:
    """The union of the specs' ``gpu_tests`` (repo-relative), first occurrence order."""
    return tuple(dict.fromkeys(f for s in all_specs() for f in s.gpu_tests))


def api(name: str) -> ModuleType:
    """The kernel package ``k3_fastpath.kernels.<name>``."""
    _check(name)
    return importlib.import_module(f"{__name__}.{name}")


def all_kernels() -> dict[str, ModuleType]:
    return {n: api(n) for n in KERNELS}


def compile_report(presets: list[str], kernels: list[str] | None = None) -> list[dict[str, Any]]:
    """Compile every decode variant of ``presets`` and report, per (kernel, preset): variants, seconds,
    and each failure as "config: error" (does not raise; for the ``kernels.compile`` check and the CLI)."""
    out = []
    for name in kernels or names():
        mod = api(name)
        for preset_name in presets:
            t0 = time.perf_counter()
            variants = mod.compile_variants(preset_name)
            errors = []
            for v in variants:
                args = {k: val for k, val in v.items() if k not in ("shape_name", "M")}
                try:
                    mod.compile_kernel(**args)
                except Exception as e:  # report, keep going
                    errors.append(f"{args}: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
            out.append({"kernel": name, "preset": preset_name, "variants": len(variants),
                        "seconds": round(time.perf_counter() - t0, 2), "errors": errors})
    return out


def precompile(preset_name: str, kernels: list[str] | None = None) -> dict[str, int]:
    """Compile every decode shape of ``preset_name`` for every registered kernel (or ``kernels``).

    Returns {kernel: number of compiled variants}. Call it at load time, before any CUDA-graph capture.
    """
    out: dict[str, int] = {}
    for name in kernels or names():
        out[name] = api(name).precompile(preset_name)
    return out
