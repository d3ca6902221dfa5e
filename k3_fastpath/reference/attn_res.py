"""AttnRes: the block residual mix applied before every sublayer of K3 and before the final norm.

The residual stream keeps snapshots ("blocks") of itself every ``attn_res_block_size`` layers plus the
running prefix sum of the current block. Before a sublayer its input is a softmax-weighted mix of these
sources (K3.md, "AttnRes"):

1. ``v = [blocks..., prefix]``: the sources, in that order (the prefix last);
2. ``k_i = v_i * rsqrt(mean(v_i^2) + eps)``: each source RMS-normalised, in FP32 (FP64 for FP64 input);
3. ``score_i = <k_i, norm_weight * proj_weight>``: one logit per source (``*_res_norm`` weight times the
   ``*_res_proj`` [1, H] weight, i.e. an RMSNorm followed by a Linear H -> 1);
4. ``p = softmax(score)`` over the sources;
5. ``out = sum_i p_i * v_i``: the RAW (un-normalised) sources are mixed, in FP32, then cast to the
   prefix's dtype. The caller applies the sublayer's own RMSNorm (``input_layernorm`` etc.) afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .common import compute_dtype


def attn_res_weights(sources: torch.Tensor, proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """Softmax mixing weights ``[..., S]`` (compute dtype) for stacked sources ``[..., S, H]``."""
    cdt = compute_dtype(sources.dtype)
    v = sources.to(cdt)
    k = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = norm_weight.to(cdt) * proj_weight.to(cdt).reshape(-1)
    return torch.softmax((k * w).sum(dim=-1), dim=-1)


def apply_attn_res(prefix: torch.Tensor, blocks: torch.Tensor | Sequence[torch.Tensor],
                   proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Mix ``blocks`` (``[..., nb, H]`` or a list of ``[..., H]``) and ``prefix [..., H]`` -> ``[..., H]``.

    Leading dims are free (``[N, H]`` tokens or ``[B, T, H]``). With no blocks the result is ``prefix``
    itself (a softmax over one source is 1), cast through the compute dtype.
    """
    h = prefix.shape[-1]
    if proj_weight.numel() != h or norm_weight.numel() != h:
        raise ValueError(f"AttnRes weights must have {h} entries, got proj {tuple(proj_weight.shape)} "
                         f"and norm {tuple(norm_weight.shape)}")
    if isinstance(blocks, torch.Tensor):
        stacked = blocks
    else:
        stacked = torch.stack(list(blocks), dim=-2) if len(blocks) else prefix.new_zeros(*prefix.shape[:-1], 0, h)
    if stacked.shape[:-2] != prefix.shape[:-1] or stacked.shape[-1] != h:
        raise ValueError(f"AttnRes blocks {tuple(stacked.shape)} do not match prefix {tuple(prefix.shape)}")
    cdt = compute_dtype(prefix.dtype)
    v = torch.cat([stacked.to(cdt), prefix.to(cdt).unsqueeze(-2)], dim=-2)  # [..., S, H]
    p = attn_res_weights(v, proj_weight, norm_weight, eps)  # [..., S]
    out = (p.unsqueeze(-1) * v).sum(dim=-2)
    return out.to(prefix.dtype)
