"""Eval checks: GSM8K, AIME25, MRCR through lm-eval, the engine under test vs the baseline, same run.

``evals.gsm8k`` / ``evals.aime25`` / ``evals.mrcr`` each:
1. load the gates for the dataset from ``evals/thresholds.yaml`` (or the ``thresholds`` param);
2. find the data (``data_dir``, ``$K3_EVAL_DATA_DIR``, or the offline HF cache; ``data_dir: synthetic``
   generates the seeded stand-ins of ``evals.data.make_synthetic`` into the run's temp dir) and record
   every file's SHA-256;
3. run the lm-eval task(s) on ``ctx.baseline_engine()`` and then ``ctx.engine_under_test()`` with the same
   limit, max_tokens, repeats and seeds; every sample of both sides goes to ``records/<check id>.jsonl``;
4. per task, pair the sides item by item (``verify.evals.gates.compare``: McNemar / paired bootstrap,
   output length, truncation, extraction failures) and record the statistics;
5. pass iff every gate of every task passed; the metrics carry each task's numbers, and ``bundle verify``
   re-derives all of it from the records (``verify.evals.rescore``).

``model``: None scores the run's model; ``sentinel`` the trained sentinel checkpoint
(``k3_fastpath.sentinel.checkpoint.sentinel_dir()``), a directory that checkpoint: read and validated like
``--checkpoint``, served by the run's builtin engines, named (path, digest, training record) in the records
and metrics. No data given and none on this machine, or no sentinel trained here: ``skipped``, the reason
naming the command that provides it.
Unreadable data, a bad thresholds file or bad params are ``error`` results with a one-line reason.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from verify.checks.registry import check
from verify.context import CheckContext
from verify.result import CheckResult

SYNTHETIC = "synthetic"
SENTINEL = "sentinel"  # `model: sentinel`: score k3_fastpath.sentinel's trained checkpoint (sentinel_dir())


@check("evals.gsm8k",
       "GSM8K through lm-eval, engine under test vs baseline in the same run (paired: McNemar, bootstrap)",
       imports=("lm_eval",))
def gsm8k(ctx: CheckContext, limit: int | None = None, max_tokens: int | None = None, data_dir: str | None = None,
          thresholds: str | None = None, model: str | None = None) -> CheckResult:
    return _run(ctx, "gsm8k", limit=limit, repeats=None, needles=(), max_tokens=max_tokens, data_dir=data_dir,
                thresholds=thresholds, model=model)


@check("evals.aime25",
       "AIME25 through lm-eval with sampled repeats, per-problem means paired (bootstrap) vs baseline",
       imports=("lm_eval",))
def aime25(ctx: CheckContext, limit: int | None = None, repeats: int = 8, max_tokens: int | None = None,
           data_dir: str | None = None, thresholds: str | None = None, model: str | None = None) -> CheckResult:
    return _run(ctx, "aime25", limit=limit, repeats=repeats, needles=(), max_tokens=max_tokens, data_dir=data_dir,
                thresholds=thresholds, model=model)


@check("evals.mrcr",
       "MRCR 2/4/8 needles through lm-eval (prefix + SequenceMatcher), paired bootstrap vs baseline",
       imports=("lm_eval",))
def mrcr(ctx: CheckContext, limit: int | None = None, needles: list[int] = [2, 4, 8],
         max_tokens: int | None = None, data_dir: str | None = None, thresholds: str | None = None,
         model: str | None = None) -> CheckResult:
    return _run(ctx, "mrcr", limit=limit, repeats=None, needles=tuple(needles), max_tokens=max_tokens,
                data_dir=data_dir, thresholds=thresholds, model=model)


def _error(ctx: CheckContext, reason: str) -> CheckResult:
    return CheckResult(id=ctx.check_id, status="error", reason=" ".join(reason.split())[:300])


def _positive_int(name: str, value: Any, allow_none: bool = True) -> str | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"param {name} must be a positive integer{' or null' if allow_none else ''}, got {value!r}"
    return None


def _data_sources(ctx: CheckContext, dataset: str, needles: tuple[int, ...], data_dir: str | None):
    from evals.data.sources import kind_for, resolve

    if data_dir == SYNTHETIC:
        from evals.data.make_synthetic import make_all

        out = Path(ctx.tmp_dir) / f"eval-data-{ctx.check_id}"
        make_all(out, seed=ctx.seed)
        data_dir = str(out)
    kinds = [kind_for(dataset, n) for n in needles] if dataset == "mrcr" else [kind_for(dataset)]
    return data_dir, [resolve(k, data_dir) for k in kinds]


def _scored_model(ctx: CheckContext, model: str | None) -> tuple[Any, dict[str, Any]]:
    """The checkpoint the evals score instead of the run's model (``model``: ``sentinel`` or a checkpoint
    directory; None: the run's own), and what the bundle says about the model scored. Raises ``NoDataError``
    (skipped) for a sentinel not trained here, ``ModelSourceError`` for a checkpoint that does not load."""
    if model is None:
        return None, {"scored": "run", "weights": ctx.weights()}
    from evals.data.sources import NoDataError
    from k3_fastpath.sentinel.checkpoint import missing_reason, sentinel_dir
    from verify.model_source import read_checkpoint

    root = sentinel_dir() if model == SENTINEL else Path(model).expanduser()
    why = missing_reason(root) if model == SENTINEL else None
    if why:
        raise NoDataError(why)
    # read and validated once per run when the run's engine pool holds it (the three evals share it)
    source = (ctx.engines.checkpoint if ctx.engines is not None else read_checkpoint)(root)
    about: dict[str, Any] = {"scored": model, "path": source.path, "name": source.name, "digest": source.digest}
    training = root / "training.json"
    if training.is_file():  # how it was trained (the sentinel's record: plan, seeds, steps, its digest then)
        import json

        rec = json.loads(training.read_text())
        about["training"] = {k: rec.get(k) for k in ("plan", "steps_done", "train_s", "device", "torch",
                                                     "checkpoint_digest")}
        about["digest_matches_training"] = rec.get("checkpoint_digest") == source.digest
    return source, about


def _run(ctx: CheckContext, dataset: str, *, limit: int | None, repeats: int | None, needles: tuple[int, ...],
         max_tokens: int | None, data_dir: str | None, thresholds: str | None, model: str | None) -> CheckResult:
    from evals.data.sources import DataError, NoDataError
    from verify.engines.base import EngineError
    from verify.evals.gates import ThresholdsError, compare, headline, load_thresholds
    from verify.evals.lm_adapter import EvalRunError
    from verify.evals.runner import run_tasks, task_names
    from verify.model_source import ModelSourceError

    bad = [p for p in (_positive_int("limit", limit), _positive_int("max_tokens", max_tokens),
                       _positive_int("repeats", repeats)) if p]
    if bad:
        return _error(ctx, bad[0])
    synthetic = data_dir == SYNTHETIC
    try:
        tasks = task_names(dataset, needles) if dataset == "mrcr" else task_names(dataset)
        th = load_thresholds(dataset, thresholds)
        data_dir, sources = _data_sources(ctx, dataset, needles, data_dir)
        scored, about_model = _scored_model(ctx, model)
    except NoDataError as e:  # nothing to score here: skipped with the whole reason, never cut short
        return CheckResult(id=ctx.check_id, status="skipped", reason=" ".join(str(e).split()))
    except (ThresholdsError, DataError, EvalRunError, ModelSourceError) as e:
        return _error(ctx, str(e))
    data = [src.describe() for src in sources]
    ctx.record({"type": "config", "dataset": dataset, "tasks": tasks, "thresholds": th.as_dict(), "seed": ctx.seed,
                "limit": limit, "repeats": repeats, "max_tokens": max_tokens, "data_dir": data_dir,
                "synthetic_data": synthetic, "model": about_model})
    for d in data:
        ctx.record({"type": "data", **d})
    try:
        engines = {"baseline": ctx.baseline_engine(scored), "under_test": ctx.engine_under_test(scored)}
    except EngineError as e:
        return _error(ctx, f"engine unavailable: {e}")
    runs: dict[str, dict] = {}
    for side, engine in engines.items():
        t0 = time.monotonic()
        try:
            runs[side] = run_tasks(engine, dataset, tasks, limit=limit, max_tokens=max_tokens, repeats=repeats,
                                   data_dir=data_dir, seed=ctx.seed)
        except (EvalRunError, DataError) as e:
            return _error(ctx, f"{side} ({engine.name}): {e}")
        n = 0
        for task in tasks:
            for rec in runs[side][task].samples:
                ctx.record({**rec, "side": side, "engine": engine.name})
                n += 1
        ctx.note(f"{side} {engine.name}: {n} samples of {', '.join(tasks)} in {time.monotonic() - t0:.1f}s")
    problems: list[str] = []
    per_task: dict[str, Any] = {}
    for task in tasks:
        m, found = compare(task, runs["baseline"][task].samples, runs["under_test"][task].samples, th, ctx.seed)
        ctx.record({"type": "task_stats", "task": task, "metrics": m, "problems": found})
        per_task[task] = m
        problems += found
    metrics: dict[str, Any] = headline(per_task)  # scalars first: summary.md's key-metrics table shows them
    metrics |= {
        "tasks": per_task,
        "engines": {side: e.name for side, e in engines.items()},
        "model": about_model,
        "lm_eval_models": {side: runs[side][tasks[0]].model for side in runs},
        "lm_eval": {side: {t: runs[side][t].lm_eval for t in tasks} for side in runs},
        "thresholds": th.as_dict(),
        "data": [{"kind": d["kind"], "origin": d["origin"],
                  "files": {f["name"]: f["sha256"] for f in d["files"]}} for d in data],
        "params": {"limit": limit, "repeats": repeats, "max_tokens": max_tokens, "needles": list(needles) or None,
                   "synthetic_data": synthetic},
    }
    return ctx.verdict(problems, metrics)
