"""Compile-only checks of the MLA decode kernels for sm_90a, on a CPU (no GPU needed).

1. Both kernels (split-KV attention, final combine) compile for every preset's MLA heads per GPU
   (k3-tp8-rank: 12, k3-tp16-rank: 6, k3-mini: 96, k3-tiny: 4 of rank 32), BF16 and FP8 caches; the
   context-parallel (partial) combine compiles for the K3 rank.
2. SASS (nvdisasm on the cubins the compile cache keeps): no local memory (no LDL/STL, zero
   EIATTR_FRAME_SIZE); the cache moves only by 16-byte cp.async (LDGSTS ...128, (stages - 1 + 1) x
   chunks-per-thread of them, no other global load wide enough to be a cache row); the scores and the
   value product run on tensor cores (HMMA.16816.F32.BF16: k-steps per warp + 4 x latent tiles per warp
   x head tiles) fed by ldmatrix (LDSM, the transposed form for the values); FP8 converts with the
   hardware e4m3 unpack; the combine loads partials and W_UV with 16-byte loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sass_tools import NVDISASM, isolated_cache
from sass_tools import frame_sizes as _frame_sizes
from sass_tools import opcodes as _opcodes

from k3_fastpath._lib import arch, compile_cache
from k3_fastpath.kernels import mla_decode as k
from k3_fastpath.kernels.mla_decode import api
from k3_fastpath.kernels.mla_decode.config import MAX_SPLITS, TILE, ksplit

PRESETS = ("k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-tiny")
needs_dsl = pytest.mark.skipif(not arch.is_available(),
                               reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
pytestmark = [pytest.mark.compile, needs_dsl]


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    yield from isolated_cache(tmp_path_factory, "k3_mla_cache")


@pytest.mark.slow  # 20-40 s per preset on a loaded 2-core CPU (two attention variants + the combine)
@pytest.mark.parametrize("preset", PRESETS)
def test_compiles_for_preset(preset):
    variants = k.compile_variants(preset)
    assert [v["dtype"] for v in variants] == ["bf16", "fp8"], variants
    for v in variants:
        assert callable(k.compile_kernel(**v))
        assert callable(api.compile_mla_combine(v["H"], v["R"], v["V"], True, v["config"]))  # cached: no recompile


def _cubin(key) -> Path:
    cubin = compile_cache.artifact_paths(key).get("cubin")
    assert cubin is not None, f"no cubin kept for {key}"
    return cubin


def test_preset_heads():
    """The heads per GPU the path must serve (K3.md failure 1: a head-count gate silently sent TP16 away)."""
    got = {p: (k.compile_variants(p)[0]["H"], k.compile_variants(p)[0]["R"]) for p in PRESETS}
    assert got == {"k3-tp8-rank": (12, 512), "k3-tp16-rank": (6, 512), "k3-mini": (96, 512), "k3-tiny": (4, 32)}


def test_partial_combine_compiles():
    v = k.compile_variants("k3-tp8-rank")[0]
    assert callable(api.compile_mla_combine(v["H"], v["R"], 1, False, v["config"]))








def _cases():
    return [(p, v) for p in ("k3-tp8-rank", "k3-tp16-rank", "k3-tiny") for v in k.compile_variants(p)]


@needs_nvdisasm
@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-{c[1]['dtype']}")
def test_attention_sass(case):
    _, v = case
    api.compile_mla_attention(v["dtype"], v["H"], v["R"], v["P"], v["page_size"], v["config"])
    key = compile_cache.CompileKey.make(k.NAME, v["dtype"], (v["H"], v["R"], v["P"], v["page_size"]), v["config"])
    cubin = _cubin(key)
    ops = _opcodes(cubin)
    cfg, D, R = v["config"], v["R"] + v["P"], v["R"]
    mem = {op: n for op, n in sorted(ops.items()) if op.startswith(("LD", "ST", "HMMA"))}
    print(f"\n[sass] mla attention {v['dtype']} H={v['H']} HG={cfg.heads_per_cta}: {mem}")
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {mem}"
    frames = _frame_sizes(cubin)
    assert frames and not any(frames), f"non-zero stack frame {frames}"
    chunks = -(-TILE * D * (1 if cfg.fp8 else 2) // 16 // 256)
    cp = {op: n for op, n in ops.items() if op.startswith("LDGSTS")}
    assert set(cp) == {"LDGSTS.E.BYPASS.LTC128B.128"} and sum(cp.values()) == cfg.stages * chunks, cp
    kpw = D // 16 // ksplit(cfg.heads_per_cta, D)
    mtw = -(-(R // 16) // 8)
    assert ops["HMMA.16816.F32.BF16"] == kpw + 4 * mtw * cfg.n_tiles, mem
    assert ops["LDSM.16.MT88.4"] == 4 * mtw, mem
    q_iters = -(-(cfg.heads_per_cta * D // 8) // 256)  # query vectors per thread (q_lat or q_pe path each)
    assert ops["LDG.E.128"] <= 2 * q_iters, f"a 16-byte global load besides the queries: {mem}"
    if cfg.fp8:
        assert ops["F2FP.F16.E4M3.UNPACK_B"] > 0, mem
    assert ops["BAR.SYNC.DEFER_BLOCKING"] + ops["BAR.SYNC"] <= 8


@needs_nvdisasm
@pytest.mark.parametrize("final", (True, False), ids=("final", "partial"))
def test_combine_sass(final):
    v = k.compile_variants("k3-tp8-rank")[0]
    H, R, V, cfg = v["H"], v["R"], v["V"], v["config"]
    api.compile_mla_combine(H, R, V if final else 1, final, cfg)
    key = compile_cache.CompileKey.make(f"{k.NAME}_combine", "fp32", (H, R, V if final else 1,
                                        "final" if final else "partial"),
                                        (cfg.gate and final, cfg.combine_rows, MAX_SPLITS))
    cubin = _cubin(key)
    ops = _opcodes(cubin)
    mem = {op: n for op, n in sorted(ops.items()) if op.startswith(("LD", "ST"))}
    print(f"\n[sass] mla combine {'final' if final else 'partial'}: {mem}")
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {mem}"
    frames = _frame_sizes(cubin)
    assert frames and not any(frames), f"non-zero stack frame {frames}"
    assert ops["LDG.E.128"] >= 8, mem  # partials (and W_UV rows) in 16-byte loads
    loads = {op for op in ops if op.startswith("LDG")}
    assert loads <= {"LDG.E.128", "LDG.E", "LDG.E.U16"}, loads  # lse (32-bit) and the bf16 gate
