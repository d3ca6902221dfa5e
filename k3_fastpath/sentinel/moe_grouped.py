"""The sentinel's training MoE: ``LatentMoE.routed`` with the token-expert pairs grouped once per layer.

The reference's routed path (``reference.moe.LatentMoE.routed``) finds each touched expert's tokens with its
own ``nonzero`` (a host synchronisation per expert: 17 per MoE layer, ~140 per forward of the sentinel, each
draining the GPU's queue) and adds each expert's output into the FP32 sum with its own ``index_add_``.
``grouped_routed`` computes the same function for training: one stable sort of the (token, slot) pairs by
expert, one host read of the per-expert counts, each expert's SiTU-GLU on its contiguous slice, and one
``index_add`` of the weighted outputs. Only the FP32 summation order differs from the reference (the test
holds outputs and gradients to it); the model the fast path is compared against keeps its own routed path.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from ..reference.common import compute_dtype


def grouped_routed(moe, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """``LatentMoE.routed(x [N, H], ids [N, k], weights [N, k])`` with the pairs grouped by expert."""
    dt = x.dtype
    cdt = compute_dtype(dt)
    z = moe.routed_expert_down_proj(x)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, token order kept inside a group
    experts = torch.arange(len(moe.experts), device=ids.device)
    counts = (flat[:, None] == experts).sum(0).tolist()  # the one host read (bincount is not deterministic)
    rows = order // k
    zs = z[rows]
    parts, start = [], 0
    for e, c in enumerate(counts):
        if c:
            parts.append(moe.experts[e](zs[start: start + c]).to(cdt))
            start += c
    w = weights.reshape(-1)[order].to(cdt).unsqueeze(-1)
    acc = torch.zeros(z.shape, dtype=cdt, device=z.device).index_add(0, rows, torch.cat(parts) * w)
    if moe.routed_expert_norm is not None:
        zr = moe.routed_expert_norm.forward(acc).to(dt)
    else:
        zr = acc.to(dt)
    return moe.routed_expert_up_proj(zr)


def use_grouped_routed(model) -> int:
    """Make every ``LatentMoE`` of ``model`` run ``grouped_routed``; returns how many."""
    from ..reference.moe import LatentMoE

    n = 0
    for mod in model.modules():
        if isinstance(mod, LatentMoE):
            mod.routed = types.MethodType(grouped_routed, mod)
            n += 1
    return n
