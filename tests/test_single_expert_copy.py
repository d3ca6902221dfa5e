"""The routed experts kept once (``ExpertBank(single_copy=True)`` / ``DecodeOptions(single_expert_copy=True)``),
without a GPU: the fragment layout becomes the only copy, and every reader of the checkpoint layout (the
reference modules: prefill, the standard path, fallbacks, ``cache_dense_experts``) sees bit for bit the bytes
it saw before; the rank-emulation byte model counts the experts once, so a full TP16 rank fits an H200.
Inputs are fresh random draws per run (the ``seed`` fixture); the model is the seeded synthetic k3-tiny."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.kernels.moe_experts.layout import ExpertWeights
from k3_fastpath.measure.rank_emulation import cache_pool_bytes, check_fits, emulation_bytes
from k3_fastpath.presets import preset, preset_spec
from k3_fastpath.reference.model import load_reference
from k3_fastpath.reference.moe import MXFP4Weight, cache_dense_experts
from k3_fastpath.runtime.envelope import Envelope
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.runtime.options import DecodeOptions
from k3_fastpath.runtime.step_plan import ModelPlan
from k3_fastpath.synthetic import synthetic_state_dict

CFG = preset("k3-tiny").config


@pytest.fixture(scope="module")
def sd():
    return synthetic_state_dict(CFG, 0, conditioning="stable")


def _mxfp4(E: int, rows: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 256, (E, rows, K // 2), generator=g, dtype=torch.uint8),
            torch.randint(118, 132, (E, rows, K // 32), generator=g, dtype=torch.uint8))


def test_compact_keeps_every_byte(seed):
    g = torch.Generator().manual_seed(seed)
    E, I, L = 5, 64, 128
    w = ExpertWeights("mxfp4", _mxfp4(E, I, L, g), _mxfp4(E, I, L, g), _mxfp4(E, L, I, g))
    want = {(n, e): tuple(t.clone() for t in w.checkpoint(n, e)) for n in ("w1", "w3", "w2") for e in range(E)}
    dense = {(n, e): w.dense(n, e, torch.float32) for n in ("w1", "w3", "w2") for e in range(E)}
    dims = (w.num_experts, w.inter, w.latent)
    freed = w.compact()
    assert w.compacted and w.w1 is None and w.w3 is None and w.w2 is None
    assert freed == sum(a.numel() + b.numel() for a, b in want.values())
    assert (w.num_experts, w.inter, w.latent) == dims == (E, I, L)
    for (n, e), (p, s) in want.items():
        q, t = w.checkpoint(n, e)
        assert torch.equal(q, p) and torch.equal(t, s), f"seed {seed}: {n}[{e}] changed"
        assert torch.equal(w.dense(n, e, torch.float32), dense[(n, e)])
    assert w.compact() == 0  # idempotent
    with pytest.raises(ValueError, match="MXFP4"):
        ExpertWeights("bf16", torch.zeros(1, 16, 64), torch.zeros(1, 16, 64), torch.zeros(1, 64, 16)).compact()


def test_reference_model_is_bitwise_unchanged(sd, seed):
    """Prefill and decode logits of the reference model, and each expert module's bytes, are the same after
    the plan keeps the experts once; the modules hold no expert buffers of their own any more."""
    model = load_reference(CFG, sd, dtype=torch.float32)
    mods = [m for m in model.modules() if isinstance(m, MXFP4Weight)]
    before = [(m.weight_packed.clone(), m.weight_scale.clone()) for m in mods]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size, (2, 5), generator=g)
    c0 = model.new_cache(2, 16)
    p0 = model.prefill(ids, None, c0)
    d0 = model.decode(p0[:, -1].argmax(-1), c0)
    ModelPlan.build(model, single_expert_copy=True)
    for m, (p, s) in zip(mods, before, strict=True):
        assert "weight_packed" not in m._buffers and "weight_scale" not in m._buffers
        assert torch.equal(m.weight_packed, p) and torch.equal(m.weight_scale, s)
    c1 = model.new_cache(2, 16)
    p1 = model.prefill(ids, None, c1)
    d1 = model.decode(p1[:, -1].argmax(-1), c1)
    assert torch.equal(p0, p1) and torch.equal(d0, d1), f"seed {seed}: logits changed"
    assert cache_dense_experts(model, torch.float32) > 0  # the dequantised cache keys on the source
    assert all(m.__dict__["_dense"][0] == m._key(torch.float32) for m in mods)
    c2 = model.new_cache(2, 16)
    assert torch.equal(model.prefill(ids, None, c2), p0) and torch.equal(model.decode(p0[:, -1].argmax(-1), c2), d0)


def test_emulated_executor_matches_the_two_copy_one(sd, seed):
    """The fast step (emulated on a CPU: each kernel served by its reference) gives the same logits whether the
    experts live twice or once."""
    outs = []
    for single in (False, True):
        m = load_reference(CFG, sd, dtype=torch.bfloat16)
        ex = DecodeExecutor(m, max_len=24, max_batch=2, envelope=Envelope(emulate=True),
                            options=DecodeOptions(single_expert_copy=single))
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, CFG.vocab_size, (2, 4), generator=g)
        cache = ex.new_cache(2)
        last = ex.prefill(ids, None, cache)[:, -1]
        steps = []
        for _ in range(2):
            last = ex.decode(last.argmax(-1), cache)
            steps.append(last.clone())
        outs.append(torch.stack(steps))
        assert ex.trace.meta["single_expert_copy"] is single
        banks = [lp.mlp.bank.weights for lp in ex._plan_or_build().layers if lp.moe]
        assert banks and all(b.compacted is single for b in banks)
    assert torch.equal(outs[0], outs[1]), f"seed {seed}: single_expert_copy changed the fast step"


def test_full_tp16_rank_fits_an_h200_only_with_one_copy():
    p = preset_spec("k3-tp16-rank")
    cache = cache_pool_bytes(p.config, 16, slots=65, max_len=1024 + 384, kv_bytes=2)
    free = 139 * 2**30
    two, one = (emulation_bytes(p.config, 16, cache_bytes=cache, single_copy=s) for s in (False, True))
    assert one["expert_fragments"] == 0 and two["expert_fragments"] == two["experts"] > 80e9
    assert one["resident"] == one["weights"] + one["plan_copies"] and one["single_expert_copy"] == 1
    why = check_fits(p.config, 16, free, cache_bytes=cache)
    assert why is not None and "single_expert_copy" in why
    assert check_fits(p.config, 16, free, cache_bytes=cache, single_copy=True) is None
