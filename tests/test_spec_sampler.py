"""Speculative decoding's acceptance rule (k3_fastpath/runtime/spec_sampler.py) on a CPU.

Greedy: the emitted tokens are plain greedy decoding's, grammar masks included. Sampling: a toy target whose
logits depend on the prefix, drafts of k = 3 from a drafter of its own, and the emitted tokens of full
speculative loops held to the exact joint distribution of the target's first two tokens by a G-test
(alpha 1e-3; 36 cells) for temperature / top-k / top-p settings, a sampling drafter and a deterministic one.
The control: a drafter that reports a distribution other than the one it samples from breaks the rule's
exactness, and the same test rejects it (the test can fail)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from k3_fastpath.runtime.sampler import SamplingConfig, filtered_logits, request_generator
from k3_fastpath.runtime.spec_sampler import AcceptanceStats, Verdict, verify_draft
from verify.checks.feature_rules import g_test

V, K, TRIALS, ALPHA = 6, 3, 12000, 1e-3


class Toy:
    """Target and drafter logits as functions of the prefix (its length and last token)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.target = 1.5 * torch.randn(K + 2, V + 1, V, generator=g)
        self.draft = self.target + 1.2 * torch.randn(K + 2, V + 1, V, generator=g)  # a drafter that is often wrong

    def _row(self, table: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        return table[min(len(prefix), K + 1), prefix[-1] if prefix else V]

    def target_logits(self, prefix: list[int], draft: list[int]) -> torch.Tensor:
        return torch.stack([self._row(self.target, prefix + draft[:i]) for i in range(len(draft) + 1)])

    def draft_probs(self, prefix: list[int]) -> torch.Tensor:
        return torch.softmax(self._row(self.draft, prefix), -1)


def _exact_joint(toy: Toy, cfg: SamplingConfig) -> np.ndarray:
    def p(prefix):
        return torch.softmax(filtered_logits(toy._row(toy.target, prefix), cfg), -1).double().numpy()

    return np.array([[p([])[a] * p([a])[b] for b in range(V)] for a in range(V)])


def _first_two(toy: Toy, cfg: SamplingConfig, gen: torch.Generator, deterministic: bool, misreport: bool) -> tuple[int, int]:
    out: list[int] = []
    while len(out) < 2:
        draft, probs = [], []
        for _ in range(K):
            q = toy.draft_probs(out + draft)
            t = int(q.argmax()) if deterministic else int(torch.multinomial(q, 1, generator=gen))
            draft.append(t)
            probs.append(torch.full((V,), 1.0 / V) if misreport else q)
        v = verify_draft(toy.target_logits(out, draft), torch.tensor(draft), cfg, gen,
                         None if deterministic else torch.stack(probs))
        out += list(v.tokens)
    return out[0], out[1]


CFGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4),
        SamplingConfig(temperature=1.3, top_p=0.85)]


def _p_value(cfg: SamplingConfig, deterministic: bool, misreport: bool = False, seed: int = 0) -> float:
    toy = Toy(seed)
    gen = request_generator(seed + 1)
    counts = np.zeros((V, V))
    for _ in range(TRIALS):
        a, b = _first_two(toy, cfg, gen, deterministic, misreport)
        counts[a, b] += 1
    exp = _exact_joint(toy, cfg) * TRIALS
    keep = exp.flatten() > 0
    assert counts.flatten()[~keep].sum() == 0, "a token the target's filters exclude was emitted"
    o, e = counts.flatten()[keep], exp.flatten()[keep]
    pooled = e < 5  # rare cells pooled into one
    o = np.append(o[~pooled], o[pooled].sum()) if pooled.any() else o
    e = np.append(e[~pooled], e[pooled].sum()) if pooled.any() else e
    return g_test(o, e)[2]


@pytest.mark.parametrize("cfg,deterministic", list(itertools.product(CFGS, [False, True])),
                         ids=lambda x: str(x))
def test_speculative_sampling_follows_the_targets_distribution(cfg, deterministic):
    assert _p_value(cfg, deterministic) > ALPHA


def test_a_drafter_misreporting_its_distribution_is_caught():
    assert _p_value(SamplingConfig(temperature=1.0), deterministic=False, misreport=True) < ALPHA


def test_greedy_accepts_the_argmax_prefix_and_adds_the_correction(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, 50, generator=g)
    best = logits.argmax(-1)
    assert verify_draft(logits, best[:K], SamplingConfig()) == Verdict(K, tuple(best.tolist()))
    wrong = best[:K].clone()
    wrong[1] = (wrong[1] + 1) % 50
    assert verify_draft(logits, wrong, SamplingConfig()) == Verdict(1, (int(best[0]), int(best[1])))


def test_greedy_under_a_grammar_rejects_a_forbidden_draft(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, 64, generator=g)
    best = logits.argmax(-1)
    masks = torch.full((K + 1, 2), -1, dtype=torch.int32)  # everything allowed ...
    t = int(best[0])
    word = ~(1 << (t % 32)) & 0xFFFFFFFF  # ... except the raw argmax at position 0 (as an int32 bit pattern:
    masks[0, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # bit 31 is the sign)
    v = verify_draft(logits, best[:K], SamplingConfig(), bitmasks=masks)
    second = int(logits[0].clone().index_fill_(0, torch.tensor([t]), float("-inf")).argmax())
    assert v == Verdict(0, (second,))


def test_bad_inputs_are_refused():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="2 draft tokens need 3 rows"):
        verify_draft(torch.randn(2, 8), torch.tensor([1, 2]), SamplingConfig())
    with pytest.raises(ValueError, match="needs the request's torch.Generator"):
        verify_draft(logits, torch.tensor([1, 2]), SamplingConfig(temperature=1.0))
    q = torch.full((2, 8), 1 / 8)
    q[0, 1] = 0.0
    with pytest.raises(ValueError, match="probability 0 under draft_probs"):
        verify_draft(logits, torch.tensor([1, 2]), SamplingConfig(temperature=1.0), request_generator(0), q)


def test_acceptance_stats_count_per_position():
    s = AcceptanceStats()
    s.add(3, Verdict(3, (1, 2, 3, 4)))
    s.add(3, Verdict(0, (5,)))
    s.add(3, Verdict(1, (1, 6)))
    assert s.examined == [3, 2, 1] and s.accepted == [2, 1, 1]
    assert s.rates() == [2 / 3, 0.5, 1.0] and s.mean_acceptance_length() == pytest.approx(1 + 4 / 3)
    with pytest.raises(ValueError):
        s.add(2, Verdict(3, (1, 2, 3, 4)))
