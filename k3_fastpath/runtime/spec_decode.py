"""Speculative decoding on the reference model (the standard path): verify steps of ``1 + k`` tokens per
request, the acceptance rule of ``spec_sampler``, the state committed after the accepted prefix, and the
synthetic drafter the perf points use.

One verify step of a request feeds ``[last emitted, d_1 .. d_k]``: row ``i`` of the target's logits scores
the token after ``d_i`` (row 0 the token after the last emitted one). ``spec_sampler.verify_draft`` keeps
``a`` drafts and adds one token. The KDA recurrent and conv states and the MLA latents must then be those
after ``[last emitted, d_1 .. d_a]``: rejected drafts leave no trace. Here the verify step runs on a copy of
the cache and the accepted ``a + 1`` tokens are then fed to the real cache (``K3ForCausalLM.prefill``
continues from ``cache.lengths``, with per-request lengths: inactive and finished requests feed 0 tokens and
keep their state bit for bit); the fast path's verify kernels keep each token's state instead (issue #22).
Both passes use the prefill's numerics (MLA not absorbed), so greedy speculative decoding equals plain greedy
decoding up to the prefill-vs-decode rounding: exactly, in FP64 (``tests/test_spec_decode.py``).

``SyntheticDrafter``: proposes the target's own next token (from ``oracle``, the target's continuation of
each request, e.g. a plain greedy run) with probability ``p`` and another token otherwise, so acceptance is
controlled (per position about ``p``; the first rejection ends a step). K3's next-token (MTP) layer is the
other drafter the issue names; no preset here has one (no ``num_nextn_predict_layers``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampler import SamplingConfig, sample_row
from .spec_sampler import AcceptanceStats, verify_draft


class SyntheticDrafter:
    """Drafts ``oracle[b][j]`` (the target's token at output position ``j`` of request ``b``) with probability
    ``p``, else a different token; deterministic (``probs`` None), seeded."""

    def __init__(self, oracle: Sequence[Sequence[int]], p: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"acceptance probability p must lie in [0, 1], got {p}")
        self.oracle, self.p, self.vocab, self.rng = [list(o) for o in oracle], p, vocab_size, random.Random(seed)

    def propose(self, b: int, emitted: Sequence[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        out = []
        for i in range(k):
            j = len(emitted) + i
            right = self.oracle[b][j] if j < len(self.oracle[b]) else None
            if right is not None and self.rng.random() < self.p:
                out.append(right)
            else:
                t = self.rng.randrange(self.vocab - 1)
                out.append(t + 1 if right is not None and t >= right else t)
        return out, None


@dataclass
class SpecResult:
    tokens: list[list[int]]  # per request, the emitted tokens (the first from the prefill's last row)
    cache: Any = None  # the committed cache: the prompt and every fed token that was accepted
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    verify_steps: int = 0


def _copy(model: Any, cache: Any, max_len: int) -> Any:
    from .cache_pool import copy_cache

    return copy_cache(model.new_cache(cache.batch, max_len), cache)


@torch.no_grad()
def speculative_generate(model: Any, prompt_ids: torch.Tensor, prompt_lens: torch.Tensor, drafter: Any, k: int,
                         max_new: int, cfg: SamplingConfig = SamplingConfig(),
                         generators: Sequence[torch.Generator | None] | None = None, max_len: int | None = None
                         ) -> SpecResult:
    """``max_new`` tokens per request of right-padded ``prompt_ids [B, T]`` by verify steps of ``1 + k``
    tokens (module docstring); the first token is sampled from the prefill's last row as in plain decoding."""
    if not 1 <= k <= 7:
        raise ValueError(f"k = {k} draft tokens: a verify step holds 1 + k <= 8 rows per request (k in 1..7)")
    bsz = prompt_ids.shape[0]
    gens = list(generators) if generators is not None else [None] * bsz
    max_len = max_len or int(prompt_lens.max()) + max_new + k + 1
    cache = model.new_cache(bsz, max_len)
    last = model.prefill(prompt_ids, prompt_lens, cache)[torch.arange(bsz), prompt_lens - 1]
    res = SpecResult([[sample_row(last[b], cfg, gens[b])] for b in range(bsz)], cache)
    dev = prompt_ids.device
    while True:
        active = [len(t) < max_new for t in res.tokens]
        if not any(active):
            return res
        feed = torch.zeros(bsz, k + 1, dtype=torch.long)
        drafts: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        for b in range(bsz):
            if active[b]:
                drafts[b] = drafter.propose(b, res.tokens[b], k)
                feed[b] = torch.tensor([res.tokens[b][-1], *drafts[b][0]])
        lens = torch.tensor([k + 1 if a else 0 for a in active])
        logits = model.prefill(feed.to(dev), lens, _copy(model, cache, max_len))
        keep = torch.zeros(bsz, dtype=torch.long)
        for b, (draft, probs) in drafts.items():
            v = verify_draft(logits[b], torch.tensor(draft), cfg, gens[b], probs)
            res.stats.add(k, v)
            keep[b] = v.accepted + 1
            res.tokens[b] = (res.tokens[b] + list(v.tokens))[:max_new]
        model.prefill(feed.to(dev), keep, cache)  # commit: [last emitted, accepted drafts] only
        res.verify_steps += 1
