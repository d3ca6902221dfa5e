"""Gates for fast-path-vs-baseline evals: per-sample records in, metrics and problems out.

``compare(task, baseline_samples, fast_samples, thresholds, seed)`` is the one function that turns the
records of one lm-eval task (both sides) into the numbers a check reports and the reasons it fails. The
check calls it while running; the bundle rescorer calls it again on the re-scored records, so the
verdict a maintainer sees is re-derived, not trusted.

A sample record (written by ``verify.evals.runner``) holds per repeat: ``scores``, ``extraction_failed``,
``truncated`` (hit max_tokens), ``output_tokens``; and the item's ``doc_id``, ``doc_hash``, ``prompt_hash``.
An item's score is the mean over its repeats (AIME) or its single score.

Gates, thresholds from ``evals/thresholds.yaml`` (each explained there):
1. same items: both sides answered the same docs with the same prompts (hash for hash);
2. accuracy: fail only if the fast path is worse, the paired test says significant at ``alpha``
   (exact McNemar when every item score is 0/1, else the paired bootstrap CI excludes 0), the fast
   path's accuracy is below ``min_relative_accuracy`` x baseline, and it is more than ``min_accuracy_drop``
   (absolute) below it;
3. output length: mean output tokens within ``max_relative_length_change`` of the baseline's;
4. truncation and 5. extraction failures: each side's rate at most ``max_rate``; the fast path's may
   exceed the baseline's by more than ``max_increase`` only if the increase is not significant (exact
   McNemar at ``alpha`` over the responses paired by item and repeat; ``increase_test: mcnemar``), so that at 20 items one response
   that stops early on one side (5 points) is not a failure while a decode loop that misses EOS is.

Every task's metrics also carry ``mde``: the smallest accuracy drop the paired test detects at its
sample size (``stats.min_detectable_drop``), and whether a 5-point drop is within reach; and each side's
``accuracy_ci``: its accuracy's interval at ``bootstrap_confidence`` (``stats.accuracy_interval``: Wilson
for 0/1 items, the seeded bootstrap otherwise), no gate rests on it.

6. the fast path served the engine under test: an engine whose description counts fast-path steps (a
   builtin fast engine's trace, ``served``) must have run at least one step on it during the check, from the
   ``engine_steps`` records the check writes before and after each side (``served_during``); an engine that
   counts none (the reference path, a server) is not held to it. Each side's steps, fallbacks by reason and
   a planted defect's changed calls go to the metrics (``served``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verify.evals.stats import (
    accuracy_interval,
    is_binary,
    mcnemar_exact,
    min_detectable_drop,
    paired_bootstrap,
    paired_counts,
)


def default_thresholds_path() -> Path:
    import evals

    return Path(list(evals.__path__)[0]) / "thresholds.yaml"


class ThresholdsError(ValueError):
    """thresholds.yaml is missing, malformed, or lacks a key (one line, names the file and key)."""


INCREASE_TESTS = ("mcnemar", "none")


@dataclass(frozen=True)
class Thresholds:
    alpha: float
    min_relative_accuracy: float
    max_relative_length_change: float
    truncation_max_rate: float
    truncation_max_increase: float
    extraction_max_rate: float
    extraction_max_increase: float
    bootstrap_iters: int
    bootstrap_confidence: float
    # "mcnemar": an increase in truncation / extraction failures above ``max_increase`` fails only when the
    # paired test says it is significant at ``alpha`` (gate 4); "none": it fails as soon as it is above
    # ``max_increase``, the rule of bundles whose recorded thresholds lack this key (written before
    # 2026-12-01 22:00 UTC), so their verdicts re-derive by the rule they ran under
    increase_test: str = "none"
    # a drop of at most this much (absolute accuracy) never fails: without it a near-zero score (MRCR's
    # similarity ratios on the sentinel, ~4%) fails the relative rule on a 0.4-point wobble; 0 in bundles whose
    # recorded thresholds lack the key (written before 2026-12-07 16:00 UTC), the rule they ran under
    min_accuracy_drop: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Thresholds:
        missing = [k for k in cls.__dataclass_fields__ if k not in d and k not in ("increase_test", "min_accuracy_drop")]
        if missing:
            raise ThresholdsError(f"thresholds lack {', '.join(missing)}")
        t = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        t._validate()
        return t

    def _validate(self) -> None:
        for k in ("alpha", "bootstrap_confidence"):
            if not 0 < getattr(self, k) < 1:
                raise ThresholdsError(f"thresholds: {k} must be in (0, 1), got {getattr(self, k)!r}")
        for k in ("min_relative_accuracy", "min_accuracy_drop", "max_relative_length_change", "truncation_max_rate",
                  "truncation_max_increase", "extraction_max_rate", "extraction_max_increase"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ThresholdsError(f"thresholds: {k} must be a number >= 0, got {v!r}")
        if self.increase_test not in INCREASE_TESTS:
            raise ThresholdsError(f"thresholds: increase_test must be one of {', '.join(INCREASE_TESTS)}, "
                                  f"got {self.increase_test!r}")
        if not isinstance(self.bootstrap_iters, int) or self.bootstrap_iters < 100:
            raise ThresholdsError(f"thresholds: bootstrap.iters must be an integer >= 100, got {self.bootstrap_iters!r}")


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def read_thresholds_file(path: str | Path | None = None) -> tuple[Path, Any]:
    """(the file, its parsed YAML): ``path`` (a relative one not found here: the repository's file), default
    ``evals/thresholds.yaml``; ``ThresholdsError`` when it cannot be read or parsed."""
    import yaml

    p = Path(path) if path else default_thresholds_path()
    if not p.is_absolute() and not p.exists():  # a tier's path names a file of the repository
        p = Path(__file__).resolve().parents[2] / p
    try:
        return p, yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ThresholdsError(f"cannot read eval thresholds {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ThresholdsError(f"{p}: not valid YAML ({' '.join(str(e).split())[:120]})") from None


def load_thresholds(dataset: str, path: str | Path | None = None) -> Thresholds:
    """The thresholds for ``dataset`` (gsm8k, aime25, mrcr): ``defaults`` with ``tasks.<dataset>`` merged in."""
    p, doc = read_thresholds_file(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("defaults"), dict):
        raise ThresholdsError(f"{p}: needs a 'defaults' mapping")
    merged = _merge(doc["defaults"], (doc.get("tasks") or {}).get(dataset) or {})
    try:
        flat = {"alpha": merged["alpha"], "min_relative_accuracy": merged["min_relative_accuracy"],
                "max_relative_length_change": merged["max_relative_length_change"],
                "truncation_max_rate": merged["truncation"]["max_rate"],
                "truncation_max_increase": merged["truncation"]["max_increase"],
                "extraction_max_rate": merged["extraction_failure"]["max_rate"],
                "extraction_max_increase": merged["extraction_failure"]["max_increase"],
                "bootstrap_iters": merged["bootstrap"]["iters"],
                "bootstrap_confidence": merged["bootstrap"]["confidence"],
                "increase_test": merged["increase_test"], "min_accuracy_drop": merged["min_accuracy_drop"]}
    except (KeyError, TypeError) as e:
        raise ThresholdsError(f"{p}: missing key {e} (in defaults or tasks.{dataset})") from None
    try:
        return Thresholds.from_dict(flat)
    except ThresholdsError as e:
        raise ThresholdsError(f"{p}: {e}") from None


# ---------------------------------------------------------------- summaries
@dataclass(frozen=True)
class SideSummary:
    items: int
    responses: int
    accuracy: float  # mean of per-item scores
    mean_output_tokens: float | None  # None when a response's length is unknown
    truncation_rate: float
    extraction_failure_rate: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def item_score(sample: Mapping[str, Any]) -> float:
    scores = sample["scores"]
    if not scores:
        raise ValueError(f"doc {sample.get('doc_id')}: no scored responses")
    return float(sum(scores)) / len(scores)


def summarize(samples: Sequence[Mapping[str, Any]]) -> SideSummary:
    if not samples:
        raise ValueError("no samples")
    responses = [(s, i) for s in samples for i in range(len(s["scores"]))]
    lengths = [s["output_tokens"][i] for s, i in responses]
    return SideSummary(
        items=len(samples), responses=len(responses),
        accuracy=sum(item_score(s) for s in samples) / len(samples),
        mean_output_tokens=None if any(n is None for n in lengths) else sum(lengths) / len(lengths),
        truncation_rate=sum(bool(s["truncated"][i]) for s, i in responses) / len(responses),
        extraction_failure_rate=sum(bool(s["extraction_failed"][i]) for s, i in responses) / len(responses),
    )


# ---------------------------------------------------------------- the comparison
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _paired_flags(base: Sequence[Mapping[str, Any]], fast: Sequence[Mapping[str, Any]],
                  key: str) -> tuple[list[int], list[int]]:
    """0/1 ``key`` flags (``truncated``, ``extraction_failed``) of the responses both sides gave to the same
    item and repeat, as two aligned lists."""
    b_out: list[int] = []
    f_out: list[int] = []
    for b, f in zip(base, fast, strict=True):
        for fb, ff in zip(b[key], f[key], strict=False):
            b_out.append(int(bool(fb)))
            f_out.append(int(bool(ff)))
    return b_out, f_out


def compare(task: str, base: Sequence[Mapping[str, Any]], fast: Sequence[Mapping[str, Any]], th: Thresholds,
            seed: int) -> tuple[dict[str, Any], list[str]]:
    """(metrics, problems) for one task; problems empty means every gate passed."""
    problems: list[str] = []
    by_doc_b = {s["doc_id"]: s for s in base}
    by_doc_f = {s["doc_id"]: s for s in fast}
    if len(by_doc_b) != len(base) or len(by_doc_f) != len(fast):
        problems.append(f"{task}: a doc_id appears twice on one side")
    if by_doc_b.keys() != by_doc_f.keys():
        only_b = sorted(by_doc_b.keys() - by_doc_f.keys())[:5]
        only_f = sorted(by_doc_f.keys() - by_doc_b.keys())[:5]
        problems.append(f"{task}: the sides answered different items (baseline only {only_b}, fast only {only_f})")
    ids = sorted(by_doc_b.keys() & by_doc_f.keys())
    if not ids:
        return {"items": 0}, problems + [f"{task}: no items answered by both sides"]
    mismatched = [i for i in ids if (by_doc_b[i]["doc_hash"], by_doc_b[i]["prompt_hash"])
                  != (by_doc_f[i]["doc_hash"], by_doc_f[i]["prompt_hash"])]
    if mismatched:
        problems.append(f"{task}: {len(mismatched)} items differ in doc or prompt between the sides "
                        f"(first doc_id {mismatched[0]}): not a paired comparison")
    b_items, f_items = [by_doc_b[i] for i in ids], [by_doc_f[i] for i in ids]
    sb, sf = summarize(b_items), summarize(f_items)
    b_scores, f_scores = [item_score(s) for s in b_items], [item_score(s) for s in f_items]
    ci = paired_bootstrap(b_scores, f_scores, iters=th.bootstrap_iters, seed=seed, confidence=th.bootstrap_confidence)
    intervals = {side: accuracy_interval(scores, confidence=th.bootstrap_confidence, iters=th.bootstrap_iters,
                                         seed=seed)
                 for side, scores in (("baseline", b_scores), ("under_test", f_scores))}
    metrics: dict[str, Any] = {"items": len(ids), "baseline": {**sb.as_dict(), "accuracy_ci": intervals["baseline"]},
                               "under_test": {**sf.as_dict(), "accuracy_ci": intervals["under_test"]},
                               "accuracy_diff": sf.accuracy - sb.accuracy, "bootstrap": ci.as_dict(),
                               "mde": min_detectable_drop(b_scores, f_scores, th.alpha)}
    binary = is_binary(b_scores) and is_binary(f_scores)
    if binary:
        counts = paired_counts(b_scores, f_scores)
        p = mcnemar_exact(counts.base_only, counts.fast_only)
        metrics.update(test="mcnemar_exact", p_value=p, discordant=counts.as_dict())
        significant = p < th.alpha
    else:
        metrics.update(test="paired_bootstrap", p_value=None)
        significant = ci.hi < 0 or ci.lo > 0
    metrics["significant"] = significant
    rel = sf.accuracy / sb.accuracy if sb.accuracy > 0 else None
    metrics["relative_accuracy"] = rel
    if (sf.accuracy < sb.accuracy - th.min_accuracy_drop and significant
            and (rel is None or rel < th.min_relative_accuracy)):
        how = (f"McNemar p={p:.3g} < {th.alpha}" if binary else
               f"{100 * ci.confidence:.0f}% paired bootstrap CI [{100 * ci.lo:+.1f}, {100 * ci.hi:+.1f}] pt excludes 0")
        problems.append(f"{task}: accuracy {sf.accuracy:.3f} vs baseline {sb.accuracy:.3f} "
                        f"({100 * (sf.accuracy - sb.accuracy):+.1f} pt), {how}, below {th.min_relative_accuracy}x baseline"
                        f"{f' and more than {100 * th.min_accuracy_drop:.1f} pt under it' if th.min_accuracy_drop else ''}")
    # output length
    if sb.mean_output_tokens is None or sf.mean_output_tokens is None:
        metrics["length_ratio"] = None
        problems.append(f"{task}: output lengths unknown for some responses: the length gate cannot be judged")
    else:
        ratio = (sf.mean_output_tokens / sb.mean_output_tokens if sb.mean_output_tokens > 0
                 else (1.0 if sf.mean_output_tokens == 0 else None))
        metrics["length_ratio"] = ratio
        if ratio is None or abs(ratio - 1) > th.max_relative_length_change:
            problems.append(f"{task}: mean output {sf.mean_output_tokens:.1f} tokens vs baseline "
                            f"{sb.mean_output_tokens:.1f}: outside +-{100 * th.max_relative_length_change:.0f}%")
    # truncation and extraction failures
    for what, attr, flag, max_rate, max_inc in (
            ("truncation (hit max_tokens)", "truncation_rate", "truncated", th.truncation_max_rate,
             th.truncation_max_increase),
            ("answer-extraction failure", "extraction_failure_rate", "extraction_failed", th.extraction_max_rate,
             th.extraction_max_increase)):
        rb, rf = getattr(sb, attr), getattr(sf, attr)
        for side, r in (("baseline", rb), ("under test", rf)):
            if r > max_rate:
                problems.append(f"{task}: {what} rate {_pct(r)} on the {side} side, over {_pct(max_rate)}")
        counts = paired_counts(*_paired_flags(b_items, f_items, flag))
        p_inc = mcnemar_exact(counts.base_only, counts.fast_only)
        metrics[f"{attr.removesuffix('_rate')}_test"] = {"discordant": counts.as_dict(), "p_value": p_inc}
        significant_inc = th.increase_test == "none" or (counts.fast_only > counts.base_only and p_inc < th.alpha)
        if rf - rb > max_inc and significant_inc:
            how = ("" if th.increase_test == "none" else
                   f", McNemar p={p_inc:.3g} < {th.alpha} ({counts.fast_only} responses on the fast side only, "
                   f"{counts.base_only} on the baseline only)")
            problems.append(f"{task}: {what} rate {_pct(rf)} vs baseline {_pct(rb)}: up more than {_pct(max_inc)}{how}")
    metrics["gates_passed"] = not problems
    return metrics, problems


def headline(per_task: dict[str, Any]) -> dict[str, Any]:
    """``<task>:<number>`` scalars for people (accuracies, difference, p-value, items); the rescorer checks them."""
    out: dict[str, Any] = {}
    for task, m in per_task.items():
        if not m.get("items"):
            continue
        out[f"{task}:items"] = m["items"]
        out[f"{task}:baseline_accuracy"] = m["baseline"]["accuracy"]
        out[f"{task}:under_test_accuracy"] = m["under_test"]["accuracy"]
        for side in ("baseline", "under_test"):  # each side's accuracy interval (results before it: absent)
            if "accuracy_ci" in m[side]:
                out[f"{task}:{side}_accuracy_ci"] = [m[side]["accuracy_ci"]["lo"], m[side]["accuracy_ci"]["hi"]]
        out[f"{task}:accuracy_diff"] = m["accuracy_diff"]
        out[f"{task}:p_value"] = m["p_value"]  # None for the bootstrap-only (fractional) scores
        out[f"{task}:ci_diff"] = [m["bootstrap"]["lo"], m["bootstrap"]["hi"]]  # paired bootstrap bounds
        out[f"{task}:mde"] = m["mde"]["mde"]  # the drop detected with 80% power at these items
    return out


def served(description: Mapping[str, Any]) -> dict[str, Any]:
    """What an engine's description counts of the steps it has served so far: a builtin engine's fast-path
    trace totals (``steps``, ``fast_steps``, ``fallback_steps``, ``fallbacks`` by reason) and a planted
    defect's changed calls (``planted_defect_calls``: eager calls and captures; graph replays are not
    counted); {} for an engine that counts neither."""
    out: dict[str, Any] = {}
    trace = description.get("fast_path_trace")
    if isinstance(trace, Mapping):
        out = {k: int(trace.get(k) or 0) for k in ("steps", "fast_steps", "fallback_steps")}
        out["fallbacks"] = {str(k): int(v) for k, v in (trace.get("fallbacks") or {}).items()}
    defect = description.get("planted_defect")
    if isinstance(defect, Mapping):
        out["planted_defect_calls"] = defect.get("calls")
    return out


def served_during(records: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """Per side, the steps its engine served during one check (``after`` - ``before`` of its ``engine_steps``
    record; None for an engine that counts no fast-path steps), and the problems: an engine under test that
    counts them but ran none on the fast path here."""
    metrics: dict[str, Any] = {}
    problems: list[str] = []
    for r in records:
        side, before, after = r.get("side"), r.get("before") or {}, r.get("after") or {}
        if "fast_steps" not in after:
            metrics[str(side)] = None
            continue
        m: dict[str, Any] = {k: int(after.get(k) or 0) - int(before.get(k) or 0)
                             for k in ("steps", "fast_steps", "fallback_steps")}
        was = before.get("fallbacks") or {}
        grew = {k: int(v) - int(was.get(k) or 0) for k, v in (after.get("fallbacks") or {}).items()}
        m["fallbacks"] = {k: n for k, n in grew.items() if n > 0}
        if "planted_defect_calls" in after:
            m["planted_defect_calls"] = after["planted_defect_calls"]
        metrics[str(side)] = m
        if side == "under_test" and m["fast_steps"] <= 0:
            why = "; ".join(f"{k} x{v}" for k, v in sorted(m["fallbacks"].items()))
            problems.append(f"under_test ({r.get('engine')}): no step ran on the fast path during this check "
                            f"({m['fallback_steps']} fell back{': ' + why if why else ''})")
    return metrics, problems
