"""Batched generation over any "stepper" with the reference model's cache API.

A stepper is an object with ``new_cache(batch, max_len, ...)``, ``prefill(input_ids [B, T], lengths [B],
cache) -> logits [B, T, V]`` and ``decode(tokens [B], cache, active [B]) -> logits [B, V]``:
``k3_fastpath.reference.model.K3ForCausalLM`` (the standard path) or the fast path's
``k3_fastpath.runtime.executor.DecodeExecutor``. The generator owns what serving adds around it:

- the context limit: ``len(prompt) + max_tokens > max_model_len`` raises ``ContextLengthError`` naming
  the numbers, before any compute (a clear rejection; prompts are never truncated);
- one right-padded prefill per batch, then one decode step per generated token for the sequences
  still running (finished ones are passed ``active=False`` and left untouched); one-token requests
  with identical prompts share one prefill;
- sampling per request (``sampler.py``: own seeded generator, FP32 logits), stop tokens, an optional
  per-request token constraint (a grammar: bitmask before sampling, advanced after; ``ForcedTokens``:
  teacher forcing through decode steps), an optional stop callback (stop strings live on the text side);
- log-probabilities: the log-softmax of the raw FP32 logits at every generated position;
- speculative decoding (``spec``: a ``spec_decode.Speculation``): after the first token, verify steps of
  the last emitted token and up to ``k`` drafts per request (at most ``max_tokens - emitted - 1``, so no
  position passes the request's context), the acceptance rule of ``spec_sampler.verify_draft`` (the
  grammar's bitmask for each verify row: the matcher advanced along the draft, then rolled back), the
  emitted tokens taken one by one as plain decoding takes them (stop tokens, grammar, ``stop_when``,
  ``max_tokens``, log-probabilities of each token's own row), and the state committed after the tokens
  kept. Acceptance is counted per request (``GenerationOutput.acceptance``) and per generator
  (``Generator.acceptance``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .sampler import SamplingConfig, bitmask_words, logprobs_of, request_generator, sample_row


class ContextLengthError(ValueError):
    """A request does not fit the context: prompt + max_tokens over ``max_model_len``."""


class TokenConstraint(Protocol):
    """Per-request structured-output state (``verify/engines/grammar.py`` wraps an xgrammar matcher)."""

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens into ``bitmask`` (int32 ``[ceil(V/32)]``, xgrammar layout)."""

    def accept_token(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar rejects it."""

    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token (the output is complete)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's drafts)."""


class ForcedTokens:
    """A ``TokenConstraint`` that allows exactly ``token_ids``, one after the other (teacher forcing through
    decode steps): with greedy sampling and ``logprobs`` the request's log-probabilities are those the model
    gives each forced token (from the raw logits, as always), and the decode steps that produce them are the
    stepper's own (the fast path's, for a fast stepper). Terminated after the last token."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("ForcedTokens needs at least one token")
        self.token_ids = [int(t) for t in token_ids]
        self.pos = 0

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        bitmask.zero_()
        if self.pos < len(self.token_ids):
            t = self.token_ids[self.pos]
            word = (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)  # int32 bit 31 is the sign bit
            bitmask[t // 32] = word

    def accept_token(self, token: int) -> bool:
        if self.pos >= len(self.token_ids) or int(token) != self.token_ids[self.pos]:
            return False
        self.pos += 1
        return True

    def is_terminated(self) -> bool:
        return self.pos >= len(self.token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.pos = max(0, self.pos - int(num_tokens))


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    logprobs: int = 0  # top-n per generated position (plus the chosen token)
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop_tokens: bool = False
    constraint: TokenConstraint | None = None
    stop_when: Callable[[list[int]], bool] | None = None  # called with the tokens so far after each token


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (stop token, constraint complete or stop_when) or "length"
    prompt_len: int
    logprobs: list[dict[int, float]] | None = None
    stop_token: int | None = None  # the stop token that ended it (not in token_ids)
    acceptance: dict | None = None  # speculative decoding: this request's AcceptanceStats.record()


class Stepper(Protocol):
    def new_cache(self, batch: int, max_len: int, *args: Any, **kwargs: Any) -> Any: ...

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None, cache: Any) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, cache: Any, active: torch.Tensor | None = None) -> torch.Tensor: ...


def check_fits(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """Raise ``ContextLengthError`` unless the prompt and its completion fit the context."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty: a request needs at least one token")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"request does not fit the context: prompt {prompt_len} tokens + max_tokens {max_tokens} = "
            f"{prompt_len + max_tokens} > max_model_len {max_model_len} "
            f"(over by {prompt_len + max_tokens - max_model_len}); shorten the prompt or lower max_tokens")


def _top_logprobs(lp: torch.Tensor, n: int, chosen: int) -> dict[int, float]:
    vals, idx = torch.topk(lp, min(n, lp.shape[-1]))
    out = {int(i): float(v) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)}
    out.setdefault(chosen, float(lp[chosen]))
    return out


def _release(cache: Any) -> None:
    """Give a fast-path cache's slots back to the executor's pool now (reference caches have no release)."""
    release = getattr(cache, "release", None)
    if release is not None:
        release()


class _Row:
    """Per-request running state."""

    def __init__(self, req: GenerationRequest, device: torch.device, index: int = 0) -> None:
        self.req = req
        self.index = index  # the request's position in its generate / run_batch call (a drafter's key)
        self.tokens: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if req.logprobs > 0 else None
        self.generator = None if req.sampling.greedy else request_generator(req.seed, device)
        self.finish: str | None = None if req.max_tokens > 0 else "length"
        self.stop_token: int | None = None
        self.stats: Any = None  # AcceptanceStats under speculative decoding


class Generator:
    """Serves ``GenerationRequest`` batches on ``stepper`` within ``max_model_len`` positions."""

    def __init__(self, stepper: Stepper, vocab_size: int, max_model_len: int, device: str | torch.device = "cpu",
                 cache_kwargs: dict[str, Any] | None = None, max_batch: int = 256, spec: Any = None) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.stepper = stepper
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.device = torch.device(device)
        self.cache_kwargs = dict(cache_kwargs or {})
        self.max_batch = max(1, int(max_batch))
        self.steps = {"prefill_calls": 0, "prefill_tokens": 0, "decode_calls": 0}
        self.spec = spec
        self.acceptance: Any = None
        if spec is not None:
            from .spec_sampler import AcceptanceStats

            self.steps["verify_steps"] = 0
            self.acceptance = AcceptanceStats()

    # ------------------------------------------------------------------ helpers
    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not (0 <= int(t) < self.vocab_size)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}")

    def _prefill(self, prompts: list[list[int]], max_len: int) -> tuple[Any, torch.Tensor]:
        b = len(prompts)
        t = max(len(p) for p in prompts)
        ids = torch.zeros(b, t, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        cache = self.stepper.new_cache(b, max_len, **self.cache_kwargs)
        logits = self.stepper.prefill(ids.to(self.device), lengths.to(self.device), cache)
        self.steps["prefill_calls"] += 1
        self.steps["prefill_tokens"] += int(lengths.sum())
        last = logits[torch.arange(b, device=logits.device), (lengths - 1).to(logits.device)]
        return cache, last.float()

    # ------------------------------------------------------------------ API
    @torch.no_grad()
    def next_token_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """FP32 logits ``[V]`` for the token after ``prompt_ids`` (the prompt must leave room for it)."""
        self._check_ids(prompt_ids)
        check_fits(len(prompt_ids), 1, self.max_model_len)
        cache, last = self._prefill([list(prompt_ids)], len(prompt_ids) + 1)
        _release(cache)
        return last[0].to("cpu")

    def _check_requests(self, requests: list[GenerationRequest]) -> None:
        for r in requests:
            self._check_ids(r.prompt_ids)
            check_fits(len(r.prompt_ids), r.max_tokens, self.max_model_len)
            if r.logprobs < 0:
                raise ValueError(f"logprobs must be >= 0, got {r.logprobs}")

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run the requests to completion; outputs in request order. Nothing runs if any request is rejected.

        Requests for at most one token need only their prompt's prefill: identical prompts among them are
        prefilled once (a sampling test sends the same prompt thousands of times). The others run in
        batches of at most ``max_batch`` rows: one prefill, then one decode (or verify) step per step.
        """
        self._check_requests(requests)
        rows = [_Row(r, self.device, i) for i, r in enumerate(requests)]
        single = [row for row in rows if row.req.max_tokens <= 1]
        multi = [row for row in rows if row.req.max_tokens > 1]
        self._run_single(single)
        for i in range(0, len(multi), self.max_batch):
            self._run_batch(multi[i: i + self.max_batch])
        return [self._output(row) for row in rows]

    @torch.no_grad()
    def run_batch(self, requests: list[GenerationRequest], keep_cache: bool = False
                  ) -> tuple[list[GenerationOutput], Any]:
        """The requests as one batch (at most ``max_batch``): one prefill and their decode or verify steps;
        with ``keep_cache`` the cache comes back unreleased (the state after the last step), else None."""
        self._check_requests(requests)
        if not 1 <= len(requests) <= self.max_batch:
            raise ValueError(f"run_batch takes 1..{self.max_batch} requests, got {len(requests)}")
        rows = [_Row(r, self.device, i) for i, r in enumerate(requests)]
        cache = self._run_batch(rows, keep_cache)
        return [self._output(row) for row in rows], cache

    def _output(self, row: _Row) -> GenerationOutput:
        return GenerationOutput(token_ids=row.tokens, finish_reason=row.finish or "length",
                                prompt_len=len(row.req.prompt_ids), logprobs=row.logprobs,
                                stop_token=row.stop_token,
                                acceptance=None if row.stats is None else row.stats.record())

    def _run_single(self, rows: list[_Row]) -> None:
        todo = [row for row in rows if row.finish is None]
        unique: dict[tuple[int, ...], int] = {}
        for row in todo:
            unique.setdefault(tuple(row.req.prompt_ids), len(unique))
        prompts = [list(p) for p in unique]
        last: list[torch.Tensor] = []
        for i in range(0, len(prompts), self.max_batch):
            chunk = prompts[i: i + self.max_batch]
            cache, logits = self._prefill(chunk, max(len(p) for p in chunk) + 1)
            _release(cache)
            last.extend(logits)
        words = bitmask_words(self.vocab_size)
        for row in todo:
            self._step_row(row, last[unique[tuple(row.req.prompt_ids)]], words)

    def _run_batch(self, rows: list[_Row], keep_cache: bool = False) -> Any:
        max_len = max(len(row.req.prompt_ids) + row.req.max_tokens for row in rows)
        cache, logits = self._prefill([list(row.req.prompt_ids) for row in rows], max_len)
        words = bitmask_words(self.vocab_size)
        try:
            if self.spec is None:
                self._decode_loop(rows, cache, logits, words)
            else:  # the speculation's own loop (spec_decode.Speculation.run)
                self.spec.run(self, rows, cache, logits, words)
        except BaseException:
            _release(cache)
            raise
        if keep_cache:
            return cache
        _release(cache)
        return None

    def _decode_loop(self, rows: list[_Row], cache: Any, logits: torch.Tensor, words: int) -> None:
        while True:
            next_tokens = torch.zeros(len(rows), dtype=torch.long)
            for i, row in enumerate(rows):
                if row.finish is None:
                    next_tokens[i] = self._step_row(row, logits[i], words)
            active = torch.tensor([row.finish is None for row in rows])
            if not bool(active.any()):
                return
            logits = self.stepper.decode(next_tokens.to(self.device), cache, active.to(self.device)).float()
            self.steps["decode_calls"] += 1

    def _step_row(self, row: _Row, logits: torch.Tensor, words: int) -> int:
        """Pick ``row``'s next token from its FP32 logits, update its state; returns the token to feed."""
        req = row.req
        bitmask = None
        if req.constraint is not None:
            bitmask = torch.zeros(words, dtype=torch.int32)
            req.constraint.fill_bitmask(bitmask)
        tok = sample_row(logits, req.sampling, row.generator, bitmask)
        self._take(row, tok, logits)
        return tok

    def _take(self, row: _Row, tok: int, logits: torch.Tensor) -> None:
        """``tok`` (chosen from ``logits``, within the grammar's bitmask) becomes ``row``'s next token."""
        req = row.req
        if row.logprobs is not None:
            row.logprobs.append(_top_logprobs(logprobs_of(logits), req.logprobs, tok))
        if req.constraint is not None and not req.constraint.accept_token(tok):
            raise RuntimeError(f"the grammar rejected token {tok} that its own bitmask allowed")
        if tok in req.stop_token_ids and not req.ignore_stop_tokens:
            row.finish, row.stop_token = "stop", tok
            if row.logprobs is not None:
                row.logprobs.pop()  # the stop token is not part of the output
            return
        row.tokens.append(tok)
        if req.constraint is not None and req.constraint.is_terminated():
            row.finish = "stop"
        elif req.stop_when is not None and req.stop_when(row.tokens):
            row.finish = "stop"
        elif len(row.tokens) >= req.max_tokens:
            row.finish = "length"
