"""``likelihood.gold_answers``: the eval items' reference answers teacher-forced through the baseline and the
engine under test, their log-likelihood per answer token compared item-paired (``verify.evals.likelihood``).

For each dataset of ``datasets`` (``gsm8k``, ``aime25``, ``mrcr``; the eval files ``evals.*`` read, found the
same way: ``data_dir``, ``synthetic``, ``$K3_EVAL_DATA_DIR`` or the offline HF cache), the first ``limits[d]``
items: the prompt as the eval task sends it (the chat template over ``evals.utils``' prompt, MRCR's turns)
and the answer ``evals.utils.gold_answer`` gives (the row's ``solution``, else GSM8K's worked answer or
MRCR's prefixed needle; AIME rows without a solution are an ``error`` naming it), then EOS. Each engine
scores them with ``score_chats`` in the evals' batches (``verify.evals.batching``):
the first answer token from the prefill, every later one from a decode step fed the answer's previous
token, so the fast path's decode kernels produce all but one log-probability of every answer.
``mrcr_lengths`` (synthetic data only): one MRCR data set per conversation length, tasks
``likelihood_mrcr_<n>needle@<chars>c``.

Records: the config (datasets, limits, thresholds, seed, model), each data file's SHA-256, one ``sample`` per
item and side (doc, prompt and answer-token hashes, per-token log-probabilities to 6 significant digits and
greedy flags), ``engine_steps`` before and after each side (``gates.served``). Passes iff every task's gates pass and the
engine under test ran decode steps on its fast path where it counts them; ``bundle verify`` re-derives all
of it (``verify.evals.likelihood.rescore``). ``model``: as the ``evals.*`` checks (``sentinel``: the
trained sentinel; its synthetic items must be ones its training kept out). An engine without
``score_chats`` (a server) is ``skipped``, the reason naming it.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from verify.checks.registry import check
from verify.context import CheckContext
from verify.result import CheckResult

DATASETS = ("gsm8k", "aime25", "mrcr")
DEFAULT_LIMITS = {"gsm8k": 300, "aime25": 30, "mrcr": 16}


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _items(dataset: str, source: Any, limit: int, needles: int) -> list[dict[str, Any]]:
    """The first ``limit`` rows of ``source`` as {doc_id, messages, answer, doc_hash, prompt_hash}."""
    from evals import utils
    from evals.data.sources import read_rows

    rows = read_rows(source)
    if dataset == "mrcr":
        rows = [r for r in rows if int(r.get("n_needles", needles)) == needles]
    out = []
    for i, doc in enumerate(rows[:limit]):
        answer = utils.gold_answer(dataset, doc)
        if answer is None:
            raise ValueError(f"{dataset} row {i} has no reference answer to score (an AIME row needs a "
                             f"'solution' field)")
        messages = (utils.expand_conversation([{"role": "user", "content": utils.mrcr_doc_to_text(doc)}])
                    if dataset == "mrcr" else [{"role": "user", "content": utils.PROMPTS[dataset](doc)}])
        out.append({"doc_id": i, "messages": messages, "answer": answer, "doc_hash": _hash(doc),
                    "prompt_hash": _hash(messages)})
    if not out:
        raise ValueError(f"{dataset}: no rows to score in {', '.join(map(str, source.files))}")
    return out


def _bad_limits(limits: Any, datasets: Any) -> str | None:
    if not isinstance(datasets, list) or not datasets or any(d not in DATASETS for d in datasets) \
            or len(set(datasets)) != len(datasets):
        return f"param datasets must be a non-empty list of distinct names among {', '.join(DATASETS)}, got {datasets!r}"
    if not isinstance(limits, dict) or any(k not in DATASETS or isinstance(v, bool) or not isinstance(v, int) or v < 1
                                           for k, v in limits.items()):
        return f"param limits must map dataset names to positive integers, got {limits!r}"
    return None


@check("likelihood.gold_answers",
       "reference answers of the eval items teacher-forced through both engines: log-likelihood per token, paired")
def gold_answers(ctx: CheckContext, datasets: list[str] = list(DATASETS), limits: dict[str, int] | None = None,
                 data_dir: str | None = None, model: str | None = None, mrcr_needles: int = 2,
                 mrcr_lengths: list[int] | None = None, thresholds: str | None = None) -> CheckResult:
    from evals.data.sources import DataError, NoDataError
    from verify.checks.evals import SYNTHETIC, _data_sources, _lengths_error, _scored_model, _training_overlap
    from verify.engines.base import EngineError
    from verify.evals.batching import batched
    from verify.evals.gates import served, served_during
    from verify.evals.likelihood import LikelihoodThresholdsError, compare, headline, load_thresholds
    from verify.model_source import ModelSourceError

    lim = {**DEFAULT_LIMITS, **(limits or {})}
    synthetic = data_dir == SYNTHETIC
    bad = _bad_limits(lim, datasets) or _lengths_error(mrcr_lengths, synthetic, "mrcr_lengths")
    if bad is None and (isinstance(mrcr_needles, bool) or mrcr_needles not in (2, 4, 8)):
        bad = f"param mrcr_needles must be 2, 4 or 8, got {mrcr_needles!r}"
    if bad:
        return CheckResult(id=ctx.check_id, status="error", reason=bad)
    parts = [(d, n) for d in datasets for n in ((mrcr_lengths or [None]) if d == "mrcr" else [None])]
    try:
        th = load_thresholds(thresholds)
        scored, about_model = _scored_model(ctx, model)
        sources, tasks = {}, {}
        for d, n in parts:
            overlap = _training_overlap(about_model, d, ctx.seed, lim[d], synthetic, mrcr_lengths if d == "mrcr" else None)
            if overlap:
                return CheckResult(id=ctx.check_id, status="error", reason=" ".join(overlap.split())[:300])
            _, found = _data_sources(ctx, d, (mrcr_needles,), data_dir, n, lim[d])
            name = f"likelihood_{d}" if d != "mrcr" else f"likelihood_mrcr_{mrcr_needles}needle"
            task = name if n is None else f"{name}@{n}c"
            # described as read: a later dataset's synthetic files are written into the same directory
            sources[task], tasks[task] = found[0].describe(), _items(d, found[0], lim[d], mrcr_needles)
    except NoDataError as e:
        return CheckResult(id=ctx.check_id, status="skipped", reason=" ".join(str(e).split()))
    except (LikelihoodThresholdsError, DataError, ModelSourceError, ValueError) as e:
        return CheckResult(id=ctx.check_id, status="error", reason=" ".join(str(e).split())[:300])
    ctx.record({"type": "config", "datasets": datasets, "tasks": list(tasks), "limits": {d: lim[d] for d in datasets},
                "thresholds": th.as_dict(), "seed": ctx.seed, "mrcr_needles": mrcr_needles,
                "mrcr_lengths": mrcr_lengths, "synthetic_data": synthetic, "model": about_model})
    for task, src in sources.items():
        ctx.record({"type": "data", "task": task, **src})
    try:
        engines = {"baseline": ctx.baseline_engine(scored), "under_test": ctx.engine_under_test(scored)}
    except EngineError as e:
        return CheckResult(id=ctx.check_id, status="error", reason=f"engine unavailable: {e}"[:300])
    missing = [e.name for e in engines.values() if not callable(getattr(e, "score_chats", None))]
    if missing:
        return CheckResult(id=ctx.check_id, status="skipped",
                           reason=f"engine {missing[0]} cannot teacher-force an answer through its decode steps "
                                  f"(score_chats: the builtin engines only)")
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {t: {} for t in tasks}
    steps: list[dict[str, Any]] = []
    for side, engine in engines.items():
        t0, before = time.monotonic(), served(engine.describe())
        for task, items in tasks.items():
            out = samples[task].setdefault(side, [])
            for batch in batched(items, lambda it: sum(len(m["content"]) for m in it["messages"])):
                try:
                    got = engine.score_chats([it["messages"] for it in batch], [it["answer"] for it in batch])
                except EngineError as e:
                    return CheckResult(id=ctx.check_id, status="error",
                                       reason=f"{side} ({engine.name}) {task}: {' '.join(str(e).split())}"[:300])
                for it, s in zip(batch, got, strict=True):
                    rec = {"type": "sample", "task": task, "side": side, "engine": engine.name, "doc_id": it["doc_id"],
                           "doc_hash": it["doc_hash"], "prompt_hash": it["prompt_hash"], "prompt_tokens": s.prompt_tokens,
                           "answer_tokens": len(s.token_ids), "answer_hash": _hash(s.token_ids),
                           "logprobs": [float(f"{x:.6g}") for x in s.logprobs], "greedy": [int(g) for g in s.greedy]}
                    ctx.record(rec)
                    out.append(rec)
        steps.append({"type": "engine_steps", "side": side, "engine": engine.name, "before": before,
                      "after": served(engine.describe())})
        ctx.record(steps[-1])
        ctx.note(f"{side} {engine.name}: {sum(len(v) for v in tasks.values())} answers scored in "
                 f"{time.monotonic() - t0:.1f}s")
    problems: list[str] = []
    per_task: dict[str, Any] = {}
    for task in tasks:
        per_task[task], found = compare(task, samples[task]["baseline"], samples[task]["under_test"], th, ctx.seed)
        problems += found
    served_metrics, found = served_during(steps)
    problems += found
    metrics = headline(per_task) | {"tasks": per_task, "served": served_metrics, "model": about_model,
                                    "engines": {side: e.name for side, e in engines.items()},
                                    "thresholds": th.as_dict()}
    return ctx.verdict(problems, metrics)
