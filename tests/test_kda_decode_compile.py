"""Compile-only checks of the KDA decode kernel for sm_90a, on a CPU (no GPU needed).

1. ``kda_decode`` compiles for the rank shape of every preset (k3-tp8-rank: 12 heads, k3-tp16-rank: 6,
   k3-mini: 96, k3-tiny: 4 heads of 32) and for the non-default rows-per-thread configs the bench sweeps.
2. SASS (nvdisasm on the cubin the compile cache keeps): the recurrent state moves in 16-byte accesses
   only (exactly rows_per_thread LDG.E.128 for the state plus the 4 parameter vectors, rows_per_thread
   STG.E.128 stores per token, and no narrower 32-bit global load/store that could be the state), no local
   memory (no LDL/STL, zero EIATTR_FRAME_SIZE), two barriers per token and one between tokens. The verify
   builds (``tokens`` 4 and 8 at the TP16 rank's 6 heads) load the state once for all their tokens; the
   builds on vLLM's cache layout (``vllm_layout``: [V, K] state, packed conv) move the state the same way.
   The counts are printed with ``-s``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sass_tools import NVDISASM, isolated_cache
from sass_tools import frame_sizes as _frame_sizes
from sass_tools import opcodes as _opcodes

from k3_fastpath._lib import arch, compile_cache
from k3_fastpath.kernels import kda_decode as k

PRESETS = ("k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-tiny")
needs_dsl = pytest.mark.skipif(not arch.is_available(),
                               reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")
pytestmark = [pytest.mark.compile, needs_dsl]


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Compile into a fresh cache dir so the cubins the SASS checks read are this run's."""
    yield from isolated_cache(tmp_path_factory, "k3_kda_cache")


def _cases() -> list[tuple[str, dict]]:
    cases = [(p, v) for p in PRESETS for v in k.compile_variants(p)]
    for rpt in (8, 32):  # the bench's alternatives at D = 128 (512 / 128 threads)
        cases.append(("sweep", {"dtype": "bf16", "H": 12, "D": 128, "config": k.KDADecodeConfig(128, rpt)}))
    for tokens in (4, 8):  # speculative verify steps (1 + 3 / 7 drafts)
        cases.append(("verify", {"dtype": "bf16", "H": 6, "D": 128,
                                 "config": k.KDADecodeConfig.from_heuristic(128, tokens=tokens)}))
    for H, D in ((6, 128), (12, 128), (4, 32)):  # vLLM's cache layout (the route's in-place decode step)
        cases.append(("vllm", {"dtype": "bf16", "H": H, "D": D,
                               "config": k.KDADecodeConfig.from_heuristic(D, vllm_layout=True)}))
    return cases


def _id(case) -> str:
    p, v = case
    return f"{p}-H{v['H']}-D{v['D']}-rpt{v['config'].rows_per_thread}-T{v['config'].tokens}"


@pytest.mark.parametrize("preset", PRESETS)
def test_compiles_for_preset(preset):
    variants = k.compile_variants(preset)
    assert variants, f"kda_decode has no decode shapes for {preset}"
    for v in variants:
        t0 = time.perf_counter()
        fn = k.compile_kernel(**v)
        print(f"\n[compile] {preset} H={v['H']} D={v['D']} {v['config']}: {time.perf_counter() - t0:.2f} s")
        assert callable(fn)


def _cubin(v: dict) -> Path:
    k.compile_kernel(**v)
    key = compile_cache.CompileKey.make(k.NAME, v["dtype"], (v["H"], v["D"]), v["config"])
    cubin = compile_cache.artifact_paths(key).get("cubin")
    assert cubin is not None, f"no cubin kept for {key}"
    return cubin


def test_rank_head_counts():
    """The head counts the path must serve (K3.md failure 1: a 6-head gate sent TP16 to the slow path)."""
    got = {p: [(v["H"], v["D"]) for v in k.compile_variants(p)] for p in PRESETS}
    assert got["k3-tp8-rank"] == [(12, 128)] and got["k3-tp16-rank"] == [(6, 128)], got
    assert got["k3-mini"] == [(96, 128)] and got["k3-tiny"] == [(4, 32)], got


# --------------------------------------------------------------------------------------------- SASS








@pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_sass_state_is_128bit_and_no_spills(case):
    _, v = case
    rpt, tokens = v["config"].rows_per_thread, v["config"].tokens
    cubin = _cubin(v)
    ops = _opcodes(cubin)
    mem = {op: n for op, n in sorted(ops.items()) if op.startswith(("LDG", "STG", "LDL", "STL", "LDS", "STS"))}
    print(f"\n[sass] {_id(case)}: {mem}")
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {mem}"
    assert _frame_sizes(cubin) and not any(_frame_sizes(cubin)), f"non-zero stack frame {_frame_sizes(cubin)}"
    # state rows: rpt 16-byte loads + 3 conv-weight vectors + the o_norm weight vector
    assert ops["LDG.E.128"] == rpt + 4, mem
    assert ops["STG.E.128"] == rpt * tokens, mem
    # the only other global accesses: bf16 scalars (inputs, conv state), A_log / slot / dt_bias (32-bit),
    # the 8-byte gate load and output stores; none can be a state access (those are all 128-bit above)
    assert set(mem) - {"LDS", "LDS.128", "STS", "STS.128"} <= {
        "LDG.E.128", "STG.E.128", "LDG.E.U16", "STG.E.U16", "LDG.E", "LDG.E.64", "STG.E.64"}, mem
    assert ops["BAR.SYNC.DEFER_BLOCKING"] + ops["BAR.SYNC"] == 3 * tokens - 1, ops


def test_cubins_recorded_compile_seconds():
    """Every compile of this module wrote its key.json (what ``compile_report`` and the CLI read)."""
    metas = [json.loads(p.read_text()) for p in compile_cache.cache_dir().glob("kda_decode/*/key.json")]
    if not metas:
        pytest.skip(reason="nothing compiled in this session (run the whole module)")
    print("\n[compile seconds] " + "; ".join(
        f"{m['key']['shapes']} rpt={m['key']['config']['rows_per_thread']}: {m['compile_seconds']}" for m in metas))
    assert all(m["compile_seconds"] > 0 for m in metas)
