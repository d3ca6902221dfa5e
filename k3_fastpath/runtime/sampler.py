"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds, grammar bitmasks.

Everything runs on FP32 logits (the model's logits are FP32; anything else is upcast first). The order
for one row is fixed and documented because it changes the distribution:

1. grammar bitmask (xgrammar layout, see ``unpack_bitmask``): disallowed tokens get ``-inf``;
2. greedy (``temperature == 0``): the argmax of the masked raw logits, nothing else applies;
3. temperature: ``logits / T``;
4. top-k (``top_k > 0``): keep the tokens whose tempered logit is >= the k-th largest (ties at the
   boundary are kept, as vLLM does);
5. top-p (``top_p < 1``): over the softmax of what is left, keep the smallest set of most likely tokens
   whose cumulative probability reaches ``top_p`` (the most likely token always stays);
6. draw one token from the softmax of the result with the request's own ``torch.Generator``.

A request's generator is seeded from its ``seed`` and consumed only by that request (one draw per
step), so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITMASK_WORD_BITS = 32  # xgrammar packs 32 allowed-token bits per int32 word, token i at bit i % 32


@dataclass(frozen=True)
class SamplingConfig:
    """One request's sampling knobs (``temperature == 0`` greedy, ``top_k == 0`` / ``top_p == 1`` off)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def request_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The per-request random stream: a fresh ``torch.Generator`` on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) & ((1 << 63) - 1))
    return g


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITMASK_WORD_BITS - 1) // BITMASK_WORD_BITS


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed bitmask ``int32 [..., ceil(V/32)]`` -> ``bool [..., V]`` (True = allowed)."""
    if bitmask.dtype != torch.int32:
        raise TypeError(f"token bitmask must be int32 (xgrammar layout), got {bitmask.dtype}")
    if bitmask.shape[-1] * BITMASK_WORD_BITS < vocab_size:
        raise ValueError(f"token bitmask has {bitmask.shape[-1]} words, too few for vocabulary {vocab_size}")
    shifts = torch.arange(BITMASK_WORD_BITS, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift; & 1 keeps only the bit we want
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` with every token the bitmask forbids set to ``-inf`` (a new tensor)."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


def filtered_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Steps 3-5 for one row ``[V]``: tempered logits with the tokens top-k / top-p drop set to ``-inf``."""
    if cfg.greedy:
        raise ValueError("filtered_logits is for sampling; greedy takes the argmax of the raw logits")
    x = logits.float() / cfg.temperature
    if 0 < cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= cfg.top_p  # the set reached top_p before this token: drop it
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_row(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
               bitmask: torch.Tensor | None = None) -> int:
    """One token from one row of FP32 logits ``[V]`` (steps 1-6 of the module docstring)."""
    x = logits.float()
    if bitmask is not None:
        x = apply_bitmask(x, bitmask)
    if not bool(torch.isfinite(x).any()):
        raise ValueError("no token is allowed: the grammar bitmask (or the logits) excludes every token")
    if cfg.greedy:
        return int(torch.argmax(x))
    if generator is None:
        raise ValueError("sampling (temperature > 0) needs the request's torch.Generator")
    probs = torch.softmax(filtered_logits(x, cfg), dim=-1)
    if probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, cfgs: list[SamplingConfig], generators: list[torch.Generator | None],
           bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [B, V]`` -> ``long [B]``; row ``b`` uses ``cfgs[b]``,
    ``generators[b]`` and ``bitmask[b]`` (``bitmask`` None: no constraint on any row)."""
    b = logits.shape[0]
    if len(cfgs) != b or len(generators) != b:
        raise ValueError(f"{b} rows of logits but {len(cfgs)} configs and {len(generators)} generators")
    out = [sample_row(logits[i], cfgs[i], generators[i], None if bitmask is None else bitmask[i])
           for i in range(b)]
    return torch.tensor(out, dtype=torch.long)


def logprobs_of(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax of the raw FP32 logits: what ``logprobs`` report (before temperature / filters)."""
    return torch.log_softmax(logits.float(), dim=-1)
