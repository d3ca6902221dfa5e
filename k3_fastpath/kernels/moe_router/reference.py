"""FP32 oracle of the router, built from ``k3_fastpath.reference.moe.route`` (the model reference).

    logits = x @ gate_weight^T (FP32; FP64 with compute_dtype=float64)
    scores = sigmoid(logits); keys = scores + bias
    ids    = the top_k keys in descending order, exact ties to the lower expert index
    w      = scores[ids] (renormalised to sum 1 if asked) * scale

``moe_router_ref`` returns ids as int32 (the kernel's index dtype) and weights in FP32 (FP64 for an FP64
``compute_dtype``). ``moe_router_select_ref`` is the same from given logits (the kernel's second stage).
"""

from __future__ import annotations

import torch

from ...reference.moe import route


def moe_router_select_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool = True,
                          scale: float = 1.0, compute_dtype: torch.dtype = torch.float32
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection from ``logits [M, E]``: (ids [M, k] int32, weights [M, k] compute_dtype)."""
    lg = logits.to(compute_dtype)
    scores = torch.sigmoid(lg)
    sel = scores + bias.to(compute_dtype)
    order = torch.sort(sel, dim=-1, descending=True, stable=True).indices
    ids = order[..., :top_k]
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), w * scale


def moe_router_ref(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                   renormalize: bool = True, scale: float = 1.0, *, compute_dtype: torch.dtype = torch.float32,
                   out_ids: torch.Tensor | None = None, out_weights: torch.Tensor | None = None, config=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op in torch (same signature as ``api.moe_router``): ``reference.moe.route`` on
    ``x.to(compute_dtype)``, ids cast to int32."""
    ids, w = route(x.to(compute_dtype), gate_weight, bias, top_k, renormalize, scale)
    ids = ids.to(torch.int32)
    if out_ids is not None:
        out_ids.copy_(ids)
        ids = out_ids
    if out_weights is not None:
        out_weights.copy_(w)
        w = out_weights
    return ids, w


__all__ = ["moe_router_ref", "moe_router_select_ref"]
