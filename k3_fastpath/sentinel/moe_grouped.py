"""The sentinel's training MoE: ``LatentMoE.routed`` as three batched GEMMs over every expert at once.

The reference's routed path (``reference.moe.LatentMoE.routed``) finds each touched expert's tokens with its
own ``nonzero`` (a host synchronisation per expert) and runs three GEMMs per expert at that expert's token
count: ~1,150 GEMMs a training step of the sentinel (forward and backward), each a new shape whose host
cost (~230 us a call on the H100, session 22) outweighed its GPU time. ``grouped_routed`` computes the same
function for training: one stable sort of the (token, slot) pairs by expert, one host read (the largest
expert load, rounded up to ``CAPACITY_ROUND`` so the shapes repeat), the latent rows scattered into an
``[experts, capacity, latent]`` block (unused rows zero: SiTU-GLU(0, 0) = 0), ``w1``/``w3``/``w2`` of all
experts as three ``bmm``, and one ``index_add`` of the weighted outputs. Only the FP32 summation order
differs from the reference (the test holds outputs and gradients to it in FP64); the model the fast path is
compared against keeps its own routed path.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from ..reference.common import compute_dtype, situ_glu

CAPACITY_ROUND = 128  # the per-expert row block is the largest load rounded up to this


def expert_counts(ids: Tensor, n_experts: int) -> Tensor:
    """Tokens routed to each expert, ``[n_experts]`` int64: an exact count without atomics (CUDA's
    ``bincount`` is not safe under deterministic algorithms)."""
    return (ids.reshape(-1, 1) == torch.arange(n_experts, device=ids.device)).sum(0)


def grouped_routed(moe, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """``LatentMoE.routed(x [N, H], ids [N, k], weights [N, k])`` with every expert in one ``bmm``."""
    dt = x.dtype
    cdt = compute_dtype(dt)
    z = moe.routed_expert_down_proj(x)
    k, n_exp = ids.shape[1], len(moe.experts)
    flat = ids.reshape(-1)
    expert, order = torch.sort(flat, stable=True)  # pairs grouped by expert, token order kept in a group
    counts = expert_counts(flat, n_exp)
    cap = -(-int(counts.max()) // CAPACITY_ROUND) * CAPACITY_ROUND  # the one host read
    slot = torch.arange(flat.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    rows = order // k
    block = z.new_zeros(n_exp, cap, z.shape[-1]).index_put((expert, slot), z[rows])
    first = moe.experts[0]

    def stacked(name: str) -> Tensor:  # [E, in, out]: BF16 training weights stacked, then cast once
        mats = [getattr(e, name) for e in moe.experts]
        if all(isinstance(getattr(m, "weight", None), torch.nn.Parameter) for m in mats):
            return torch.stack([m.weight for m in mats]).to(dt).transpose(1, 2)
        return torch.stack([m.dense(dt) for m in mats]).transpose(1, 2)

    h = situ_glu(torch.bmm(block, stacked("w1")), torch.bmm(block, stacked("w3")), first.beta, first.linear_beta)
    y = torch.bmm(h.to(dt), stacked("w2"))[expert, slot]  # [pairs, latent] in the sorted order
    w = weights.reshape(-1)[order].to(cdt).unsqueeze(-1)
    acc = torch.zeros(z.shape, dtype=cdt, device=z.device).index_add(0, rows, y.to(cdt) * w)
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
