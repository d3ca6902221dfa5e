"""Rank emulation on one GPU: one tensor-parallel rank's share of K3, built and timed as a TP1 model.

``emulation_model("k3-tp16-rank", seed, "cuda")`` builds rank 0 of TP16 (``device_synthetic.device_model``
with ``tp=16, rank=0``): a reference model of ``tp.rank_config(cfg, 16)`` holding exactly the rank's share
of the seeded synthetic checkpoint, in the real formats (BF16 projections, FP32 norms/conv/vectors, MXFP4
routed experts with ue8m0 scales). A ``DecodeExecutor`` over it runs the rank's compute and reads the
rank's bytes; there is no communication (row-parallel outputs are used as if they were the all-reduced
sums): the all-reduce is measured separately (the TP2 sweep). Every weight is a distinct allocation (no
tensor is shared between layers or experts), so a step streams the rank's whole working set from HBM and
the 60 MB L2 cannot serve it (K3.md, "Bytes a decode step must read").

What fits (``emulation_bytes`` / ``check_fits``). A TP8 rank's routed experts alone are 181 GB, and the
fast path holds the experts twice on a GPU: the checkpoint layout (what the reference modules read: the
standard path, prefill, fallbacks) and the kernel's fragment layout (``ExpertWeights.fragments()``, a
permutation of the same bytes; ``kernels/moe_experts/layout.py``). The two cannot share storage (the
fragment order is not a strided view of ``[rows, K/2]``) and the reference modules need the checkpoint
layout, so both copies are counted, unless the executors keep the experts once (``single_expert_copy``:
the reference modules then rebuild an expert's checkpoint bytes from its fragments when they read it;
``step_plan.ExpertBank``), which brings a full TP16 rank to its 108 GB of weights; ``backend="standard_graph"`` adds a BF16 copy of every expert
(``standard_ops.StandardExperts``, 3.8x the MXFP4 bytes), or with ``standard_mxfp4_experts`` humming's MXFP4
copy (``standard_experts="mxfp4"``; a TP16 slice padded from I = 192 to 256: 1.3x the MXFP4 bytes). Hence even a full TP16 rank (108 GB of weights,
90 GB of them experts) does not fit an H200 once the fast path is built (199 GB); ``check_fits`` names the
largest expert pool (``SPEC:experts=N``) or layer count that does. The expert pool is the knob that keeps
every per-layer shape real.

A reduced pool changes routing, not shapes: top-k over E experts touches ``expected_distinct_experts(E, k,
batch)`` distinct experts per MoE layer, fewer than over 896 once a batch is large (batch 64 at TP8: 613
of 896, 128 of 128). ``floor.step_bytes`` takes ``cfg.num_experts`` (the pool), so the floor and the step
agree; what a step over the real 896 experts reads is ``step_bytes`` of the unreduced preset.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..config import ConfigError, K3Config
from ..presets import Preset, _k3_layers, preset_spec, spec_name
from ..runtime.tp import rank_config
from .floor import (
    expected_distinct_experts,
    kda_conv_state_bytes_per_seq,
    kda_state_bytes_per_seq,
    layer_weight_bytes,
    mla_cache_bytes_per_token,
    moe_layer_ids,
)

GB = 1e9  # decimal, as K3.md's byte counts
RESERVE_BYTES = 2 * 10**9  # cuBLAS workspaces, CUDA-graph pools, activations, allocator slack
# the weight parts of a rank (floor.py's part names, with every routed expert as "experts")
WEIGHT_PARTS = ("kda", "mla", "moe_nonexpert", "dense_mlp", "norms", "embed", "lm_head", "experts")
DRAW_BYTES_PER_ELEMENT = 8  # device_synthetic: FP32 randn + FP32 scaled copy of the full tensor at once
QUANT_BYTES_PER_ELEMENT = 40  # device_synthetic + mxfp4.quantize temporaries of one full expert matrix


class RankEmulationError(RuntimeError):
    """A rank emulation that cannot be built here (it does not fit the device); the message is one line."""


# ------------------------------------------------------------------------------------------ bytes
def rank_weight_bytes(cfg: K3Config, tp: int) -> tuple[dict[str, int], int]:
    """Rank 0's weights under ``tp`` by part (``WEIGHT_PARTS``), in stored formats, as allocated: the manifest
    of ``rank_config(cfg, tp)`` (what ``device_model`` loads), layers of one kind counted once. Also returns
    one routed expert's slice (w1 + w3 + w2, packed + scales) in bytes."""
    rcfg = rank_config(cfg, tp)
    parts = dict.fromkeys(WEIGHT_PARTS, 0)
    by_kind: dict[tuple[bool, bool], Any] = {}
    moe = set(moe_layer_ids(rcfg))
    expert_slice = 0
    for i in range(rcfg.num_hidden_layers):
        kind = (rcfg.is_kda_layer(i), i in moe)
        if kind not in by_kind:
            by_kind[kind] = layer_weight_bytes(rcfg, i, 1)
        lw = by_kind[kind]
        for part, b in lw.parts.items():
            parts[part] += b
        if i in moe:
            parts["experts"] += rcfg.num_experts * lw.expert_slice
            expert_slice = lw.expert_slice
    from ..manifest import tensor_specs

    for spec in tensor_specs(dataclasses.replace(rcfg, num_experts=0)):
        if spec.name.startswith("model.layers."):
            continue
        part = "embed" if spec.kind == "embedding" else "lm_head" if spec.name == "lm_head.weight" else "norms"
        parts[part] += spec.nbytes
    return parts, expert_slice


def _plan_copies(cfg: K3Config, tp: int) -> int:
    """What ``step_plan.ModelPlan.build`` copies out of the model: W_UK (FP32) / W_UV (BF16) per MLA layer,
    the KDA beta projection padded to 8 rows when the rank's head count is not a multiple of 8."""
    rcfg = rank_config(cfg, tp)
    heads, r = rcfg.num_attention_heads, rcfg.kv_lora_rank
    mla = heads * r * (4 * rcfg.qk_nope_head_dim + 2 * rcfg.v_head_dim)
    kh = rcfg.linear_attn_config.num_heads
    kda = 0 if kh % 8 == 0 else (-(-kh // 8) * 8) * rcfg.hidden_size * 2
    return len(rcfg.mla_layer_ids) * mla + len(rcfg.kda_layer_ids) * kda


def _draw_transient(cfg: K3Config, tp: int) -> int:
    """Temporaries of ``device_synthetic`` while it draws the largest full tensor (then cuts the rank's share):
    the embedding / lm_head in FP32 twice, or one full expert matrix through ``mxfp4.quantize``."""
    big = cfg.vocab_size * cfg.hidden_size * DRAW_BYTES_PER_ELEMENT
    expert = cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * QUANT_BYTES_PER_ELEMENT
    return max(big, expert if cfg.num_experts else 0)


def cache_pool_bytes(cfg: K3Config, tp: int, *, slots: int, max_len: int, kv_bytes: int = 2) -> int:
    """Bytes of a ``CachePool`` of ``slots`` slots (an executor's ``max_batch + 1``) for a rank of ``tp``:
    per KDA layer the FP32 recurrent state and the BF16 conv windows, per MLA layer the latent pool of
    ``max_len`` rounded up to 64 positions in ``kv_bytes`` per element (2 BF16, 1 FP8) and its FP32 scale."""
    from ..runtime.cache_pool import CachePool

    lp = CachePool.latent_length(max_len)
    kda = slots * (kda_state_bytes_per_seq(cfg, tp) + kda_conv_state_bytes_per_seq(cfg, tp, 2))
    mla = slots * lp * mla_cache_bytes_per_token(cfg, kv_bytes) + 4
    return len(cfg.kda_layer_ids) * kda + len(cfg.mla_layer_ids) * mla


def emulation_bytes(cfg: K3Config, tp: int, *, standard: bool = False, fragments: bool = True,
                    cache_bytes: int = 0, single_copy: bool = False, standard_experts: str = "bf16") -> dict[str, int]:
    """What rank 0 of ``tp`` takes on one device, in bytes.

    Keys: the ``WEIGHT_PARTS`` and their sum ``weights`` (stored formats, as ``device_model`` allocates them);
    ``expert_slice`` (one expert's rank slice, one layer), ``moe_layers``; ``expert_fragments`` (the fast
    path's second copy of the experts, ``fragments=True``: a GPU ``ExpertBank``; none with ``single_copy``:
    ``ExpertBank(single_copy=True)`` keeps only the fragment layout); ``plan_copies``
    (``ModelPlan``'s W_UK / W_UV, per plan: two with ``standard``); ``standard_experts`` (``standard``: the
    BF16 copy ``StandardExperts`` makes, or with ``standard_experts="mxfp4"`` humming's padded MXFP4 copy,
    ``standard_mxfp4.humming_expert_bytes``); ``resident`` (all of these); ``cache`` (``cache_bytes``: the
    executors' cache pools, ``cache_pool_bytes``) and ``peak``: the most in use at once, over building
    (``device_synthetic``'s draw temporaries, an ``ExpertBank`` stacking one layer again, ``StandardExperts``
    stacking one BF16 matrix of a layer) and running (``resident + cache``).
    """
    parts, expert_slice = rank_weight_bytes(cfg, tp)
    weights = sum(parts.values())
    rcfg = rank_config(cfg, tp)
    n_moe = len(moe_layer_ids(rcfg))
    frag = parts["experts"] if fragments and cfg.expert_format == "mxfp4" and not single_copy else 0
    plan = _plan_copies(cfg, tp) * (2 if standard else 1)
    bf16_matrix = rcfg.num_experts * rcfg.moe_intermediate_size * rcfg.routed_expert_hidden_size * 2
    layer_experts = rcfg.num_experts * expert_slice
    if standard_experts not in ("bf16", "mxfp4"):
        raise ValueError(f"standard_experts: 'bf16' or 'mxfp4', got {standard_experts!r}")
    if standard_experts == "mxfp4":
        from ..runtime.standard_mxfp4 import humming_expert_bytes

        layer_std = humming_expert_bytes(rcfg.num_experts, rcfg.moe_intermediate_size,
                                         rcfg.routed_expert_hidden_size)
        build = layer_experts + 3 * layer_std  # a layer's checkpoint bytes stacked, padded and repacked
    else:
        layer_std, build = 3 * bf16_matrix, bf16_matrix  # StandardExperts: E dense matrices, then stacked
    std = layer_std * n_moe if standard else 0
    resident = weights + frag + plan + std
    peak = max(weights + _draw_transient(cfg, tp),  # drawing (the last big tensor, lm_head, before any bank)
               weights + frag + plan + layer_experts,  # ExpertBank: a layer's experts stacked next to the modules'
               resident + (build if standard else 0),  # the standard path's experts, one layer being built
               resident + cache_bytes)
    out = dict(parts)
    out.update(weights=weights, expert_slice=expert_slice, moe_layers=n_moe, expert_fragments=frag,
               plan_copies=plan, standard_experts=std, resident=resident, cache=cache_bytes, peak=peak,
               single_expert_copy=int(bool(single_copy and cfg.expert_format == "mxfp4")))
    return out


# ------------------------------------------------------------------------------------------ fit
def _fits(cfg: K3Config, tp: int, free_bytes: int, reserve_bytes: int, **kw: Any) -> bool:
    return emulation_bytes(cfg, tp, **kw)["peak"] + reserve_bytes <= free_bytes


def _with_experts(cfg: K3Config, n: int) -> K3Config:
    return dataclasses.replace(cfg, num_experts=n)


def _with_layers(cfg: K3Config, n: int) -> K3Config:
    kda, full = _k3_layers(n)
    return dataclasses.replace(cfg, num_hidden_layers=n, first_k_dense_replace=min(cfg.first_k_dense_replace, n),
                               linear_attn_config=dataclasses.replace(cfg.linear_attn_config, kda_layers=kda,
                                                                      full_attn_layers=full))


def max_expert_pool(cfg: K3Config, tp: int, free_bytes: int, *, reserve_bytes: int = RESERVE_BYTES,
                    **kw: Any) -> int:
    """The largest expert pool (at most ``cfg.num_experts``) whose emulation fits ``free_bytes``; a multiple
    of 8 when one fits (the router's logits GEMM takes N % 8 == 0); 0 when not even ``top_k`` experts fit.
    ``kw``: ``emulation_bytes``' options."""
    k = cfg.num_experts_per_token
    if not _fits(_with_experts(cfg, k), tp, free_bytes, reserve_bytes, **kw):
        return 0
    lo, hi = k, cfg.num_experts  # fits(lo); the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(_with_experts(cfg, mid), tp, free_bytes, reserve_bytes, **kw):
            lo = mid
        else:
            hi = mid - 1
    return lo // 8 * 8 if lo // 8 * 8 >= k else lo


def max_layers(cfg: K3Config, tp: int, free_bytes: int, *, reserve_bytes: int = RESERVE_BYTES, **kw: Any) -> int:
    """The most layers (K3's cadence, at most ``cfg.num_hidden_layers``) whose emulation fits; 0 if not 2."""
    if not _fits(_with_layers(cfg, 2), tp, free_bytes, reserve_bytes, **kw):
        return 0
    lo, hi = 2, cfg.num_hidden_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(_with_layers(cfg, mid), tp, free_bytes, reserve_bytes, **kw):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _spec_with(cfg: K3Config, tp: int, key: str, value: str) -> str:
    """``cfg``'s spec with ``key`` set (its other overrides kept); a config that is no spec gets a plain hint."""
    base, _, rest = cfg.name.partition(":")
    try:
        p = preset_spec(cfg.name)
    except ConfigError:
        return f"{key}={value}"
    ov: dict[str, int | str] = {}
    if rest:
        ov.update((k.strip(), v.strip()) for k, _, v in (item.partition("=") for item in rest.split(",")))
    if p.tp_size != tp:
        ov["tp"] = tp
    ov[key] = value
    return spec_name(base, ov)


def check_fits(cfg: K3Config, tp: int, free_bytes: int, *, standard: bool = False, fragments: bool = True,
               cache_bytes: int = 0, reserve_bytes: int = RESERVE_BYTES, single_copy: bool = False,
               standard_experts: str = "bf16") -> str | None:
    """None when rank 0 of ``tp`` (``emulation_bytes``) fits ``free_bytes``, else a one-line reason with the
    numbers and the largest expert pool that fits (or, when not even ``top_k`` experts do, the most layers)."""
    kw = dict(standard=standard, fragments=fragments, cache_bytes=cache_bytes, single_copy=single_copy,
              standard_experts=standard_experts)
    b = emulation_bytes(cfg, tp, **kw)
    if b["peak"] + reserve_bytes <= free_bytes:
        return None
    terms = [f"{b['weights'] / GB:.1f} GB of weights ({b['experts'] / GB:.1f} GB experts)"]
    if b["expert_fragments"]:
        terms.append(f"{b['expert_fragments'] / GB:.1f} GB fragment copy")
    if b["standard_experts"]:
        terms.append(f"{b['standard_experts'] / GB:.1f} GB standard {standard_experts.upper()} experts")
    extra = b["peak"] - b["weights"] - b["expert_fragments"] - b["standard_experts"]
    terms.append(f"{extra / GB:.1f} GB plan copies, caches and build peak")
    terms.append(f"{reserve_bytes / GB:.1f} GB reserve")
    why = f"{cfg.name}: {' + '.join(terms)} > {free_bytes / GB:.1f} GB free"
    if b["expert_fragments"] and _fits(cfg, tp, free_bytes, reserve_bytes, **{**kw, "single_copy": True}):
        why += " (fits with the experts kept once: single_expert_copy)"
    n = max_expert_pool(cfg, tp, free_bytes, reserve_bytes=reserve_bytes, **kw)
    if n:
        return f"{why}; use {_spec_with(cfg, tp, 'experts', 'N')} with N <= {n}"
    n = max_layers(cfg, tp, free_bytes, reserve_bytes=reserve_bytes, **kw)
    if n:
        return f"{why}; use {_spec_with(cfg, tp, 'layers', 'N')} with N <= {n}"
    return f"{why}; not even 2 layers fit"


# ------------------------------------------------------------------------------------------ build
def device_free_bytes(device: Any) -> int:
    """Free memory of ``device``: ``torch.cuda.mem_get_info`` on a GPU, available physical memory on a CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def emulation_model(spec: str, seed: int, device: Any, *, conditioning: str = "stable", standard: bool = False,
                    cache_bytes: int = 0, reserve_bytes: int = RESERVE_BYTES,
                    single_copy: bool = False, standard_experts: str = "bf16") -> tuple[Any, Preset]:
    """Rank 0 of preset spec ``spec`` (``presets.preset_spec``: e.g. ``k3-tp8-rank:experts=120``) as a BF16
    reference model of ``rank_config(cfg, preset.tp_size)`` on ``device``, and the preset.

    Checked before anything is allocated: ``check_fits`` against the device's free memory (``standard``: a
    ``standard_graph`` executor will also run; ``cache_bytes``: what its cache pools will take) raises
    ``RankEmulationError`` with the reason and the largest pool that fits (``single_copy``: the executors
    will be built with ``single_expert_copy=True``, so the experts are counted once). Weights: the seeded synthetic
    checkpoint drawn on the device (``device_synthetic.device_model``), each a distinct allocation; a
    ``DecodeExecutor(model, ...)`` runs the rank's step (no communication)."""
    import torch

    from .device_synthetic import device_model

    p = preset_spec(spec)
    dev = torch.device(device)
    why = check_fits(p.config, p.tp_size, device_free_bytes(dev), standard=standard, fragments=dev.type == "cuda",
                     cache_bytes=cache_bytes, reserve_bytes=reserve_bytes, single_copy=single_copy,
                     standard_experts=standard_experts)
    if why:
        raise RankEmulationError(why)
    model = device_model(p.config, seed, dev, tp=p.tp_size, rank=0, conditioning=conditioning)
    return model.eval(), p


def emulation_record(p: Preset, *, standard: bool = False, fragments: bool = True, batch: int | None = None,
                     single_copy: bool = False, standard_experts: str = "bf16") -> dict[str, Any]:
    """What a bundle records about an emulated rank: the spec, the reductions against the full model, the
    byte estimate, and with ``batch`` the experts a uniform routing touches per MoE layer over the pool vs
    over the full model's pool."""
    from ..presets import preset

    cfg = p.config
    try:
        full = preset(cfg.name.partition(":")[0]).config
    except ConfigError:  # not a preset spec (a checkpoint's config): no reduction to report
        full = cfg
    out: dict[str, Any] = {
        "spec": p.name, "tp": p.tp_size, "num_experts": cfg.num_experts, "full_num_experts": full.num_experts,
        "layers": cfg.num_hidden_layers, "full_layers": full.num_hidden_layers,
        "bytes": emulation_bytes(cfg, p.tp_size, standard=standard, fragments=fragments, single_copy=single_copy,
                                 standard_experts=standard_experts),
    }
    if batch is not None:
        k = cfg.num_experts_per_token
        out["touched_experts"] = {"batch": batch, "pool": expected_distinct_experts(cfg.num_experts, k, batch),
                                  "full": expected_distinct_experts(full.num_experts, k, batch)}
    return out


__all__ = ["RESERVE_BYTES", "WEIGHT_PARTS", "RankEmulationError", "cache_pool_bytes", "check_fits",
           "device_free_bytes", "emulation_bytes", "emulation_model", "emulation_record", "max_expert_pool",
           "max_layers", "rank_weight_bytes"]
