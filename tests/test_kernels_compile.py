"""Compile-only checks of the CuTe DSL kernels for sm_90a, on a CPU (no GPU needed).

1. Every kernel compiles for every decode shape of k3-tp8-rank, k3-tp16-rank, k3-mini and k3-tiny
   (each kernel's ``compile_variants(preset)``, with fake tensors and a symbolic batch dimension).
   The default run compiles a representative subset of the skinny-GEMM grid: every GEMM shape of every
   preset once, with the M bucket rotating over the shapes so every bucket (fma M=1, 2; mma m_max 8, 16,
   32, 64, with and without split-K, and the residual / FP32-output epilogues) is compiled for several
   shapes: about 1 minute on 2 CPUs. The full grid (every shape x bucket x epilogue: 336 distinct GEMM
   compiles, ~165 s; mean 0.2-0.3 s for fma / mma-8, ~1.2 s for mma-64; all presets ~3.5 minutes) runs
   with K3_COMPILE_FULL=1.
2. SASS (nvdisasm on the cubin the compile cache keeps) of representative GEMM configs and the row
   kernels: the GEMM's weight loads are 128-bit (LDG.E.128), its inner loop holds no narrower global
   load, the mma epilogue stores 16 bytes, no LDL/STL; the inner-loop instruction mix is printed
   (``-s``). Every cubin the module compiled is also checked for a zero stack frame (no spills) from
   its .nv.info (EIATTR_FRAME_SIZE), which is fast enough for the whole grid.
3. The registry: the registered kernels are the folders with a spec.py (``test_kernel_specs.py`` checks the
   specs themselves); every one has spec/config/kernel/api/reference, exports the required API and is
   named by another test file (this part needs neither cutlass-dsl nor a GPU).
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from collections import Counter
from pathlib import Path

import pytest
from sass_tools import NVDISASM, isolated_cache, opcode, sass_lines

from k3_fastpath import kernels as registry
from k3_fastpath._lib import arch, compile_cache

PRESETS = ("k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-tiny")
FULL = os.environ.get("K3_COMPILE_FULL", "") not in ("", "0")
needs_dsl = pytest.mark.skipif(not arch.is_available(),
                               reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")
KERNEL_DIR = Path(registry.__file__).parent
TIMINGS: list[tuple[str, str, str, float]] = []


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Compile into a fresh cache dir so the cubins the SASS checks read are this run's."""
    yield from isolated_cache(tmp_path_factory, "k3_kernel_cache")
    if TIMINGS:
        by_kernel: dict[str, list[float]] = {}
        for kernel, _, _, s in TIMINGS:
            by_kernel.setdefault(kernel, []).append(s)
        print("\ncompile times (s): " + "; ".join(
            f"{k}: n={len(v)} total={sum(v):.1f} mean={sum(v) / len(v):.2f} max={max(v):.2f}"
            for k, v in by_kernel.items()))


def _variants(kernel: str, preset: str) -> list[dict]:
    vs = registry.api(kernel).compile_variants(preset)
    if kernel != "skinny_gemm" or FULL:
        return vs
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for v in vs:
        by_shape.setdefault((v["N"], v["K"]), []).append(v)
    offset = PRESETS.index(preset)
    return [opts[(i + offset) % len(opts)] for i, opts in enumerate(by_shape.values())]


def _compile(kernel: str, v: dict):
    args = {k: val for k, val in v.items() if k not in ("shape_name", "M")}
    return registry.api(kernel).compile_kernel(**args)


@needs_dsl
@pytest.mark.compile
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("kernel", registry.names())
def test_compiles_for_preset(kernel, preset):
    variants = _variants(kernel, preset)
    assert variants, f"{kernel} has no decode shapes for {preset}"
    for v in variants:
        t0 = time.perf_counter()
        fn = _compile(kernel, v)
        TIMINGS.append((kernel, preset, repr(v.get("config")), time.perf_counter() - t0))
        assert callable(fn)


# --------------------------------------------------------------------------------------------- SASS
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


def _sass(kernel: str, key_args: dict) -> list[str]:
    """Instruction lines (predicate kept) of the cubin compiled for ``key_args``, plus labels."""
    api = registry.api(kernel)
    _compile(kernel, key_args)
    shapes = {"skinny_gemm": ("N", "K"), "rmsnorm_residual": ("H",), "attn_res_mix": ("S", "H"), "situ_glu": ("I",)}[kernel]
    key = compile_cache.CompileKey.make(api.NAME, key_args["dtype"], tuple(key_args[s] for s in shapes),
                                        key_args["config"])
    cubin = compile_cache.artifact_paths(key).get("cubin")
    assert cubin is not None, f"no cubin kept for {key}"
    return sass_lines(cubin)


def _inner_loop(lines: list[str]) -> list[str]:
    """The longest loop body: instructions between a label and the backward branch to it."""
    best: list[str] = []
    for i, insn in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", insn)
        if not m or m.group(1) not in lines[:i]:
            continue
        start = lines.index(m.group(1))
        body = [x for x in lines[start + 1:i + 1] if not x.startswith(".L")]
        if len(body) > len(best):
            best = body
    return best


def _gemm_cases():
    from k3_fastpath.kernels.skinny_gemm import SkinnyGemmConfig
    from k3_fastpath.presets import preset

    N, K = preset("k3-tp8-rank").shapes.kda_in_proj
    n_small, k_small = preset("k3-tp16-rank").shapes.mla_gate
    return [(f"{n}x{k} M={M}", {"dtype": "bf16", "N": n, "K": k, "config": SkinnyGemmConfig.from_heuristic(M, n, k)})
            for n, k, Ms in ((N, K, (1, 2, 8, 64)), (n_small, k_small, (16,)))
            for M in Ms]


@needs_dsl
@needs_nvdisasm
@pytest.mark.compile
@pytest.mark.parametrize("case", _gemm_cases(), ids=lambda c: c[0])
def test_gemm_sass_vector_loads_no_spills(case):
    name, args = case
    lines = _sass("skinny_gemm", args)
    ops = Counter(opcode(x) for x in lines if not x.startswith(".L"))
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {ops}"
    loop = _inner_loop(lines)
    assert loop, "no inner loop found"
    loop_ops = Counter(opcode(x) for x in loop)
    loads = {op: n for op, n in loop_ops.items() if op.startswith("LDG")}
    assert loads and set(loads) == {"LDG.E.128"}, f"inner-loop global loads not all 128-bit: {loads}"
    cfg = args["config"]
    if cfg.variant == "mma":
        assert loop_ops["HMMA.16816.F32.BF16"] > 0
        stores = {op: n for op, n in ops.items() if op.startswith("STG")}
        # 16-byte output stores (smem-staged epilogue); one 32-bit store resets the split-K counter
        assert set(stores) <= {"STG.E.128", "STG.E"} and stores.get("STG.E", 0) <= 1, stores
    else:
        assert loop_ops["FFMA"] > 0
    print(f"\n[sass] skinny_gemm {name} {cfg.variant} m_max={cfg.m_max} split_k={cfg.split_k}: "
          f"inner loop {len(loop)} insns, " + ", ".join(f"{k} {v}" for k, v in loop_ops.most_common(8)))


def _row_kernel_cases():
    from k3_fastpath.kernels.attn_res_mix import AttnResConfig
    from k3_fastpath.kernels.rmsnorm_residual import RMSNormConfig
    from k3_fastpath.kernels.situ_glu import SituGluConfig

    return [("rmsnorm_residual", {"dtype": "bf16", "H": 7168, "config": RMSNormConfig.from_heuristic(7168)}),
            ("attn_res_mix", {"dtype": "bf16", "S": 4, "H": 7168, "config": AttnResConfig.from_heuristic(4, 7168)}),
            ("attn_res_mix", {"dtype": "bf16", "S": 9, "H": 7168, "config": AttnResConfig.from_heuristic(9, 7168)}),
            ("situ_glu", {"dtype": "bf16", "I": 384, "config": SituGluConfig.from_heuristic(384, 4.0, 25.0)}),
            ("situ_glu", {"dtype": "bf16", "I": 2112, "config": SituGluConfig.from_heuristic(2112, 4.0, 25.0)})]


@needs_dsl
@needs_nvdisasm
@pytest.mark.compile
@pytest.mark.parametrize("case", _row_kernel_cases(), ids=lambda c: f"{c[0]}-{c[1].get('S', c[1].get('I', ''))}")
def test_row_kernels_sass_vector_access_no_spills(case):
    kernel, args = case
    ops = Counter(opcode(x) for x in _sass(kernel, args) if not x.startswith(".L"))
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {ops}"
    ldg = {op: n for op, n in ops.items() if op.startswith("LDG")}
    stg = {op: n for op, n in ops.items() if op.startswith("STG")}
    assert set(ldg) == {"LDG.E.128"}, ldg
    assert set(stg) == {"STG.E.128"}, stg
    if kernel == "situ_glu":  # two 16-byte loads (g, u) and one store per vector; tanh not the MUFU approximation
        assert ldg["LDG.E.128"] == 2 * args["config"].vec_per_thread and stg["STG.E.128"] == args["config"].vec_per_thread
        assert "MUFU.TANH" not in ops, ops


def _nv_info(cubin: Path) -> dict[int, list[int]]:
    """Per-function attributes of a cubin's .nv.info section: {EIATTR id: [value, ...]} for the
    (function, value) records, e.g. 0x2f REGCOUNT, 0x11 FRAME_SIZE (bytes of local memory: spills)."""
    b = cubin.read_bytes()
    (shoff,) = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx][4]
    out: dict[int, list[int]] = {}
    for sec in secs:
        name = b[strtab + sec[0]: b.index(b"\0", strtab + sec[0])]
        if name != b".nv.info":
            continue
        p, end = sec[4], sec[4] + sec[5]
        while p < end:
            fmt, attr = b[p], b[p + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size, payload
                (size,) = struct.unpack_from("<H", b, p + 2)
                if size == 8:
                    out.setdefault(attr, []).append(struct.unpack_from("<II", b, p + 4)[1])
                p += 4 + size
            else:
                p += 4 if fmt == 0x03 else 2
    return out


@needs_dsl
@pytest.mark.compile
def test_no_kernel_compiled_in_this_session_uses_local_memory():
    """Every cubin this module compiled (the preset grids above) has a zero stack frame: no spills.
    (ptxas -O3 once spilled a loop counter at 40 registers to raise occupancy; .minnctapersm 1 fixed it.)"""
    cubins = sorted(compile_cache.cache_dir().glob("*/*/*.cubin"))
    if not cubins:
        pytest.skip(reason="no kernels compiled in this session (run the whole module)")
    bad, regs = [], Counter()
    for cubin in cubins:
        info = _nv_info(cubin)
        meta = json.loads((cubin.parent / "key.json").read_text())["key"]
        assert info.get(0x11), f"no FRAME_SIZE record in {cubin}"
        if any(info[0x11]):
            bad.append(f"{meta['kernel']} {meta['shapes']} {meta['config']}: frame {info[0x11]} B")
        regs[meta["kernel"]] = max(regs[meta["kernel"]], *info.get(0x2F, [0]))
    assert not bad, f"{len(bad)} of {len(cubins)} kernels use local memory: " + "; ".join(bad[:5])
    print(f"\n[sass] {len(cubins)} kernels: zero stack frame; max registers {dict(regs)}")


# ----------------------------------------------------------------------------------------- registry
def test_registry_lists_every_kernel_folder():
    folders = sorted(p.parent.name for p in KERNEL_DIR.glob("*/kernel.py"))
    assert folders == sorted(registry.names()), "a kernel folder has no spec.py (or a spec.py no kernel.py)"
    assert registry.names() == registry.KERNELS == tuple(s.name for s in registry.all_specs())


@pytest.mark.parametrize("kernel", registry.names())
def test_registry_kernel_contract(kernel):
    folder = KERNEL_DIR / kernel
    for f in ("__init__.py", "spec.py", "config.py", "kernel.py", "api.py", "reference.py"):
        assert (folder / f).is_file(), f"{kernel}/{f} missing"
    mod = registry.api(kernel)
    for name in registry.REQUIRED_EXPORTS:
        assert hasattr(mod, name), f"{kernel} does not export {name}"
    assert mod.NAME == kernel == registry.spec(kernel).name
    assert registry.spec(kernel).gpu_tests, f"{kernel}: its spec names no GPU test"
    here = Path(__file__).resolve()
    refs = (f'"{kernel}"', f"kernels.{kernel}", f"kernels import {kernel}")
    covered = [p.name for p in here.parent.rglob("test_*.py")
               if p.resolve() != here and any(r in p.read_text() for r in refs)]
    assert covered, f"no test file under tests/ (besides this registry check) names kernel {kernel}"
