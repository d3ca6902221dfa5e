"""Speculative decoding over any decode stepper (the reference ``K3ForCausalLM``, the standard path, or a
``DecodeExecutor``: the fast path's kernels): verify steps of ``1 + k`` tokens per request, the acceptance
rule of ``spec_sampler``, the state committed after the accepted prefix, and the synthetic drafter.

One verify step of a request feeds ``[last emitted, d_1 .. d_k]``: row ``i`` of the target's logits scores
the token after ``d_i`` (row 0 the token after the last emitted one). ``spec_sampler.verify_draft`` keeps
``a`` drafts and adds one token; the KDA recurrent and conv states and the MLA cache must then be those
after ``[last emitted, d_1 .. d_a]``: rejected drafts leave no trace. ``verify_step`` runs the ``k + 1``
positions as ``k + 1`` decode steps of the stepper, keeping a copy of every KDA layer's state after each
(the per-token states a fused verify kernel keeps too); ``commit`` restores each request's state after its
accepted prefix and sets its length, so the MLA latents written for rejected drafts lie past the length and
are never attended (the next step overwrites them). Each position is exactly a plain decode step, so
greedy speculative decoding emits plain greedy decoding's tokens (bitwise, where the stepper's rows do not
depend on each other: ``tests/test_spec_decode.py``). Cost: ``k + 1`` decode steps per verify step and
``k + 1`` copies of the KDA states; the fused verify kernels of issue #22 (the KDA recurrence over the
``k + 1`` tokens in one launch, MLA with causal masking inside the draft, GEMMs at M = B(k + 1)) are what
make a verify step cost about one decode step.

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
            if right is None:  # past the oracle: any token
                out.append(self.rng.randrange(self.vocab))
            elif self.rng.random() < self.p:
                out.append(right)
            else:  # any token but the right one
                t = self.rng.randrange(self.vocab - 1)
                out.append(t + 1 if t >= right else t)
        return out, None


@dataclass
class SpecResult:
    tokens: list[list[int]]  # per request, the emitted tokens (the first from the prefill's last row)
    cache: Any = None  # the committed cache: the prompt and every emitted token but the last
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    verify_steps: int = 0


def _kda_tensors(cache: Any) -> list[torch.Tensor]:
    from ..reference.kda import KDACache

    return [t for layer in cache.layers if isinstance(layer, KDACache) for t in layer.tensors()]


def verify_step(stepper: Any, cache: Any, feed: torch.Tensor, active: torch.Tensor
                ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """``feed [B, k + 1]`` decoded position by position on ``cache`` (rows ``active``): the logits
    ``[B, k + 1, V]`` and, after each of the first ``k`` positions, a copy of every KDA tensor of the cache
    (``commit``; after the last position the cache itself holds it)."""
    logits, states = [], []
    for i in range(feed.shape[1]):
        logits.append(stepper.decode(feed[:, i].contiguous(), cache, active))
        if i + 1 < feed.shape[1]:
            states.append([t.clone() for t in _kda_tensors(cache)])
    return torch.stack(logits, 1), states


def commit(cache: Any, start: torch.Tensor, states: list[list[torch.Tensor]], keep: torch.Tensor) -> None:
    """Each request ``b`` with ``keep[b] > 0`` back to its state after ``keep[b]`` fed tokens (KDA from
    ``states[keep[b] - 1]``, or the cache's own after all ``k + 1``; length ``start[b] + keep[b]``);
    requests with ``keep[b] == 0`` are untouched."""
    tensors = _kda_tensors(cache)
    for n in range(1, len(states) + 1):
        group = (keep == n).nonzero().flatten()
        if len(group):
            for t, kept in zip(tensors, states[n - 1], strict=True):
                idx = group.to(t.device)
                t[idx] = kept[idx]
    rows = (keep > 0).nonzero().flatten().tolist()
    lengths = cache.lengths.clone()
    lengths[rows] = (start.to(lengths.device) + keep.to(lengths.device))[rows]
    cache.lengths = lengths
    if hasattr(cache, "length_bound"):  # a PooledCache: the host-side bound of its lengths
        cache.length_bound = int(lengths.max())


@torch.no_grad()
def speculative_generate(stepper: Any, prompt_ids: torch.Tensor, prompt_lens: torch.Tensor, drafter: Any, k: int,
                         max_new: int, cfg: SamplingConfig = SamplingConfig(),
                         generators: Sequence[torch.Generator | None] | None = None, max_len: int | None = None
                         ) -> SpecResult:
    """``max_new`` tokens per request of right-padded ``prompt_ids [B, T]`` by verify steps of ``1 + k``
    tokens on ``stepper`` (module docstring); the first token is sampled from the prefill's last row as in
    plain decoding. A ``DecodeExecutor`` allocates its own cache (``new_cache``), the reference a plain one."""
    if not 1 <= k <= 7:
        raise ValueError(f"k = {k} draft tokens: a verify step holds 1 + k <= 8 rows per request (k in 1..7)")
    bsz = prompt_ids.shape[0]
    gens = list(generators) if generators is not None else [None] * bsz
    max_len = max_len or int(prompt_lens.max()) + max_new + k + 1
    cache = stepper.new_cache(bsz) if hasattr(stepper, "warmup_and_capture") else stepper.new_cache(bsz, max_len)
    last = stepper.prefill(prompt_ids, prompt_lens, cache)[torch.arange(bsz), prompt_lens - 1]
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
        start = cache.lengths.clone()
        logits, states = verify_step(stepper, cache, feed.to(dev), torch.tensor(active, device=dev))
        keep = torch.zeros(bsz, dtype=torch.long)
        for b, (draft, probs) in drafts.items():
            v = verify_draft(logits[b], torch.tensor(draft), cfg, gens[b], probs)
            res.stats.add(k, v)
            new = v.tokens[: max_new - len(res.tokens[b])]  # a request ends at max_new tokens
            keep[b] = len(new)  # fed: the last emitted token and the accepted drafts that are emitted
            res.tokens[b] = res.tokens[b] + list(new)
        commit(cache, start, states, keep)
        res.verify_steps += 1
