"""Routing for the HBM floor: how many distinct routed experts a decode step touches, per MoE layer.

Two sources, both giving per-MoE-layer counts that ``floor.step_bytes(touched=...)`` consumes:

* **uniform**: every token picks its top-k as a uniformly random k-subset of the experts; the expected
  distinct count is ``floor.expected_distinct_experts(E, k, B)`` (the same for every layer).
* **real**: the routing the reference model actually produces. ``RoutingRecorder`` hooks every
  ``LatentMoE`` router (``MoEGate``) of a ``K3ForCausalLM`` and records the chosen expert ids per token;
  ``record_prompt_routing`` runs a prefill over prompts and keeps them per (sequence, position);
  ``touched_from_trace`` then draws decode batches (one token from each of B different sequences, as a
  decode step has) and counts distinct experts per layer, averaged over draws. ``touched_in_step`` counts
  them for one actual decode step (the step a sweep point times).

Real prompts (``prompt_token_ids``): text from ``k3_fastpath.tokenizer`` (the locally trained tiny BPE;
its generated English-like prose, JSON and chat turns, drawn with a seed different from the training
corpus), tokenized and cut into prompts. When the tokenizer cannot be built here (``tokenizers`` /
``transformers`` missing), seeded random token ids are used instead; the returned ``source`` says which.
With synthetic weights the "real" routing is the synthetic model's routing of real text, not K3's.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..config import K3Config

TOKENIZER_MAX_VOCAB = 4096  # k3_fastpath.tokenizer.MAX_VOCAB: larger model vocabularies use its ids < 4096
PROMPT_TEXT_SEED = 7  # the text is drawn with another seed than the tokenizer's training corpus (0)


@functools.lru_cache(maxsize=4)
def _tokenizer(vocab: int):
    """The tiny tokenizer of ``vocab`` tokens, trained once per process (training takes seconds)."""
    from ..tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(vocab, seed=0)


def prompt_token_ids(cfg: K3Config, n_prompts: int, length: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """``[n_prompts, length]`` int64 token ids of real text, and where they came from (one line)."""
    if n_prompts < 1 or length < 1:
        raise ValueError(f"need n_prompts >= 1 and length >= 1, got {n_prompts}, {length}")
    vocab = min(cfg.vocab_size, TOKENIZER_MAX_VOCAB)
    try:
        from ..tokenizer import tiny_corpus

        tok = _tokenizer(vocab)
    except Exception as e:  # tokenizers/transformers absent, or a vocab the tiny tokenizer cannot train
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, cfg.vocab_size, (n_prompts, length), generator=g)
        return ids, f"seeded random token ids (seed {seed}; tokenizer unavailable: {type(e).__name__}: {e})"
    docs = tiny_corpus(PROMPT_TEXT_SEED + seed, n_docs=max(64, 4 * n_prompts))
    random.Random(seed).shuffle(docs)
    stream: list[int] = []
    for d in docs:
        stream.extend(tok.encode(d, add_special_tokens=False))
        if len(stream) >= n_prompts * length:
            break
    while len(stream) < n_prompts * length:  # a tiny vocab compresses little: repeat the text if short
        stream.extend(stream[: n_prompts * length - len(stream)])
    ids = torch.tensor(stream[: n_prompts * length], dtype=torch.long).reshape(n_prompts, length)
    return ids, (f"tiny BPE tokenizer (vocab {vocab}, k3_fastpath.tokenizer) on generated text "
                  f"(tiny_corpus seed {PROMPT_TEXT_SEED + seed})")


def _moe_gates(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, MoEGate module) of every MoE layer of a reference ``K3ForCausalLM``."""
    out = []
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            out.append((i, moe.gate))
    return out


class RoutingRecorder:
    """Collects ``expert_ids [N, k]`` from every router call, per MoE layer, in call order."""

    def __init__(self, model) -> None:
        self.layers = [i for i, _ in _moe_gates(model)]
        self.calls: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}
        self._model = model

    @contextmanager
    def active(self) -> Iterator[RoutingRecorder]:
        handles = []
        for i, gate in _moe_gates(self._model):
            def hook(module, args, output, layer=i):
                self.calls[layer].append(output[0].detach().to("cpu"))
            handles.append(gate.register_forward_hook(hook))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def touched(self) -> list[int]:
        """Distinct experts each MoE layer routed to over everything recorded (one step: that step's)."""
        return [int(torch.unique(torch.cat(self.calls[i]) if self.calls[i] else torch.empty(0)).numel())
                for i in self.layers]


@dataclass(frozen=True)
class RoutingTrace:
    """Recorded routing of a prefill: per MoE layer ``ids [B, T, k]`` (-1 at padded positions)."""

    layers: tuple[int, ...]
    ids: tuple[torch.Tensor, ...]
    lengths: torch.Tensor  # [B]
    source: str

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.shape[0])


@torch.no_grad()
def record_prompt_routing(model, input_ids: torch.Tensor, lengths: torch.Tensor | None = None,
                          source: str = "") -> RoutingTrace:
    """Prefill ``input_ids [B, T]`` through the reference ``model`` and record every token's experts."""
    b, t = input_ids.shape
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.long)
    lengths = lengths.to(torch.long).cpu()
    rec = RoutingRecorder(model)
    cache = model.new_cache(b, t)
    with rec.active():
        model.prefill(input_ids.to(model.device), lengths.to(model.device), cache)
    valid = torch.arange(t)[None, :] < lengths[:, None]
    k = model.cfg.num_experts_per_token
    out = []
    for layer in rec.layers:
        calls = rec.calls[layer]
        if len(calls) != 1:
            raise RuntimeError(f"MoE layer {layer}: expected one router call in a prefill, saw {len(calls)}")
        ids = torch.full((b, t, k), -1, dtype=torch.long)
        ids[valid] = calls[0].to(torch.long)  # the layer routes the valid tokens in row-major (b, t) order
        out.append(ids)
    return RoutingTrace(tuple(rec.layers), tuple(out), lengths, source)


def touched_from_trace(trace: RoutingTrace, batch: int, draws: int = 32, seed: int = 0) -> list[float]:
    """Mean distinct experts per MoE layer over ``draws`` decode-like batches drawn from ``trace``.

    A draw picks ``batch`` different sequences (with replacement only when the trace holds fewer) and one
    valid position in each: the tokens one decode step would route together.
    """
    if batch < 1 or draws < 1:
        raise ValueError(f"need batch >= 1 and draws >= 1, got {batch}, {draws}")
    rng = random.Random(seed)
    seqs = [s for s in range(trace.num_sequences) if int(trace.lengths[s]) > 0]
    if not seqs:
        raise ValueError("the routing trace holds no valid token")
    totals = [0.0] * len(trace.layers)
    for _ in range(draws):
        picked = rng.sample(seqs, batch) if batch <= len(seqs) else [rng.choice(seqs) for _ in range(batch)]
        pos = [rng.randrange(int(trace.lengths[s])) for s in picked]
        for li, ids in enumerate(trace.ids):
            chosen = torch.stack([ids[s, p] for s, p in zip(picked, pos, strict=True)])
            totals[li] += torch.unique(chosen).numel()
    return [x / draws for x in totals]


@torch.no_grad()
def touched_in_step(model, step) -> list[int]:
    """Distinct experts per MoE layer routed during ``step()`` (a callable running one decode step of the
    reference ``model``, or of anything that calls its ``LatentMoE`` modules)."""
    rec = RoutingRecorder(model)
    with rec.active():
        step()
    if any(not rec.calls[i] for i in rec.layers):
        raise RuntimeError("the step ran no reference MoE router: its routing cannot be recorded this way")
    return rec.touched()
