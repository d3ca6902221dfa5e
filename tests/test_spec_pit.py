"""The randomized PIT behind features.spec_sampling / decode_sampling (``spec_rules.token_interval`` /
``pit_test``) under the null: tokens drawn from the reference distribution itself, at a filtered cell
(T 0.7, top-k 20, top-p 0.9) where a few percent of draws are ambiguous (near the top-p boundary within the
logit tolerance). The intervals conditioned on the unambiguous tokens give a uniform PIT; leaving ambiguous
tokens out of unconditional intervals (what the rule did before ``PIT_RULE``) empties the top bin and fails
on the same draws, as it did on the GPU (bundles/runs/2026-12-06-h100-session20)."""

from __future__ import annotations

import numpy as np

from verify.checks.feature_rules import reference_distribution
from verify.checks.spec_rules import pit_test, token_interval

T, K, TOP_P, TOL, BINS = 0.7, 20, 0.9, 0.05, 20


def _draws(seed: int, n: int, spread: float = 0.5):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        logits = rng.normal(0.0, spread, 64)
        p, _ = reference_distribution(logits, T, K, TOP_P)  # what the engine samples from under the null
        yield logits, int(rng.choice(64, p=p)), float(rng.random())


def test_conditional_intervals_are_uniform_and_unconditional_exclusion_is_biased(seed):
    cond, uncond = [], []
    for logits, tok, u in _draws(seed, 6000):
        lo, pt, amb = token_interval(logits, tok, T, K, TOP_P, TOL, 0.0)
        cond.append({"lo": [lo], "p": [pt], "U": [u], "ambiguous": [amb]})
        p, ambs = reference_distribution(logits, T, K, TOP_P, TOL, 0.0)
        before = (p > p[tok]) | ((p == p[tok]) & (np.arange(64) < tok))
        uncond.append({"lo": [float(p[before].sum())], "p": [float(p[tok])], "U": [u], "ambiguous": [bool(ambs[tok])]})
    good, bad = pit_test(cond, BINS), pit_test(uncond, BINS)
    assert good["ambiguous"] == bad["ambiguous"] >= 100, f"seed {seed}: the case must exercise ambiguity {good}"
    assert good["forbidden"] == 0 and good["p_value"] > 1e-4, f"seed {seed}: {good}"
    assert bad["p_value"] < 1e-4 and bad["counts"][-1] < 0.75 * bad["tested"] / BINS, f"seed {seed}: {bad}"


def test_measured_spread_ignores_a_common_shift_and_a_filter_bug_stays_forbidden(seed):
    from verify.checks.spec_features import logit_spread

    base = np.array([-1.1, -1.9, -3.0, -4.0])
    assert logit_spread({0: -0.6, 1: -1.4}, base) < 1e-12  # log-softmax moved as a whole: no filter sees it
    assert abs(logit_spread({0: -1.0, 1: -2.0}, base) - 0.1) < 1e-12
    assert logit_spread(None, base) == 0.0
    # an engine whose sampler ignores top-p (same logits, so its measured spread is 0): its tokens past the
    # nucleus are not ambiguous, they are forbidden
    forbidden, rng = 0, np.random.default_rng(seed + 1)
    for logits, _, _ in _draws(seed, 500, spread=1.5):
        p_k, _ = reference_distribution(logits, T, K, 1.0)  # top-k only
        tok = int(rng.choice(64, p=p_k))
        lp = logits - np.log(np.exp(logits).sum())
        tol = max(TOL, logit_spread({t: lp[t] for t in np.argsort(-lp)[:20]}, lp))
        _, pt, amb = token_interval(logits, tok, T, K, TOP_P, tol, 0.0)
        forbidden += pt == 0.0 and not amb
    assert forbidden >= 10, f"seed {seed}: {forbidden}"
