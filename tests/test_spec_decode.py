"""Speculative decoding on the reference model (k3_fastpath/runtime/spec_decode.py) on a CPU, k3-tiny.

In FP64, greedy speculative decoding emits exactly plain greedy decoding's tokens for any drafter (always
right, always wrong, right with probability 0.7) and k = 1, 3, 7, and the committed KDA / MLA state equals a
plain prefill of the same tokens (rejected drafts leave no trace; without the commit's restore of the KDA
states these fail); the synthetic drafter's per-position acceptance is about its p; the emulated fast
executor serves every verify position as a fast step with its own plain greedy tokens. Inputs: fresh random
prompts per run (the ``seed`` fixture)."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.spec_decode import SyntheticDrafter, speculative_generate
from k3_fastpath.synthetic import synthetic_state_dict

CFG = preset("k3-tiny").config
NEW = 20


@pytest.fixture(scope="module")
def model64():
    return load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.float64)


def _plain_greedy(model, ids, lens, n):
    cache = model.new_cache(ids.shape[0], ids.shape[1] + n + 1)
    logits = model.prefill(ids, lens, cache)[torch.arange(ids.shape[0]), lens - 1]
    out = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(n - 1):
        logits = model.decode(torch.tensor([o[-1] for o in out]), cache)
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return out


def _prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CFG.vocab_size, (3, 6), generator=g), torch.tensor([6, 4, 5])


@pytest.mark.parametrize("k,p", [(3, 0.7), (1, 0.7), (7, 0.7), (3, 0.0), (3, 1.0), (7, 1.0)])
def test_greedy_speculative_decoding_is_plain_greedy_and_commits_only_accepted_tokens(model64, seed, k, p):
    ids, lens = _prompts(seed)
    plain = _plain_greedy(model64, ids, lens, NEW)
    res = speculative_generate(model64, ids, lens, SyntheticDrafter(plain, p, CFG.vocab_size, seed), k, NEW)
    assert res.tokens == plain, f"seed {seed}"
    if p == 1.0:  # every draft right: every verify step emits k + 1 tokens
        assert res.verify_steps == -(-(NEW - 1) // (k + 1))
    # the committed state: a plain prefill of the prompt and every emitted token but the last (k 7 at p 1 ends
    # with a verify step that accepts more drafts than the request has room for: those are not committed)
    fed = res.cache.lengths - lens
    assert fed.tolist() == [NEW - 1] * 3
    ref = model64.new_cache(3, res.cache.max_len)
    model64.prefill(ids, lens, ref)
    model64.prefill(torch.tensor([plain[b][:int(fed[b])] + [0] * (int(fed.max()) - int(fed[b])) for b in range(3)]),
                    fed, ref)
    assert torch.equal(ref.lengths, res.cache.lengths)
    for a, b in zip(res.cache.layers, ref.layers, strict=True):
        if hasattr(a, "tensors"):  # KDA: conv and recurrent state
            assert all(torch.allclose(x, y, rtol=1e-9, atol=1e-12) for x, y in zip(a.tensors(), b.tensors(), strict=True))
        else:  # MLA: the latents up to each length (past it: rejected drafts' rows, never attended)
            for r, n in enumerate(ref.lengths.tolist()):
                assert torch.allclose(a.latent[r, :n], b.latent[r, :n], rtol=1e-9, atol=1e-12)


def test_the_synthetic_drafters_acceptance_is_about_its_p(seed):
    model = load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.float32)
    ids, lens = _prompts(seed)
    plain = _plain_greedy(model, ids, lens, 60)
    res = speculative_generate(model, ids, lens, SyntheticDrafter(plain, 0.6, CFG.vocab_size, seed), 3, 60)
    rates = res.stats.rates()
    # position 0 examined by every verify step but a request's last, which has no token left to draft
    assert res.stats.steps - 3 <= res.stats.examined[0] <= res.stats.steps and res.stats.steps > 3 * 60 / 4
    # each position's rate is a binomial share of the drafts it examined (later positions see fewer: a step's
    # first rejection ends it): within 4 standard errors, at least 0.2 (seed 493550808: 23 of 28 at the third)
    for r, n in zip(rates, res.stats.examined, strict=True):
        assert abs(r - 0.6) < max(0.2, 4 * (0.6 * 0.4 / n) ** 0.5), (rates, res.stats.examined, seed)
    assert 1.0 < res.stats.mean_acceptance_length() < 4.0


def test_a_verify_step_holds_at_most_8_rows(model64):
    ids, lens = _prompts(0)
    with pytest.raises(ValueError, match="1 \\+ k <= 8 rows"):
        speculative_generate(model64, ids, lens, SyntheticDrafter([[]] * 3, 0.5, CFG.vocab_size), 8, 4)
    with pytest.raises(ValueError, match="must lie in \\[0, 1\\]"):
        SyntheticDrafter([[]], 1.5, CFG.vocab_size)


def test_the_fast_step_serves_verify_steps_with_plain_greedys_tokens(seed):
    """The emulated fast executor (its step's structure, each kernel served by its reference) as the stepper:
    greedy speculative decoding emits exactly its own plain greedy tokens, every verify position a fast step."""
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor

    m16 = load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.bfloat16)
    ex = DecodeExecutor(m16, max_len=48, max_batch=4, envelope=Envelope(emulate=True))
    ids, lens = _prompts(seed)
    cache = ex.new_cache(3)
    out = [[int(t)] for t in ex.prefill(ids, lens, cache)[torch.arange(3), lens - 1].argmax(-1)]
    for _ in range(NEW - 1):
        for o, t in zip(out, ex.decode(torch.tensor([o[-1] for o in out]), cache).argmax(-1).tolist(), strict=True):
            o.append(t)
    steps = len(ex.trace)
    cache.release()
    res = speculative_generate(ex, ids, lens, SyntheticDrafter(out, 0.7, CFG.vocab_size, seed), 3, NEW)
    assert res.tokens == out, f"seed {seed}"
    fast = [r for r in ex.trace.since(steps) if r.fallback is None]
    # every verify position a fast step: k + 1 = 4 per verify step but the last ones (drafts capped by the
    # tokens left to emit)
    assert len(fast) == res.positions and 4 * (res.verify_steps - 2) < res.positions <= 4 * res.verify_steps
