"""The HBM floor model (k3_fastpath/measure/floor.py) against K3.md's numbers, and routing counts.

K3.md ("Bytes a decode step must read") gives per-GPU, per-layer bytes at TP8 to the digits shown; those
are matched exactly at that rounding. Its whole-step floors are "about" values; they are matched within
5% (the document does not say which small tensors it left out). Independent checks: the byte count of a
random config equals a direct sum over the manifest's rank shapes, and the uniform-routing expectation
matches a Monte-Carlo draw.
"""

from __future__ import annotations

import random

import pytest
import torch

from k3_fastpath.manifest import tensor_specs
from k3_fastpath.measure import floor as F
from k3_fastpath.measure import routing as R
from k3_fastpath.presets import preset
from k3_fastpath.weights import rank_shape

K3 = preset("k3").config
MB = 1e6


def test_per_layer_bytes_match_k3_md_at_tp8():
    kda = F.layer_weight_bytes(K3, 1, 8)  # layer 1: KDA + MoE
    mla = F.layer_weight_bytes(K3, 3, 8)  # layer 3: MLA + MoE
    assert K3.is_kda_layer(1) and K3.is_mla_layer(3)
    assert round(kda.parts["kda"] / MB, 1) == 112.6
    assert round(mla.parts["mla"] / MB, 1) == 84.5
    assert round(kda.parts["moe_nonexpert"] / MB, 1) == 148.6  # router + latent replicated (the manifest)
    sharded = F.layer_weight_bytes(K3, 1, 8, moe_latent_sharded=True)
    assert round(sharded.parts["moe_nonexpert"] / MB, 1) == 47.5
    assert round(kda.expert_slice / MB, 2) == 2.19
    # the expert slice is exactly packed + scales of 384x3584 (w1, w3) and 3584x384 (w2)
    assert kda.expert_slice == 3 * (384 * 3584 // 2 + 384 * 3584 // 32)
    assert round(F.kda_state_bytes_per_seq(K3, 8) / MB, 2) == 0.79
    assert F.mla_cache_bytes_per_token(K3, kv_bytes=1) == 576


def test_uniform_touched_experts_match_k3_md():
    got = [round(F.expected_distinct_experts(896, 16, b)) for b in (1, 8, 64)]
    assert got == [16, 120, 613]
    assert F.expected_distinct_experts(896, 16, 0) == 0


def test_uniform_expectation_matches_monte_carlo(seed):
    rng = random.Random(seed)
    e, k, b = 64, 4, 8
    draws = 3000
    mean = sum(len({x for _ in range(b) for x in rng.sample(range(e), k)}) for _ in range(draws)) / draws
    assert abs(mean - F.expected_distinct_experts(e, k, b)) < 0.4, seed


@pytest.mark.parametrize("batch,want_ms", [(1, 4.0), (8, 9.1), (64, 33.6)])
def test_whole_tp8_step_is_about_k3_md(batch, want_ms):
    s = F.step_bytes(K3, tp=8, batch=batch, context=0, kv_bytes=1, moe_latent_sharded=True)
    got = s.floor_us(4.3e12) / 1e3
    assert abs(got - want_ms) / want_ms < 0.05, (got, want_ms)


@pytest.mark.parametrize("batch,want_ms,pad", [(1, 2.1, 1), (8, 5.5, 256), (64, 21.6, 256)])
def test_whole_tp16_step_is_about_k3_md(batch, want_ms, pad):
    """K3.md's TP16 batch 8 / 64 floors are those of expert slices padded from 192 to 256 wide."""
    s = F.step_bytes(K3, tp=16, batch=batch, context=0, kv_bytes=1, moe_latent_sharded=True, expert_pad=pad)
    got = s.floor_us(4.3e12) / 1e3
    assert abs(got - want_ms) / want_ms < 0.05, (got, want_ms)


def test_step_bytes_equal_a_direct_manifest_sum(seed):
    """An independent count: sum every non-expert tensor's rank share, add touched experts and caches."""
    cfg = preset("k3-mini").config
    g = random.Random(seed)
    tp, batch, context, kv = g.choice([1, 2, 4]), g.choice([1, 3, 8]), g.choice([0, 100, 4096]), g.choice([1, 2])
    touched = [g.uniform(0, min(64, batch * 16)) for _ in F.moe_layer_ids(cfg)]
    s = F.step_bytes(cfg, tp=tp, batch=batch, context=context, kv_bytes=kv, touched=touched)
    want = 0.0
    nbytes = {"BF16": 2, "F32": 4, "U8": 1}
    expert_bytes = {}
    for spec in tensor_specs(cfg):
        n = 1
        for d in rank_shape(spec, tp, cfg):
            n *= d
        b = n * nbytes[spec.dtype]
        if ".experts." in spec.name:
            layer = int(spec.name.split(".")[2])
            if ".experts.0." in spec.name:
                expert_bytes[layer] = expert_bytes.get(layer, 0) + b
        elif spec.kind == "embedding":
            want += batch * cfg.hidden_size * 2 / tp
        else:
            want += b
    for t, layer in zip(touched, F.moe_layer_ids(cfg), strict=True):
        want += t * expert_bytes[layer]
    lac = cfg.linear_attn_config
    n_kda, n_mla = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    want += n_kda * batch * 2 * (lac.num_heads // tp) * 128 * 128 * 4
    want += n_kda * batch * 2 * 3 * 3 * (lac.projection_dim // tp) * 2
    want += n_mla * batch * (context + 1) * 576 * kv
    assert abs(s.total - want) <= len(s.parts), (seed, s.total, want)
    assert sum(s.by_layer_type().values()) == s.total
    assert s.floor_us(1e12) == pytest.approx(s.total / 1e6)


def test_floor_scales_with_context_and_batch():
    cfg = preset("k3-mini").config
    a = F.step_bytes(cfg, batch=8, context=1024)
    b = F.step_bytes(cfg, batch=8, context=32768)
    assert b.parts["mla_cache"] - a.parts["mla_cache"] == 2 * 8 * (32768 - 1024) * 576 * 2
    assert b.parts["kda"] == a.parts["kda"]
    assert F.step_bytes(cfg, batch=64, context=1024).parts["moe_experts"] > a.parts["moe_experts"]


def test_bad_inputs_raise_one_clear_error():
    cfg = preset("k3-mini").config
    with pytest.raises(ValueError, match="MoE layers"):
        F.step_bytes(cfg, batch=1, context=0, touched=[1.0, 2.0])
    with pytest.raises(ValueError, match="outside"):
        F.step_bytes(cfg, batch=1, context=0, touched=17)
    with pytest.raises(ValueError, match="batch >= 1"):
        F.step_bytes(cfg, batch=0, context=0)
    with pytest.raises(ValueError, match="positive"):
        F.step_bytes(cfg, batch=1, context=0).floor_us(0)


def test_recorded_routing_counts_distinct_experts(seed):
    """Routing recorded through the reference model: each token's k experts are distinct, a decode-like
    draw of B tokens touches between k and min(E, B*k), and the per-step count equals a direct count."""
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.synthetic import synthetic_state_dict

    cfg = preset("k3-tiny").config
    model = load_reference(cfg, synthetic_state_dict(cfg, seed=seed % 1000), dtype=torch.float32)
    ids, source = R.prompt_token_ids(cfg, 6, 10, seed=seed % 100)
    assert ids.shape == (6, 10) and int(ids.max()) < cfg.vocab_size and source
    trace = R.record_prompt_routing(model, ids, source=source)
    k, e = cfg.num_experts_per_token, cfg.num_experts
    assert trace.layers == tuple(F.moe_layer_ids(cfg))
    for layer_ids in trace.ids:
        assert layer_ids.shape == (6, 10, k)
        assert all(len(set(row.tolist())) == k for row in layer_ids.reshape(-1, k))
    for b in (1, 4):
        t = R.touched_from_trace(trace, b, draws=8, seed=seed)
        assert all(k <= x <= min(e, b * k) for x in t), t
    assert R.touched_from_trace(trace, 1, draws=4) == [float(k)] * len(trace.layers)
    # one decode step: the recorder's count equals a count from the router run by hand on the same inputs
    cache = model.new_cache(3, 16)
    model.prefill(ids[:3, :5], None, cache)
    tokens = ids[:3, 5]
    rec = R.RoutingRecorder(model)
    with rec.active():
        model.decode(tokens, cache)
    per_layer = rec.touched()
    manual = [int(torch.unique(rec.calls[i][0]).numel()) for i in rec.layers]
    assert per_layer == manual and all(k <= x <= min(e, 3 * k) for x in per_layer)
    s = F.step_bytes(cfg, batch=3, context=5, touched=per_layer)
    assert s.touched == tuple(float(x) for x in per_layer)
