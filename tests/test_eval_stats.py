"""Paired statistics and eval gates on constructed data where the right answer is known.

References are independent of ``verify.evals.stats``: exact binomial tails summed as ``Fraction``s, and
scipy's ``binomtest`` where scipy is installed (it comes with lm-eval). The headline case: a 1-point
regression on GSM8K's 1,319 items is flagged when its 13 lost items are all discordant one way
(p = 2/2^13), and not when they are the net of 60 vs 47 discordant items (p ~ 0.25)."""

from __future__ import annotations

import random
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from verify.evals.gates import Thresholds, ThresholdsError, compare, load_thresholds
from verify.evals.stats import (
    accuracy_interval,
    mcnemar_exact,
    paired_bootstrap,
    paired_counts,
    per_item_means,
)

TH = Thresholds(alpha=0.05, min_relative_accuracy=0.99, max_relative_length_change=0.10, truncation_max_rate=0.05,
                truncation_max_increase=0.02, extraction_max_rate=0.05, extraction_max_increase=0.02,
                bootstrap_iters=2000, bootstrap_confidence=0.95, increase_test="mcnemar")


def exact_two_sided(b: int, c: int) -> float:
    """Independent reference: P[X <= min] + P[X >= max] for X ~ Binom(b + c, 1/2), in exact fractions."""
    n = b + c
    if n == 0:
        return 1.0
    lo, hi = min(b, c), max(b, c)
    if lo == hi:
        return 1.0
    tail = sum(Fraction(comb(n, k), 2**n) for k in range(lo + 1)) + sum(Fraction(comb(n, k), 2**n)
                                                                       for k in range(hi, n + 1))
    return float(min(Fraction(1), tail))


def scores_with(n: int, both: int, base_only: int, fast_only: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """0/1 score lists over ``n`` items with exactly this cross-tab, in a random item order."""
    cells = [(1, 1)] * both + [(1, 0)] * base_only + [(0, 1)] * fast_only
    cells += [(0, 0)] * (n - len(cells))
    rng.shuffle(cells)
    return [b for b, _ in cells], [f for _, f in cells]


def samples(scores: list, *, tokens: int | list[int] = 100, truncated: bool | list[bool] = False,
            failed: bool | list[bool] = False, repeats: int = 1) -> list[dict]:
    out = []
    for i, s in enumerate(scores):
        reps = list(s) if isinstance(s, (list, tuple)) else [s] * repeats
        k = len(reps)
        def per(x, i=i, k=k):
            return list(x[i]) if isinstance(x, list) and isinstance(x[i], list) else [x[i] if isinstance(x, list) else x] * k
        out.append({"doc_id": i, "doc_hash": f"d{i}", "prompt_hash": f"p{i}", "scores": reps,
                    "output_tokens": per(tokens), "truncated": per(truncated), "extraction_failed": per(failed)})
    return out


# ---------------------------------------------------------------- McNemar
def test_mcnemar_matches_exact_binomial_sums(seed) -> None:
    rng = random.Random(seed)
    cases = [(0, 0), (1, 0), (0, 1), (5, 5), (13, 0), (60, 47)] + [(rng.randrange(80), rng.randrange(80)) for _ in range(40)]
    for b, c in cases:
        assert mcnemar_exact(b, c) == pytest.approx(exact_two_sided(b, c), rel=1e-12, abs=1e-300), (b, c, seed)


def test_mcnemar_matches_scipy(seed) -> None:
    stats = pytest.importorskip("scipy.stats", reason="needs_eval_extra: scipy comes with lm-eval")
    rng = random.Random(seed)
    for _ in range(60):
        b, c = rng.randrange(300), rng.randrange(300)
        ref = stats.binomtest(min(b, c), b + c, 0.5).pvalue if b + c else 1.0
        assert mcnemar_exact(b, c) == pytest.approx(ref, rel=1e-9, abs=1e-300), (b, c, seed)


def test_one_point_regression_on_1319_items_flagged_as_the_statistics_say(seed) -> None:
    """Baseline 1,187/1,319 (90.0%), fast path 1,174/1,319 (89.0%): 13 items fewer either way."""
    rng = random.Random(seed)
    n = 1319
    # (a) all 13 discordant items go against the fast path: p = 2 * 2^-13 = 2.44e-4 -> flagged
    base, fast = scores_with(n, both=1174, base_only=13, fast_only=0, rng=rng)
    assert (sum(base), sum(fast)) == (1187, 1174)
    counts = paired_counts(base, fast)
    assert (counts.base_only, counts.fast_only, counts.both) == (13, 0, 1174)
    assert mcnemar_exact(13, 0) == pytest.approx(exact_two_sided(13, 0)) == pytest.approx(2 / 2**13)
    metrics, problems = compare("gsm8k", samples(base), samples(fast), TH, seed)
    assert metrics["p_value"] == pytest.approx(2 / 2**13) and metrics["significant"]
    assert metrics["accuracy_diff"] == pytest.approx(-13 / n)
    assert len(problems) == 1 and "McNemar p=0.000244 < 0.05" in problems[0], problems
    assert metrics["bootstrap"]["hi"] < 0  # the bootstrap agrees: the whole CI is below zero
    # (b) the same net loss from 60 vs 47 discordant items: p ~ 0.246 -> not flagged
    base, fast = scores_with(n, both=1127, base_only=60, fast_only=47, rng=rng)
    assert (sum(base), sum(fast)) == (1187, 1174)
    metrics, problems = compare("gsm8k", samples(base), samples(fast), TH, seed)
    assert metrics["p_value"] == pytest.approx(exact_two_sided(60, 47), rel=1e-12)
    assert 0.2 < metrics["p_value"] < 0.3 and not metrics["significant"]
    assert problems == []
    assert metrics["bootstrap"]["lo"] < 0 < metrics["bootstrap"]["hi"]


def test_significant_but_negligible_drop_is_not_a_failure(seed) -> None:
    """Significant (p < 0.05) but the fast path keeps >= 0.99x the baseline: not a regression by the gate."""
    base, fast = scores_with(5000, both=4490, base_only=10, fast_only=0, rng=random.Random(seed))
    metrics, problems = compare("big", samples(base), samples(fast), TH, seed)
    assert metrics["significant"] and metrics["relative_accuracy"] > 0.99 and problems == []


def test_improvement_is_never_a_failure(seed) -> None:
    base, fast = scores_with(500, both=300, base_only=0, fast_only=40, rng=random.Random(seed))
    metrics, problems = compare("up", samples(base), samples(fast), TH, seed)
    assert metrics["significant"] and problems == []


# ---------------------------------------------------------------- bootstrap
def test_paired_bootstrap_known_answers(seed) -> None:
    rng = np.random.default_rng(seed)
    x = rng.random(400)
    same = paired_bootstrap(x, x, iters=500, seed=seed)
    assert same.diff == same.lo == same.hi == 0.0
    shifted = paired_bootstrap(x, x + 0.25, iters=500, seed=seed)
    assert shifted.lo == pytest.approx(0.25) and shifted.hi == pytest.approx(0.25)


def test_paired_bootstrap_width_matches_the_normal_approximation(seed) -> None:
    """With 400 items the percentile CI of a mean difference is close to mean +- 1.96 sd / sqrt(n)."""
    rng = np.random.default_rng(seed)
    base = rng.random(400)
    fast = base + rng.normal(-0.02, 0.1, 400)
    ci = paired_bootstrap(base, fast, iters=20000, seed=seed)
    d = fast - base
    half = 1.959964 * d.std(ddof=1) / np.sqrt(d.size)
    assert ci.diff == pytest.approx(d.mean())
    assert (ci.hi - ci.lo) / 2 == pytest.approx(half, rel=0.06)
    assert ci.lo < d.mean() < ci.hi


def test_paired_bootstrap_is_reproducible_from_its_seed(seed) -> None:
    rng = np.random.default_rng(seed)
    b, f = rng.integers(0, 2, 300), rng.integers(0, 2, 300)
    assert paired_bootstrap(b, f, iters=3000, seed=7) == paired_bootstrap(b, f, iters=3000, seed=7)
    assert paired_bootstrap(b, f, iters=3000, seed=7) != paired_bootstrap(b, f, iters=3000, seed=8)
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap([1, 0], [1], seed=0)


# ---------------------------------------------------------------- AIME repeats
def test_aime_repeats_are_averaged_per_problem_then_paired(seed) -> None:
    rng = random.Random(seed)
    base = [[rng.random() < 0.7 for _ in range(8)] for _ in range(30)]
    base = [[int(x) for x in reps] for reps in base]
    assert per_item_means(base) == [sum(r) / 8 for r in base]
    # a fast path that loses 4 of 8 repeats on 25 of 30 problems: a large, consistent drop
    fast = [[0] * 4 + r[4:] if i < 25 else r for i, r in enumerate(base)]
    for i in range(25):
        base[i][:4] = [1, 1, 1, 1]
    metrics, problems = compare("aime25", samples(base), samples(fast), TH, seed)
    assert metrics["test"] == "paired_bootstrap" and metrics["baseline"]["responses"] == 240
    assert metrics["accuracy_diff"] == pytest.approx(-(25 * 4 / 8) / 30)
    assert metrics["bootstrap"]["hi"] < 0 and len(problems) == 1 and "paired bootstrap CI" in problems[0]
    # identical repeats on both sides: no difference at all
    metrics, problems = compare("aime25", samples(base), samples(base), TH, seed)
    assert metrics["accuracy_diff"] == 0 and problems == []


# ---------------------------------------------------------------- the other gates
def test_length_truncation_and_extraction_gates() -> None:
    s = [1, 0, 1, 1] * 25
    ok, problems = compare("t", samples(s, tokens=100), samples(s, tokens=109), TH, 0)
    assert problems == [] and ok["length_ratio"] == pytest.approx(1.09)
    _, problems = compare("t", samples(s, tokens=100), samples(s, tokens=111), TH, 0)
    assert problems == ["t: mean output 111.0 tokens vs baseline 100.0: outside +-10%"]
    _, problems = compare("t", samples(s, tokens=100), samples(s, tokens=89), TH, 0)
    assert len(problems) == 1
    # 8 of 200 truncated on the fast side only: under the 5% cap, +4 points, McNemar p = 2/2^8
    s200 = s * 2
    trunc = [i < 8 for i in range(200)]
    m, problems = compare("t", samples(s200), samples(s200, truncated=trunc), TH, 0)
    assert problems == ["t: truncation (hit max_tokens) rate 4.0% vs baseline 0.0%: up more than 2.0%, "
                        "McNemar p=0.00781 < 0.05 (8 responses on the fast side only, 0 on the baseline only)"]
    assert m["truncation_test"]["p_value"] == pytest.approx(2 / 2**8)
    # the same +4 points on 100 items (4 responses, p = 0.125), or one response of 20 (+5 points, the H200
    # standard run of 2026-12-01): not evidence of a decode loop that misses EOS
    for n, k in ((100, 4), (20, 1)):
        _, problems = compare("t", samples(s[:n]), samples(s[:n], truncated=[i < k for i in range(n)]), TH, 0)
        assert problems == [], (n, k, problems)
    # thresholds recorded before the paired test existed (no increase_test key): the plain rule, so an old
    # bundle's verdict re-derives as it was written
    old = Thresholds.from_dict({k: v for k, v in TH.as_dict().items() if k != "increase_test"})
    assert old.increase_test == "none"
    _, problems = compare("t", samples(s[:20]), samples(s[:20], truncated=[i < 1 for i in range(20)]), old, 0)
    assert problems == ["t: truncation (hit max_tokens) rate 5.0% vs baseline 0.0%: up more than 2.0%"]
    fails = [i < 6 for i in range(100)]  # 6% on both sides: over the absolute cap on each side
    _, problems = compare("t", samples(s, failed=fails), samples(s, failed=fails), TH, 0)
    assert problems == ["t: answer-extraction failure rate 6.0% on the baseline side, over 5.0%",
                        "t: answer-extraction failure rate 6.0% on the under test side, over 5.0%"]


def test_unpaired_items_are_refused() -> None:
    a, b = samples([1, 0, 1]), samples([1, 0, 1])
    b[1]["prompt_hash"] = "other"
    _, problems = compare("t", a, b, TH, 0)
    assert problems and "not a paired comparison" in problems[0]
    _, problems = compare("t", a, samples([1, 0]), TH, 0)
    assert problems and "different items" in problems[0]


def test_thresholds_yaml_defaults_and_overrides(tmp_path) -> None:
    gsm = load_thresholds("gsm8k")
    aime = load_thresholds("aime25")
    assert gsm.alpha == 0.05 and gsm.min_relative_accuracy == 0.99 and gsm.max_relative_length_change == 0.10
    assert aime.truncation_max_rate == 0.10 and aime.alpha == gsm.alpha  # override merged over the defaults
    bad = tmp_path / "t.yaml"
    bad.write_text("defaults: {alpha: 0.05}\n")
    with pytest.raises(ThresholdsError, match="missing key"):
        load_thresholds("gsm8k", bad)
    bad.write_text(open(load_thresholds.__globals__["default_thresholds_path"]()).read().replace("alpha: 0.05", "alpha: 2"))
    with pytest.raises(ThresholdsError, match="alpha must be in"):
        load_thresholds("gsm8k", bad)
    with pytest.raises(ThresholdsError, match="cannot read"):
        load_thresholds("gsm8k", tmp_path / "missing.yaml")


def test_min_detectable_drop_is_detected_with_its_power_and_half_of_it_is_not():
    from verify.evals.stats import min_detectable_drop

    # full agreement: Z^2 / n; that many items flipped one way is significant, half of them is not
    m = min_detectable_drop([1.0] * 30, [1.0] * 30, alpha=0.05)
    assert m["mde"] == pytest.approx((1.959964 + 0.841621) ** 2 / 30, rel=1e-5) and m["discordance"] == 0
    assert not m["detects_target"] and m["items_for_target"] == 157
    k = round(m["mde"] * 30)
    assert mcnemar_exact(k, 0) < 0.05 <= mcnemar_exact(k // 2, 0)
    # with background disagreement q = 10% both ways, a drop of the MDE is caught ~80% of the time
    n, q = 400, 0.10
    d = min_detectable_drop([1.0] * int(n * q / 2) + [0.0] * int(n * q / 2) + [1.0] * (n - int(n * q)),
                            [0.0] * int(n * q / 2) + [1.0] * int(n * q / 2) + [1.0] * (n - int(n * q)), 0.05)
    assert d["discordance"] == pytest.approx(q) and 0.05 < d["mde"] < 0.06
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(1000):  # per item: base-only with q/2 + d, fast-only with q/2 (a real drop of d)
        u = rng.random(n)
        b, c = int((u < q / 2 + d["mde"]).sum()), int(((u >= q / 2 + d["mde"]) & (u < q + d["mde"])).sum())
        hits += mcnemar_exact(b, c) < 0.05
    assert 0.72 < hits / 1000 < 0.88, hits


def test_compare_records_the_mde():
    base = [{"doc_id": i, "doc_hash": "h", "prompt_hash": "p", "scores": [1.0], "extraction_failed": [False],
             "truncated": [False], "output_tokens": [10]} for i in range(50)]
    metrics, _ = compare("t", base, [dict(s) for s in base], TH, seed=0)
    assert metrics["mde"]["items"] == 50 and metrics["mde"]["mde"] == pytest.approx(7.849 / 50, rel=1e-3)


def test_accuracy_interval_wilson_known_answers_and_bootstrap_for_fractions(seed) -> None:
    """Wilson's interval at 95% (textbook values: 15/30 -> [0.3315, 0.6685], 0/30 -> [0, 0.1135], 30/30 ->
    [0.8865, 1]); fractional scores get the seeded bootstrap of the mean, reproducible and about the
    normal approximation's width."""
    for right, lo, hi in ((15, 0.3315, 0.6685), (0, 0.0, 0.1135), (30, 0.8865, 1.0)):
        ci = accuracy_interval([1] * right + [0] * (30 - right))
        assert ci["method"] == "wilson" and ci["accuracy"] == right / 30
        assert abs(ci["lo"] - lo) < 1e-4 and abs(ci["hi"] - hi) < 1e-4, (right, ci)
    rng = np.random.default_rng(seed)
    frac = rng.uniform(0, 1, 400).tolist()
    a, b = accuracy_interval(frac, seed=seed), accuracy_interval(frac, seed=seed)
    assert a == b and a["method"] == "bootstrap" and a["lo"] < a["accuracy"] < a["hi"]
    half = 1.96 * float(np.std(frac)) / np.sqrt(len(frac))
    assert abs((a["hi"] - a["lo"]) / 2 - half) < 0.15 * half
    with pytest.raises(ValueError, match="at least one item"):
        accuracy_interval([])


def test_a_significant_wobble_on_a_near_zero_score_is_not_a_regression(seed) -> None:
    """MRCR's similarity ratios on the sentinel sit near 4%: 16 items each 0.3 points lower are significant and
    below 0.99x the baseline, yet under the 1-point absolute floor (``min_accuracy_drop``); 2 points lower
    fails; thresholds recorded without the key (older bundles) judge by the relative rule alone, as they ran."""
    import random

    rng = random.Random(seed)
    base = [rng.uniform(0.03, 0.06) for _ in range(16)]
    th = Thresholds.from_dict({**TH.as_dict(), "min_accuracy_drop": 0.01})
    _, problems = compare("m", samples(base), samples([b - 0.003 for b in base]), th, 0)
    assert problems == []
    _, problems = compare("m", samples(base), samples([b - 0.02 for b in base]), th, 0)
    assert len(problems) == 1 and "below 0.99x baseline and more than 1.0 pt under it" in problems[0]
    old = Thresholds.from_dict({k: v for k, v in TH.as_dict().items() if k != "min_accuracy_drop"})
    assert old.min_accuracy_drop == 0.0
    _, problems = compare("m", samples(base), samples([b - 0.003 for b in base]), old, 0)
    assert len(problems) == 1 and "below 0.99x baseline" in problems[0]
