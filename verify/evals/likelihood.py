"""The gold-answer likelihood gate: per-token log-probabilities of reference answers in, statistics and
problems out, and the ``bundle verify`` rescorer that re-derives them from the records.

``likelihood.gold_answers`` (``verify.checks.likelihood``) teacher-forces each item's reference answer
through the baseline and the engine under test (a sample record per item and side: the answer's
``answer_hash``, SHA-256 of its token ids; the ``logprobs`` the engine gave each token, 6 significant
digits; ``greedy``: 1 where the token was the engine's argmax). Greedy accuracy moves only when a bug flips
a token a confident model was sure of; the answers' log-likelihood moves with any change to the
distribution, so a numerics bug that leaves the greedy answers in place can still show.

Per task (``stats``): each side's negative log-likelihood per answer token (``nll``: -sum of log-probs /
tokens, over all items), the difference ``nll_diff`` = under test - baseline, its paired bootstrap interval
over items (``ci``: the ratio of sums recomputed per resample, seeded), its standard error, the share of
answer tokens each side would have chosen greedily, and the items where the engine under test gave the
answer less probability. Gates (``problems``):

1. the same items with the same prompts and the same answer tokens on both sides;
2. no item scored empty, every log-probability finite and <= 0;
3. the answers' likelihood: fails when the interval's lower bound lies above the margin ``max(max_nll_increase,
   max_relative_nll_increase x baseline nll)``: the engine under test is worse by more than a negligible
   amount, significantly. ``detectable_increase`` (metrics) is the increase this sample finds with 80%
   power: the margin plus (z(1 - alpha/2) + z(0.8)) standard errors.

Thresholds: ``likelihood`` in ``evals/thresholds.yaml`` (``load_thresholds``), recorded in the check's
config record; the rescorer judges by the recorded ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verify.evals.gates import ThresholdsError, read_thresholds_file

SIDES = ("baseline", "under_test")
_Z_POWER = 0.8416212335729143  # z(0.8): 80% power


class LikelihoodThresholdsError(ThresholdsError):
    """The ``likelihood`` thresholds are missing or malformed (one line, names the file and key)."""


@dataclass(frozen=True)
class LikelihoodThresholds:
    confidence: float  # two-sided confidence of the paired bootstrap interval of nll_diff
    bootstrap_iters: int
    max_nll_increase: float  # nats per answer token: an increase below it is negligible whatever its significance
    max_relative_nll_increase: float  # ... or below this fraction of the baseline's nll

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LikelihoodThresholds:
        missing = [k for k in cls.__dataclass_fields__ if k not in d]
        if missing:
            raise LikelihoodThresholdsError(f"likelihood thresholds lack {', '.join(missing)}")
        t = cls(**{k: d[k] for k in cls.__dataclass_fields__})
        if not (isinstance(t.confidence, float) and 0 < t.confidence < 1):
            raise LikelihoodThresholdsError(f"likelihood.confidence must be in (0, 1), got {t.confidence!r}")
        if isinstance(t.bootstrap_iters, bool) or not isinstance(t.bootstrap_iters, int) or t.bootstrap_iters < 100:
            raise LikelihoodThresholdsError(f"likelihood.bootstrap_iters must be an integer >= 100, "
                                            f"got {t.bootstrap_iters!r}")
        for k in ("max_nll_increase", "max_relative_nll_increase"):
            v = getattr(t, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise LikelihoodThresholdsError(f"likelihood.{k} must be a number >= 0, got {v!r}")
        return t


def load_thresholds(path: str | Path | None = None) -> LikelihoodThresholds:
    """The ``likelihood`` mapping of ``path`` (default: ``evals/thresholds.yaml``)."""
    try:
        p, doc = read_thresholds_file(path)
    except ThresholdsError as e:
        raise LikelihoodThresholdsError(str(e)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("likelihood"), dict):
        raise LikelihoodThresholdsError(f"{p}: needs a 'likelihood' mapping")
    try:
        return LikelihoodThresholds.from_dict(doc["likelihood"])
    except LikelihoodThresholdsError as e:
        raise LikelihoodThresholdsError(f"{p}: {e}") from None


# ---------------------------------------------------------------- statistics
def _ratio_bootstrap(num: Sequence[float], den: Sequence[float], iters: int, seed: int, confidence: float
                     ) -> tuple[float, float, float]:
    """(lo, hi, standard error) of sum(num) / sum(den) over ``iters`` seeded resamples of the items."""
    import numpy as np

    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    rng = np.random.default_rng(seed)
    out = np.empty(iters, dtype=np.float64)
    for start in range(0, iters, 1000):
        m = min(1000, iters - start)
        idx = rng.integers(0, a.size, size=(m, a.size))
        out[start:start + m] = a[idx].sum(axis=1) / b[idx].sum(axis=1)
    lo, hi = np.quantile(out, [(1 - confidence) / 2, 1 - (1 - confidence) / 2])
    return float(lo), float(hi), float(out.std(ddof=1))


def _z(p: float) -> float:
    """The standard normal quantile (bisection on erf: no scipy)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p else (lo, mid)
    return (lo + hi) / 2


def compare(task: str, base: Sequence[Mapping[str, Any]], test: Sequence[Mapping[str, Any]],
            th: LikelihoodThresholds, seed: int) -> tuple[dict[str, Any], list[str]]:
    """(metrics, problems) for one task's sample records of both sides; problems empty: every gate passed."""
    problems: list[str] = []
    by_b, by_t = {s["doc_id"]: s for s in base}, {s["doc_id"]: s for s in test}
    if len(by_b) != len(base) or len(by_t) != len(test):
        problems.append(f"{task}: a doc_id appears twice on one side")
    if by_b.keys() != by_t.keys():
        problems.append(f"{task}: the sides scored different items (baseline only "
                        f"{sorted(by_b.keys() - by_t.keys())[:5]}, under test only {sorted(by_t.keys() - by_b.keys())[:5]})")
    ids = sorted(by_b.keys() & by_t.keys())
    if not ids:
        return {"items": 0}, problems + [f"{task}: no items scored by both sides"]
    differ = [i for i in ids if (by_b[i]["doc_hash"], by_b[i]["prompt_hash"], by_b[i]["answer_hash"])
              != (by_t[i]["doc_hash"], by_t[i]["prompt_hash"], by_t[i]["answer_hash"])]
    if differ:
        problems.append(f"{task}: {len(differ)} items differ in doc, prompt or answer tokens between the sides "
                        f"(first doc_id {differ[0]}): not a paired comparison")
    bad = [f"{i} ({side})" for i in ids for side, s in (("baseline", by_b[i]), ("under_test", by_t[i]))
           if not s["logprobs"] or len(s["greedy"]) != len(s["logprobs"]) or len(s["logprobs"]) != len(by_b[i]["logprobs"])
           or any(not (isinstance(x, (int, float)) and math.isfinite(x) and x <= 0) for x in s["logprobs"])]
    if bad:
        return {"items": len(ids)}, problems + [f"{task}: {len(bad)} items without one finite log-probability <= 0 "
                                                f"and one greedy flag per answer token (first {bad[0]})"]
    tokens = [len(by_b[i]["logprobs"]) for i in ids]
    lp_b, lp_t = [sum(by_b[i]["logprobs"]) for i in ids], [sum(by_t[i]["logprobs"]) for i in ids]
    n = sum(tokens)
    nll_b, nll_t = -sum(lp_b) / n, -sum(lp_t) / n
    lo, hi, se = _ratio_bootstrap([b - t for b, t in zip(lp_b, lp_t, strict=True)], tokens, th.bootstrap_iters,
                                  seed, th.confidence)
    margin = max(th.max_nll_increase, th.max_relative_nll_increase * nll_b)
    metrics: dict[str, Any] = {
        "items": len(ids), "answer_tokens": n,
        "baseline": {"nll": nll_b, "greedy_rate": sum(sum(map(bool, by_b[i]["greedy"])) for i in ids) / n},
        "under_test": {"nll": nll_t, "greedy_rate": sum(sum(map(bool, by_t[i]["greedy"])) for i in ids) / n},
        "nll_diff": nll_t - nll_b, "ci": {"lo": lo, "hi": hi, "confidence": th.confidence,
                                         "iters": th.bootstrap_iters, "seed": seed},
        "se": se, "margin": margin, "items_worse": sum(t < b for b, t in zip(lp_b, lp_t, strict=True)),
        "detectable_increase": margin + (_z(1 - (1 - th.confidence) / 2) + _Z_POWER) * se,
    }
    if lo > margin:
        problems.append(f"{task}: the answers' negative log-likelihood is {nll_t:.4g} nats a token under test vs "
                        f"{nll_b:.4g} on the baseline ({nll_t - nll_b:+.3g}, {100 * th.confidence:.0f}% CI "
                        f"[{lo:+.3g}, {hi:+.3g}]), above the margin {margin:.3g}")
    metrics["gates_passed"] = not problems
    return metrics, problems


def headline(per_task: Mapping[str, Any]) -> dict[str, Any]:
    """``<task>:<number>`` scalars for people; the rescorer checks them."""
    out: dict[str, Any] = {}
    for task, m in per_task.items():
        if "nll_diff" not in m:
            continue
        out |= {f"{task}:items": m["items"], f"{task}:baseline_nll": m["baseline"]["nll"],
                f"{task}:under_test_nll": m["under_test"]["nll"], f"{task}:nll_diff": m["nll_diff"],
                f"{task}:ci_diff": [m["ci"]["lo"], m["ci"]["hi"]], f"{task}:margin": m["margin"]}
    return out


# ---------------------------------------------------------------- bundle verify
def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def rescore(records: Mapping[str, list], result: Any) -> list[str]:
    """Re-derive a ``likelihood.*`` result from its records: every task's statistics and gates, its
    headline metrics, the fast-path steps each side served (``gates.served_during``) and its status."""
    from verify.evals.gates import served_during

    if result.status in ("skipped", "error"):
        return []
    stream = [r for r in records.get(result.id, []) if isinstance(r, dict)]
    configs = [r for r in stream if r.get("type") == "config"]
    if len(configs) != 1:
        return [f"expected one config record in records/{result.id}.jsonl, found {len(configs)}"]
    try:
        th = LikelihoodThresholds.from_dict(configs[0]["thresholds"])
        seed, tasks = int(configs[0]["seed"]), list(configs[0]["tasks"])
    except (KeyError, TypeError, ValueError) as e:
        return [f"config record unreadable: {e}"]
    by: dict[tuple[str, str], list] = defaultdict(list)
    for r in stream:
        if r.get("type") == "sample":
            by[(str(r.get("task")), str(r.get("side")))].append(r)
    problems: list[str] = []
    if not by:
        return [f"no sample records in records/{result.id}.jsonl: the result is not backed by records"]
    unknown = sorted(k for k in by if k[0] not in tasks or k[1] not in SIDES)
    if unknown:
        problems.append(f"sample records for unplanned task/side {unknown[:3]}")
    gate_problems: list[str] = []
    per_task: dict[str, Any] = {}
    for task in tasks:
        try:
            m, found = compare(task, by.get((task, "baseline"), []), by.get((task, "under_test"), []), th, seed)
        except (KeyError, TypeError) as e:
            problems.append(f"{task}: a sample record lacks {e}")
            continue
        per_task[task] = m
        gate_problems += found
    claimed = result.metrics.get("tasks") if isinstance(result.metrics.get("tasks"), Mapping) else {}
    for task, m in per_task.items():
        for key in ("items", "answer_tokens", "nll_diff", "se", "margin", "items_worse", "gates_passed"):
            if key in m and not _same(m[key], (claimed.get(task) or {}).get(key)):
                problems.append(f"{task}: result says {key}={(claimed.get(task) or {}).get(key)!r}, the records give {m[key]!r}")
    for key, mine in headline(per_task).items():
        if not _same(mine, result.metrics.get(key)):
            problems.append(f"result says {key}={result.metrics.get(key)!r}, the records give {mine!r}")
    steps = [r for r in stream if r.get("type") == "engine_steps"]
    served, found = served_during(steps)
    gate_problems += found
    if result.metrics.get("served") != served:
        problems.append(f"result says served={result.metrics.get('served')!r}, the engine_steps records give {served!r}")
    if result.status == "passed" and gate_problems:
        problems.append(f"result passed but the records fail a gate: {gate_problems[0]}")
    elif result.status == "failed" and not gate_problems:
        problems.append(f"result failed ({result.reason}) but the records pass every gate")
    return problems

