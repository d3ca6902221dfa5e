"""lm-eval's own ``local-completions`` / ``local-chat-completions`` models, with the three things a paired
fast-path-vs-baseline eval needs and they do not do:

1. **A seed per repeat.** lm-eval sends the same ``seed`` with every request, so against a server with
   per-request seeding (vLLM) all AIME repeats of one problem would be the same sample. Sampled requests
   here get ``derive_seed(run seed, prompt, repeat)`` (the same rule as ``EngineLM``): repeats differ, and
   the baseline and the engine under test draw the same seeds.
2. **Finish reason and token counts per response** (truncation = ``finish_reason == "length"``), read from
   the server's JSON into a ``CompletionLog`` keyed by (prompt, text).
3. **MRCR as real chat turns**: ``apply_chat_template`` unpacks the JSON message list that MRCR's
   doc_to_text yields (``evals.utils.expand_conversation``).

Everything else (HTTP, retries, batching, stop handling) is lm-eval's. The runner uses batch size 1 and
no concurrency, so each HTTP response is one request and its ``usage`` counts that response alone.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.api_models import JsonChatStr
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

from evals.utils import expand_conversation
from verify.evals.lm_adapter import CompletionLog, context_key, derive_seed


class _K3Mixin:
    k3_seed: int
    log: CompletionLog

    def _k3_init(self, seed: int) -> None:
        self.k3_seed = int(seed)
        self.log = CompletionLog()
        self._k3_repeats: Counter[str] = Counter()
        self._k3_last: dict[str, Any] = {}

    def _k3_payload_seed(self, prompt_key: str, gen_kwargs: dict[str, Any] | None, default: int) -> int | None:
        gk = gen_kwargs or {}
        sampled = bool(gk.get("do_sample")) and float(gk.get("temperature", 0) or 0) > 0
        repeat = self._k3_repeats[prompt_key]
        self._k3_repeats[prompt_key] += 1
        seed = derive_seed(self.k3_seed, prompt_key, repeat) if sampled else default
        self._k3_last = {"seed": seed if sampled else None, "repeat": repeat,
                         "max_tokens": gk.get("max_gen_toks", gk.get("max_tokens", getattr(self, "_max_gen_toks", None)))}
        return seed

    def _k3_log(self, outputs: Any, texts: list, contexts) -> None:
        outs = outputs if isinstance(outputs, list) else [outputs]
        choices = [c for o in outs for c in sorted(o.get("choices", []), key=lambda c: c.get("index", 0))]
        usage = outs[0].get("usage") if len(outs) == 1 and len(choices) == 1 else None
        for i, text in enumerate(texts):
            if text is None or contexts is None or i >= len(contexts):
                continue
            finish = choices[i].get("finish_reason") if i < len(choices) else None
            tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
            self.log.add(context_key(contexts[i]), text,
                         {"output_tokens": tokens, "finish_reason": finish, "truncated": finish == "length",
                          "prompt_tokens": usage.get("prompt_tokens") if isinstance(usage, dict) else None,
                          **self._k3_last})


@register_model("k3-local-completions")
class K3LocalCompletions(_K3Mixin, LocalCompletionsAPI):
    def __init__(self, k3_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._k3_init(k3_seed)

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs) -> dict:
        if generate:
            key = messages if isinstance(messages, str) else json.dumps(messages, ensure_ascii=False)
            seed = self._k3_payload_seed(key, gen_kwargs, seed)
        return super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos, **kwargs)

    def parse_generations(self, outputs, contexts=None, **kwargs) -> list[str]:
        texts = LocalCompletionsAPI.parse_generations(outputs)
        self._k3_log(outputs, texts, contexts)
        return texts


@register_model("k3-local-chat-completions")
class K3LocalChatCompletions(_K3Mixin, LocalChatCompletion):
    def __init__(self, k3_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._k3_init(k3_seed)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True):
        return JsonChatStr(json.dumps(expand_conversation(chat_history), ensure_ascii=False))

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs) -> dict:
        if generate:
            seed = self._k3_payload_seed(json.dumps(messages, ensure_ascii=False), gen_kwargs, seed)
        return super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos, **kwargs)

    def parse_generations(self, outputs, contexts=None, **kwargs) -> list[str]:
        texts = super().parse_generations(outputs, **kwargs)
        self._k3_log(outputs, texts, contexts)
        return texts
