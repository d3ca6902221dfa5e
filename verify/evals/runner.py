"""Run lm-eval tasks from ``evals/`` on one engine and turn lm-eval's sample log into k3-verify records.

``run_tasks(engine, tasks, ...)``:
1. a ``TaskManager`` over ``evals/`` only (``include_path``, no built-in tasks), with ``data_dir`` passed
   as task metadata to the YAMLs' ``custom_dataset`` loader; ``repeats`` set on each task;
2. the model: an engine with ``base_url`` (``OpenAIEngine``) runs lm-eval's own ``local-completions`` /
   ``local-chat-completions`` (through ``verify.evals.api_lm``) against that server; any other engine
   runs through ``verify.evals.lm_adapter.EngineLM``; a dataset of ``CHAT_DATASETS`` (all three)
   goes out as chat turns through the model's chat template, any other as a plain completion;
3. ``lm_eval.evaluator.evaluate(..., log_samples=True)`` (what ``simple_evaluate`` calls, without its
   ``pip list`` environment dump): lm-eval builds the requests, calls the model, filters and scores;
4. one record per (task, doc): lm-eval's doc/prompt/target hashes and its metrics, every repeat's
   response re-scored by ``evals.utils`` (must agree with lm-eval's metric), output tokens, finish
   reason, truncation, extraction failure, seed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import evals
from evals.utils import SCORERS, target_fields
from k3_fastpath.sentinel import tasks as sentinel_tasks
from verify.evals.lm_adapter import EngineLM, EvalRunError, context_key

EVALS_DIR = Path(list(evals.__path__)[0]).resolve()  # __path__: also right when installed as a namespace
CHAT_DATASETS = sentinel_tasks.CHAT_TASKS  # the datasets whose requests go through the chat template
SCORE_METRIC = {"gsm8k": "exact_match", "aime25": "exact_match", "mrcr": "score"}


def task_names(dataset: str, needles: list[int] | tuple[int, ...] = (2, 4, 8)) -> list[str]:
    if dataset == "gsm8k":
        return ["k3_gsm8k"]
    if dataset == "aime25":
        return ["k3_aime25"]
    if dataset == "mrcr":
        bad = [n for n in needles if n not in (2, 4, 8)]
        if bad or not needles:
            raise EvalRunError(f"MRCR needles must be among 2, 4, 8, got {list(needles)}")
        return [f"k3_mrcr_{n}needle" for n in needles]
    raise EvalRunError(f"unknown eval dataset {dataset!r}")


@dataclass
class TaskRun:
    task: str
    engine: str
    samples: list[dict[str, Any]]  # one record per doc (without "side")
    lm_eval: dict[str, Any]  # lm-eval's aggregate for this task
    model: dict[str, Any] = field(default_factory=dict)  # what lm-eval model ran, with which arguments


def _is_server_engine(engine: Any) -> bool:
    return isinstance(getattr(engine, "base_url", None), str) and isinstance(getattr(engine, "model", None), str)


def build_model(engine: Any, *, chat: bool, seed: int, max_tokens: int | None) -> tuple[Any, dict[str, Any]]:
    """(lm-eval LM, description). Server engines get lm-eval's own API models, others ``EngineLM``."""
    if not _is_server_engine(engine):
        return EngineLM(engine, seed=seed), {"model": "k3-verify EngineLM", "engine": engine.name}
    import lm_eval.api.registry

    import verify.evals.api_lm  # noqa: F401  (registers the k3-local-* models)

    name = "k3-local-chat-completions" if chat else "k3-local-completions"
    base = engine.base_url.rstrip("/")
    tokenizer_dir = getattr(engine, "tokenizer_dir", None)
    args: dict[str, Any] = {
        "model": engine.model, "base_url": f"{base}/chat/completions" if chat else f"{base}/completions",
        "num_concurrent": 1, "batch_size": 1, "max_retries": 1, "k3_seed": seed,
        "max_length": int(engine.max_model_len),
        # send text, never token ids: lm-eval left-truncates over-long tokenized prompts without failing; the
        # server instead rejects a prompt over its context (HTTP 400), which fails the check loudly
        "tokenized_requests": False,
    }
    if max_tokens:
        args["max_gen_toks"] = int(max_tokens)
    if chat:
        args["tokenizer_backend"] = None
    elif tokenizer_dir:
        args.update(tokenizer_backend="huggingface", tokenizer=str(tokenizer_dir))
    else:
        args["tokenizer_backend"] = None
    lm = lm_eval.api.registry.get_model(name).create_from_arg_obj(args, {})
    return lm, {"model": name, "model_args": {k: v for k, v in args.items() if k != "k3_seed"}, "engine": engine.name}


def run_tasks(engine: Any, dataset: str, tasks: list[str], *, limit: int | None, max_tokens: int | None,
              repeats: int | None, data_dir: str | Path | None, seed: int) -> dict[str, TaskRun]:
    """Run ``tasks`` (lm-eval task names from ``evals/``) on ``engine``; {task: TaskRun}."""
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager

    # lm-eval logs each task's setup at INFO/WARNING (e.g. "Custom kwargs can be passed to --metadata"
    # for every custom_dataset task); errors still show, and the bundle records what ran
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    chat = dataset in CHAT_DATASETS
    tm = TaskManager(include_path=str(EVALS_DIR), include_defaults=False,
                     metadata={"data_dir": str(data_dir) if data_dir else None})
    missing = [t for t in tasks if t not in tm.all_tasks]
    if missing:
        raise EvalRunError(f"lm-eval found no task {', '.join(missing)} under {EVALS_DIR}")
    loaded = tm.load(tasks)
    # what simple_evaluate does to the tasks before evaluate(), minus its environment dump (torch's
    # collect_env runs `pip list`: ~7 s a call, and the bundle records the environment anyway)
    for task in loaded["tasks"].values():
        if repeats is not None:
            task.set_config("repeats", int(repeats))
        if max_tokens:
            task.set_config("generation_kwargs", {"max_gen_toks": int(max_tokens)}, update=True)
        if task.get_config("num_fewshot") is None:
            task.set_config("num_fewshot", 0)
        task.set_fewshot_seed(seed=seed)
    lm, model_desc = build_model(engine, chat=chat, seed=seed, max_tokens=max_tokens)
    res = evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=True, bootstrap_iters=0,
                   apply_chat_template=chat, fewshot_as_multiturn=False)
    if res is None or "samples" not in res:
        raise EvalRunError("lm-eval returned no sample log")
    out = {}
    for task in tasks:
        samples = res["samples"].get(task)
        if not samples:
            raise EvalRunError(f"lm-eval logged no samples for {task}")
        records = [_sample_record(dataset, task, s, lm.log, max_tokens) for s in samples]
        out[task] = TaskRun(task=task, engine=engine.name, samples=records,
                            lm_eval=_jsonable(res["results"].get(task, {})), model=model_desc)
    return out


def _sample_record(dataset: str, task: str, s: dict[str, Any], log: Any, max_tokens: int | None) -> dict[str, Any]:
    args = s["arguments"][0]
    prompt = context_key(args[0])
    gen_kwargs = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
    responses = [str(r) for r in s["resps"][0]]
    target = target_fields(dataset, s["doc"])
    scored = [SCORERS[dataset](r, target) for r in responses]
    infos = [log.take(prompt, r) for r in responses]
    if any(i is None for i in infos):
        raise EvalRunError(f"{task} doc {s['doc_id']}: a response lm-eval logged was not seen by the model adapter")
    # lm-eval scored the same responses with the same functions: a disagreement is a bug, not a result
    metric = SCORE_METRIC[dataset]
    ours = sum(x["score"] for x in scored) / len(scored)
    if metric in s and abs(float(s[metric]) - ours) > 1e-9:
        raise EvalRunError(f"{task} doc {s['doc_id']}: lm-eval scored {s[metric]} but evals.utils gives {ours}")
    limit_tokens = max_tokens or gen_kwargs.get("max_gen_toks")
    truncated = []
    for info in infos:
        if info["finish_reason"] is not None:
            truncated.append(bool(info["truncated"]))
        elif info["output_tokens"] is not None and limit_tokens:
            truncated.append(info["output_tokens"] >= int(limit_tokens))
        else:
            raise EvalRunError(f"{task} doc {s['doc_id']}: the server reported neither finish_reason nor usage")
    return {
        "type": "sample", "task": task, "dataset": dataset, "doc_id": int(s["doc_id"]),
        "doc_hash": s["doc_hash"], "prompt_hash": s["prompt_hash"], "target_hash": s["target_hash"],
        "target": target, "repeats": len(responses), "responses": responses,
        "scores": [x["score"] for x in scored], "extracted": [x["extracted"] for x in scored],
        "rules": [x["rule"] for x in scored], "extraction_failed": [bool(x["extraction_failed"]) for x in scored],
        "output_tokens": [i["output_tokens"] for i in infos], "output_chars": [len(r) for r in responses],
        "prompt_tokens": [i.get("prompt_tokens") for i in infos],
        "finish_reasons": [i["finish_reason"] for i in infos], "truncated": truncated,
        "seeds": [i["seed"] for i in infos], "max_tokens": limit_tokens,
        "lm_eval": {k: _jsonable(s[k]) for k in s.get("metrics", []) if k in s},
    }


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
