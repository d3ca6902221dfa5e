"""The skinny GEMM's TMA + wgmma variant (kernel_wgmma.py), without a GPU: config rules, the default range, compiles
for sm_90a, and what its SASS must contain.

1. Config (no cutlass needed): validation, ``wgmma_for`` (fits 2 CTAs per SM, split-K keeps >= 4 K stages
   per split), ``from_heuristic`` never returns it, ``select`` / ``m_buckets`` / ``compile_variants`` send
   M >= 4 to it by default and follow their ``wgmma_min_m`` (``DecodeOptions.gemm_wgmma_min_m``: 0 = off, 1..64 = the threshold).
2. Compiles (CUTE_DSL_ARCH=sm_90a, fake tensors, symbolic M) for the K3 rank shapes at M = 32 and 64: by
   default the projections the variant is for (KDA in_proj at TP8/TP16, o_proj, MLA q_b, lm_head, the dense
   MLP) plus epilogue / knob variants; every GEMM shape of k3-tp8-rank, k3-tp16-rank and k3-mini with
   K3_COMPILE_FULL=1 (~1 s per compile).
3. SASS (nvdisasm): HGMMA.64x{m_max}x16.F32.BF16 in the K loop beside the mbarrier wait, UTMALDG (TMA)
   loads, no LDG of W or x (they only arrive by TMA), 16-byte output stores, no LDL/STL and a zero stack
   frame. PTX of the PDL config: only W tiles are requested before griddepcontrol.wait.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter

import pytest
from sass_tools import NVDISASM, frame_sizes, isolated_cache, opcode, sass_lines

from k3_fastpath._lib import arch, compile_cache
from k3_fastpath.kernels.skinny_gemm import api
from k3_fastpath.kernels.skinny_gemm.config import (
    MMA_BUCKETS,
    SMEM_PER_SM_H200,
    SkinnyGemmConfig,
    m_buckets,
    wgmma_threshold,
)

FULL = os.environ.get("K3_COMPILE_FULL", "") not in ("", "0")
needs_dsl = pytest.mark.skipif(not arch.is_available(), reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
PRESETS = ("k3-tp8-rank", "k3-tp16-rank", "k3-mini")


@pytest.fixture(scope="module")
def _cache(tmp_path_factory):
    yield from isolated_cache(tmp_path_factory, "k3_wgmma_cache")


# ----------------------------------------------------------------------------------------------- config
def _all_shapes() -> dict[tuple[int, int], str]:
    from k3_fastpath.presets import preset

    out: dict[tuple[int, int], str] = {}
    for p in PRESETS:
        for name, nk in preset(p).shapes.gemm_shapes().items():
            out.setdefault(nk, f"{p}:{name}")
    return out


def test_wgmma_config_validation():
    ok = SkinnyGemmConfig("wgmma", m_max=64, rows_per_warp=1, warps_n=4, k_unroll=1, stages=6)
    assert (ok.rows_per_cta, ok.threads, ok.block_k, ok.acc_per_thread) == (64, 128, 64, 32)
    assert ok.stage_bytes == (64 + 64) * 64 * 2
    two = dataclasses.replace(ok, warps_n=8, m_max=32, stages=4)
    assert (two.rows_per_cta, two.threads, two.acc_per_thread) == (128, 256, 16)
    bad = [dict(m_max=8), dict(m_max=48), dict(warps_n=2), dict(warps_k=2), dict(rows_per_warp=3),
           dict(k_unroll=3), dict(stages=1), dict(stages=13), dict(k_unroll=4, stages=12)]  # last: > 227 KB
    for kw in bad:
        with pytest.raises(ValueError):
            dataclasses.replace(ok, **kw)
    with pytest.raises(ValueError, match="stages is a wgmma knob"):
        SkinnyGemmConfig("mma", m_max=32, rows_per_warp=1, warps_n=4, stages=6)


@pytest.mark.parametrize("M", (9, 16, 17, 32, 33, 64))
def test_wgmma_for_every_rank_shape(M):
    """Every K3 rank shape gets a valid config: bucket >= M, 2 CTAs per SM fit, >= 3 stages, each split
    keeps >= 4 K stages (or split 1), the split-K workspace shape matches the kernel's fragment count."""
    for (N, K), name in _all_shapes().items():
        c = SkinnyGemmConfig.wgmma_for(M, N, K)
        assert c.variant == "wgmma" and c.m_max >= M and c.m_max - M < c.m_max // 2 + 1, (name, c)
        assert c.ctas_per_sm() >= 2 and 2 * (c.smem_bytes + 1024) <= SMEM_PER_SM_H200, (name, c)
        assert c.stages >= 3
        k_stages = -(-K // c.block_k)
        assert c.split_k == 1 or k_stages // c.split_k >= 4, (name, c)
        assert c.acc_per_thread * c.threads == c.rows_per_cta * c.m_max


def test_bench_wgmma_grid_is_valid_and_one_factor_at_a_time():
    from k3_fastpath.kernels.skinny_gemm.bench import _changes, wgmma_candidates

    for (N, K) in ((6288, 7168), (7168, 384), (20480, 7168)):
        base = SkinnyGemmConfig.wgmma_for(64, N, K)
        grid = wgmma_candidates(64, N, K)
        assert len(grid) >= 6 and base not in grid and len(set(grid)) == len(grid)
        for cfg in grid:
            assert cfg.variant == "wgmma" and cfg.split_k <= -(-K // cfg.block_k)
            assert 1 <= len(_changes(base, cfg)) <= 2, _changes(base, cfg)  # a knob (+ its re-fitted stages)


def test_heuristic_never_picks_wgmma():
    for (N, K) in _all_shapes():
        for M in range(1, 65):
            try:
                assert SkinnyGemmConfig.from_heuristic(M, N, K).variant != "wgmma"
            except ValueError:
                pass


def test_default_and_threshold():
    N, K = 6288, 7168
    assert wgmma_threshold(4) == 4 and SkinnyGemmConfig.select(4, N, K) == SkinnyGemmConfig.wgmma_for(4, N, K)
    assert SkinnyGemmConfig.select(3, N, K).variant == "fma"
    assert m_buckets() == (1, 2, 3, 4, 16, 32, 64)
    assert wgmma_threshold(0) is None and SkinnyGemmConfig.select(40, N, K, wgmma_min_m=0).variant == "mma"
    assert m_buckets(0) == (1, 2, 3, 4) + MMA_BUCKETS
    assert SkinnyGemmConfig.select(16, N, K, wgmma_min_m=17).variant == "mma"
    assert SkinnyGemmConfig.select(17, N, K, wgmma_min_m=17) == SkinnyGemmConfig.wgmma_for(17, N, K)
    assert SkinnyGemmConfig.select(64, N, K, residual=True, wgmma_min_m=17).residual
    assert m_buckets(17) == (1, 2, 3, 4, 8, 16, 17, 32, 64)
    assert SkinnyGemmConfig.select(9, N, K, wgmma_min_m=9).m_max == 16
    assert SkinnyGemmConfig.select(8, N, K, wgmma_min_m=9).variant == "mma"
    assert SkinnyGemmConfig.select(1, N, K, wgmma_min_m=1) == SkinnyGemmConfig.wgmma_for(1, N, K)
    assert m_buckets(1) == (1, 16, 32, 64)
    assert SkinnyGemmConfig.select(5, N, K, wgmma_min_m=5).m_max == 16
    assert SkinnyGemmConfig.select(4, N, K, wgmma_min_m=5).variant == "fma"
    for raw in (65, "5", 1.5, -3, True):
        with pytest.raises(ValueError, match="wgmma_min_m"):
            wgmma_threshold(raw)


@pytest.mark.parametrize("lo", [4, 1, 5, 17, 20, 40])
def test_compile_variants_follow_the_threshold(lo):
    """precompile must cover what select() launches, or a decode step would compile during graph capture:
    every M 1..64 of every shape and epilogue is served by a listed config."""
    off = api.compile_variants("k3-tp16-rank", wgmma_min_m=0)
    assert not any(v["config"].variant == "wgmma" for v in off)
    on = api.compile_variants("k3-tp16-rank", wgmma_min_m=lo)
    if lo == 4:
        assert on == api.compile_variants("k3-tp16-rank")  # the default threshold
    wg = [v for v in on if v["config"].variant == "wgmma"]
    assert wg and all(v["M"] >= lo for v in wg)
    listed = {(v["N"], v["K"], v["config"]) for v in on}
    for name, (N, K) in api.preset_shapes("k3-tp16-rank").items():
        epilogues = ((False, False),) + api.EXTRA_EPILOGUES.get(name, ())
        for M in range(1, 65):
            for out_fp32, residual in epilogues:
                cfg = SkinnyGemmConfig.select(M, N, K, out_fp32=out_fp32, residual=residual, wgmma_min_m=lo)
                assert (N, K, cfg) in listed, (name, M, cfg)
                assert (cfg.variant == "wgmma") == (M >= lo)


# ---------------------------------------------------------------------------------------------- compile
def _compile_cases() -> list[tuple[str, int, int, SkinnyGemmConfig]]:
    from k3_fastpath.presets import preset

    tp8, tp16, mini = (preset(p).shapes for p in PRESETS)
    if FULL:
        return [(f"{name}-M{M}", N, K, SkinnyGemmConfig.wgmma_for(M, N, K))
                for (N, K), name in _all_shapes().items() for M in (32, 64)]
    w = SkinnyGemmConfig.wgmma_for
    named = [("tp8:kda_in_proj", *tp8.kda_in_proj), ("tp16:kda_in_proj", *tp16.kda_in_proj),
             ("tp8:kda_o_proj", *tp8.kda_o_proj), ("tp8:mla_q_b", *tp8.mla_q_b), ("tp8:lm_head", *tp8.lm_head),
             ("tp8:dense_gate_up", *tp8.dense_gate_up), ("tp16:dense_down", *tp16.dense_down),
             ("mini:lm_head", *mini.lm_head), ("mini:dense_down", *mini.dense_down)]
    cases = [(f"{name}-M{M}", N, K, w(M, N, K)) for i, (name, N, K) in enumerate(named)
             for M in ((32, 64) if i < 5 else (64 if i % 2 else 32,))]
    N, K = tp8.kda_o_proj
    cases += [  # epilogues and knobs
        ("o_proj-M64-residual", N, K, w(64, N, K, residual=True)),
        ("router-M33-fp32-split16", *tp8.router, w(33, *tp8.router, out_fp32=True)),
        ("shared_down-M17-residual-fp32", *tp16.shared_down, w(17, *tp16.shared_down, residual=True, out_fp32=True)),
        ("o_proj-M16", N, K, w(16, N, K)),
        ("o_proj-M64-2wg", N, K, dataclasses.replace(w(64, N, K), warps_n=8, stages=4)),
        ("o_proj-M64-2tiles", N, K, dataclasses.replace(w(64, N, K), rows_per_warp=2, stages=4)),
        ("o_proj-M64-k128x4", N, K, dataclasses.replace(w(64, N, K), k_unroll=2, stages=4, split_k=1)),
        ("in_proj-M64-pdl", *tp8.kda_in_proj, dataclasses.replace(w(64, *tp8.kda_in_proj, residual=True), pdl=True)),
    ]
    return cases


def _cubin(N: int, K: int, cfg: SkinnyGemmConfig):
    api.compile_skinny_gemm("bf16", N, K, cfg)
    paths = compile_cache.artifact_paths(compile_cache.CompileKey.make(api.NAME, "bf16", (N, K), cfg))
    assert "cubin" in paths, "compile cache kept no cubin"
    return paths


def _loops(lines: list[str]) -> list[list[str]]:
    """Every backward-branch body (label .. BRA to it), innermost and outer alike."""
    out = []
    for i, insn in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", insn)
        if m and m.group(1) in lines[:i]:
            out.append([x for x in lines[lines.index(m.group(1)) + 1:i + 1] if not x.startswith(".L")])
    return out


@needs_dsl
@needs_nvdisasm
@pytest.mark.compile
@pytest.mark.parametrize("case", _compile_cases(), ids=lambda c: c[0])
def test_wgmma_compiles_hgmma_tma_no_spills(case, _cache):
    name, N, K, cfg = case
    cubin = _cubin(N, K, cfg)["cubin"]
    lines = sass_lines(cubin)
    ops = Counter(opcode(x) for x in lines if not x.startswith(".L"))
    hgmma = f"HGMMA.64x{cfg.m_max}x16.F32.BF16"
    assert set(op for op in ops if op.startswith("HGMMA")) == {hgmma}, ops
    assert ops[hgmma] == (cfg.rows_per_cta // 64 // (cfg.warps_n // 4)) * cfg.k_unroll * 4
    tma = sum(n for op, n in ops.items() if op.startswith("UTMALDG"))
    assert tma >= 4, f"expected UTMALDG (TMA) loads of W and x: {ops}"
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {ops}"
    assert frame_sizes(cubin) and not any(frame_sizes(cubin)), f"stack frame {frame_sizes(cubin)}"
    ldg = {op: n for op, n in ops.items() if op.startswith("LDG")}
    allowed_ldg = {"LDG.E.128", "LDG.E.128.STRONG.GPU"}  # residual vectors, split-K partials (L2)
    assert set(ldg) <= allowed_ldg, f"unexpected global loads (W and x must come by TMA): {ldg}"
    stg = {op: n for op, n in ops.items() if op.startswith("STG")}
    assert set(stg) <= {"STG.E.128", "STG.E"} and stg.get("STG.E", 0) <= 1, stg  # 1 x 32-bit: counter reset
    k_loop = [body for body in _loops(lines) if any(opcode(x) == hgmma for x in body)]
    assert k_loop, "no loop around the HGMMAs"
    body = Counter(opcode(x) for x in min(k_loop, key=len))
    assert body["WARPGROUP.ARRIVE"] >= 1 and any(op.startswith("SYNCS.PHASECHK") for op in body), body
    assert sum(n for op, n in body.items() if op.startswith("UTMALDG")) >= 2, f"K loop issues no refill: {body}"
    print(f"\n[sass] wgmma {name} {N}x{K} m_max={cfg.m_max} rows={cfg.rows_per_cta} split={cfg.split_k} "
          f"stages={cfg.stages}x{cfg.block_k}: {hgmma} {ops[hgmma]}, UTMALDG {tma}, STL/LDL 0, "
          f"K-loop {sum(body.values())} insns")


@needs_dsl
@pytest.mark.compile
def test_pdl_requests_only_weights_before_the_wait(_cache):
    """K3.md failure 2: with ``pdl`` the kernel may touch only W (never written by a step) before
    griddepcontrol.wait; x (its TMA descriptor is kernel parameter 1), the residual and the split-K
    workspace come after. Without pdl there is no wait."""
    N, K = 7168, 1536
    base = SkinnyGemmConfig.wgmma_for(64, N, K, residual=True)
    assert base.split_k > 1
    for pdl in (False, True):
        cfg = dataclasses.replace(base, pdl=pdl)
        ptx = _cubin(N, K, cfg)["ptx"].read_text()
        wait = ptx.find("griddepcontrol.wait")
        if not pdl:
            assert wait == -1
            continue
        assert "griddepcontrol.launch_dependents" in ptx
        before = ptx[:wait]
        assert "cp.async.bulk.tensor" in before, "no W tile requested before the wait"
        assert "ld.global" not in before and "st.global" not in before and "atom." not in before
        params = dict((m.group(2), m.group(1)) for m in re.finditer(r"mov\.b64\s+(%rd\d+),\s*\w+_param_(\d+);", ptx))
        assert "0" in params and "1" in params, "TMA descriptor parameters 0 (W) and 1 (x) not found in the PTX"
        generic = dict(re.findall(r"cvta\.param\.u64\s+(%rd\d+),\s*(%rd\d+);", before))
        descs = re.findall(r"cp\.async\.bulk\.tensor\S*\s+\[[^]]*\],\s*\[(%rd\d+),", before)
        assert descs and all(generic.get(d) == params["0"] for d in descs), \
            f"a TMA load before griddepcontrol.wait uses a descriptor other than W's: {descs} {generic} {params}"
