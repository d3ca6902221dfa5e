"""``KernelSpec``: the one declaration of a CuTe DSL kernel (``kernels/<op>/spec.py``), and its validation.

Each kernel folder holds a ``spec.py`` whose ``SPEC`` says what the kernel is and where its parts live;
``k3_fastpath.kernels`` discovers the folders that have one, and every list of kernels elsewhere (the GPU
test files ``kernels.numerics`` runs, the launches the sanitizer driver expects, the PDL compile tests, the
kernels a default decode step launches) is derived from the specs, never kept by hand.

The targets are lazy ``"module:attr"`` strings (``api`` is a module path), so reading a spec imports
neither torch nor cutlass-dsl (``resolve`` imports on demand). ``validate_specs`` is what the CPU registry
test runs: it names every problem (a target that does not resolve, a GPU test file that is missing, is
not marked ``gpu`` or never names the kernel, ...) instead of stopping at the first.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# fields holding "module:attr" targets (``api`` is a plain module path)
TARGET_FIELDS = ("config_type", "support", "reference", "compile_variants")


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel is, declared once in its folder (``kernels/<name>/spec.py``: ``SPEC = KernelSpec(...)``).

    * ``name``: the folder name and the counter name (``_lib.counters``) its launches and fallbacks count
      under; the api module's ``NAME``.
    * ``launch_names``: every counter name a launch of the kernel counts under (``name`` first), e.g.
      mla_decode's context-parallel merge counts as ``mla_decode_merge``.
    * ``api``: the module with ``NAME``, ``is_supported``, ``compile_variants``, the compile function and the op.
    * ``config_type``, ``support``, ``reference``, ``compile_variants``: ``"module:attr"`` of the frozen config
      dataclass, ``is_supported(...) -> Support``, the FP32 PyTorch oracle, and ``compile_variants(preset)``
      (the variants per preset: every compile a decode step of the preset needs).
    * ``gpu_tests``: repo-relative GPU test files (marked ``gpu``) that launch the kernel and check its
      launch counter moved; ``kernels.numerics`` runs their union.
    * ``pdl``: the kernel has a programmatic-dependent-launch build (``config.pdl``).
    * ``pdl_prologue_reads``: the parameters (as the kernel and ``tests/test_pdl_compile.py`` name them)
      its PDL build may read, or prefetch into L2, before ``griddepcontrol.wait``: weights only, never
      anything a step writes; empty when it touches no global memory before the wait.
    * ``serves_op``: the fast step's op it serves (``runtime.fast_ops``' table): the api's ``step_op`` is that
      op's adapter, with the step's signature; its keyword-only parameters are the ``DecodeOptions`` fields
      it takes (``pdl``, ``gemm_wgmma_min_m``), bound when the executor builds its table.
    * ``opt_in``: ``""`` when a default decode step launches it, else the ``DecodeOptions`` field that puts
      its op in the table (``situ_glu_kernel``).
    """

    name: str
    launch_names: tuple[str, ...]
    api: str
    config_type: str
    support: str
    reference: str
    compile_variants: str
    gpu_tests: tuple[str, ...]
    pdl: bool
    pdl_prologue_reads: tuple[str, ...]
    serves_op: str
    opt_in: str

    @property
    def in_default_step(self) -> bool:
        """A default decode step (``DecodeOptions()``, no opt-in) launches this kernel."""
        return not self.opt_in

    def resolve(self, field: str) -> Any:
        """The object a target field names (``"api"``: the module), imported now."""
        if field != "api" and field not in TARGET_FIELDS:
            raise KeyError(f"{field!r} is not a target field of KernelSpec ({', '.join(('api', *TARGET_FIELDS))})")
        return resolve(getattr(self, field))


def resolve(target: str) -> Any:
    """``"pkg.module:attr.sub"`` -> that attribute; ``"pkg.module"`` -> the module."""
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


_LOAD_LOCK = threading.RLock()  # a spec module sits in sys.modules while it executes: one loader at a time


def load_spec(path: Path, module_name: str) -> KernelSpec:
    """``SPEC`` of the spec file ``path``, loaded as ``module_name`` without importing the kernel package
    (whose ``__init__`` imports torch): the spec module is registered under its own dotted name only.
    Thread-safe: a second thread asking while the first executes the module waits for it (TP ranks in
    threads build their op tables at once)."""
    with _LOAD_LOCK:
        mod = sys.modules.get(module_name)
        if mod is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load {path}")
            mod = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = mod
            try:
                loader_spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[module_name]
                raise
    spec = getattr(mod, "SPEC", None)
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"{path}: SPEC is {type(spec).__name__}, not a KernelSpec")
    if spec.name != path.parent.name:
        raise ValueError(f"{path}: SPEC.name {spec.name!r} is not its folder name {path.parent.name!r}")
    return spec


# ------------------------------------------------------------------------------------ validation
_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def names_kernel(text: str, name: str) -> bool:
    """Whether test source ``text`` imports kernel ``name``'s package / api or calls it."""
    n = re.escape(name)
    return any(re.search(p, text) for p in (
        rf"\bk3_fastpath\.kernels\.{n}\b",  # from k3_fastpath.kernels.<name>[.api] import ...
        rf"\bfrom k3_fastpath\.kernels import \(?[\w\s,]*\b{n}\b",  # from k3_fastpath.kernels import a, <name>
        rf"(?<![\w.]){n}\(",  # <name>(...) called directly
    ))


def _check_gpu_test(spec: KernelSpec, rel: Any, repo_root: Path) -> list[str]:
    where = f"{spec.name}: gpu_tests {rel!r}"
    if not isinstance(rel, str) or not rel.startswith("tests/") or Path(rel).is_absolute() or ".." in Path(rel).parts:
        return [f"{where} is not a repo-relative path under tests/"]
    path = repo_root / rel
    if not path.is_file():
        return [f"{where} does not exist"]
    text = path.read_text()
    problems = []
    if "pytest.mark.gpu" not in text:
        problems.append(f"{where} is not marked gpu (no pytest.mark.gpu): kernels.numerics (-m gpu) runs nothing of it")
    if not names_kernel(text, spec.name):
        problems.append(f"{where} never imports or calls {spec.name}: none of its tests launches the kernel")
    if "counters" not in text:
        problems.append(f"{where} never reads the launch counters: nothing shows the kernel ran")
    return problems


def _check_targets(spec: KernelSpec) -> list[str]:
    problems = []
    if not isinstance(spec.api, str) or not _MODULE.match(spec.api):
        problems.append(f"{spec.name}: api {spec.api!r} is not a module path")
    else:
        try:
            api = resolve(spec.api)
        except Exception as e:  # report every spec's problems, keep going
            problems.append(f"{spec.name}: api {spec.api!r} does not import: {type(e).__name__}: {e}")
        else:
            if getattr(api, "NAME", None) != spec.name:
                problems.append(f"{spec.name}: {spec.api}.NAME is {getattr(api, 'NAME', None)!r}, not {spec.name!r}")
    for f in TARGET_FIELDS:
        target = getattr(spec, f)
        if not isinstance(target, str) or not _TARGET.match(target):
            problems.append(f"{spec.name}: {f} {target!r} is not a 'module:attr' string")
            continue
        try:
            obj = resolve(target)
        except Exception as e:
            problems.append(f"{spec.name}: {f} {target!r} does not resolve: {type(e).__name__}: {e}")
            continue
        if f == "config_type" and not isinstance(obj, type):
            problems.append(f"{spec.name}: config_type {target!r} is not a class")
        elif f != "config_type" and not callable(obj):
            problems.append(f"{spec.name}: {f} {target!r} is not callable")
    return problems


def validate_specs(specs: Iterable[KernelSpec], repo_root: Path | str) -> list[str]:
    """Every problem of ``specs`` (empty: all good), one line each, naming the kernel. Imports each target."""
    repo_root = Path(repo_root)
    specs = list(specs)
    problems: list[str] = []
    seen_names: dict[str, int] = {}
    seen_launches: dict[str, str] = {}
    seen_ops: dict[str, str] = {}
    for spec in specs:
        if not isinstance(spec, KernelSpec):
            problems.append(f"{spec!r} is not a KernelSpec")
            continue
        for f in fields(KernelSpec):
            v = getattr(spec, f.name)
            want = {"bool": bool, "tuple[str, ...]": tuple}.get(str(f.type), str)
            if not isinstance(v, want) or (want is tuple and not all(isinstance(x, str) for x in v)):
                problems.append(f"{spec.name}: {f.name} is {v!r}, not {f.type}")
        if not (isinstance(spec.name, str) and spec.name.isidentifier()):
            problems.append(f"{spec.name!r}: name is not an identifier")
            continue
        seen_names[spec.name] = seen_names.get(spec.name, 0) + 1
        launch_names = tuple(spec.launch_names) if isinstance(spec.launch_names, tuple) else ()
        if not launch_names or launch_names[0] != spec.name:
            problems.append(f"{spec.name}: launch_names {spec.launch_names!r} must start with the kernel's name")
        if len(set(launch_names)) != len(launch_names):
            problems.append(f"{spec.name}: launch_names {launch_names!r} lists a name twice")
        for n in dict.fromkeys(launch_names):
            owner = seen_launches.setdefault(n, spec.name)
            if owner != spec.name:
                problems.append(f"{spec.name}: launch name {n!r} is also {owner}'s")
        problems += _check_targets(spec)
        tests = spec.gpu_tests if isinstance(spec.gpu_tests, tuple) else ()
        if not tests:
            problems.append(f"{spec.name}: no gpu_tests: no GPU test launches this kernel")
        for rel in tests:
            problems += _check_gpu_test(spec, rel, repo_root)
        reads = spec.pdl_prologue_reads if isinstance(spec.pdl_prologue_reads, tuple) else ()
        if reads and spec.pdl is not True:
            problems.append(f"{spec.name}: pdl_prologue_reads {reads!r} without a PDL build (pdl=False)")
        if len(set(reads)) != len(reads) or not all(isinstance(r, str) and r.isidentifier() for r in reads):
            problems.append(f"{spec.name}: pdl_prologue_reads {reads!r} must be distinct parameter names")
        if not (isinstance(spec.serves_op, str) and spec.serves_op.isidentifier()):
            problems.append(f"{spec.name}: serves_op {spec.serves_op!r} is not an op name")
        elif spec.serves_op in seen_ops:
            problems.append(f"{spec.name}: op {spec.serves_op!r} is also served by {seen_ops[spec.serves_op]}")
        else:
            seen_ops[spec.serves_op] = spec.name
        if not isinstance(spec.opt_in, str) or (spec.opt_in and not spec.opt_in.isidentifier()):
            problems.append(f"{spec.name}: opt_in {spec.opt_in!r} is neither '' nor a DecodeOptions field name")
    problems += [f"{n}: declared by {k} specs" for n, k in seen_names.items() if k > 1]
    return problems
