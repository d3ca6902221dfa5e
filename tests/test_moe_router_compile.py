"""Compile-only checks of the router selection kernel for sm_90a, on a CPU (no GPU needed).

1. ``moe_router`` compiles for the router of every preset (896 experts / top-16 for the K3 ranks, 64 / 16
   for k3-mini, 16 / 4 for k3-tiny) and for the other rows-per-CTA the bench sweeps.
2. SASS (nvdisasm on the cubin the compile cache keeps): logits and bias move in 16-byte loads (exactly
   2 x vec_per_lane LDG.E.128), the only other global load is the 32-bit re-read of a pick's logit, the
   outputs are two 32-bit stores, no local memory (no LDL/STL, zero EIATTR_FRAME_SIZE), no barrier.
3. The CPU-side contract: the support gate's reasons for inputs outside the envelope.
"""

from __future__ import annotations

import pytest
import torch
from sass_tools import NVDISASM, isolated_cache
from sass_tools import frame_sizes as _frame_sizes
from sass_tools import opcodes as _opcodes

from k3_fastpath._lib import arch, compile_cache
from k3_fastpath.kernels import moe_router as k

PRESETS = ("k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-tiny")
needs_dsl = pytest.mark.skipif(not arch.is_available(),
                               reason=f"needs nvidia-cutlass-dsl: {arch.unavailable_reason()}")


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    yield from isolated_cache(tmp_path_factory, "k3_router_cache")


def _cases() -> list[tuple[str, dict]]:
    cases = [(p, v) for p in PRESETS for v in k.compile_variants(p)]
    cases.append(("sweep", {"dtype": "fp32", "E": 896, "top_k": 16,
                            "config": k.MoERouterConfig(896, 16, True, rows_per_cta=4)}))
    cases.append(("no-renorm", {"dtype": "fp32", "E": 896, "top_k": 16, "config": k.MoERouterConfig(896, 16, False)}))
    return cases


def _id(case) -> str:
    p, v = case
    return f"{p}-E{v['E']}-k{v['top_k']}-rpc{v['config'].rows_per_cta}-renorm{int(v['config'].renormalize)}"


@needs_dsl
@pytest.mark.compile
@pytest.mark.parametrize("preset", PRESETS)
def test_compiles_for_preset(preset):
    variants = k.compile_variants(preset)
    assert variants, f"moe_router has no decode shapes for {preset}"
    for v in variants:
        assert callable(k.compile_kernel(**v))


def test_preset_router_shapes():
    got = {p: [(v["E"], v["top_k"], v["config"].renormalize) for v in k.compile_variants(p)] for p in PRESETS}
    assert got["k3-tp8-rank"] == got["k3-tp16-rank"] == [(896, 16, True)], got
    assert got["k3-mini"] == [(64, 16, True)] and got["k3-tiny"] == [(16, 4, True)], got






@needs_dsl
@pytest.mark.compile
@pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_sass_vector_loads_no_spills(case):
    _, v = case
    k.compile_kernel(**v)
    key = compile_cache.CompileKey.make(k.NAME, v["dtype"], (v["E"], v["top_k"]), v["config"])
    cubin = compile_cache.artifact_paths(key).get("cubin")
    assert cubin is not None, f"no cubin kept for {key}"
    ops = _opcodes(cubin)
    mem = {op: n for op, n in sorted(ops.items()) if op.startswith(("LDG", "STG", "LDL", "STL", "LDS", "STS"))}
    print(f"\n[sass] {_id(case)}: {mem}, {sum(ops.values())} instructions")
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local-memory spills: {mem}"
    frames = _frame_sizes(cubin)
    assert frames and not any(frames), f"non-zero stack frame {frames}"
    assert ops["LDG.E.128"] == 2 * v["config"].vec_per_lane, mem
    assert set(mem) <= {"LDG.E.128", "LDG.E", "STG.E"} and ops["STG.E"] == 2, mem
    assert not any(op.startswith("BAR") for op in ops), "the selection is warp-synchronous: no barrier expected"


def test_support_gate_reasons():
    """Inputs outside the envelope get a named reason (CPU tensors: the device check comes last)."""
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    w = torch.zeros(16, 128, dtype=torch.bfloat16)
    b = torch.zeros(16)
    assert "M=65" in k.is_supported(torch.zeros(65, 128, dtype=torch.bfloat16), w, b, 4).reason
    assert "bias shape" in k.is_supported(x, w, torch.zeros(15), 4).reason
    assert "top_k" in k.is_supported(x, w, b, 17).reason
    assert not k.is_supported(x, w, b, 4)  # CPU tensors: never the kernel
    with pytest.raises(ValueError):
        k.MoERouterConfig(898, 16)
