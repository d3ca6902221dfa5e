"""Compile-only checks of the routed-expert kernels for sm_90a, on a CPU (no GPU needed).

1. Every kernel of a preset's experts compiles (plan for each pair-count bucket, gate/up GEMM, down GEMM,
   combine): k3-tp8-rank (896 experts, I = 384), k3-tp16-rank (I = 192), k3-mini (64 experts, I = 3072),
   k3-tiny; the BF16-weight GEMMs and the FP32-output combine for the K3 rank.
2. SASS: no local memory (no LDL/STL, zero EIATTR_FRAME_SIZE); the MXFP4 GEMM's weights move in 16-byte
   loads (LDG.E.128) with 32-bit scale loads, its e2m1 table lookups are 32-bit shared loads, its math is
   HMMA.16816.F32.BF16; the BF16 GEMM has no table at all.
"""

from __future__ import annotations

import pytest
from sass_tools import NVDISASM, isolated_cache
from sass_tools import frame_sizes as _frame_sizes
from sass_tools import opcodes as _opcodes

from k3_fastpath._lib import arch, compile_cache
from k3_fastpath.kernels import moe_experts as k
from k3_fastpath.kernels.moe_experts import api
from k3_fastpath.kernels.moe_experts.config import ExpertGemmConfig

PRESETS = ("k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-tiny")
needs_dsl = pytest.mark.skipif(not arch.is_available(),
                               reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
pytestmark = [pytest.mark.compile, needs_dsl]


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    yield from isolated_cache(tmp_path_factory, "k3_experts_cache")


@pytest.mark.slow  # 30-60 s per preset on a loaded 2-core CPU (three plan sizes, two GEMMs, the combine)
@pytest.mark.parametrize("preset", PRESETS)
def test_compiles_for_preset(preset):
    variants = k.compile_variants(preset)
    assert len(variants) == 1 and variants[0]["dtype"] == "mxfp4", variants
    v = variants[0]
    assert callable(k.compile_kernel(**v))
    c = v["config"]  # the other kernels are in the cache now: fetching them does not recompile
    fns = [api.compile_plan(v["E"], n) for n in api.SORT_SIZES]
    fns += [api.compile_gemm(v["E"], v["L"], v["I"], v["k_top"], c.beta, c.linear_beta, c.down),
            api.compile_combine(v["L"], v["k_top"], c.norm)]
    assert all(callable(f) for f in fns)


def test_preset_expert_shapes():
    got = {p: tuple(k.compile_variants(p)[0][n] for n in ("E", "I", "L", "k_top")) for p in PRESETS}
    assert got == {"k3-tp8-rank": (896, 384, 3584, 16), "k3-tp16-rank": (896, 192, 3584, 16),
                   "k3-mini": (64, 3072, 3584, 16), "k3-tiny": (16, 128, 64, 4)}, got






def _gemm_cases():
    v = k.compile_variants("k3-tp8-rank")[0]
    E, I, L, kt, c = v["E"], v["I"], v["L"], v["k_top"], v["config"]
    return [("mxfp4-glu", (E, I, L, kt, c.beta, c.linear_beta, c.glu)),
            ("mxfp4-down", (E, L, I, kt, c.beta, c.linear_beta, c.down)),
            ("bf16-glu", (E, I, L, kt, c.beta, c.linear_beta, ExpertGemmConfig.from_heuristic("bf16", True, I, L))),
            ("bf16-down", (E, L, I, kt, c.beta, c.linear_beta, ExpertGemmConfig.from_heuristic("bf16", False, L, I)))]


@needs_nvdisasm
@pytest.mark.parametrize("case", _gemm_cases(), ids=lambda c: c[0])
def test_gemm_sass(case):
    name, args = case
    api.compile_gemm(*args)
    cfg = args[-1]
    key = compile_cache.CompileKey.make(f"{k.NAME}_gemm", cfg.fmt, args[:-1], cfg)
    cubin = compile_cache.artifact_paths(key).get("cubin")
    assert cubin is not None, f"no cubin kept for {key}"
    ops = _opcodes(cubin)
    mem = {op: n for op, n in sorted(ops.items()) if op.startswith(("LD", "ST", "HMMA"))}
    print(f"\n[sass] moe_experts {name}: {mem}")
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {mem}"
    frames = _frame_sizes(cubin)
    assert frames and not any(frames), f"non-zero stack frame {frames}"
    mats = 2 if cfg.glu else 1
    per_step = 2 * 2 * cfg.tiles_per_pass * mats  # two mma per group, two groups per 64-wide step
    assert ops["HMMA.16816.F32.BF16"] == per_step * cfg.k_unroll, mem
    loads = {op for op in ops if op.startswith("LDG")}
    assert loads <= {"LDG.E.128", "LDG.E", "LDG.E.64"}, loads  # no sub-word global loads
    if cfg.fmt == "mxfp4":
        assert ops["LDS"] == 2 * 2 * 4 * mats * cfg.k_unroll, mem  # one 32-bit lookup per weight byte
    else:
        assert ops["LDS"] == 0 and not ops["STS"], mem


@needs_nvdisasm
def test_plan_and_combine_compile_without_spills():
    v = k.compile_variants("k3-tp8-rank")[0]
    api.compile_plan(v["E"], 1024)
    api.compile_combine(v["L"], v["k_top"], False)
    keys = [compile_cache.CompileKey.make(f"{k.NAME}_plan", "i32", (v["E"], 1024), None),
            compile_cache.CompileKey.make(f"{k.NAME}_combine", "bf16", (v["L"], v["k_top"], False),
                                          api.COMBINE_THREADS)]
    for key in keys:
        cubin = compile_cache.artifact_paths(key)["cubin"]
        ops = _opcodes(cubin)
        assert not any(op.startswith(("LDL", "STL")) for op in ops) and not any(_frame_sizes(cubin)), ops
