"""The one interface every engine serves: ``builtin`` (k3_fastpath's generator) and ``openai`` (a server).

Feature checks and evals talk to an ``Engine`` only, so the same check runs against the builtin reference
path, the builtin fast path, or a vLLM server with or without ``decode_backend: latency_specialized``.

Conventions every implementation keeps:
- ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1.0`` mean "off".
- ``seed`` makes sampling reproducible per request: the same (prompt, params, seed) gives the same tokens.
- ``logprobs = n`` returns, per generated position, the ``n`` most likely tokens of the model's
  distribution before temperature / top-k / top-p (raw log-softmax of the logits), plus the chosen token.
- A request over the engine's context limit raises ``ContextLimitError`` (a clear rejection), never a
  silent truncation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable


class EngineError(RuntimeError):
    """The engine could not serve a request (server down, bad response, engine crashed)."""


class ContextLimitError(EngineError):
    """The request does not fit the engine's context (prompt, or prompt + max_tokens, over the limit)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int = 0  # top-n log-probabilities per generated position (0 = none)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep generating past EOS up to max_tokens (vLLM's ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Constraint:
    """Structured output: a JSON schema (dict), a regex (str), or a choice among strings (list[str])."""

    kind: Literal["json_schema", "regex", "choice"]
    spec: Any


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length" (hit max_tokens)
    prompt_tokens: int
    # per generated position: {token_id: logprob} of the top-n (plus the chosen token); None if not asked
    logprobs: list[dict[int, float]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScoredContinuation:
    """A given continuation teacher-forced after a prompt: its token ids (the text's, then EOS), the
    log-probability the model gave each (raw log-softmax), whether each was the model's greedy choice, and
    the prompt's token count. Engines that can (``BuiltinEngine.score_chats``) produce them through the
    decode steps they serve."""

    token_ids: list[int]
    logprobs: list[float]
    greedy: list[bool]
    prompt_tokens: int


@runtime_checkable
class Engine(Protocol):
    name: str  # "builtin:reference", "builtin:fast", "openai:vllm", "openai:vllm+latency_specialized", ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams,
                 constraint: Constraint | None = None) -> list[Completion]:
        """Complete each prompt (text, or token ids). One Completion per prompt, in order."""
        ...

    def chat(self, messages: list[dict[str, str]], params: SamplingParams,
             constraint: Constraint | None = None) -> Completion:
        """Apply the model's chat template and complete."""
        ...

    def next_token_logprobs(self, prompt: str | list[int]) -> dict[int, float]:
        """The full next-token distribution (log-softmax of the logits, every token of the vocabulary)
        after ``prompt``: the reference a sampling test compares frequencies against."""
        ...

    def describe(self) -> dict[str, Any]:
        """What goes into the bundle: engine kind, model, path (reference/fast), server config, versions."""
        ...

    def close(self) -> None:
        """Release what the engine holds (stop a launched server by PID)."""
        ...


def model_vocab_size(model_dir: str | Path) -> int | None:
    """``vocab_size`` from a HF model dir's config.json (or its ``text_config``), if it has one."""
    p = Path(model_dir) / "config.json"
    if not p.is_file():
        return None
    cfg = json.loads(p.read_text())
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None
