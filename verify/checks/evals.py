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
5. record what each side's engine counted of the steps it served before and after its run
   (``engine_steps``: ``verify.evals.gates.served``): the engine under test, where it counts fast-path steps,
   must have run some on the fast path (``served_during``; metrics ``served``);
6. pass iff every gate of every task passed; the metrics carry each task's numbers, and ``bundle verify``
   re-derives all of it from the records (``verify.evals.rescore``).

``evals.mrcr``'s ``lengths`` (synthetic data only): one data set per conversation length in characters, its
tasks named ``k3_mrcr_<n>needle@<chars>c`` and gated each on its own (a model trained on short chats scored
long: the KDA state and the MLA cache carry it); ``metrics.prompt_tokens`` gives each task's prompt lengths
in tokens as the engine reported them.

``model``: None scores the run's model; ``sentinel`` the trained sentinel checkpoint
(``k3_fastpath.sentinel.checkpoint.sentinel_dir()``), a directory that checkpoint: read and validated like
``--checkpoint``, served by the run's builtin engines, named (path, digest, training record) in the records
and metrics. No data given and none on this machine, or no sentinel trained here: ``skipped``, the reason
naming the command that provides it. The sentinel scored on synthetic items is an ``error`` unless its
``training.json`` says those items were kept out of its training (the run's seed among its excluded eval
seeds, the limit within the items excluded: ``_training_overlap``).

Synthetic data holds at least ``limit`` items of the dataset scored (default sizes otherwise), so a limit
is the number of items scored.
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
         model: str | None = None, lengths: list[int] | None = None) -> CheckResult:
    return _run(ctx, "mrcr", limit=limit, repeats=None, needles=tuple(needles), max_tokens=max_tokens,
                data_dir=data_dir, thresholds=thresholds, model=model, lengths=lengths)


def _error(ctx: CheckContext, reason: str) -> CheckResult:
    return CheckResult(id=ctx.check_id, status="error", reason=" ".join(reason.split())[:300])


def _positive_int(name: str, value: Any, allow_none: bool = True) -> str | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"param {name} must be a positive integer{' or null' if allow_none else ''}, got {value!r}"
    return None


def _data_sources(ctx: CheckContext, dataset: str, needles: tuple[int, ...], data_dir: str | None,
                  length: int | None = None, limit: int | None = None):
    """The data directory and its resolved sources; synthetic files hold at least ``limit`` items of
    ``dataset`` (the first items of a seeded stream are the same at any count)."""
    from evals.data.sources import kind_for, resolve

    if data_dir == SYNTHETIC:
        from evals.data.make_synthetic import COUNT_ARG, DEFAULT_COUNTS, make_all

        out = Path(ctx.tmp_dir) / f"eval-data-{ctx.check_id}{'' if length is None else f'-{length}c'}"
        arg = COUNT_ARG[dataset]
        sizes = {} if limit is None else {arg: max(limit, DEFAULT_COUNTS[arg])}
        make_all(out, seed=ctx.seed, **sizes, **({} if length is None else {"mrcr_chars": length}))
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
        # heldout: its held-out scores, also with its MLA layers zeroed (what a defect there can move)
        about["training"] = {k: rec.get(k) for k in ("plan", "steps_done", "train_s", "device", "torch",
                                                     "checkpoint_digest", "eval_seeds_excluded",
                                                     "eval_items_excluded", "heldout")}
        about["digest_matches_training"] = rec.get("checkpoint_digest") == source.digest
    return source, about


def _training_overlap(about_model: dict[str, Any], dataset: str, seed: int, limit: int | None, synthetic: bool,
                      lengths: list[int] | None) -> str | None:
    """Why the synthetic items about to be scored may have been trained on (None: they were kept out).

    The sentinel's training skipped the first ``eval_items_excluded[task]`` items of the eval streams of
    ``eval_seeds_excluded`` (``training.json``); a word problem outside them can coincide with a training
    item (short templates, small numbers). MRCR at another conversation length than the eval files' is
    not checked: thousands of characters of random words never coincide with a training chat."""
    from evals.data.make_synthetic import COUNT_ARG, DEFAULT_COUNTS
    from k3_fastpath.sentinel.tasks import EVAL_MRCR_CHARS

    if about_model.get("scored") != SENTINEL or not synthetic:
        return None
    if dataset == "mrcr" and lengths and EVAL_MRCR_CHARS not in lengths:
        return None
    rec = about_model.get("training")
    if not rec:
        return ("the sentinel checkpoint has no training.json: which eval items its training kept out cannot be "
                "checked, so its scores on synthetic items cannot be trusted")
    seeds, kept = rec.get("eval_seeds_excluded") or [], (rec.get("eval_items_excluded") or {}).get(dataset, 0)
    n = DEFAULT_COUNTS[COUNT_ARG[dataset]] if limit is None else limit
    if seed not in seeds or n > kept:
        return (f"the sentinel's training kept out the first {kept} {dataset} items of eval seed(s) {seeds}; "
                f"scoring {n} items of seed {seed} could score items it was trained on (run with --seed "
                f"{seeds[0] if seeds else 0} and a limit of at most {kept})")
    return None


def _label(task: str, length: int | None) -> str:
    """A task's name in the records: the lm-eval task, ``@<chars>c`` where the MRCR length was chosen."""
    return task if length is None else f"{task}@{length}c"


def _lengths_error(lengths: Any, synthetic: bool, param: str = "lengths") -> str | None:
    """Why ``lengths`` (param ``param``: MRCR conversation lengths) cannot be used, or None."""
    if lengths is None:
        return None
    if not synthetic:
        return f"param {param} (MRCR conversation lengths in characters) needs data_dir: synthetic"
    if (not isinstance(lengths, list) or not lengths or len(set(lengths)) != len(lengths)
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths)):
        return f"param {param} must be a list of distinct positive integers (characters), got {lengths!r}"
    return None


def _run(ctx: CheckContext, dataset: str, *, limit: int | None, repeats: int | None, needles: tuple[int, ...],
         max_tokens: int | None, data_dir: str | None, thresholds: str | None, model: str | None,
         lengths: list[int] | None = None) -> CheckResult:
    from evals.data.sources import DataError, NoDataError
    from verify.engines.base import EngineError
    from verify.evals.gates import ThresholdsError, compare, headline, load_thresholds, served, served_during
    from verify.evals.lm_adapter import EvalRunError
    from verify.evals.runner import run_tasks, task_names
    from verify.model_source import ModelSourceError

    synthetic = data_dir == SYNTHETIC
    bad = [p for p in (_positive_int("limit", limit), _positive_int("max_tokens", max_tokens),
                       _positive_int("repeats", repeats), _lengths_error(lengths, synthetic)) if p]
    if bad:
        return _error(ctx, bad[0])
    parts: list[int | None] = list(lengths) if lengths else [None]  # one data set per MRCR length
    try:
        base_tasks = task_names(dataset, needles) if dataset == "mrcr" else task_names(dataset)
        tasks = [_label(t, n) for n in parts for t in base_tasks]
        th = load_thresholds(dataset, thresholds)
        dirs = {n: _data_sources(ctx, dataset, needles, data_dir, n, limit) for n in parts}
        scored, about_model = _scored_model(ctx, model)
        overlap = _training_overlap(about_model, dataset, ctx.seed, limit, synthetic, lengths)
        if overlap:
            return _error(ctx, overlap)
    except NoDataError as e:  # nothing to score here: skipped with the whole reason, never cut short
        return CheckResult(id=ctx.check_id, status="skipped", reason=" ".join(str(e).split()))
    except (ThresholdsError, DataError, EvalRunError, ModelSourceError) as e:
        return _error(ctx, str(e))
    data = [{**src.describe(), **({} if n is None else {"mrcr_chars": n})} for n in parts for src in dirs[n][1]]
    ctx.record({"type": "config", "dataset": dataset, "tasks": tasks, "thresholds": th.as_dict(), "seed": ctx.seed,
                "limit": limit, "repeats": repeats, "max_tokens": max_tokens,
                "data_dir": dirs[None][0] if lengths is None else {str(n): dirs[n][0] for n in parts},
                "lengths": lengths, "synthetic_data": synthetic, "model": about_model})
    for d in data:
        ctx.record({"type": "data", **d})
    try:
        engines = {"baseline": ctx.baseline_engine(scored), "under_test": ctx.engine_under_test(scored)}
    except EngineError as e:
        return _error(ctx, f"engine unavailable: {e}")
    runs: dict[str, dict] = {}
    steps: list[dict[str, Any]] = []
    for side, engine in engines.items():
        t0 = time.monotonic()
        runs[side] = {}
        before = served(engine.describe())
        for n in parts:
            try:
                got = run_tasks(engine, dataset, base_tasks, limit=limit, max_tokens=max_tokens, repeats=repeats,
                                data_dir=dirs[n][0], seed=ctx.seed)
            except (EvalRunError, DataError) as e:
                return _error(ctx, f"{side} ({engine.name}): {e}")
            for task, run in got.items():
                for rec in run.samples:
                    rec["task"] = _label(task, n)
                runs[side][_label(task, n)] = run
        k = 0
        for task in tasks:
            for rec in runs[side][task].samples:
                ctx.record({**rec, "side": side, "engine": engine.name})
                k += 1
        steps.append({"type": "engine_steps", "side": side, "engine": engine.name, "before": before,
                      "after": served(engine.describe())})
        ctx.record(steps[-1])
        ctx.note(f"{side} {engine.name}: {k} samples of {', '.join(tasks)} in {time.monotonic() - t0:.1f}s")
    problems: list[str] = []
    per_task: dict[str, Any] = {}
    for task in tasks:
        m, found = compare(task, runs["baseline"][task].samples, runs["under_test"][task].samples, th, ctx.seed)
        ctx.record({"type": "task_stats", "task": task, "metrics": m, "problems": found})
        per_task[task] = m
        problems += found
    served_metrics, found = served_during(steps)
    problems += found
    metrics: dict[str, Any] = headline(per_task)  # scalars first: summary.md's key-metrics table shows them
    metrics |= {
        "tasks": per_task,
        "prompt_tokens": {task: _prompt_tokens(runs["under_test"][task].samples) for task in tasks},
        "engines": {side: e.name for side, e in engines.items()},
        "served": served_metrics,
        "model": about_model,
        "lm_eval_models": {side: runs[side][tasks[0]].model for side in runs},
        "lm_eval": {side: {t: runs[side][t].lm_eval for t in tasks} for side in runs},
        "thresholds": th.as_dict(),
        "data": [{"kind": d["kind"], "origin": d["origin"], **({"mrcr_chars": d["mrcr_chars"]} if "mrcr_chars" in d else {}),
                  "files": {f["name"]: f["sha256"] for f in d["files"]}} for d in data],
        "params": {"limit": limit, "repeats": repeats, "max_tokens": max_tokens, "needles": list(needles) or None,
                   "synthetic_data": synthetic, "lengths": lengths},
    }
    return ctx.verdict(problems, metrics)


def _prompt_tokens(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The prompts' token counts the engine reported (min / median / max), None where it reported none."""
    counts = sorted(c for s in samples for c in s.get("prompt_tokens") or [] if isinstance(c, int))
    if not counts:
        return None
    return {"min": counts[0], "median": counts[len(counts) // 2], "max": counts[-1], "n": len(counts)}
