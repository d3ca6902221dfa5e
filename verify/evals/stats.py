"""Paired statistics for fast-path-vs-baseline evals: both sides answer the *same* items in the same run.

Why paired: two engines scored on the same 1,319 GSM8K items differ only where they disagree. An
unpaired comparison of two accuracies treats the shared item difficulty as noise and needs several
points of difference to see anything; the paired tests below look only at the discordant items.

- ``mcnemar_exact(b, c)``: for binary scores. ``b`` items only the baseline got right, ``c`` items only
  the fast path got right. Under "no difference" each discordant item is a fair coin, so
  ``p = min(1, 2 * P[Binom(b + c, 1/2) <= min(b, c)])`` (two-sided, exact; no normal approximation,
  which is poor for the handful of discordant items a near-identical fast path produces).
- ``paired_bootstrap(base, fast)``: for any per-item score (MRCR's SequenceMatcher ratio, AIME's
  per-problem mean over repeats, or 0/1): resample items with replacement, keeping each item's pair
  together, and take percentiles of the mean difference (fast - base). Seeded, so a verifier reproduces
  it exactly.
- ``min_detectable_drop(base, fast, alpha)``: the smallest accuracy drop the paired test detects with
  ``MDE_POWER`` power at this many items, given the sides' observed disagreement (below).
- ``accuracy_interval(scores)``: one side's accuracy with its confidence interval: Wilson's score
  interval for 0/1 item scores (sound at 0% and 100%, where the normal approximation collapses), the
  seeded percentile bootstrap of the mean for fractional ones (MRCR ratios, AIME means over repeats).
- ``per_item_means``: AIME runs each problem ``repeats`` times with sampling; each problem's score is its
  mean over repeats, and those per-problem means are what gets paired (repeats of one problem are not
  independent items).

Pure Python + numpy: the bundle verifier re-derives these offline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class PairedCounts:
    n: int
    both: int  # both sides right
    base_only: int  # baseline right, fast path wrong  (b)
    fast_only: int  # fast path right, baseline wrong  (c)
    neither: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def paired_counts(base: Sequence[float], fast: Sequence[float]) -> PairedCounts:
    """Cross-tab of two binary score lists over the same items (scores must be 0 or 1)."""
    _check_pair(base, fast)
    both = base_only = fast_only = neither = 0
    for b, f in zip(base, fast, strict=True):
        if b not in (0, 1) or f not in (0, 1):
            raise ValueError(f"paired_counts needs 0/1 scores, got {b!r} and {f!r}")
        if b and f:
            both += 1
        elif b:
            base_only += 1
        elif f:
            fast_only += 1
        else:
            neither += 1
    return PairedCounts(len(base), both, base_only, fast_only, neither)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the two discordant counts (1.0 when there are none)."""
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1))  # exact integers; one division at the end
    return min(1.0, 2 * tail / (1 << n))


@dataclass(frozen=True)
class BootstrapCI:
    diff: float  # mean(fast) - mean(base) on the data
    lo: float  # lower percentile of the resampled differences
    hi: float
    confidence: float
    iters: int
    seed: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def paired_bootstrap(base: Sequence[float], fast: Sequence[float], *, iters: int = 10000, seed: int = 0,
                     confidence: float = 0.95, chunk: int = 1000) -> BootstrapCI:
    """Percentile CI of mean(fast - base) from ``iters`` resamples of the items (pairs kept together).

    Resampling draws item indices with ``np.random.default_rng(seed).integers`` in chunks of ``chunk``
    resamples (bounded memory at 1,319 items x 10,000 resamples); the same inputs and seed give the same CI.
    """
    _check_pair(base, fast)
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    if iters < 1:
        raise ValueError("iters must be >= 1")
    d = np.asarray(fast, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    n = d.size
    if n == 0:
        raise ValueError("paired_bootstrap needs at least one item")
    rng = np.random.default_rng(seed)
    means = np.empty(iters, dtype=np.float64)
    for start in range(0, iters, chunk):
        m = min(chunk, iters - start)
        idx = rng.integers(0, n, size=(m, n))
        means[start:start + m] = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return BootstrapCI(float(d.mean()), float(lo), float(hi), confidence, iters, seed)


def accuracy_interval(scores: Sequence[float], *, confidence: float = 0.95, iters: int = 10000,
                      seed: int = 0) -> dict[str, float | str]:
    """One side's mean item score with its ``confidence`` interval (``method``: ``wilson`` for 0/1 scores,
    ``bootstrap`` otherwise: percentiles of the mean over ``iters`` seeded resamples of the items)."""
    from statistics import NormalDist

    n = len(scores)
    if n == 0:
        raise ValueError("accuracy_interval needs at least one item")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    mean = float(sum(scores)) / n
    if is_binary(scores):
        z = NormalDist().inv_cdf(0.5 + confidence / 2)
        centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n))
        lo, hi, method = max(0.0, centre - half), min(1.0, centre + half), "wilson"
    else:
        zeros = [0.0] * n  # the paired bootstrap of (scores - 0): the same seeded resamples
        ci = paired_bootstrap(zeros, scores, iters=iters, seed=seed, confidence=confidence)
        lo, hi, method = ci.lo, ci.hi, "bootstrap"
    return {"accuracy": mean, "lo": float(lo), "hi": float(hi), "confidence": confidence, "method": method}


MDE_POWER = 0.8  # the power a minimum detectable effect is stated at
MDE_TARGET = 0.05  # the drop (accuracy points as a fraction) the tiers aim to detect (issue #19)


def min_detectable_drop(base: Sequence[float], fast: Sequence[float], alpha: float,
                        power: float = MDE_POWER, target: float = MDE_TARGET) -> dict[str, float | int | bool]:
    """The minimum detectable effect of the paired accuracy test on these items.

    Model: the sides disagree on a share ``q = mean |fast - base|`` of each item's score anyway (for 0/1
    scores: the discordant share), and a regression adds a drop ``d`` on top, so the paired difference over
    ``n`` items has mean ``d`` and variance about ``(q + d) / n``. The drop detected with ``power`` at the
    two-sided level ``alpha`` solves ``d = Z sqrt((q + d) / n)``, ``Z = z(1 - alpha/2) + z(power)``:
    ``d = (Z^2 + sqrt(Z^4 + 4 n Z^2 q)) / (2 n)``. With the sides in full agreement (``q = 0``) it is
    ``Z^2 / n`` (7.85 / n at alpha 0.05: 26 points at 30 items, 0.6 at GSM8K's 1,319), close to what the
    exact McNemar needs (6 one-sided flips at alpha 0.05). Returns ``mde`` (as a fraction),
    ``discordance`` q, ``items`` n, ``items_for_target`` (n at which ``target`` would be the MDE at this q),
    ``detects_target`` and the ``alpha``/``power``/``target`` it was computed at."""
    from statistics import NormalDist

    _check_pair(base, fast)
    n = len(base)
    q = sum(abs(f - b) for b, f in zip(base, fast, strict=True)) / n
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    d = (z * z + math.sqrt(z ** 4 + 4 * n * z * z * q)) / (2 * n)
    need = math.ceil(z * z * (q + target) / (target * target))
    return {"mde": d, "discordance": q, "items": n, "items_for_target": need, "detects_target": d <= target,
            "alpha": alpha, "power": power, "target": target}


def per_item_means(scores_per_item: Sequence[Sequence[float]]) -> list[float]:
    """Each item's mean score over its repeats (AIME: one problem sampled ``repeats`` times)."""
    out = []
    for i, reps in enumerate(scores_per_item):
        if len(reps) == 0:
            raise ValueError(f"item {i} has no scored repeats")
        out.append(float(sum(reps)) / len(reps))
    return out


def is_binary(scores: Sequence[float]) -> bool:
    return all(s in (0, 1) for s in scores)


def _check_pair(base: Sequence[float], fast: Sequence[float]) -> None:
    if len(base) != len(fast):
        raise ValueError(f"paired scores need the same items: {len(base)} baseline vs {len(fast)} fast-path scores")
