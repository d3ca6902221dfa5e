"""The vLLM route's decode step on vLLM's own caches, in place: no executor pool, no import / export.

A routed decode step (``InPlaceRouter.run``) is the executor's fast step (``DecodeExecutor.decode_in_place``)
over vLLM's per-layer cache tensors themselves, every per-request index being vLLM's own device tensor:

- KDA: ``kernels/kda_decode`` on vLLM's packed conv window ``[N, W-1, 3C]`` and ``[N, h, V, K]`` recurrent state
  (``kda_decode_vllm``), at vLLM's state indices (``non_spec_state_indices_tensor``; -1 pads a row);
- each layer's indices from its own metadata: vLLM's hybrid allocator puts the layers in cache groups (our
  k3-tiny checkpoint on vLLM-CPU: two groups of KDA layers, one of MLA layers), each group with its own state
  indices / blocks per request over one shared buffer, so a request has different indices in different layers;
- MLA: the new latent written at position ``seq_len - 1`` through vLLM's block table (a padded row writes
  into vLLM's null block 0), ``kernels/mla_decode`` over vLLM's paged cache with that block table and
  ``seq_lens``. vLLM splits a hybrid model's large cache blocks into the MLA backend's kernel blocks (64) and
  binds that view to the layer, its metadata's block table in the same units: the page size is the bound
  cache's (``InPlaceRouter`` reads it there), not ``cache_config.block_size``.

Both kernels take the stride between state indices / pages as a launch parameter, so vLLM's hybrid layouts
(a KDA layer's conv window and state sharing one padded page; MLA pages interleaved by block) are read where
they lie. Nothing in the step reads a device value on the host, so vLLM can capture it in its FULL decode
CUDA graph: the decision to route is made from the metadata's host-side counts (``classify_in_place``) when
vLLM captures the graph for a batch size, and baked in; a replay runs the captured step on the new indices.
Rows past the real requests (vLLM's padding) carry index -1 and write only the null block. A replay does not
call ``forward``: the captured step increments a device counter, and ``flush`` (before every step vLLM's own
forward runs) traces the replayed steps as one record of that ``count``; the capture itself is traced with
``count`` 0 and the kernels the graph holds.

What this serves: plain decode steps (no speculative decoding: vLLM's verify steps keep a conv window of
``W-1+k`` inputs shifted by ``num_accepted_tokens``, which ``kda_decode_vllm`` does not implement; the route
keeps the import / export router for them, ``vllm_routing.VllmDecodeRouter``), at the layouts
``in_place_reason`` accepts. vLLM's caches are always current, so a fallback step needs no sync.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..kernels.mla_decode.api import PAGE_SIZE as MLA_PAGE  # mla_decode pages by multiples of it
from ..reference.mla import FP8
from ..runtime.envelope import PREFILL_REASON
from ..runtime.fast_step import StepIO
from ..runtime.graphs import capturing
from ..runtime.trace import StepRecord
from .vllm_state import VllmLayout, as_kv, bound_key, kda_tensors, layout_reason, mla_tensor


@dataclass
class VllmKdaLayer:
    """One KDA layer's vLLM cache as the fast step reads it in place, with the step's state indices of its
    cache group (``slot`` [B] int32, -1 / 0 pads)."""

    conv: torch.Tensor  # [N, W-1, 3C] packed q|k|v window
    state: torch.Tensor  # [N, h, V, K] FP32
    slot: torch.Tensor | None = None
    vllm_layout = True


@dataclass
class VllmMlaLayer:
    """One MLA layer's vLLM paged latent cache ``[pages, page_size, rank + rope]`` (FP8 as e4m3), with the step's
    ``paged`` = (block_table [B, pages] int32, ctx_len [B] int32, new latent's page [B], offset [B]) of its
    cache group."""

    latent: torch.Tensor
    scale: torch.Tensor | None
    paged: tuple[torch.Tensor, ...] | None = None


@dataclass
class VllmCacheView:
    """vLLM's caches of every layer, in the executor's step's ``pool.layers`` order."""

    layers: list[Any]


def cache_view(cfg: Any, vllm_caches: list[Any], kv_dtype: torch.dtype, kv_scale: float | None,
               device: torch.device) -> VllmCacheView:
    """vLLM's per-layer caches as the step's layers (no indices yet: ``step_inputs`` adds each step's); an FP8
    MLA cache (stored as bytes) viewed as e4m3 with the executor's scale."""
    scale = torch.tensor([kv_scale if kv_scale is not None else 1.0], dtype=torch.float32, device=device)
    layers: list[Any] = []
    for i, kv in enumerate(vllm_caches):
        if cfg.is_kda_layer(i):
            conv, rec, _ = kda_tensors(kv)
            layers.append(VllmKdaLayer(conv, rec))
        else:
            layers.append(VllmMlaLayer(as_kv(mla_tensor(kv), kv_dtype), scale if kv_dtype == FP8 else None))
    return VllmCacheView(layers)


def in_place_reason(cfg: Any, vllm_caches: list[Any], layout: VllmLayout, *, conv_dtype: torch.dtype,
                    kv_dtype: torch.dtype) -> str | None:
    """Why the fast step cannot run on vLLM's caches in place (None: it can): what ``layout_reason`` says,
    speculative decoding, a block size the MLA kernel does not page by, strides that break the kernels'
    16-byte state vectors or page copies. One line."""
    why = layout_reason(cfg, vllm_caches, layout, conv_dtype=conv_dtype, kv_dtype=kv_dtype)
    if why:
        return why
    if layout.num_spec:
        return f"speculative decoding ({layout.num_spec} tokens): vLLM's verify-step conv window is not read in place"
    if layout.block_size % MLA_PAGE:
        return f"MLA block size {layout.block_size} is not a multiple of {MLA_PAGE} (mla_decode's page)"
    for i, kv in enumerate(vllm_caches):
        if cfg.is_kda_layer(i):
            conv, rec, _ = kda_tensors(kv)
            if not (conv[0].is_contiguous() and rec[0].is_contiguous()) or (rec.stride(0) * 4) % 16:
                return f"layer {i}: KDA state index stride {rec.stride(0)} (or a non-compact index) breaks 16-byte access"
        else:
            lat = mla_tensor(kv)
            if not lat[0].is_contiguous() or (lat.stride(0) * lat.element_size()) % 16:
                return f"layer {i}: MLA page stride {lat.stride(0)} elements breaks 16-byte copies"
    return None


def classify_in_place(attn_metadata: Any, kda_layer: str, mla_layer: str, *, max_batch: int,
                      num_tokens: int) -> tuple[str | None, int]:
    """(fallback reason or None, batch) of one forward call, from the metadata's host-side counts only (no
    device read: vLLM may be capturing this call into a CUDA graph)."""
    if attn_metadata is None:
        return "no attention metadata (vLLM profile / dummy run)", 0
    if isinstance(attn_metadata, list):
        return "micro-batched step (dual batch overlap)", 0
    kda, mla = attn_metadata.get(kda_layer), attn_metadata.get(mla_layer)
    if kda is None or mla is None:
        return f"no metadata for layer {kda_layer if kda is None else mla_layer}", 0
    b = int(kda.num_decodes)
    if kda.num_prefills or mla.num_prefills:
        return PREFILL_REASON, b + int(kda.num_prefills)
    if kda.num_spec_decodes:
        return f"speculative decoding ({kda.num_spec_decode_tokens} tokens of {kda.num_spec_decodes} requests)", b
    if b == 0:
        return "no decode tokens in step", 0
    if not (kda.num_decode_tokens == b == mla.num_decodes == mla.num_decode_tokens):
        return (f"not one token per request (KDA {kda.num_decode_tokens} tokens / {b} requests, MLA "
                f"{mla.num_decode_tokens} / {mla.num_decodes})"), b
    if b > max_batch:
        return f"batch {b} > {max_batch} (the executor's max_batch)", b
    if mla.decode is None or kda.non_spec_state_indices_tensor is None:
        return "decode metadata missing (MLA decode / KDA state indices)", b
    short = [n for n, t in (("KDA state indices", kda.non_spec_state_indices_tensor),
                            ("MLA block table", mla.decode.block_table), ("MLA seq_lens", mla.decode.seq_lens))
             if t.shape[0] < b]
    if short or num_tokens < b:
        return f"metadata shorter than the batch of {b}: {', '.join(short) or 'token ids'}", b
    return None, b


def kda_slot(meta: Any, batch: int) -> torch.Tensor:
    """A KDA cache group's state indices of the step's rows (a view of vLLM's buffer where it is int32)."""
    return meta.non_spec_state_indices_tensor[:batch].to(torch.int32)


def mla_index(meta: Any, batch: int, page_size: int, live: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An MLA cache group's (block_table, ctx_len, page, offset) of the step's rows: each row's new latent goes
    where vLLM's MLA decode will read it, page ``block_table[b, p // page_size]``, offset ``p % page_size``,
    p = ``seq_len - 1`` (the table in the units of the bound cache's pages: vLLM splits a hybrid model's cache
    blocks into the backend's kernel blocks and binds that view); a padded row (``live`` false) writes the
    null page 0. Device ops only: capturable."""
    table = meta.decode.block_table[:batch].to(torch.int32)
    ctx = meta.decode.seq_lens[:batch].to(torch.int32)
    p = (ctx.long() - 1).clamp_(min=0)
    page = table.gather(1, torch.div(p, page_size, rounding_mode="floor")[:, None])[:, 0].long()
    return table, ctx, torch.where(live, page, 0), torch.where(live, p % page_size, 0)


def step_inputs(attn_metadata: Any, names: list[str], base: VllmCacheView, batch: int, input_ids: torch.Tensor,
                positions: torch.Tensor, hidden: torch.Tensor) -> tuple[StepIO, VllmCacheView]:
    """The step's ``StepIO`` and its cache view, every layer with its own cache group's indices (vLLM's hybrid
    allocator gives each group of layers its own state indices / blocks per request: layer ``names[i]``'s
    metadata is its group's), as views of or device ops on vLLM's tensors. The active mask: the first KDA
    layer's index > 0 (vLLM pads every group's rows alike)."""
    kda = [n for n, c in zip(names, base.layers, strict=True) if isinstance(c, VllmKdaLayer)]
    first = kda_slot(attn_metadata[kda[0]], batch)
    live = first > 0
    groups: dict[int, Any] = {id(attn_metadata[kda[0]]): first}  # id(metadata) -> its indices, once per group
    layers: list[Any] = []
    for name, layer in zip(names, base.layers, strict=True):
        meta = attn_metadata[name]
        if id(meta) not in groups:
            groups[id(meta)] = (kda_slot(meta, batch) if isinstance(layer, VllmKdaLayer)
                                else mla_index(meta, batch, layer.latent.shape[1], live))
        layers.append(VllmKdaLayer(layer.conv, layer.state, groups[id(meta)]) if isinstance(layer, VllmKdaLayer)
                      else VllmMlaLayer(layer.latent, layer.scale, groups[id(meta)]))
    io = StepIO(tokens=input_ids[:batch].long(), slot=first, pos=positions[:batch].long(), active=live,
                logits=hidden.new_empty(batch, 0, dtype=torch.float32), hidden=hidden[:batch])
    return io, VllmCacheView(layers)


@dataclass(frozen=True)
class InPlacePlan:
    """One forward call: routed (``reason`` None) or not, with what a routed step reads."""

    reason: str | None
    batch: int = 0
    kind: str = "decode"  # "decode" | "prefill" | "profile"
    attn_metadata: Any = None
    positions: torch.Tensor | None = None

    @property
    def route(self) -> bool:
        return self.reason is None


class InPlaceRouter:
    """The route's side of a vLLM K3 model whose decode steps run on vLLM's caches in place (module docstring).
    ``vllm_layers[i]``: vLLM's layer ``i`` attention module (its ``kv_cache`` read at every step), ``names[i]``
    its name in the forward context's metadata."""

    def __init__(self, executor: Any, vllm_layers: list[Any], layout: VllmLayout, names: list[str]) -> None:
        self.ex = executor
        self.cfg = executor.model.cfg
        self.layers = vllm_layers
        self.layout = layout
        self.names = list(names)  # every layer's name: the key of its cache group's metadata
        self.kda_name = next(n for i, n in enumerate(self.names) if self.cfg.is_kda_layer(i))
        self.mla_name = next(n for i, n in enumerate(self.names) if not self.cfg.is_kda_layer(i))
        self._checked: tuple[int, ...] | None = None
        self._reason: str | None = None
        self._view: VllmCacheView | None = None
        self._ran: torch.Tensor | None = None  # steps run by replays of vLLM's graphs, counted on the device
        self._flushed = 0

    def caches(self) -> list[Any]:
        return [layer.kv_cache for layer in self.layers]

    def layout_problem(self) -> str | None:
        caches = self.caches()
        key = bound_key(caches)
        if key != self._checked:
            mla = next((kv for i, kv in enumerate(caches) if not self.cfg.is_kda_layer(i)), None)
            if isinstance(mla, torch.Tensor) and mla.dim() in (3, 4):  # the bound view's page: vLLM's kernel block
                self.layout = replace(self.layout, block_size=int(mla_tensor(mla).shape[1]))
            self._reason = in_place_reason(self.cfg, caches, self.layout, conv_dtype=self.ex.dtype,
                                           kv_dtype=self.ex.kv_dtype)
            self._view = None if self._reason else cache_view(self.cfg, caches, self.ex.kv_dtype, self.ex.kv_scale,
                                                              self.ex.device)
            self._checked = key
        return self._reason

    def plan(self, attn_metadata: Any, positions: torch.Tensor) -> InPlacePlan:
        why, b = classify_in_place(attn_metadata, self.kda_name, self.mla_name, max_batch=self.ex.max_batch,
                                   num_tokens=int(positions.shape[-1]))
        if why is None:
            missing = [n for n in self.names if n not in attn_metadata]
            why = f"no metadata for {len(missing)} layers (first {missing[0]})" if missing else None
        if why is None and not self.ex.fast:
            why = f"executor: {self.ex.model_reason or self.ex.backend}"
        if why is None:
            layout = self.layout_problem()
            why = f"cache layout: {layout}" if layout else None
        kind = "prefill" if why == PREFILL_REASON else "profile" if attn_metadata is None else "decode"
        return InPlacePlan(why, b, kind, attn_metadata if why is None else None, positions if why is None else None)

    def run(self, plan: InPlacePlan, input_ids: torch.Tensor) -> torch.Tensor:
        """One routed decode step on vLLM's caches; returns each request's hidden state ``[batch, hidden]``
        (what vLLM's K3 ``forward`` returns for those tokens)."""
        hidden = torch.empty(plan.batch, self.cfg.hidden_size, dtype=self.ex.dtype, device=input_ids.device)
        io, view = step_inputs(plan.attn_metadata, self.names, self._view, plan.batch, input_ids, plan.positions,
                               hidden)
        out = self.ex.decode_in_place(io, view)  # traced: once if it ran, with count 0 if captured
        if capturing(self.ex.device):  # each replay of vLLM's graph counts itself here, on the device
            if self._ran is None:
                raise RuntimeError("in-place step captured before any eager run: vLLM warms up before capturing")
            self._ran.add_(1)
        elif self._ran is None:
            self._ran = torch.zeros((), dtype=torch.int64, device=self.ex.device)
        return out

    def flush(self) -> int:
        """Trace the steps replays of vLLM's graphs ran since the last flush (one record, ``count`` of them, read
        from the device counter the captured steps increment); nothing while a capture is under way. Returns
        how many."""
        if self._ran is None or capturing(self.ex.device):
            return 0
        n = int(self._ran.item()) - self._flushed
        if n:
            self._flushed += n
            self.ex.trace.record(StepRecord(0, self.ex.backend, 0, None, graph=True, count=n))
        return n

    def sync_back(self, plan: Any = None) -> int:
        """Nothing to hand back (vLLM's caches are the step's own); before vLLM's forward runs a step, the
        replayed steps so far are traced (``flush``)."""
        self.flush()
        return 0

    def record_fallback(self, plan: Any) -> None:
        """Trace a step vLLM's own forward ran (``fallback: "vllm standard path: <reason>"``)."""
        from .vllm_routing import VLLM_PATH

        self.ex.trace.record(StepRecord(0, self.ex.backend, plan.batch, None, fallback=f"{VLLM_PATH}: {plan.reason}",
                                        kind=plan.kind))
