"""The kernel specs (``kernels/<op>/spec.py``), checked on a CPU with neither cutlass-dsl nor a GPU.

A kernel is declared once, by its spec; every list of kernels is derived from the specs. Here:

1. every kernel folder has a spec and every spec a kernel folder; reading the specs imports neither
   torch nor cutlass-dsl;
2. ``validate_specs`` finds no problem: every ``"module:attr"`` target resolves (and is what the kernel
   package exports), every GPU test file exists, is marked ``gpu``, names the kernel and reads the launch
   counters, so a registered kernel without a GPU test that launches it fails here, not on an H200;
3. the validation can fail: specs broken on purpose (no GPU test, a test file that never names the
   kernel, one that is not a GPU test, a target that does not resolve, ...) are each rejected with the
   problem named;
4. the derived lists agree: ``kernels.numerics`` runs every spec's GPU tests, the sanitizer driver expects
   every launch name and calls every kernel, the executor's op tables serve exactly the default-step
   kernels (each under its ``serves_op``, ``pdl`` bound where it has a PDL build) and the opt-in ones.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3_fastpath import kernels as registry
from k3_fastpath._lib.kernel_spec import KernelSpec, names_kernel, validate_specs

REPO = Path(__file__).resolve().parents[1]
KERNEL_DIR = Path(registry.__file__).parent


def test_every_kernel_folder_has_a_spec_and_every_spec_a_kernel():
    with_kernel = sorted(p.parent.name for p in KERNEL_DIR.glob("*/kernel.py"))
    with_spec = sorted(p.parent.name for p in KERNEL_DIR.glob("*/spec.py"))
    assert with_kernel == with_spec, f"kernel.py without spec.py (or vice versa): {set(with_kernel) ^ set(with_spec)}"
    assert list(registry.names()) == with_spec
    assert [s.name for s in registry.all_specs()] == with_spec


# the files a kernel folder holds beyond these must be named here with what they are for
KERNEL_FILES = {"__init__.py", "spec.py", "config.py", "kernel.py", "api.py", "reference.py", "bench.py"}
EXTRA_FILES = {"skinny_gemm": {"kernel_wgmma.py", "tuned.py", "tuned_h200.json"},  # 2nd variant, sweep table
               "moe_experts": {"layout.py"}}  # the MXFP4 fragment layout built once per expert bank


def test_every_kernel_folder_has_the_same_files():
    for name in registry.names():
        files = {p.name for p in (KERNEL_DIR / name).iterdir() if p.is_file()}
        want = KERNEL_FILES - ({"bench.py"} if name == "situ_glu" else set())  # situ_glu: timed in the step
        assert want <= files, f"{name} lacks {sorted(want - files)}"
        extra = files - KERNEL_FILES - EXTRA_FILES.get(name, set())
        assert not extra, f"{name} has {sorted(extra)}: shared device code belongs in kernels/common"


def test_device_helpers_live_in_common():
    """The sigmoid and the PDL prologue's L2 prefetch are written once (kernels/common/primitives.py), the PDL
    wait and trigger go through common/pdl.py's ``PdlOrder`` (which states per operand whether it may be read
    before the wait): no kernel issues a raw ``cp.async.bulk.prefetch`` or ``griddepcontrol``, defines its own
    sigmoid, or imports another kernel's folder; every kernel with a PDL build names its order."""
    import re

    from k3_fastpath.kernels import KERNELS, spec

    for path in KERNEL_DIR.glob("*/kernel*.py"):
        text = path.read_text()
        assert 'inline_ptx("cp.async.bulk.prefetch' not in text, f"{path}: use common.primitives.prefetch_weights_l2"
        assert "griddepcontrol_" not in text, f"{path}: wait / trigger through common.pdl.PdlOrder"
        assert not re.search(r"^def _?sigmoid\(", text, re.M), f"{path}: use common.primitives.sigmoid"
        others = {m for m in re.findall(r"from \.\.(\w+)", text) if m != "common"}
        assert not others, f"{path} imports kernel folder(s) {sorted(others)}"
    for name in KERNELS:
        if spec(name).pdl:
            text = "".join(p.read_text() for p in (KERNEL_DIR / name).glob("kernel*.py"))
            assert "PdlOrder(" in text and ".wait()" in text, f"{name}: a PDL build states its order (PdlOrder)"


def test_reading_specs_imports_neither_torch_nor_cutlass():
    code = ("import sys; import k3_fastpath.kernels as k; k.all_specs(); k.launch_names(); k.gpu_test_files(); "
            "bad = [m for m in ('torch', 'cutlass') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_specs_are_valid():
    assert validate_specs(registry.all_specs(), REPO) == []


@pytest.mark.parametrize("kernel", registry.names())
def test_spec_targets_are_the_kernel_packages_exports(kernel):
    spec = registry.spec(kernel)
    pkg = registry.api(kernel)
    assert spec.resolve("api").NAME == pkg.NAME == kernel
    assert spec.resolve("support") is pkg.is_supported
    assert spec.resolve("reference") is pkg.reference
    assert spec.resolve("compile_variants") is pkg.compile_variants
    assert dataclasses.is_dataclass(spec.resolve("config_type"))
    assert spec.launch_names[0] == spec.name
    assert spec.pdl or not spec.pdl_prologue_reads


def _broken(**changes) -> KernelSpec:
    return dataclasses.replace(registry.spec("kda_decode"), **changes)


BROKEN = {  # id -> (the spec, a problem validate_specs must name)
    "no-gpu-test": (_broken(gpu_tests=()), "no gpu_tests"),
    "test-never-names-kernel": (_broken(gpu_tests=("tests/test_situ_glu_gpu.py",)), "never imports or calls"),
    "not-a-gpu-test": (_broken(gpu_tests=("tests/test_kda_decode_compile.py",)), "is not marked gpu"),
    "missing-test-file": (_broken(gpu_tests=("tests/test_kda_decode_gpu_gone.py",)), "does not exist"),
    "test-outside-tests": (_broken(gpu_tests=("../tests/test_kda_decode_gpu.py",)), "under tests/"),
    "unresolved-target": (_broken(support="k3_fastpath.kernels.kda_decode.api:is_supported_gone"), "does not resolve"),
    "target-not-module-attr": (_broken(reference="k3_fastpath.kernels.kda_decode.reference"), "'module:attr'"),
    "config-not-a-class": (_broken(config_type="k3_fastpath.kernels.kda_decode.api:is_supported"), "not a class"),
    "api-of-another-kernel": (_broken(api="k3_fastpath.kernels.situ_glu.api"), "NAME is 'situ_glu'"),
    "launch-names-without-name": (_broken(launch_names=("kda",)), "must start with the kernel's name"),
    "reads-without-pdl": (_broken(pdl=False), "without a PDL build"),
    "not-a-bool": (_broken(pdl="yes"), "pdl"),
    "op-not-a-name": (_broken(serves_op="two words"), "serves_op"),
}


@pytest.mark.parametrize("case", BROKEN, ids=str)
def test_validation_rejects_a_broken_spec(case):
    """The validation the registry test relies on can fail: each broken spec is rejected, the problem named;
    the unbroken spec passes the same call."""
    spec, problem = BROKEN[case]
    problems = validate_specs([spec], REPO)
    assert any(problem in p for p in problems), problems
    assert validate_specs([registry.spec("kda_decode")], REPO) == []


def test_validation_rejects_duplicate_kernels_and_launch_names():
    mla = registry.spec("mla_decode")
    twin = dataclasses.replace(registry.spec("kda_decode"), launch_names=("kda_decode", "mla_decode_merge"))
    problems = validate_specs([mla, mla, twin], REPO)
    assert any("declared by 2 specs" in p for p in problems), problems
    assert any("'mla_decode_merge' is also mla_decode's" in p for p in problems), problems


def test_names_kernel_reads_imports_and_calls():
    assert names_kernel("from k3_fastpath.kernels import (\n    attn_res_mix,\n    skinny_gemm,\n)", "skinny_gemm")
    assert names_kernel("from k3_fastpath.kernels.skinny_gemm import api", "skinny_gemm")
    assert names_kernel("    y = situ_glu(g, u, 4.0, 25.0)", "situ_glu")
    assert not names_kernel("def test_kda_decode(B):\n    test_kda_decode_tiny(1)", "kda_decode")
    assert not names_kernel("from k3_fastpath.kernels import situ_glu as k", "skinny_gemm")


def test_numerics_check_runs_every_specs_gpu_tests():
    from verify.checks.kernels import GPU_KERNEL_TESTS

    assert GPU_KERNEL_TESTS == registry.gpu_test_files()
    for s in registry.all_specs():
        assert set(s.gpu_tests) <= set(GPU_KERNEL_TESTS), s.name
    assert all((REPO / f).is_file() for f in GPU_KERNEL_TESTS)


def test_sanitizer_driver_expects_and_calls_every_kernel():
    from k3_fastpath.runtime import sanitize_driver

    assert "mla_decode_merge" in registry.launch_names()
    src = Path(sanitize_driver.__file__).read_text()
    assert "registry.launch_names()" in src  # what the driver requires to have moved
    missing = [s.name for s in registry.all_specs() if f"from {s.api} import" not in src]
    assert not missing, f"sanitize_driver never calls {missing}"


def test_op_tables_serve_the_specs_kernels():
    """``fast_ops.op_table``: the default table's kernels are the specs in the default step, each under the op
    its spec names; every opt-in names a DecodeOptions bool that adds exactly its kernel's op; an adapter takes ``pdl``
    (keyword-only) exactly when its kernel has a PDL build."""
    import dataclasses
    import inspect

    from k3_fastpath.runtime import fast_ops
    from k3_fastpath.runtime.options import DecodeOptions

    specs = registry.all_specs()
    plain = fast_ops.op_table()
    assert {n: o.kernel for n, o in plain.items()} == {s.serves_op: s.name for s in specs if s.in_default_step}
    bools = {f.name for f in dataclasses.fields(DecodeOptions) if f.type in (bool, "bool")}
    for s in specs:
        params = inspect.signature(s.resolve("api").step_op).parameters
        assert "pdl" not in params or params["pdl"].kind is inspect.Parameter.KEYWORD_ONLY, s.name
        assert ("pdl" in fast_ops.launch_options(s.resolve("api").step_op)) == s.pdl, s.name
        if s.opt_in:
            assert s.opt_in in bools, f"{s.name}: opt_in {s.opt_in!r} is not a DecodeOptions bool"
            added = set(fast_ops.op_table(DecodeOptions(**{s.opt_in: True}))) - set(plain)
            assert added == {s.serves_op}, (s.name, added)


def test_pdl_order_refuses_an_after_wait_operand_before_the_wait():
    """``kernels/common/pdl.py`` at trace time (the non-PDL order emits no instruction, so this needs no
    kernel): an ``AfterWait`` handle refuses indexing, item assignment and ``.tensor`` until ``wait()``, its
    shape stays readable, dependents cannot be triggered first, and a weight is handed back as it is."""
    pytest.importorskip("cutlass", reason="needs CuTe DSL (nvidia-cutlass-dsl, the gpu extra)")
    import torch

    from k3_fastpath.kernels.common.pdl import PdlOrder, PdlOrderError

    order = PdlOrder(False)
    x, w = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    hx, none = order.after_wait(x, None)
    assert none is None and order.weight(w) is w and hx.shape == (2, 3)
    for touch in (lambda: hx[0], lambda: hx.__setitem__((0, 0), 1.0), lambda: hx.tensor, lambda: order.open(hx),
                  order.launch_dependents):
        with pytest.raises(PdlOrderError):
            touch()
    order.wait()
    order.launch_dependents()
    assert torch.equal(hx[1], x[1]) and order.open(hx) is x
    hx[0, 0] = 7.0
    assert x[0, 0] == 7.0
