"""Speculative decoding over any decode stepper (the reference ``K3ForCausalLM``, the standard path, or a
``DecodeExecutor``: the fast path's kernels): the verify step, the state committed after the accepted
prefix, the drafters, and ``SpecConfig`` (what ``Generator(spec=...)`` and an engine's ``+spec=`` run).

One verify step of a request feeds ``[last emitted, d_1 .. d_n]`` (``n <= k`` drafts): row ``i`` of the
target's logits scores the token after ``d_i`` (row 0 the token after the last emitted one).
``spec_sampler.verify_draft`` keeps ``a`` drafts and adds one token; the KDA recurrent and conv states
and the MLA cache must then be those after ``[last emitted, d_1 .. d_a]``: rejected drafts leave no trace.
On a ``DecodeExecutor`` built with ``spec_tokens >= n + 1``, ``verify_step`` runs the verify step fused
(``verify_step.py``: one step of ``B (n + 1)`` rows, GEMMs and experts at that M, the KDA recurrence over
each request's rows in one launch keeping every row's state in scratch slots, MLA causal inside the
draft) and ``commit`` copies back the states after the kept tokens. Otherwise (any other stepper, or the
executor's ``verify_reason``, which it records) it runs the positions as decode steps of the stepper
(column ``i`` for the requests with at least ``i`` drafts), keeping a copy of every KDA layer's state
after each; ``commit`` restores each request's state after its kept tokens. Either way the lengths move
to the kept tokens, so the MLA latents written for rejected drafts lie past the length and are never
attended (the next step overwrites them). A column-by-column position is exactly a plain decode step, so
greedy speculative decoding emits plain greedy decoding's tokens (bitwise, where the stepper's rows do not
depend on each other: ``tests/test_spec_decode.py``); a fused step computes each row as a decode row of a
larger batch (the same up to the rounding of GEMMs at another M).

Drafters (``propose(b, prompt, emitted, k) -> (tokens, probs | None)``: at most ``k`` drafts for request
``b`` (its index in the generator call) after its prompt and emitted tokens, with the distributions they
were drawn from, None when deterministic; ``SpecConfig.method`` names them):

- ``NgramDrafter`` (``ngram``, vLLM's prompt-lookup method): the longest suffix of the context of
  ``ngram_max`` down to ``ngram_min`` tokens that occurred earlier; its most recent earlier occurrence's
  next tokens are the draft (none when no suffix recurs). Independent of the target, so two engines with
  the same prompts and drafter draft from the same rule, and acceptance measures the target alone;
- ``DraftModelDrafter`` (``synthetic``): the reference model's own greedy continuation, each token kept
  with probability ``p`` (controlled acceptance at any engine, for the acceptance and sampling checks);
- ``SyntheticDrafter``: proposes the target's own next token (from ``oracle``, the target's continuation of
  each request, e.g. a plain greedy run) with probability ``p`` and another token otherwise, so acceptance
  is controlled (per position about ``p``; the first rejection ends a step): for ``equivalence.spec_decode``
  and perf points at chosen acceptance lengths.

- ``MTPDrafter`` (``mtp``): K3's next-token layer (``reference/mtp.py``; a config with
  ``num_nextn_predict_layers``, e.g. the preset spec ``k3-tiny:mtp=1``) chained greedily as vLLM's MTP
  proposer runs it: the target's hidden states of the context, then each draft fed back with the layer's
  own hidden state, one layer for every draft. A model without the layer is refused with the reason.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampler import SamplingConfig
from .spec_sampler import AcceptanceStats

MAX_DRAFT_TOKENS = 7  # a verify step holds at most 1 + 7 rows per request (vLLM's K3 specialized decode too)
METHODS = ("ngram", "synthetic", "mtp")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding as a generator or engine serves it: ``method`` with ``k`` drafts per step.

    ``parse("ngram:3")``, ``parse("ngram:3:min=2,max=4")``, ``parse("synthetic:3:p=0.8")``: the ``+spec=``
    value of an engine spec."""

    method: str = "ngram"
    k: int = 3
    ngram_min: int = 1
    ngram_max: int = 3
    p: float = 0.8  # synthetic: the probability each draft token is the draft model's own

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: one of {', '.join(METHODS)}")
        if not 1 <= self.k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"k = {self.k} draft tokens: a verify step holds 1 + k <= {MAX_DRAFT_TOKENS + 1} rows "
                             f"per request (k in 1..{MAX_DRAFT_TOKENS})")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes min {self.ngram_min} / max {self.ngram_max}: need 1 <= min <= max")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"synthetic acceptance p {self.p} must lie in [0, 1]")

    @classmethod
    def parse(cls, text: str) -> SpecConfig:
        method, _, rest = text.partition(":")
        k, _, opts = rest.partition(":")
        if not k.isdigit():
            raise ValueError(f"speculative config {text!r}: METHOD:K[:OPTIONS], e.g. ngram:3, ngram:3:min=1,max=3 "
                             "or synthetic:3:p=0.8")
        names = {"ngram": ("min", "max"), "synthetic": ("p",)}.get(method, ())
        kw: dict[str, Any] = {}
        for item in filter(None, opts.split(",")):
            key, eq, val = item.partition("=")
            try:
                if key not in names or not eq:
                    raise ValueError
                kw["p" if key == "p" else f"ngram_{key}"] = float(val) if key == "p" else int(val)
            except ValueError:
                raise ValueError(f"speculative config {text!r}: option {item!r} is not one of "
                                 f"{', '.join(n + '=N' for n in names) or 'none'} for {method}") from None
        return cls(method, int(k), **kw)

    def describe(self) -> str:
        extra = {"ngram": f":min={self.ngram_min},max={self.ngram_max}", "synthetic": f":p={self.p:g}"}
        return f"{self.method}:{self.k}{extra.get(self.method, '')}"

    def drafter(self, model: Any, seed: int = 0) -> Any:
        """The drafter for the reference ``K3ForCausalLM`` ``model`` (the synthetic drafter's draft model);
        ``ValueError`` when there is none of this kind."""
        if self.method == "ngram":
            return NgramDrafter(self.ngram_min, self.ngram_max)
        if self.method == "synthetic":
            return DraftModelDrafter(model, self.p, seed)
        if not getattr(model, "mtp_layers", None):
            raise ValueError(f"speculative method mtp: {getattr(model.cfg, 'name', 'the model')} has no next-token "
                             "(MTP) layer (config num_nextn_predict_layers is 0): use ngram or synthetic, or a "
                             "checkpoint with one (preset spec NAME:mtp=1)")
        return MTPDrafter(model)


class BatchedDrafter:
    """A drafter that proposes for many requests at once (``propose_batch``, which the generator calls);
    ``propose`` is one request of it."""

    def propose(self, b: int, prompt: Sequence[int], emitted: Sequence[int], k: int
                ) -> tuple[list[int], torch.Tensor | None]:
        return self.propose_batch([(b, prompt, emitted, k)])[0]

    def propose_batch(self, asks: Sequence[tuple[int, Sequence[int], Sequence[int], int]]
                      ) -> list[tuple[list[int], torch.Tensor | None]]:
        raise NotImplementedError


class DraftModelDrafter(BatchedDrafter):
    """The synthetic drafter at an engine: the reference model (``model``, the standard path on the engine's
    own weights) drafts its greedy continuation of the request, and each draft token is kept with
    probability ``p``, else replaced by another token. The draw for draft position ``j`` of a request is a
    function of (seed, prompt, j) only, so two engines with the same prompts get the same corruptions and
    the same drafts wherever their outputs agree. On the reference engine the drafts are the target's own
    tokens (greedy acceptance per position exactly the kept ones: about ``p``); on the fast path they are
    the reference's, so acceptance also measures how far the fast path's verify rows agree with it.
    Stateless: each verify step prefills every live request's context on ``model`` in one batch
    (``propose_batch``, which the generator calls when a drafter has it); the cost grows with the context: a
    check's drafter, not a production one."""

    def __init__(self, model: Any, p: float, seed: int = 0) -> None:
        self.model, self.p, self.seed = model, p, seed
        self.vocab = int(model.cfg.vocab_size)

    def _rng(self, prompt: Sequence[int], j: int) -> random.Random:
        import hashlib

        h = hashlib.blake2b(repr((self.seed, tuple(prompt), j)).encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(h, "little"))

    def _keep_or_replace(self, prompt: Sequence[int], j: int, tok: int) -> int:
        rng = self._rng(prompt, j)
        if rng.random() < self.p:
            return tok
        t = rng.randrange(self.vocab - 1)  # any token but the draft model's
        return t + 1 if t >= tok else t

    @torch.no_grad()
    def propose_batch(self, asks: Sequence[tuple[int, Sequence[int], Sequence[int], int]]
                      ) -> list[tuple[list[int], torch.Tensor | None]]:
        """``propose`` for many requests at once: one right-padded prefill of their contexts on the draft
        model and ``max k - 1`` batched greedy decode steps."""
        rows = [i for i, (_, _, _, k) in enumerate(asks) if k > 0]
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in asks]
        if not rows:
            return out
        ctxs = [list(asks[i][1]) + list(asks[i][2]) for i in rows]
        kmax = max(asks[i][3] for i in rows)
        dev = next(self.model.parameters()).device
        ids = torch.zeros(len(rows), max(len(c) for c in ctxs), dtype=torch.long)
        for r, c in enumerate(ctxs):
            ids[r, : len(c)] = torch.tensor(c)
        lens = torch.tensor([len(c) for c in ctxs])
        cache = self.model.new_cache(len(rows), int(lens.max()) + kmax)
        logits = self.model.prefill(ids.to(dev), lens.to(dev), cache)[torch.arange(len(rows)), (lens - 1).to(dev)]
        drafts: list[list[int]] = [[] for _ in rows]
        for i in range(kmax):
            best = logits.float().argmax(-1).tolist()
            for r, a in enumerate(rows):
                _, prompt, emitted, k = asks[a]
                if i < k:
                    drafts[r].append(self._keep_or_replace(prompt, len(emitted) + i, int(best[r])))
            if i + 1 < kmax:
                feed = torch.tensor([d[-1] if d else 0 for d in drafts], device=dev)
                logits = self.model.decode(feed, cache)
        for r, a in enumerate(rows):
            out[a] = (drafts[r], None)
        return out


class MTPDrafter(BatchedDrafter):
    """K3's next-token layer as vLLM's MTP proposer runs it (``vllm/v1/worker/gpu/spec_decode/mtp``), on the
    reference ``model`` (the standard path on the engine's own weights, like ``DraftModelDrafter``). For a
    context ``t_0 .. t_n`` (``t_n`` the last emitted token, not yet seen by the target): the target's hidden
    states ``h_0 .. h_{n-1}`` (``K3ForCausalLM.prefill_hidden`` over ``t_0 .. t_{n-1}``), the layer over the
    pairs ``(t_{p+1}, h_p)`` at positions ``p = 0 .. n-1`` (filling its own latent cache), draft 1 the argmax
    of the target's ``lm_head`` at the last pair; draft ``j`` then feeds ``(draft j-1, the layer's own s)`` at
    position ``n + j - 2``. The first layer serves every draft (vLLM's ``MTPSpeculator`` passes no step
    index). Stateless like ``DraftModelDrafter``: each call recomputes the contexts' hidden states (a check's
    drafter; vLLM reuses the verify step's own hidden states)."""

    def __init__(self, model: Any) -> None:
        self.model, self.layer = model, model.mtp_layers[0]

    @torch.no_grad()
    def propose_batch(self, asks: Sequence[tuple[int, Sequence[int], Sequence[int], int]]
                      ) -> list[tuple[list[int], torch.Tensor | None]]:
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in asks]
        rows = [i for i, (_, p, e, k) in enumerate(asks) if k > 0 and len(p) + len(e) >= 2]
        if not rows:
            return out
        m, dev = self.model, self.model.device
        ctxs = [list(asks[i][1]) + list(asks[i][2]) for i in rows]
        kmax = max(asks[i][3] for i in rows)
        n = torch.tensor([len(c) - 1 for c in ctxs], device=dev)  # pairs per row
        width = int(n.max())
        seen = torch.zeros(len(rows), width, dtype=torch.long, device=dev)  # t_0 .. t_{n-1}
        nxt = torch.zeros_like(seen)  # t_1 .. t_n
        for r, c in enumerate(ctxs):
            seen[r, : len(c) - 1] = torch.tensor(c[:-1])
            nxt[r, : len(c) - 1] = torch.tensor(c[1:])
        _, hidden = m.prefill_hidden(seen, n, m.new_cache(len(rows), width))
        cache = self.layer.new_cache(len(rows), width + kmax)
        embed = m.model.embed_tokens
        lh, s = self.layer(embed(nxt), hidden, cache, torch.zeros_like(n), n, mode="plain")
        last = torch.arange(len(rows), device=dev), n - 1
        lh, s = lh[last][:, None], s[last][:, None]
        drafts: list[list[int]] = [[] for _ in rows]
        for j in range(kmax):
            tok = m.lm_head(lh[:, 0]).float().argmax(-1)
            for r, a in enumerate(rows):
                if j < asks[a][3]:
                    drafts[r].append(int(tok[r]))
            if j + 1 < kmax:
                lh, s = self.layer(embed(tok[:, None]), s, cache, n + j, torch.ones_like(n), mode="absorbed")
        for r, a in enumerate(rows):
            out[a] = (drafts[r], None)
        return out


class NgramDrafter:
    """Prompt lookup (module docstring): deterministic, the same drafts for the same context."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, b: int, prompt: Sequence[int], emitted: Sequence[int], k: int
                ) -> tuple[list[int], torch.Tensor | None]:
        ctx = list(prompt) + list(emitted)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # most recent earlier occurrence first
                if ctx[start: start + n] == suffix:
                    return ctx[start + n: start + n + k], None
        return [], None


class SyntheticDrafter:
    """Drafts ``oracle[b][j]`` (the target's token at output position ``j`` of request ``b``) with probability
    ``p``, else a different token; deterministic (``probs`` None), seeded."""

    def __init__(self, oracle: Sequence[Sequence[int]], p: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"acceptance probability p must lie in [0, 1], got {p}")
        self.oracle, self.p, self.vocab, self.rng = [list(o) for o in oracle], p, vocab_size, random.Random(seed)

    def propose(self, b: int, prompt: Sequence[int], emitted: Sequence[int], k: int
                ) -> tuple[list[int], torch.Tensor | None]:
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


def kda_tensors(cache: Any) -> list[torch.Tensor]:
    """Every KDA tensor of ``cache`` (layer-major, ``KDACache.tensors`` order)."""
    from ..reference.kda import KDACache

    return [t for layer in cache.layers if isinstance(layer, KDACache) for t in layer.tensors()]


@dataclass(frozen=True)
class FusedVerify:
    """What ``commit`` needs after a fused verify step: the executor that ran it (it kept every row's KDA
    state in its pool's scratch slots)."""

    stepper: Any


def verify_step(stepper: Any, cache: Any, feed: torch.Tensor, active: torch.Tensor, fused: bool = True
                ) -> tuple[torch.Tensor, list[list[torch.Tensor]] | FusedVerify]:
    """``feed [B, n + 1]`` on ``cache``, column ``i`` for the rows ``active[:, i]`` (``active [B]``: the same
    rows every column) -> the logits ``[B, n + 1, V]`` (0 where inactive) and what ``commit`` needs. A
    stepper with fused verify steps (``DecodeExecutor.verify``) runs them in one step where it can
    (``verify_reason``, which it records otherwise); else (or ``fused=False``) the columns are decode steps, and
    after each of the first ``n`` a copy of every KDA tensor of the cache is kept (after the last the cache
    itself holds it)."""
    cols = feed.shape[1]
    act = active.reshape(-1, 1).expand(-1, cols) if active.dim() == 1 else active
    if fused and hasattr(stepper, "verify_reason"):
        reason = stepper.verify_reason(int(feed.shape[0]), int(cols), cache)
        if reason is None:
            return stepper.verify(feed, cache, act.contiguous()), FusedVerify(stepper)
        stepper.record_verify_split(reason)
    logits, states = [], []
    for i in range(cols):
        logits.append(stepper.decode(feed[:, i].contiguous(), cache, act[:, i].contiguous()))
        if i + 1 < cols:
            states.append([t.clone() for t in kda_tensors(cache)])
    return torch.stack(logits, 1), states


def commit(cache: Any, start: torch.Tensor, states: list[list[torch.Tensor]] | FusedVerify, keep: torch.Tensor
           ) -> None:
    """Each request ``b`` with ``keep[b] > 0`` back to its state after ``keep[b]`` fed tokens (KDA from
    ``states[keep[b] - 1]``, or the cache's own after all ``n + 1``; a fused step's from its executor's
    scratch slots; length ``start[b] + keep[b]``); requests with ``keep[b] == 0`` are untouched."""
    if isinstance(states, FusedVerify):
        states.stepper.commit_verify(cache, keep)
        return
    tensors = kda_tensors(cache)
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


@dataclass
class SpecResult:
    tokens: list[list[int]]  # per request, the emitted tokens (the first from the prefill's last row)
    cache: Any = None  # the committed cache: the prompt and every emitted token but the last
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    verify_steps: int = 0
    positions: int = 0  # decode steps the verify steps ran (one per column: at most k + 1 per verify step)


@torch.no_grad()
def speculative_generate(stepper: Any, prompt_ids: torch.Tensor, prompt_lens: torch.Tensor, drafter: Any, k: int,
                         max_new: int, cfg: SamplingConfig = SamplingConfig(), seeds: Sequence[int] | None = None
                         ) -> SpecResult:
    """``max_new`` tokens per request of right-padded ``prompt_ids [B, T]`` by verify steps of ``1 + k``
    tokens on ``stepper``: ``Generator(spec=...)``'s loop (stop tokens ignored), keeping the committed
    cache for inspection; the first token is sampled from the prefill's last row as in plain decoding."""
    from .generator import GenerationRequest, Generator

    SpecConfig("ngram", k)  # validates k
    bsz = prompt_ids.shape[0]
    seeds = list(seeds) if seeds is not None else [0] * bsz
    dev = prompt_ids.device
    gen = Generator(stepper, _vocab(stepper), int(prompt_lens.max()) + max_new, device=dev, max_batch=bsz,
                    spec=Speculation(drafter, k))
    reqs = [GenerationRequest(prompt_ids=prompt_ids[b, : int(prompt_lens[b])].tolist(), max_tokens=max_new,
                              sampling=cfg, seed=seeds[b], ignore_stop_tokens=True) for b in range(bsz)]
    outs, cache = gen.run_batch(reqs, keep_cache=True)
    return SpecResult([o.token_ids for o in outs], cache, gen.acceptance, gen.steps["verify_steps"],
                      gen.steps["decode_calls"])


def _vocab(stepper: Any) -> int:
    cfg = getattr(stepper, "cfg", None) or stepper.model.cfg
    return int(cfg.vocab_size)


@dataclass
class Speculation:
    """What a ``Generator`` drafts with: a drafter object and at most ``k`` drafts per verify step."""

    drafter: Any
    k: int
    label: str = ""

    @classmethod
    def from_config(cls, spec: SpecConfig, model: Any, seed: int = 0) -> Speculation:
        return cls(spec.drafter(model, seed), spec.k, spec.describe())

    def run(self, gen: Any, rows: list[Any], cache: Any, logits: torch.Tensor, words: int) -> None:
        """The generator's decode loop under this speculation (``spec_loop``)."""
        spec_loop(gen, rows, cache, logits, words)


def _draft_bitmasks(constraint: Any, draft: list[int], words: int) -> torch.Tensor:
    """The grammar's bitmask for each of the ``len(draft) + 1`` verify rows: the matcher advanced along the
    draft (row ``i`` after drafts ``0..i-1``) and rolled back. Rows after a draft token the grammar rejects
    (or after it terminated) allow everything: verify_draft rejects that token at its own row, so they are
    never examined."""
    masks = torch.full((len(draft) + 1, words), -1, dtype=torch.int32)
    advanced = 0
    for i in range(len(draft) + 1):
        if constraint.is_terminated():
            break
        constraint.fill_bitmask(masks[i])
        if i == len(draft) or not constraint.accept_token(draft[i]):
            break
        advanced += 1
    if advanced:
        constraint.rollback(advanced)
    return masks


def spec_loop(gen: Any, rows: list[Any], cache: Any, logits: torch.Tensor, words: int) -> None:
    """``Generator``'s decode loop under speculative decoding (``gen.spec``; the generator's docstring)."""
    from .spec_sampler import verify_draft

    spec = gen.spec
    for i, row in enumerate(rows):  # the first token: the prefill's last row, as plain decoding
        row.stats = AcceptanceStats()
        if row.finish is None:
            gen._step_row(row, logits[i], words)
    dev = gen.device
    while True:
        live = [i for i, row in enumerate(rows) if row.finish is None]
        if not live:
            return
        asks = [(rows[i].index, rows[i].req.prompt_ids, rows[i].tokens,
                 min(spec.k, rows[i].req.max_tokens - len(rows[i].tokens) - 1)) for i in live]
        if hasattr(spec.drafter, "propose_batch"):  # a draft model: one batched forward for every request
            proposed = spec.drafter.propose_batch(asks)
        else:
            proposed = [spec.drafter.propose(*a) if a[3] > 0 else ([], None) for a in asks]
        drafts: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        for i, (_, _, _, budget), (d, q) in zip(live, asks, proposed, strict=True):
            drafts[i] = (list(d)[:budget], None if q is None else q[: min(len(d), budget)])
        cols = 1 + max(len(d) for d, _ in drafts.values())
        feed = torch.zeros(len(rows), cols, dtype=torch.long)
        active = torch.zeros(len(rows), cols, dtype=torch.bool)
        for i, (d, _) in drafts.items():
            feed[i, : len(d) + 1] = torch.tensor([rows[i].tokens[-1], *d])  # a live row has emitted a token
            active[i, : len(d) + 1] = True
        start = cache.lengths.clone()
        out, states = verify_step(gen.stepper, cache, feed.to(dev), active.to(dev))
        out = out.float()
        gen.steps["verify_steps"] += 1
        gen.steps["decode_calls"] += cols
        keep = torch.zeros(len(rows), dtype=torch.long)
        for i, (d, q) in drafts.items():
            row = rows[i]
            masks = None if row.req.constraint is None else _draft_bitmasks(row.req.constraint, d, words)
            v = verify_draft(out[i, : len(d) + 1], torch.tensor(d, dtype=torch.long), row.req.sampling,
                             row.generator, q, masks)
            row.stats.add(len(d), v)
            gen.acceptance.add(len(d), v)
            for j, tok in enumerate(v.tokens):
                gen._take(row, int(tok), out[i, j])
                keep[i] = j + 1  # fed tokens whose state stays: the last emitted one and the kept drafts
                if row.finish is not None:
                    break
        commit(cache, start, states, keep)
