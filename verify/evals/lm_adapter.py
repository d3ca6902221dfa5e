"""An lm-eval ``LM`` over any ``verify.engines.base.Engine``: lm-eval runs the eval loop, the engine answers.

lm-eval builds every request (prompt, stop strings, max tokens, repeats), calls ``generate_until`` once
with all of them, filters and scores. This adapter turns each request into ``Engine.generate`` (text
prompts) or a chat (the eval tasks' conversations, sent as real turns), batched up to ``batch_size`` where
the sampling parameters agree (chats whatever their seeds: each sampled chat carries its own to
``chat_batch``; text prompts where the seed agrees too) and the prompts
stay within ``batching.BATCH_CHARS`` (a batch is prefilled as one padded block): chats through the engine's
``chat_batch`` where it has one (the builtin engine: its decode steps then run at the batch's size, as a
server's would), else one ``Engine.chat`` each. It keeps, per response, what lm-eval's sample log does not:
generated token count, finish reason (``length`` = hit max_tokens), the seed. ``CompletionLog`` holds that,
keyed by (prompt, text), so the runner can attach it to lm-eval's per-sample records whatever order lm-eval used.

Seeds: a sampled request gets ``derive_seed(run seed, prompt, repeat)``; repeats of one prompt get
different seeds, and the baseline and the engine under test get the same seed for the same (prompt,
repeat), so their samples are paired. Greedy requests carry no seed.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lm_eval.api.model import LM

from evals.utils import expand_conversation
from verify.engines.base import ContextLimitError, Engine, EngineError, SamplingParams
from verify.evals.batching import BATCH, batched

DEFAULT_MAX_TOKENS = 256  # lm-eval's own default when a task names no max_gen_toks


class EvalRunError(RuntimeError):
    """An eval request could not be served (over the context, engine failure): one line with the doc."""


class ChatPrompt(str):
    """A chat conversation rendered by ``EngineLM.apply_chat_template`` (JSON of the message list); its type
    tells ``generate_until`` to call ``Engine.chat`` instead of ``Engine.generate``."""

    def messages(self) -> list[dict[str, str]]:
        return json.loads(self)


def derive_seed(seed: int, prompt: str, repeat: int) -> int:
    h = hashlib.sha256(f"{seed}\x00{repeat}\x00{prompt}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


def context_key(context: Any) -> str:
    """A request's prompt as text: a str, or the JSON of a chat (``ChatPrompt``, lm-eval's ``JsonChatStr``)."""
    prompt = getattr(context, "prompt", None)  # lm_eval.models.api_models.JsonChatStr
    if isinstance(prompt, str):
        return prompt
    if isinstance(context, (tuple, list)) and len(context) == 1 and isinstance(context[0], str):
        return context[0]  # a JsonChatStr as lm-eval's sample log holds it: a plain 1-tuple
    return str(context)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string (what lm-eval expects from generate_until); True if one was found."""
    cut = min((i for s in stop if s and (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class CompletionLog:
    """Per response: {output_tokens, finish_reason, truncated, seed, repeat}, looked up by (prompt, text)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        self.count = 0

    def add(self, prompt: str, text: str, info: dict[str, Any]) -> None:
        self._by_key[(prompt, text)].append(info)
        self.count += 1

    def take(self, prompt: str, text: str) -> dict[str, Any] | None:
        """The oldest unclaimed info for this (prompt, text); None if none was logged."""
        infos = self._by_key.get((prompt, text))
        return infos.pop(0) if infos else None


def sampling_params(gen_kwargs: dict[str, Any], seed: int, prompt: str, repeat: int) -> SamplingParams:
    """lm-eval generation kwargs -> ``SamplingParams``. ``do_sample: false`` or temperature 0 is greedy."""
    known = {"until", "max_gen_toks", "max_tokens", "do_sample", "temperature", "top_p", "top_k"}
    unknown = sorted(set(gen_kwargs) - known)
    if unknown:
        raise EvalRunError(f"generation kwargs the engine adapter does not support: {', '.join(unknown)}")
    until = gen_kwargs.get("until") or []
    stop = (until,) if isinstance(until, str) else tuple(until)
    temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
    if not gen_kwargs.get("do_sample", temperature > 0):
        temperature = 0.0
    max_tokens = int(gen_kwargs.get("max_gen_toks", gen_kwargs.get("max_tokens", DEFAULT_MAX_TOKENS)))
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          top_p=float(gen_kwargs.get("top_p", 1.0)), top_k=int(gen_kwargs.get("top_k", 0)),
                          seed=derive_seed(seed, prompt, repeat) if temperature > 0 else None, stop=stop)


class EngineLM(LM):
    """lm-eval model backed by an ``Engine`` (the builtin engine, or any other implementation)."""

    def __init__(self, engine: Engine, *, seed: int = 0, batch_size: int = BATCH) -> None:
        super().__init__()
        self.engine = engine
        self.seed = seed
        self.batch_size = max(1, int(batch_size))
        self.log = CompletionLog()

    # -- what lm-eval asks of a model
    @property
    def tokenizer_name(self) -> str:
        return self.engine.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str:
        return "engine chat template"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return ChatPrompt(json.dumps(expand_conversation(chat_history), ensure_ascii=False))

    def loglikelihood(self, requests):
        raise NotImplementedError("k3-verify's eval tasks are generative; EngineLM serves generate_until only")

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError("k3-verify's eval tasks are generative; EngineLM serves generate_until only")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        seen: Counter[int] = Counter()
        jobs = []  # (position, instance, prompt, params)
        for pos, inst in enumerate(requests):
            context, gen_kwargs = inst.args[0], inst.args[1]
            repeat = seen[id(inst)]
            seen[id(inst)] += 1
            prompt = context_key(context)
            jobs.append((pos, inst, context, prompt, sampling_params(dict(gen_kwargs), self.seed, prompt, repeat), repeat))
        out: list[str | None] = [None] * len(jobs)
        chat_batch = getattr(self.engine, "chat_batch", None)
        for is_chat in (True, False):
            # chats through chat_batch share a batch whatever their seeds (each request keeps its own); other
            # calls take one SamplingParams, so only requests with the same seed share one
            own_seeds = is_chat and chat_batch is not None
            groups: dict[SamplingParams, list] = defaultdict(list)
            for job in jobs:
                if isinstance(job[2], ChatPrompt) == is_chat:
                    groups[replace(job[4], seed=None) if own_seeds else job[4]].append(job)
            step = 1 if is_chat and chat_batch is None else self.batch_size
            for params, group in groups.items():
                for batch in batched(group, lambda job: len(job[2]), step):
                    if not is_chat:
                        call = lambda b=batch, p=params: self.engine.generate([j[3] for j in b], p)  # noqa: E731
                    elif chat_batch is not None:
                        call = lambda b=batch, p=params: chat_batch(  # noqa: E731
                            [j[2].messages() for j in b], p,
                            seeds=None if p.greedy else [j[4].seed for j in b])
                    else:
                        call = lambda b=batch, p=params: [self.engine.chat(b[0][2].messages(), p)]  # noqa: E731
                    done = self._call(batch[0], call)
                    if len(done) != len(batch):
                        raise EvalRunError(f"engine {self.engine.name} returned {len(done)} completions for "
                                           f"{len(batch)} prompts")
                    for job, completion in zip(batch, done, strict=True):
                        self._finish(out, job, [completion])
        return [o if o is not None else "" for o in out]

    def _call(self, job, fn):
        inst = job[1]
        try:
            return fn()
        except ContextLimitError as e:
            raise EvalRunError(f"{inst.task_name} doc {inst.doc_id}: does not fit engine {self.engine.name}: {e} "
                               f"(lower max_tokens or use shorter items)") from e
        except EngineError as e:
            raise EvalRunError(f"{inst.task_name} doc {inst.doc_id}: engine {self.engine.name} failed: {e}") from e

    def _finish(self, out: list, job, completions) -> None:
        pos, inst, _, prompt, params, repeat = job
        c = completions[0]
        text, stopped = cut_at_stop(c.text, params.stop)
        finish = "stop" if stopped else c.finish_reason
        out[pos] = text
        self.log.add(prompt, text, {"output_tokens": len(c.token_ids), "finish_reason": finish,
                                    "truncated": finish == "length", "prompt_tokens": c.prompt_tokens,
                                    "seed": params.seed, "repeat": repeat, "max_tokens": params.max_tokens})
