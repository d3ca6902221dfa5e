"""``DecodeOptions`` (k3_fastpath/runtime/options.py): one set of defaults, per-backend defaults from one table,
an option a backend cannot honour refused by name, the options recorded whole in the executor's trace, and a
tier's mapping validated (an unknown name or a wrong type is an error naming it)."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.envelope import Envelope
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.runtime.options import HONOURED, DecodeOptions, defaults, resolve
from k3_fastpath.synthetic import synthetic_state_dict
from verify.checks.perf_sweep import check_fast_variants

CFG = preset("k3-tiny").config


def test_defaults_per_backend_come_from_one_table():
    assert resolve(None, "latency_specialized") == DecodeOptions()
    assert DecodeOptions().pdl and not resolve(None, "standard_graph").pdl and not resolve(None, "standard").pdl
    assert not resolve(None, "tp:latency_specialized").pdl  # off until measured at TP2
    assert set(HONOURED) >= {"latency_specialized", "standard_graph", "standard"}
    assert defaults("standard_graph") == DecodeOptions(pdl=False)


def test_an_option_a_backend_cannot_honour_is_refused_by_name():
    with pytest.raises(ValueError, match=r"standard_graph cannot honour decode option\(s\) situ_glu_kernel=True"):
        resolve(DecodeOptions(situ_glu_kernel=True), "standard_graph")
    with pytest.raises(ValueError, match="prefetch=True, shared_stream=False"):
        resolve(DecodeOptions(prefetch=True, shared_stream=False), "standard")
    # the plain defaults pass everywhere (PDL then runs as the backend has it)
    assert resolve(DecodeOptions(), "standard_graph").pdl is False
    assert resolve(DecodeOptions(standard_compiled_glue=True), "standard_graph").standard_compiled_glue
    with pytest.raises(ValueError, match="standard_compiled_glue=True"):
        resolve(DecodeOptions(standard_compiled_glue=True), "latency_specialized")
    with pytest.raises(TypeError):
        resolve({"pdl": True}, "latency_specialized")  # type: ignore[arg-type]


def test_from_mapping_validates_names_and_types():
    assert DecodeOptions.from_mapping({"pdl": False, "prefetch_budget": 1 << 20}) == DecodeOptions(
        pdl=False, prefetch_budget=1 << 20)
    with pytest.raises(ValueError, match=r"unknown decode option\(s\) \['nope'\]"):
        DecodeOptions.from_mapping({"nope": True})
    with pytest.raises(ValueError, match="decode option pdl: expected true or false, got 1"):
        DecodeOptions.from_mapping({"pdl": 1})
    with pytest.raises(ValueError, match="prefetch_budget: expected a count"):
        DecodeOptions.from_mapping({"prefetch_budget": -1})
    assert DecodeOptions().replace(prefetch=True).prefetch


def test_perf_variants_take_decode_options_and_the_gemm_switch():
    assert check_fast_variants({"fast_nopdl": {"pdl": False}, "fast_fma": {"gemm_wgmma_min_m": 0}}) is None
    assert "unknown decode option" in check_fast_variants({"fast_x": {"bogus": True}})
    assert "unknown decode option" in check_fast_variants({"fast_x": {"skinny_gemm_wgmma": "0"}})  # no env switch
    assert "expected true or false" in check_fast_variants({"fast_x": {"prefetch": "yes"}})
    assert "gemm_wgmma_min_m" in check_fast_variants({"fast_x": {"gemm_wgmma_min_m": 65}})


def test_the_gemm_variant_is_an_option_of_the_linear_op():
    """``gemm_wgmma_min_m`` reaches ``SkinnyGemmConfig.select`` through the op table (no environment):
    0 keeps every M on fma / mma, 1 sends every M to wgmma; the TP decoder honours it, standard_graph refuses it."""
    from k3_fastpath.kernels.skinny_gemm.config import SkinnyGemmConfig
    from k3_fastpath.runtime.fast_ops import op_table

    assert op_table(DecodeOptions(gemm_wgmma_min_m=0))["linear"].launch["gemm_wgmma_min_m"] == 0
    assert SkinnyGemmConfig.select(8, 256, 512, wgmma_min_m=0).variant != "wgmma"
    assert SkinnyGemmConfig.select(2, 256, 512, wgmma_min_m=1).variant == "wgmma"
    assert SkinnyGemmConfig.select(8, 256, 512).variant == "wgmma"
    assert resolve(DecodeOptions(gemm_wgmma_min_m=9), "tp:latency_specialized").gemm_wgmma_min_m == 9
    with pytest.raises(ValueError, match="gemm_wgmma_min_m=9"):
        resolve(DecodeOptions(gemm_wgmma_min_m=9), "standard_graph")
    with pytest.raises(ValueError, match="M threshold in 1..64"):
        DecodeOptions(gemm_wgmma_min_m=99)


def test_the_executor_records_its_resolved_options():
    m = load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.bfloat16)
    ex = DecodeExecutor(m, max_len=16, max_batch=2, envelope=Envelope(emulate=True),
                        options=DecodeOptions(situ_glu_kernel=True, prefetch_budget=1 << 20))
    assert ex.trace.meta["options"] == DecodeOptions(situ_glu_kernel=True, prefetch_budget=1 << 20).as_dict()
    assert "situ_glu" in ex.ops
    std = DecodeExecutor(m, backend="standard_graph", max_len=16, max_batch=2, envelope=Envelope(emulate=True))
    assert std.trace.meta["options"]["pdl"] is False and std.trace.meta["pdl"]["requested"] is False
    with pytest.raises(ValueError, match="situ_glu_kernel"):
        DecodeExecutor(m, backend="standard", max_len=16, options=DecodeOptions(situ_glu_kernel=True))
