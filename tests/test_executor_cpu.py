"""The decode executor on a CPU: envelope reasons, fallback dispatch, the execution trace, the slot pool, the
standard backend (bitwise the reference), and the fast step's structure emulated with every kernel served
by its FP32 reference (``Envelope(emulate=True)``), against an FP64 oracle.

What needs a GPU (graphs, the kernels themselves, no-allocation / no-sync replay) is in
tests/test_executor_gpu.py. Inputs are fresh random tokens per run (the ``seed`` fixture); the model
weights are the seeded synthetic k3-tiny checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from k3_fastpath.kernels.mla_decode.api import step_op as mla_step_op
from k3_fastpath.kernels.moe_experts.api import step_op as experts_step_op
from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime import fast_ops
from k3_fastpath.runtime.cache_pool import CachePool, PooledCache, copy_cache
from k3_fastpath.runtime.envelope import PREFILL_REASON, Envelope
from k3_fastpath.runtime.executor import DecodeExecutor, _buckets
from k3_fastpath.runtime.graphs import bucket_for
from k3_fastpath.runtime.options import DecodeOptions
from k3_fastpath.runtime.trace import TRACE_ENV, fast_path_problems, read_trace, summarize
from k3_fastpath.synthetic import synthetic_state_dict

CFG = preset("k3-tiny").config


@pytest.fixture(scope="module")
def sd_stable():
    return synthetic_state_dict(CFG, 0, conditioning="stable")


@pytest.fixture(scope="module")
def model32(sd_stable):
    return load_reference(CFG, sd_stable, dtype=torch.float32)


def _prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CFG.vocab_size, (batch, length), generator=g)


# ------------------------------------------------------------------------------------------ envelope
def test_envelope_step_reasons():
    env = Envelope(max_batch=64, max_context=100)
    assert env.check_step(batch=8) is None
    assert env.check_step(batch=65) == "batch 65 > 64"
    assert env.check_step(batch=0) == "batch 0 < 1"
    assert env.check_step(batch=2, new_tokens=7) == PREFILL_REASON
    assert env.check_step(batch=2, context=101) == "context 101 > max 100"
    assert env.check_step(batch=2, context=100) is None
    assert env.check_step(batch=2, speculative_tokens=3) is None  # fused verify steps are served
    assert Envelope(speculative=False).check_step(batch=2, speculative_tokens=3).startswith("speculative decoding")
    assert env.check_step(batch=2, model_reason="device cpu is not sm_90") == "device cpu is not sm_90"


def test_envelope_model_reasons():
    env = Envelope()
    assert env.check_model(CFG, device="cpu", dtype=torch.bfloat16) == "device cpu is not sm_90"
    emu = Envelope(emulate=True)
    assert emu.check_model(CFG, device="cpu", dtype=torch.bfloat16) is None
    assert emu.check_model(CFG, device="cpu", dtype=torch.float32) == "dtype float32 (fast path needs bfloat16)"
    assert emu.check_model(CFG, device="cpu", dtype=torch.bfloat16, kv_dtype=torch.float16).startswith(
        "kv cache dtype float16")
    assert emu.check_model(CFG, device="cpu", dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn) is None
    odd = CFG.replace(linear_attn_config=dataclasses.replace(CFG.linear_attn_config, head_dim=48))
    assert emu.check_model(odd, device="cpu", dtype=torch.bfloat16) == "KDA head dim 48 not in (32, 64, 128)"
    assert emu.check_model(CFG, device="cpu", dtype=torch.bfloat16, tp_size=3) == "tp size 3 not in (1, 2, 4, 8, 16)"


def test_buckets():
    assert _buckets((1, 2, 4, 8, 16, 32, 64), 64) == (1, 2, 4, 8, 16, 32, 64)
    assert _buckets((1, 2, 4, 8), 3) == (1, 2, 4)
    assert _buckets((1, 8), 64) == (1, 8, 64)  # max_batch itself closes the list
    assert [bucket_for(b, (1, 2, 4)) for b in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]


# ------------------------------------------------------------------------------------------ slot pool
def test_cache_pool_slots_and_release():
    pool = CachePool(CFG, slots=6, max_len=16, dtype=torch.float32, device="cpu")
    mla = CFG.mla_layer_ids[0]
    assert pool.layers[mla].latent.shape[:2] == (6, 64)  # MLA pools: a multiple of mla_decode's 64-page
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a.slots.tolist() == [1, 2] and b.slots.tolist() == [3, 4, 5]  # slot 0 is never handed out
    with pytest.raises(RuntimeError, match="no 1 contiguous free slots"):
        pool.allocate(1)
    a.release()
    c = pool.allocate(1)
    assert c.slots.tolist() == [1]
    del b  # garbage collection gives the slots back
    import gc

    gc.collect()
    assert pool.free_slots == 4
    d = pool.allocate(4, max_len=8)
    assert d.slots.tolist() == [2, 3, 4, 5] and d.max_len == 8 and d.layers[mla].latent.shape[1] == 8
    # the views write through to the pools: the reference model's cache code works on them
    kda = next(i for i in range(CFG.num_hidden_layers) if CFG.is_kda_layer(i))
    d.layers[kda].state.fill_(7.0)
    assert float(pool.layers[kda].state[2:6].min()) == 7.0 and float(pool.layers[kda].state[0].abs().max()) == 0.0
    assert pool.owns(d) and not pool.owns(CachePool(CFG, 2, 4, torch.float32, "cpu").allocate(1))


def test_copy_cache_roundtrip(model32, seed):
    ex = DecodeExecutor(model32, max_len=32, max_batch=3, envelope=Envelope(emulate=True))
    ref = model32.new_cache(3, 32)
    model32.prefill(_prompt(3, 5, seed), torch.tensor([5, 3, 4]), ref)
    dst = ex.new_cache(3)
    copy_cache(dst, ref)
    assert isinstance(dst, PooledCache) and dst.length_bound == 5
    assert torch.equal(dst.lengths, ref.lengths)
    for d, s in zip(dst.layers, ref.layers, strict=True):
        pairs = zip(d.tensors(), s.tensors(), strict=True) if hasattr(d, "tensors") else [(d.latent, s.latent)]
        for a, b in pairs:
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ dispatch
def test_cpu_fast_backend_falls_back_bitwise(model32, seed, tmp_path):
    """On a CPU the fast backend runs every step on the reference model, with the reason in the trace."""
    ex = DecodeExecutor(model32, max_len=32, max_batch=4, trace_dir=str(tmp_path))
    assert not ex.fast and ex.model_reason == "device cpu is not sm_90"
    ids = _prompt(2, 4, seed)
    cache, ref = ex.new_cache(2), model32.new_cache(2, 32)
    l1, l2 = ex.prefill(ids, None, cache), model32.prefill(ids, None, ref)
    assert torch.equal(l1, l2)
    tok = l1[:, -1].argmax(-1)
    active = torch.tensor([True, False])
    for _ in range(2):
        a, b = ex.decode(tok, cache, active), model32.decode(tok, ref, active)
        assert torch.equal(a, b)
        tok = a.argmax(-1)
    s = ex.trace.summary()
    assert s["fallbacks"] == {PREFILL_REASON: 1, "device cpu is not sm_90": 2} and s["fast_steps"] == 0
    ex.close()
    meta, steps = read_trace(tmp_path)
    assert len(meta) == 1 and meta[0]["model_reason"] == "device cpu is not sm_90"
    assert [r["kind"] for r in steps] == ["prefill", "decode", "decode"]
    for r in steps:
        assert {"step", "backend", "batch", "bucket", "kernels", "standard_ops", "fallback"} <= set(r)
    summ = summarize(steps)
    assert summ["fallbacks"] == {"device cpu is not sm_90": 2}
    assert fast_path_problems(summ) == ["2 step(s) fell back to the standard path: device cpu is not sm_90",
                                        "no step ran the fast path"]


def test_trace_dir_from_environment(model32, tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "t"))
    ex = DecodeExecutor(model32, max_len=8, max_batch=2)
    cache = ex.new_cache(1)
    ex.decode(torch.tensor([5]), cache)
    ex.close()
    path = tmp_path / "t" / f"trace-{os.getpid()}.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["type"] == "meta" and lines[1]["type"] == "step" and lines[1]["batch"] == 1
    assert lines[1]["fallback"] == "device cpu is not sm_90"
    assert ex.trace.to_jsonl().splitlines()[1] == json.dumps(lines[1], sort_keys=True)


def test_step_reasons_batch_context_foreign_cache(sd_stable):
    m = load_reference(CFG, sd_stable, dtype=torch.bfloat16)
    ex = DecodeExecutor(m, max_len=16, max_batch=2, envelope=Envelope(emulate=True, max_context=6))
    assert ex.fast
    big = ex.new_cache(3)  # more sequences than the pool serves: a plain cache, standard path
    assert not isinstance(big, PooledCache)
    assert ex.step_reason(3, big) == "batch 3 > 2"
    assert ex.step_reason(1, m.new_cache(1, 16)).startswith("cache not allocated by this executor")
    c = ex.new_cache(1)
    ex.prefill(torch.tensor([[5, 6, 7, 8, 9, 10]]), None, c)
    assert ex.step_reason(1, c) == "context 7 > max 6"
    logits = ex.decode(torch.tensor([11]), c)  # falls back, still correct and still advancing
    assert logits.shape == (1, CFG.vocab_size) and c.lengths.tolist() == [7]
    assert ex.trace.records[-1].fallback == "context 7 > max 6"


def test_standard_backend_is_the_reference_bitwise(model32, seed):
    ex = DecodeExecutor(model32, backend="standard", max_len=16)
    ids = _prompt(3, 5, seed)
    cache, ref = ex.new_cache(3), model32.new_cache(3, 16)
    lens = torch.tensor([5, 2, 4])
    assert torch.equal(ex.prefill(ids, lens, cache), model32.prefill(ids, lens, ref))
    tok = ids[:, 0]
    for active in (None, torch.tensor([True, False, True])):
        assert torch.equal(ex.decode(tok, cache, active), model32.decode(tok, ref, active))
    assert ex.trace.summary()["fallbacks"] == {} and ex.trace.summary()["backends"] == {"standard": 3}


# ------------------------------------------------------------------------------------------ emulated fast step
# Two equally correct BF16 paths (the reference, the fast step with each kernel's rounding points) differ from
# FP64 by 1-7% relative RMS on k3-tiny, and their ratio has a tail: over 88 seeded steps the fast path's
# error reached 3.1x the reference's when the latter was small (0.0514 vs 0.0166). The slack keeps such draws
# passing; a structural bug (a wrong slot, row, head or scale) is an O(1) relative error.
REL_RMS_SLACK = 0.05


def _rel_rms(x: torch.Tensor, ref64: torch.Tensor) -> float:
    """RMS of x - ref64 over RMS of ref64 (a statistic over every element: the max of a BF16 error is one
    draw from its tail and swung 1-3.6x between two equally correct BF16 paths from seed to seed)."""
    r = ref64.double()
    return float((x.double() - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-30))


def test_emulated_fast_step_matches_fp64_oracle(sd_stable, seed):
    """The fast step's structure (static buffers, slot mapping with padding and an inactive row, the
    residual-stream buffer, the mla_decode / moe_experts adapters with each kernel served by its reference)
    against the FP64 reference: relative RMS error within 2.5x the BF16 reference's own + REL_RMS_SLACK and no
    logit off by a quarter of the scale; inactive rows 0 with untouched caches; the latents land where the
    reference writes them, as close to FP64 as the reference's."""
    m16 = load_reference(CFG, sd_stable, dtype=torch.bfloat16)
    m64 = load_reference(CFG, sd_stable, dtype=torch.float64)
    ex = DecodeExecutor(m16, max_len=24, max_batch=4, envelope=Envelope(emulate=True))
    for a, b in zip(m16.buffers(), m64.buffers(), strict=True):  # the experts' re-pointed tensors: same values
        if a.dtype == torch.uint8:
            assert torch.equal(a, b)
    ids = _prompt(3, 6, seed)
    lens = torch.tensor([6, 4, 5])
    cache, c16, c64 = ex.new_cache(3), m16.new_cache(3, 24), m64.new_cache(3, 24)
    ex.prefill(ids, lens, cache)
    m16.prefill(ids, lens, c16)
    l64 = m64.prefill(ids, lens, c64)[torch.arange(3), lens - 1]
    active = torch.tensor([True, False, True])
    kda = CFG.kda_layer_ids[-1]
    mla = CFG.mla_layer_ids[-1]
    frozen = cache.layers[kda].state[1].clone()
    for _ in range(2):
        tok = l64.argmax(-1)
        fast = ex.decode(tok, cache, active)
        ref = m16.decode(tok, c16, active)
        l64 = m64.decode(tok, c64, active)
        rows = active.nonzero().flatten()
        e_fast, e_ref = _rel_rms(fast[rows], l64[rows]), _rel_rms(ref[rows], l64[rows])
        assert e_fast <= 2.5 * e_ref + REL_RMS_SLACK, (
            f"seed {seed}: fast {e_fast:.4g} vs BF16 reference {e_ref:.4g} (rel. RMS)")
        worst = float((fast[rows].double() - l64[rows]).abs().max())
        assert worst <= 0.25 * float(l64[rows].abs().max()), f"seed {seed}: a logit off by {worst:.4g}"
        assert torch.all(fast[1] == 0) and torch.isfinite(fast).all()
    assert cache.lengths.tolist() == [8, 4, 7] and cache.length_bound >= 8
    assert torch.equal(cache.layers[kda].state[1], frozen)
    assert float(ex.pool.layers[kda].state[0].abs().max()) == 0.0  # the empty slot stays empty
    # the decode latents: at (slot, pos) of each active row, as close to the FP64 reference's as the BF16
    # reference's are (the logits' bound: they carry the same compounded rounding); prefill positions are the
    # reference's own (ex.prefill is the standard path); nothing past the length
    lat, l16, l64 = (c.layers[mla].latent for c in (cache, c16, c64))
    for row, n in enumerate(cache.lengths.tolist()):
        d = slice(int(lens[row]), n)
        assert torch.equal(lat[row, :d.start], l16[row, :d.start]), f"seed {seed}: row {row} prefill latents differ"
        if d.start < n:
            e_fast, e_ref = _rel_rms(lat[row, d], l64[row, d]), _rel_rms(l16[row, d], l64[row, d])
            assert e_fast <= 2.5 * e_ref + REL_RMS_SLACK, (
                f"seed {seed}: row {row} decode latents {e_fast:.3g} vs BF16 reference {e_ref:.3g} (rel. RMS)")
        assert float(lat[row, n:].abs().max()) == 0.0
    assert ex.pool.layers[mla].latent.shape[1] == 64  # max_len 24 rounded up to mla_decode's page size
    rec = ex.trace.records[-1]
    assert rec.fallback is None and rec.bucket == 4 and rec.batch == 3 and not rec.graph
    assert rec.standard_ops == []  # MLA attention and the routed experts are kernels now
    n_moe = sum(1 for i in range(CFG.num_hidden_layers) if CFG.is_moe_layer(i))
    assert rec.kernel_fallbacks["kda_decode"] == {"no cuda device": len(CFG.kda_layer_ids)}
    assert rec.kernel_fallbacks["mla_decode"] == {"no cuda device": len(CFG.mla_layer_ids)}
    assert rec.kernel_fallbacks["moe_experts"] == {"no cuda device": n_moe}
    assert fast_path_problems(summarize(list(ex.trace.records)))  # emulation is not a fast path


@pytest.mark.parametrize("backend", ["latency_specialized", "standard"])
def test_hidden_readout_is_what_the_final_norm_reads(sd_stable, seed, backend):
    """``readout="hidden"`` (the vLLM route, whose engine applies the final norm and lm_head): decode and fused
    verify steps return the hidden states the final norm reads. The reference's final norm and lm_head of them
    (vLLM's K3 ``compute_logits``) give the logits executor's logits of the same step (bitwise on the standard
    path, which is the reference; to BF16 rounding of the logits on the emulated fast step), the caches are left
    bitwise as the logits executor leaves them, inactive rows are 0, and a mixed step is refused."""
    m16 = load_reference(CFG, sd_stable, dtype=torch.bfloat16)
    kw = {"backend": backend, "max_len": 24, "max_batch": 4, "envelope": Envelope(emulate=True), "spec_tokens": 3}
    hid, log = DecodeExecutor(m16, readout="hidden", **kw), DecodeExecutor(m16, **kw)
    ids, lens = _prompt(3, 6, seed), torch.tensor([6, 4, 5])
    ch, cl = hid.new_cache(3), log.new_cache(3)
    hid.prefill(ids, lens, ch)
    log.prefill(ids, lens, cl)

    def check(h, want, live):
        assert h.dtype == torch.bfloat16 and h.shape[-1] == CFG.hidden_size and not h[~live].any()
        with torch.no_grad():
            got, want = m16.compute_logits(h[live]), want[live]
        if backend == "standard":
            assert torch.equal(got, want)
        else:
            assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max()), f"seed {seed}"
        for a, b in zip(ch.layers, cl.layers, strict=True):
            for x, y in zip(*(c.tensors() if hasattr(c, "tensors") else [c.latent] for c in (a, b)), strict=True):
                assert torch.equal(x, y)

    active = torch.tensor([True, False, True])
    tok = _prompt(3, 1, seed + 1)[:, 0]
    check(hid.decode(tok, ch, active), log.decode(tok, cl, active), active)
    if backend != "standard":  # the standard backend runs no fused verify step
        feed = _prompt(3, 3, seed + 2)
        act = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
        check(hid.verify(feed, ch, act), log.verify(feed, cl, act), act)
        assert hid.trace.records[-1].kind == "verify" and hid.trace.records[-1].fallback is None
    with pytest.raises(ValueError, match="readout='hidden'"):
        hid.mixed(tok, ch, 0, ids[0, :2])


# ------------------------------------------------------------------------------------------ kernel adapters
def _mla_setup(dtype, kv_dtype, seed):
    from k3_fastpath.reference.mla import MLACache

    m = load_reference(CFG, synthetic_state_dict(CFG, 0), dtype=dtype)
    layer = CFG.mla_layer_ids[0]
    attn = m.model.layers[layer].self_attn
    g = torch.Generator().manual_seed(seed)
    b, ctx = 3, 11
    cache = MLACache.empty(CFG, b, 16, kv_dtype)
    cache.write(torch.arange(b).repeat_interleave(ctx), torch.arange(ctx).repeat(b),
                torch.randn(b * ctx, CFG.mla_latent_dim, generator=g).to(dtype))
    x = torch.randn(b, 1, CFG.hidden_size, generator=g).to(dtype)
    pos = torch.tensor([10, 4, 7])  # each sequence's current position (shorter ones have stale keys after it)
    return attn, cache, x, pos


@pytest.mark.parametrize("kv,tol", [(torch.bfloat16, 1e-3), (torch.float8_e4m3fn, 1e-3)])
@torch.no_grad()
def test_mla_attention_adapter_matches_reference(kv, tol, seed):
    """``mla_attention`` through ``mla_decode`` (its reference on a CPU) over a 64-position slot pool whose
    slots are not the batch order, against ``GatedMLA`` absorbed decode: the same latents at the same
    (slot, position), attention over exactly positions 0..pos of the row's own slot, gate fused."""
    from k3_fastpath._lib import counters
    from k3_fastpath.kernels.mla_decode.api import split_kv_b
    from k3_fastpath.reference.mla import MLACache

    attn, cache, x, pos = _mla_setup(torch.bfloat16, kv, seed)
    slots = torch.tensor([3, 1, 4], dtype=torch.int32)  # rows -> pool slots (0: empty, 2: another sequence)
    pool = MLACache.empty(CFG, 5, 64, kv, scale=None)
    pool.latent[slots.long(), :16] = cache.latent
    pool.latent[2, :16] = cache.latent[0]  # a neighbour a wrong slot would read (and must not write)
    neighbour = pool.latent[2].clone()
    want = attn(x, cache, pos, mode="absorbed")[:, 0]
    q_nope, q_pe = attn.project_q(x)
    q = torch.cat([q_nope, q_pe], -1)[:, 0]
    kv_raw = attn.kv_a_proj_with_mqa(x)[:, 0]
    w_uk, w_uv = split_kv_b(attn.kv_b_proj.weight, attn.num_heads, attn.nope, attn.v_dim)
    table, ctx_len = fast_ops.mla_step_index(slots, pos, pool.latent.shape[1])
    assert ctx_len.tolist() == [11, 5, 8] and table.shape == (3, 1)
    before = counters.fallbacks("mla_decode")
    o = mla_step_op(q, kv_raw, attn.kv_a_layernorm.weight, CFG.rms_norm_eps, pool.latent,
                                      pool.scale, slots, pos, table, ctx_len, w_uk.float(), w_uv,
                                      attn.softmax_scale, attn.g_proj(x)[:, 0])
    assert counters.fallbacks("mla_decode") == before + 1  # served by the kernel api (its reference here)
    got = attn.o_proj(o)
    lat = pool.latent.view(torch.uint8) if kv == torch.float8_e4m3fn else pool.latent
    ref_lat = cache.latent.view(torch.uint8) if kv == torch.float8_e4m3fn else cache.latent
    assert torch.equal(lat[slots.long(), :16], ref_lat)  # same latent written at the same positions
    nb = neighbour.view(torch.uint8) if kv == torch.float8_e4m3fn else neighbour
    assert torch.equal(lat[2], nb) and not lat[:, 16:].any() and not lat[0].any()
    err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    assert err <= tol, f"seed {seed}: relative error {err:.3g}"


@pytest.mark.parametrize("norm", [False, True])
@torch.no_grad()
def test_moe_experts_adapter_matches_reference(norm, seed):
    """``moe_experts`` through the kernel api (its reference on a CPU) over the bank's ``ExpertWeights``
    (MXFP4, stacked once, sharing storage with the module: no BF16 copy) against the experts modules."""
    from k3_fastpath._lib import counters
    from k3_fastpath.reference.common import rms_norm
    from k3_fastpath.reference.moe import route
    from k3_fastpath.runtime.step_plan import ExpertBank

    m = load_reference(CFG, synthetic_state_dict(CFG, 0), dtype=torch.bfloat16)
    moe = m.model.layers[1].block_sparse_moe
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, CFG.hidden_size, generator=g).bfloat16()
    ids, w = route(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.gate.top_k, True, 1.0)
    z = moe.routed_expert_down_proj(x)
    want = torch.zeros(z.shape, dtype=torch.float32)
    for row in range(5):
        for slot in range(ids.shape[1]):
            want[row] += w[row, slot] * moe.experts[int(ids[row, slot])](z[row:row + 1])[0].float()
    originals = [t.clone() for t in moe.buffers() if t.dtype == torch.uint8]
    bank = ExpertBank(moe, CFG)
    assert all(torch.equal(a, b) for a, b in zip(originals, [t for t in moe.buffers() if t.dtype == torch.uint8],
                                                       strict=True))
    ex0 = moe.experts[0].w1
    assert bank.weights.fmt == "mxfp4" and not hasattr(bank, "stacked")
    assert ex0.weight_packed.data_ptr() == bank.weights.w1[0].data_ptr()  # the module's tensors are views
    assert ExpertBank(moe, CFG).weights is bank.weights  # built once per module
    before = counters.fallbacks("moe_experts")
    norm_w = moe.routed_expert_norm.weight if norm else None
    got = experts_step_op(z, ids, w, bank, norm_w, CFG.rms_norm_eps)
    assert counters.fallbacks("moe_experts") == before + 1
    if norm:
        want = rms_norm(want, norm_w, CFG.rms_norm_eps).bfloat16()
        assert got.dtype == torch.bfloat16
    else:
        assert got.dtype == torch.float32
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err <= (1e-2 if norm else 1e-5), f"seed {seed}: relative error {err:.3g}"


def test_route_from_logits_matches_reference(seed):
    from k3_fastpath.reference.moe import route

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, CFG.hidden_size, generator=g).bfloat16()
    w = (torch.randn(CFG.num_experts, CFG.hidden_size, generator=g) * 0.1).bfloat16()
    bias = torch.randn(CFG.num_experts, generator=g) * 0.02
    x[3] = 0  # all scores tied: the lower expert index wins
    ids, wt = fast_ops.route_from_logits(x.float() @ w.float().T, bias, 4, True, 1.0)
    rid, rw = route(x, w, bias, 4, True, 1.0)
    assert torch.equal(ids, rid)
    assert torch.allclose(wt, rw, rtol=1e-5, atol=1e-6)


def test_op_table_is_derived_from_the_kernel_specs_and_overrides_stay_local():
    """One entry per kernel spec (``serves_op``), launch options bound from ``DecodeOptions``; an override
    changes that table only (no global registry), and cannot add an op the step does not call."""
    from k3_fastpath import kernels

    table = fast_ops.op_table()
    assert table["linear"].kernel == "skinny_gemm" and table["kda_step"].kernel == "kda_decode"
    assert table["mla_attention"].kernel == "mla_decode" and table["moe_experts"].kernel == "moe_experts"
    assert [n for n, o in table.items() if o.standard_reason] == []  # every op of the step is a kernel
    assert set(table) == {s.serves_op for s in kernels.all_specs() if s.in_default_step}
    assert table["linear"].launch == {"pdl": True, "gemm_wgmma_min_m": 4}
    off = fast_ops.op_table(DecodeOptions(pdl=False, gemm_wgmma_min_m=0, situ_glu_kernel=True))
    assert off["linear"].launch == {"pdl": False, "gemm_wgmma_min_m": 0} and off["situ_glu"].launch == {"pdl": False}
    custom = fast_ops.OpImpl("mla_attention", lambda *a, **k: None, standard_reason="a test")
    mine = fast_ops.op_table(overrides={"mla_attention": custom})
    assert mine["mla_attention"] is custom and fast_ops.op_table()["mla_attention"].kernel == "mla_decode"
    ex = DecodeExecutor(load_reference(CFG, synthetic_state_dict(CFG, 0), dtype=torch.float32), max_len=32,
                        ops={"mla_attention": custom})
    assert ex.ops["mla_attention"] is custom and ex.trace.meta["ops"]["mla_attention"] == "standard: a test"
    with pytest.raises(ValueError, match="no such op"):
        fast_ops.op_table(overrides={"situ_glu": custom})  # opt-in op not asked for
    with pytest.raises(ValueError, match="exactly one"):
        fast_ops.OpImpl("x", lambda: None)
    assert fast_ops.launch_options(lambda x, pdl=False, *, out=None, prefetch=False: x) == ("prefetch",)


@pytest.mark.compile
def test_l2_prefetch_kernel_compiles_for_sm90a(tmp_path, monkeypatch):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("K3_KERNEL_CACHE", str(tmp_path))
    from k3_fastpath._lib import compile_cache
    from k3_fastpath.runtime.prefetch import L2PrefetchConfig, compile_l2_prefetch, prefetch_plan

    compile_cache.clear_memory()
    compile_l2_prefetch(L2PrefetchConfig())
    ptx = next(tmp_path.rglob("*.ptx")).read_text()
    assert "cp.async.bulk.prefetch.L2.global" in ptx
    t = torch.empty(1000, dtype=torch.bfloat16)
    plan = prefetch_plan([t, t], budget=2600)
    assert [n for _, n in plan] == [2000, 592] and all(n % 16 == 0 for _, n in plan)


@pytest.mark.compile
@pytest.mark.parametrize("M,N,K,residual", [(1, 1536, 7168, False), (16, 7168, 1536, True)])
def test_pdl_skinny_gemm_waits_before_reading_activations(M, N, K, residual, tmp_path, monkeypatch):
    """K3.md failure 2: a PDL kernel that reads activations before ``griddepcontrol.wait`` reads its
    predecessor's output too early. In the PTX of the PDL variant the wait precedes every global load (the
    only earlier memory instruction is the L2 prefetch of the weights); without PDL there is no wait."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("K3_KERNEL_CACHE", str(tmp_path))
    from k3_fastpath._lib import compile_cache
    from k3_fastpath.kernels.skinny_gemm.api import compile_skinny_gemm
    from k3_fastpath.kernels.skinny_gemm.config import SkinnyGemmConfig

    compile_cache.clear_memory()
    base = SkinnyGemmConfig.from_heuristic(M, N, K, residual=residual)
    for pdl in (False, True):
        cfg = dataclasses.replace(base, pdl=pdl)
        compile_skinny_gemm("bf16", N, K, cfg)
        ptx = compile_cache.artifact_paths(compile_cache.CompileKey.make("skinny_gemm", "bf16", (N, K), cfg))["ptx"]
        text = ptx.read_text()
        wait, first_load = text.find("griddepcontrol.wait"), text.find("ld.global")
        if pdl:
            assert 0 <= wait < first_load and "griddepcontrol.launch_dependents" in text
            assert 0 <= text.find("cp.async.bulk.prefetch.L2") < wait
        else:
            assert wait == -1 and "cp.async.bulk.prefetch" not in text


def test_step_sections_follow_the_layers(sd_stable, seed):
    """``fast_step.step_sections``: head.in, attention + MLP per layer typed by the layer, head.out; running
    them in order is the step the executor runs (here: equal logits to ``decode`` from a copied cache)."""
    from k3_fastpath.runtime.fast_step import OpCalls, step_sections

    cfg = preset("k3-tiny").config
    m = load_reference(cfg, sd_stable, dtype=torch.bfloat16)
    ex = DecodeExecutor(m, max_len=16, max_batch=4, buckets=(2, 4), envelope=Envelope(emulate=True))
    plan, pool = ex._plan_or_build(), ex._ensure_pool()
    io = ex._io_for(2)
    secs = step_sections(plan, OpCalls(ex.ops), io, pool)
    want = ["head"] + [t for i in range(cfg.num_hidden_layers) for t in
                       ("kda" if cfg.is_kda_layer(i) else "mla", "moe" if cfg.is_moe_layer(i) else "dense_mlp")]
    assert [s.layer_type for s in secs] == want + ["head"]
    assert secs[1].name == "L0.attn" and secs[-1].name == "head.out"
    cache = ex.new_cache(2)
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(3, cfg.vocab_size, (2,), generator=g)
    twin = ex.new_cache(2)
    ex.copy_cache(twin, cache)
    want_logits = ex.decode(tok, cache)
    io.load(tok, None, twin.slots, twin.lengths)
    io.logits.fill_(float("nan"))
    for s in step_sections(plan, OpCalls(ex.ops), io, pool):
        s.run()
    assert torch.equal(io.logits[:2], want_logits)


def test_situ_glu_kernel_option_serves_every_mlp_activation(sd_stable, seed):
    """``situ_glu_kernel=True`` puts the ``situ_glu`` op (kernels/situ_glu) in the table and the step calls it
    once per MLP (the dense layers' and every MoE layer's shared experts) instead of the PyTorch glue. On a
    CPU the kernel serves each call from its reference, which is the glue's formula: the logits are bitwise
    the default executor's, and the trace counts the refused kernel calls with their reason (never silent)."""
    m16 = load_reference(CFG, sd_stable, dtype=torch.bfloat16)
    plain = DecodeExecutor(m16, max_len=16, max_batch=2, envelope=Envelope(emulate=True))
    glu = DecodeExecutor(m16, max_len=16, max_batch=2, envelope=Envelope(emulate=True),
                         options=DecodeOptions(situ_glu_kernel=True))
    assert "situ_glu" not in plain.ops and glu.ops["situ_glu"].kernel == "situ_glu"
    assert glu.trace.meta["ops"]["situ_glu"] == "situ_glu"
    ids = _prompt(2, 5, seed)
    lens = torch.tensor([5, 3])
    ca, cb = plain.new_cache(2), glu.new_cache(2)
    la = plain.prefill(ids, lens, ca)[torch.arange(2), lens - 1]
    glu.prefill(ids, lens, cb)
    tok = la.argmax(-1)
    start = len(glu.trace)
    for _ in range(2):
        a, b = plain.decode(tok, ca), glu.decode(tok, cb)
        assert torch.equal(a, b), f"seed {seed}"
        tok = a.argmax(-1)
    recs = glu.trace.since(start)
    assert len(recs) == 2 and all(r.fallback is None for r in recs), recs
    for r in recs:  # one refused kernel call per MLP per step (dense or the shared experts), with its reason
        assert sum(r.kernel_fallbacks["situ_glu"].values()) == CFG.num_hidden_layers, r.kernel_fallbacks
    assert all("situ_glu" not in r.kernel_fallbacks for r in plain.trace.records)
