"""``bundle verify`` rescorer for ``evals.*`` results: re-score every sample, re-derive every gate.

A maintainer should trust the records, not the summary. For each eval result this:
1. re-scores every recorded response with ``evals.utils`` against the recorded target fields and
   compares with the recorded per-response scores and extraction failures (an edited score fails);
2. recomputes, per task, both sides' accuracy, the paired statistics and every gate with
   ``verify.evals.gates.compare``, using the thresholds and seed the run recorded;
3. compares that with the result: its status (passed iff no gate failed) and its metrics (accuracies,
   p-value, bootstrap bounds, rates, length ratio);
4. re-derives from the ``engine_steps`` records the steps each side served on the fast path and its gate
   (``gates.served_during``) and compares them with the result's ``served`` (results written before those
   records: neither).

Registered for the prefix ``evals.`` on import (``k3-verify bundle verify`` imports this module).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from evals.utils import SCORERS
from verify.evals.gates import Thresholds, compare, headline, served_during

SIDES = ("baseline", "under_test")
_CI_KEYS = tuple((side, "accuracy_ci", end) for side in SIDES for end in ("lo", "hi"))  # each side's interval
_KEYS = (("items",), ("baseline", "accuracy"), ("under_test", "accuracy"), ("accuracy_diff",), ("p_value",),
         ("bootstrap", "lo"), ("bootstrap", "hi"), ("length_ratio",), ("baseline", "truncation_rate"),
         ("under_test", "truncation_rate"), ("baseline", "extraction_failure_rate"),
         ("under_test", "extraction_failure_rate"), ("mde", "mde"), ("mde", "items_for_target"), ("gates_passed",),
         *_CI_KEYS)
# informational metrics that results written before them do not carry (no verdict rests on them): checked
# whenever a result claims them; per task, and as headline scalars ``<task>:<name>``
_SINCE_LATER = {("mde", "mde"), ("mde", "items_for_target"), *_CI_KEYS}
_HEADLINE_SINCE_LATER = {"mde", "baseline_accuracy_ci", "under_test_accuracy_ci"}


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, Mapping) or k not in d:
            return _MISSING
        d = d[k]
    return d


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def rescore_samples(samples: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Samples with scores and extraction failures recomputed from their responses; problems where the
    recorded values disagree."""
    problems: list[str] = []
    out = []
    for s in samples:
        where = f"{s.get('task')} doc {s.get('doc_id')} ({s.get('side')})"
        n = len(s["responses"])
        lens = {k: len(s[k]) for k in ("scores", "extraction_failed", "truncated", "output_tokens")}
        if any(v != n for v in lens.values()):
            problems.append(f"{where}: {n} responses but per-response fields of lengths {lens}")
            continue
        scored = [SCORERS[s["dataset"]](r, s["target"]) for r in s["responses"]]
        scores = [x["score"] for x in scored]
        failed = [bool(x["extraction_failed"]) for x in scored]
        if any(not _same(float(a), float(b)) for a, b in zip(scores, s["scores"], strict=True)):
            problems.append(f"{where}: recorded scores {s['scores']} but the responses re-score to {scores}")
        if failed != [bool(x) for x in s["extraction_failed"]]:
            problems.append(f"{where}: recorded extraction failures {s['extraction_failed']} but re-scoring gives {failed}")
        out.append({**s, "scores": scores, "extraction_failed": failed})
    return out, problems


def rescore_eval(records: Mapping[str, list], result: Any) -> list[str]:
    if result.status in ("skipped", "error"):
        return []  # nothing was claimed
    stream = records.get(result.id, [])
    configs = [r for r in stream if isinstance(r, dict) and r.get("type") == "config"]
    samples = [r for r in stream if isinstance(r, dict) and r.get("type") == "sample"]
    if len(configs) != 1:
        return [f"expected one config record in records/{result.id}.jsonl, found {len(configs)}"]
    if not samples:
        return [f"no sample records in records/{result.id}.jsonl: the result is not backed by records"]
    cfg = configs[0]
    try:
        th = Thresholds.from_dict(cfg["thresholds"])
        seed = int(cfg["seed"])
        tasks = list(cfg["tasks"])
    except (KeyError, TypeError, ValueError) as e:
        return [f"config record unreadable: {e}"]
    samples, problems = rescore_samples(samples)
    by = defaultdict(list)
    for s in samples:
        by[(s["task"], s.get("side"))].append(s)
    unknown = sorted({k for k in by if k[0] not in tasks or k[1] not in SIDES})
    if unknown:
        problems.append(f"sample records for unplanned task/side {unknown[:3]}")
    gate_problems: list[str] = []
    recomputed_tasks: dict[str, dict[str, Any]] = {}
    task_metrics = result.metrics.get("tasks") if isinstance(result.metrics.get("tasks"), Mapping) else {}
    for task in tasks:
        base, fast = by.get((task, "baseline"), []), by.get((task, "under_test"), [])
        if not base or not fast:
            problems.append(f"{task}: samples missing for {'baseline' if not base else 'under_test'}")
            continue
        metrics, found = compare(task, base, fast, th, seed)
        recomputed_tasks[task] = metrics
        gate_problems += found
        claimed = task_metrics.get(task)
        if not isinstance(claimed, Mapping):
            problems.append(f"{task}: the result has no metrics for this task")
            continue
        for path in _KEYS:
            mine, theirs = _get(metrics, path), _get(claimed, path)
            if (mine is _MISSING and theirs is _MISSING) or (theirs is _MISSING and path in _SINCE_LATER):
                continue
            if not _same(mine, theirs):
                problems.append(f"{task}: result says {'.'.join(path)}={theirs!r}, the records give {mine!r}")
    recomputed = headline(recomputed_tasks)
    for key, mine in recomputed.items():
        theirs = result.metrics.get(key, _MISSING)
        if theirs is _MISSING and key.rpartition(":")[2] in _HEADLINE_SINCE_LATER:
            continue
        if theirs is _MISSING:
            problems.append(f"the result lacks the metric {key}")
        elif isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
            if not all(_same(a, b) for a, b in zip(mine, theirs, strict=True)):
                problems.append(f"result says {key}={theirs!r}, the records give {mine!r}")
        elif not _same(mine, theirs):
            problems.append(f"result says {key}={theirs!r}, the records give {mine!r}")
    steps = [r for r in stream if isinstance(r, dict) and r.get("type") == "engine_steps"]
    if steps or "served" in result.metrics:
        served, found = served_during(steps)
        gate_problems += found
        if result.metrics.get("served") != served:
            problems.append(f"result says served={result.metrics.get('served')!r}, the engine_steps records give "
                            f"{served!r}")
    if result.status == "passed" and gate_problems:
        problems.append(f"result passed but the records fail a gate: {gate_problems[0]}")
    elif result.status == "failed" and not gate_problems:
        problems.append(f"result failed ({result.reason}) but the records pass every gate")
    return problems

