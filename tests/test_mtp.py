"""K3's next-token (MTP) layer (k3_fastpath/reference/mtp.py) and the ``mtp`` drafter on a CPU, k3-tiny:mtp=1.

The checkpoint names are vLLM's (``KimiK3MTP``: ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head,...}`` and
the block without AttnRes), written and read back through the normal writer and loader; the layer computes
vLLM's formula (recomputed here in FP64 from its submodules: input order ``[enorm(e) | hnorm(h)]``, the
embedding masked at position 0, the shared head's norm on the logits side, the un-normed sum passed on); the
drafter's cached chain equals recomputing the layer over the whole extended sequence; greedy speculative
decoding with it emits plain greedy decoding's tokens. Inputs: fresh random tokens per run (``seed``)."""

from __future__ import annotations

import copy

import pytest
import torch

from k3_fastpath.manifest import tensor_specs
from k3_fastpath.presets import preset_spec
from k3_fastpath.reference.common import rms_norm
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.spec_decode import MTPDrafter, SpecConfig, speculative_generate
from k3_fastpath.synthetic import synthetic_state_dict
from k3_fastpath.weights import load_checkpoint, write_synthetic_checkpoint

CFG = preset_spec("k3-tiny:mtp=1").config
L = CFG.num_hidden_layers


@pytest.fixture(scope="module")
def sd():
    return synthetic_state_dict(CFG, 0, conditioning="stable")


@pytest.fixture(scope="module")
def model64(sd):
    return load_reference(CFG, sd, dtype=torch.float64)


def test_the_mtp_layers_checkpoint_names_are_vllms(tmp_path):
    """vLLM's ``KimiK3MTP.load_weights`` keeps ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.*,
    embed_tokens}`` and puts every other name of the layer under ``mtp_block.``: the block's MLA, norms and
    LatentMoE, with no AttnRes tensors. The writer writes them, the loader reads them back bit for bit."""
    names = {s.name[len(f"model.layers.{L}."):]: s for s in tensor_specs(CFG) if s.name.startswith(f"model.layers.{L}.")}
    H, V = CFG.hidden_size, CFG.vocab_size
    assert names["eh_proj.weight"].shape == (H, 2 * H) and names["shared_head.head.weight"].shape == (V, H)
    assert {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_b_proj.weight",
            "block_sparse_moe.gate.e_score_correction_bias"} <= set(names)
    assert not [n for n in names if "_res_" in n] and not [n for n in names if "conv1d" in n]  # MLA, no AttnRes
    assert tensor_specs(CFG)[: -len(names)] == tensor_specs(CFG.replace(num_nextn_predict_layers=0))
    write_synthetic_checkpoint(CFG, tmp_path / "ck", seed=0)
    cfg, back = load_checkpoint(tmp_path / "ck")
    assert cfg.num_nextn_predict_layers == 1
    want = synthetic_state_dict(CFG, 0)
    for n in names:
        assert torch.equal(back[f"model.layers.{L}.{n}"], want[f"model.layers.{L}.{n}"]), n
    load_reference(cfg, back)  # strictly: every tensor has its module


def _vllm_formula(layer, model, nxt, hidden, n):
    """vLLM's ``KimiK3MultiTokenPredictorLayer.forward`` in FP64 over pairs at positions 0 .. T-1, from the
    layer's submodules (no AttnRes, the residual sums unfused)."""
    e = model.model.embed_tokens(nxt)
    e[:, 0] = 0  # positions == 0
    x = layer.eh_proj(torch.cat([rms_norm(e, layer.enorm.weight, CFG.rms_norm_eps),
                                 rms_norm(hidden, layer.hnorm.weight, CFG.rms_norm_eps)], dim=-1))
    cache = layer.new_cache(nxt.shape[0], nxt.shape[1])
    r = x + layer.self_attn(layer.input_layernorm(x), cache, torch.zeros(nxt.shape[0], dtype=torch.long), n)
    s = r + layer.block_sparse_moe(layer.post_attention_layernorm(r))
    return layer.shared_head.norm(s), s


@torch.no_grad()
def test_the_mtp_layer_computes_vllms_formula(model64, seed):
    g = torch.Generator().manual_seed(seed)
    layer = model64.mtp_layers[0]
    nxt = torch.randint(3, CFG.vocab_size, (2, 6), generator=g)
    hidden = torch.randn(2, 6, CFG.hidden_size, generator=g, dtype=torch.float64)
    n = torch.tensor([6, 6])
    want_lh, want_s = _vllm_formula(layer, model64, nxt, hidden, n)
    lh, s = layer(model64.model.embed_tokens(nxt), hidden, layer.new_cache(2, 6), torch.zeros(2, dtype=torch.long), n)
    assert torch.allclose(lh, want_lh, rtol=1e-10, atol=1e-12) and torch.allclose(s, want_s, rtol=1e-10, atol=1e-12)
    # the pieces the formula pins down each move the output: the embedding at position 0 is masked, the rest is not
    other = nxt.clone()
    other[:, 0], other[:, 3] = (nxt[:, 0] + 1) % CFG.vocab_size, (nxt[:, 3] + 1) % CFG.vocab_size
    lh2, _ = layer(model64.model.embed_tokens(other), hidden, layer.new_cache(2, 6), torch.zeros(2, dtype=torch.long), n)
    assert torch.allclose(lh2[:, :3], lh[:, :3], rtol=1e-10, atol=1e-12) and not torch.allclose(lh2[:, 3], lh[:, 3])


@torch.no_grad()
def test_the_drafters_cached_chain_is_the_layer_over_the_whole_sequence(model64, seed):
    """Draft j of ``MTPDrafter`` (the layer's latent cache, one absorbed step per draft) equals the argmax at
    the last row of ONE plain pass of the layer over every pair so far, ``(t_{p+1}, h_p)`` then ``(d_{j-1},
    s_prev)``, on a fresh cache: the positions and the hidden state fed back are the ones vLLM uses."""
    g = torch.Generator().manual_seed(seed)
    model64 = copy.deepcopy(model64)  # the shared head's norm far from 1, so that feeding back its output
    layer = model64.mtp_layers[0]  # instead of the sum it normalises changes the drafts
    layer.shared_head.norm.weight.copy_(torch.rand(CFG.hidden_size, generator=g, dtype=torch.float64) * 4 - 2)
    ctx = torch.randint(3, CFG.vocab_size, (7,), generator=g).tolist()
    k = 4
    drafts, probs = MTPDrafter(model64).propose(0, ctx[:4], ctx[4:], k)
    assert len(drafts) == k and probs is None
    n = len(ctx) - 1
    _, h = model64.prefill_hidden(torch.tensor([ctx[:-1]]), None, model64.new_cache(1, n))
    toks, hid = list(ctx[1:]), h[0]
    for j in range(k):
        lh, s = layer(model64.model.embed_tokens(torch.tensor([toks])), hid[None], layer.new_cache(1, len(toks)),
                      torch.zeros(1, dtype=torch.long), torch.tensor([len(toks)]), mode="plain")
        assert int(model64.lm_head(lh[0, -1]).argmax()) == drafts[j], f"draft {j + 1}, seed {seed}"
        toks.append(drafts[j])
        hid = torch.cat([hid, s[0, -1:]])


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_speculative_decoding_with_the_mtp_drafter_is_plain_greedy(model64, seed, k):
    g = torch.Generator().manual_seed(seed)
    ids, lens = torch.randint(3, CFG.vocab_size, (3, 6), generator=g), torch.tensor([6, 4, 5])
    drafter = SpecConfig.parse(f"mtp:{k}").drafter(model64)
    assert isinstance(drafter, MTPDrafter)
    res = speculative_generate(model64, ids, lens, drafter, k, 12)
    plain = speculative_generate(model64, ids, lens, drafter, k, 12)  # determinism of the whole loop
    assert res.tokens == plain.tokens
    cache = model64.new_cache(3, 6 + 13)
    logits = model64.prefill(ids, lens, cache)[torch.arange(3), lens - 1]
    want = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(11):
        logits = model64.decode(torch.tensor([w[-1] for w in want]), cache)
        for w, t in zip(want, logits.argmax(-1).tolist(), strict=True):
            w.append(t)
    assert res.tokens == want, f"seed {seed}"


def test_a_model_without_the_layer_refuses_the_mtp_method():
    cfg = preset_spec("k3-tiny").config
    m = load_reference(cfg, synthetic_state_dict(cfg, 0, conditioning="stable"), dtype=torch.float32)
    with pytest.raises(ValueError, match="no next-token"):
        SpecConfig.parse("mtp:3").drafter(m)


def test_the_builtin_engine_decodes_with_the_mtp_drafter(seed):
    """``builtin:reference+spec=mtp:3`` on ``k3-tiny:mtp=1``: greedy outputs equal the same engine's without
    speculation, and it records its verify steps."""
    from verify.engines.base import SamplingParams
    from verify.engines.builtin import BuiltinEngine

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in (5, 7)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for spec in ("", "+spec=mtp:3"):
        e = BuiltinEngine(preset="k3-tiny:mtp=1", path="reference" + spec, device="cpu", seed=0, max_model_len=64)
        outs[spec] = [c.token_ids for c in e.generate(prompts, params)]
        if spec:
            assert e.generator.steps["verify_steps"] > 0
        e.close()
    assert outs[""] == outs["+spec=mtp:3"], f"seed {seed}"


def test_the_emulated_fast_step_verifies_the_mtp_drafts(seed):
    """The executor over a model with a next-token layer (its step structure, kernels served by their
    references): the layer is not a decoder layer to it, and greedy speculative decoding with the MTP drafter
    emits its own plain greedy tokens, every verify position a fast step."""
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor

    m16 = load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.bfloat16)
    ex = DecodeExecutor(m16, max_len=48, max_batch=4, envelope=Envelope(emulate=True))
    g = torch.Generator().manual_seed(seed)
    ids, lens = torch.randint(3, CFG.vocab_size, (3, 6), generator=g), torch.tensor([6, 4, 5])
    cache = ex.new_cache(3)
    out = [[int(t)] for t in ex.prefill(ids, lens, cache)[torch.arange(3), lens - 1].argmax(-1)]
    for _ in range(11):
        for o, t in zip(out, ex.decode(torch.tensor([o[-1] for o in out]), cache).argmax(-1).tolist(), strict=True):
            o.append(t)
    steps = len(ex.trace)
    cache.release()
    res = speculative_generate(ex, ids, lens, MTPDrafter(m16), 3, 12)
    assert res.tokens == out, f"seed {seed}"
    assert len([r for r in ex.trace.since(steps) if r.fallback is None]) == res.positions
