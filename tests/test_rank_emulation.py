"""Rank emulation: preset specs with overrides, the byte estimate and fit check, and an emulated rank that
decodes through the executor (CPU: k3-tiny ranks, every kernel served by its reference).

The byte estimate is judged against independent numbers: floor.py's per-layer bytes (K3.md: expert slice
2.19 MB at TP8), the tensors the built model actually holds, and a real ``CachePool``'s tensors.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from k3_fastpath.config import ConfigError, load_config
from k3_fastpath.measure import floor, rank_emulation
from k3_fastpath.measure.rank_emulation import (
    RankEmulationError,
    cache_pool_bytes,
    check_fits,
    emulation_bytes,
    emulation_model,
    emulation_record,
    max_expert_pool,
)
from k3_fastpath.presets import PRESET_NAMES, _k3_layers, get_config, preset, preset_spec
from k3_fastpath.rank_shapes import rank_shapes
from k3_fastpath.runtime.tp import rank_config

H200_FREE = 141_000_000_000
TINY_RANK = "k3-tiny:experts=8,layers=4,tp=2"


# ------------------------------------------------------------------------------------------ specs
@pytest.mark.parametrize("spec, name, experts, layers, tp", [
    ("k3-tp8-rank:experts=128", "k3-tp8-rank:experts=128", 128, 93, 8),
    ("k3-tp16-rank:layers=24", "k3-tp16-rank:layers=24", 896, 24, 16),
    (" k3-tiny: layers = 4 , experts=8", "k3-tiny:experts=8,layers=4", 8, 4, 1),  # canonical key order
    ("k3-tiny:tp=2", "k3-tiny:tp=2", 16, 8, 2),
    ("k3-mini:experts=16", "k3-mini:experts=16", 16, 8, 1),
])
def test_spec_overrides(spec, name, experts, layers, tp, tmp_path):
    p = preset_spec(spec)
    base = preset(name.split(":")[0])
    cfg = p.config
    assert (p.name, cfg.name, cfg.num_experts, cfg.num_hidden_layers, p.tp_size) == (name, name, experts, layers, tp)
    lac = cfg.linear_attn_config
    if layers != base.config.num_hidden_layers:
        assert (lac.kda_layers, lac.full_attn_layers) == _k3_layers(layers)
    else:
        assert lac == base.config.linear_attn_config
    for f in ("hidden_size", "moe_intermediate_size", "num_experts_per_token", "vocab_size"):
        assert getattr(cfg, f) == getattr(base.config, f)
    assert get_config(spec) == cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert load_config(tmp_path) == cfg  # the spec travels in the config's name


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_plain_names_are_the_presets(name):
    assert preset_spec(name) == preset(name)
    assert get_config(name) == preset(name).config


@pytest.mark.parametrize("spec, match", [
    ("k3-tp8-rank:experts=8", r"experts=8 is below num_experts_per_token \(16\)"),
    ("k3-tiny:layers=1", "layers=1 must be at least 2"),
    ("k3-tiny:depth=4", "unknown key 'depth'"),
    ("k3-tiny:experts=many", "experts must be a positive integer, got 'many'"),
    ("k3-tiny:experts=-8", "experts must be a positive integer"),
    ("k3-tiny:layers", "'layers' is not key=value"),
    ("k3-tiny:", "no overrides"),
    ("k3-tiny:experts=8,experts=16", "'experts' is given twice"),
    ("k3-tiny:tp=3", "tp=3: .*num_heads"),
    ("k3-tiny:tp=0", "tp=0 must be at least 1"),
    ("k4:experts=8", "unknown preset 'k4'"),
])
def test_bad_specs_name_the_key(spec, match):
    for parse in (preset_spec, get_config):
        with pytest.raises(ConfigError, match=match) as e:
            parse(spec)
        assert "\n" not in str(e.value)


def test_rank_config_of_a_reduced_tp8_rank():
    p = preset_spec("k3-tp8-rank:experts=128")
    r = rank_config(p.config, p.tp_size)
    assert r.linear_attn_config.num_heads == 12 and r.num_attention_heads == 12
    assert r.num_experts == 128 and r.moe_intermediate_size == 384 and r.vocab_size == 20480
    assert rank_shapes(p.config, 8).router == (128, 7168)
    assert rank_shapes(p.config, 8).kda_in_proj == rank_shapes(preset("k3").config, 8).kda_in_proj


# ------------------------------------------------------------------------------------------ bytes
@pytest.mark.parametrize("spec", ["k3-tp8-rank", "k3-tp8-rank:experts=128", "k3-tp16-rank:layers=24"])
def test_byte_estimate_matches_floor(spec):
    """The estimate (the rank config's manifest) against floor.py (the full manifest cut by TP rules)."""
    p = preset_spec(spec)
    cfg, tp = p.config, p.tp_size
    b = emulation_bytes(cfg, tp)
    kda_layer, mla_layer = cfg.kda_layer_ids[1], cfg.mla_layer_ids[0]  # layer 0 is the dense MLP
    fk, fm = floor.layer_weight_bytes(cfg, kda_layer, tp), floor.layer_weight_bytes(cfg, mla_layer, tp)
    assert b["expert_slice"] == fk.expert_slice == fm.expert_slice
    if tp == 8:
        assert b["expert_slice"] == 2_193_408  # K3.md: one expert slice 2.19 MB (MXFP4 with scales)
    n_moe = len(floor.moe_layer_ids(cfg))
    assert b["moe_layers"] == n_moe and b["experts"] == n_moe * cfg.num_experts * b["expert_slice"]
    n_kda, n_mla = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    # A_log: the rank holds max(head_dim, heads/tp) FP32 entries (padded), floor counts heads/tp
    lac = cfg.linear_attn_config
    pad = 4 * (max(lac.head_dim, lac.num_heads // tp) - lac.num_heads // tp)
    assert b["kda"] == n_kda * (fk.parts["kda"] + pad)
    assert b["mla"] == n_mla * fm.parts["mla"]
    assert b["moe_nonexpert"] == n_moe * fk.parts["moe_nonexpert"]
    assert b["weights"] == sum(b[k] for k in rank_emulation.WEIGHT_PARTS)
    assert b["expert_fragments"] == b["experts"]  # the fast path's second copy of the same bytes
    # the step over the pool reads the touched experts of the pool: floor.step_bytes at batch 1
    sb = floor.step_bytes(cfg, tp=tp, batch=1, context=0)
    assert sb.parts["moe_experts"] == n_moe * cfg.num_experts_per_token * b["expert_slice"]


def test_standard_path_adds_a_bf16_copy():
    p = preset_spec("k3-tp8-rank:experts=128")
    fast, std = emulation_bytes(p.config, 8), emulation_bytes(p.config, 8, standard=True)
    assert std["standard_experts"] == 92 * 128 * 3 * 384 * 3584 * 2
    assert std["resident"] > fast["resident"] + std["standard_experts"] - 1  # plus a second plan's copies


def test_full_tp8_rank_is_refused_on_an_h200_with_a_pool_that_fits():
    cfg = preset("k3-tp8-rank").config
    why = check_fits(cfg, 8, H200_FREE, standard=False)
    assert why is not None and "\n" not in why
    assert why.startswith("k3-tp8-rank: ") and "> 141.0 GB free" in why and "fragment copy" in why
    n = int(re.search(r"use k3-tp8-rank:experts=N with N <= (\d+)$", why).group(1))
    assert 16 <= n < 896 and n % 8 == 0
    assert check_fits(preset_spec(f"k3-tp8-rank:experts={n}").config, 8, H200_FREE) is None
    assert check_fits(preset_spec(f"k3-tp8-rank:experts={n + 8}").config, 8, H200_FREE) is not None
    # the standard path's BF16 experts leave room for fewer
    why_std = check_fits(cfg, 8, H200_FREE, standard=True)
    assert "standard BF16 experts" in why_std
    assert int(re.search(r"N <= (\d+)$", why_std).group(1)) < n


def test_full_tp16_rank_needs_a_reduced_pool_once_the_fragments_exist():
    cfg = preset("k3-tp16-rank").config
    b = emulation_bytes(cfg, 16)
    assert 95e9 < b["weights"] < 115e9  # fits by itself (K3.md: "~97 GB"; the replicated MoE parts add more)
    assert check_fits(cfg, 16, H200_FREE, fragments=False) is None
    why = check_fits(cfg, 16, H200_FREE)
    assert why is not None and re.search(r"use k3-tp16-rank:experts=N with N <= \d+$", why)


def test_refusal_keeps_the_other_overrides_and_falls_back_to_layers():
    cfg = preset_spec("k3-tp16-rank:layers=48").config
    assert check_fits(cfg, 16, 40e9).endswith("use k3-tp16-rank:experts=N,layers=48 with N <= " +
                                              str(max_expert_pool(cfg, 16, 40e9)))
    why = check_fits(preset("k3-tp8-rank").config, 8, 20e9)  # not even 16 experts of 93 layers
    n = int(re.search(r"use k3-tp8-rank:layers=N with N <= (\d+)$", why).group(1))
    assert check_fits(preset_spec(f"k3-tp8-rank:layers={n}").config, 8, 20e9) is None
    assert check_fits(preset_spec(f"k3-tp8-rank:layers={n + 1}").config, 8, 20e9) is not None


def test_cache_pool_bytes_match_a_real_pool():
    from k3_fastpath.runtime.cache_pool import CachePool

    p = preset_spec(TINY_RANK)
    rcfg = rank_config(p.config, p.tp_size)
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        pool = CachePool(rcfg, 3, 70, torch.bfloat16, "cpu", kv_dtype=kv)
        got = sum(t.numel() * t.element_size() for c in pool.layers
                  for t in (c.tensors() if hasattr(c, "state") else (c.latent, c.scale)))
        assert cache_pool_bytes(p.config, p.tp_size, slots=3, max_len=70, kv_bytes=kv.itemsize) == got


# ------------------------------------------------------------------------------------------ build + decode
def _storages(model) -> list[tuple[int, int]]:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sorted(seen.items())


def test_emulated_rank_holds_exactly_the_estimate_in_distinct_allocations(seed):
    model, p = emulation_model(TINY_RANK, seed, "cpu")
    rcfg = rank_config(p.config, 2)
    assert model.cfg == rcfg and model.dtype == torch.bfloat16
    tensors = list(model.parameters()) + list(model.buffers())
    storages = _storages(model)
    assert len(storages) == len(tensors)  # no tensor shares memory with another
    for (a, n), (b, _) in zip(storages, storages[1:], strict=False):  # storages do not overlap
        assert a + n <= b
    assert sum(n for _, n in storages) == emulation_bytes(p.config, 2, fragments=False)["weights"]


def test_too_big_is_refused_before_anything_is_allocated(monkeypatch):
    from k3_fastpath.measure import device_synthetic

    monkeypatch.setattr(rank_emulation, "device_free_bytes", lambda device: 10**6)
    monkeypatch.setattr(device_synthetic, "device_model", lambda *a, **k: pytest.fail("allocated anyway"))
    with pytest.raises(RankEmulationError, match=r"k3-tiny:experts=8,layers=4,tp=2: .* > 0\.0 GB free"):
        emulation_model(TINY_RANK, 0, "cpu")


@torch.no_grad()
def test_emulated_rank_decodes_through_the_executor(seed):
    """The rank's model through ``DecodeExecutor`` (fast step emulated on the CPU): against an FP64 oracle of
    the same weights, within 2x the BF16 reference's own error (+1% of the logit scale)."""
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.runtime.envelope import PREFILL_REASON, Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor

    model, p = emulation_model(TINY_RANK, seed, "cpu")
    m64 = load_reference(model.cfg, {k: v.clone() for k, v in model.state_dict().items()}, dtype=torch.float64)
    ex = DecodeExecutor(model, max_len=64, max_batch=2, use_graphs=False, envelope=Envelope(emulate=True))
    assert ex.fast, ex.model_reason
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 5), generator=g)
    lens = torch.tensor([5, 3])
    cache, c64, c16 = ex.new_cache(2), m64.new_cache(2, 64), model.new_cache(2, 64)
    l64 = m64.prefill(ids, lens, c64)[torch.arange(2), lens - 1]
    ex.prefill(ids, lens, cache)
    model.prefill(ids, lens, c16)
    tok = l64.argmax(-1)
    fast = ex.decode(tok, cache)
    ref = model.decode(tok, c16)
    want = m64.decode(tok, c64)
    assert fast.shape == (2, model.cfg.vocab_size) and torch.isfinite(fast).all()
    scale = float(want.abs().max())
    e_fast, e_ref = float((fast.double() - want).abs().max()), float((ref.double() - want).abs().max())
    assert e_fast <= 2 * e_ref + 0.01 * scale, f"seed {seed}: fast {e_fast:.4g} vs BF16 reference {e_ref:.4g}"
    summary = ex.trace.summary()
    assert summary["fast_steps"] == 1 and summary["fallbacks"] == {PREFILL_REASON: 1}, summary


def test_emulation_record_says_what_ran():
    p = preset_spec("k3-tp8-rank:experts=128")
    r = emulation_record(p, batch=64)
    assert (r["spec"], r["tp"], r["num_experts"], r["full_num_experts"], r["layers"]) == (
        "k3-tp8-rank:experts=128", 8, 128, 896, 93)
    assert r["touched_experts"]["full"] == pytest.approx(613.2, abs=0.1)
    assert r["touched_experts"]["pool"] == pytest.approx(128 * (1 - (1 - 16 / 128) ** 64))
    assert r["bytes"]["experts"] == 92 * 128 * 2_193_408
