"""FP32 / FP64 oracle of the routed experts of LatentMoE (``reference.moe.LatentMoE.routed`` between the
latent down projection and the latent norm):

    for every touched expert e (ascending id), rows r routed to it with weight w[r, slot]:
        g = z[r] W1_e^T,  u = z[r] W3_e^T                   (rounded to the model dtype, as F.linear does)
        h = SiTU-GLU(g, u) = beta tanh(g/beta) sigmoid(g) * lb tanh(u/lb)   (FP32, rounded)
        y = h W2_e^T                                          (rounded)
        acc[r] += w[r, slot] * y                              (FP32)
    out = acc, or with ``norm_weight``: bf16(RMSNorm(acc) * norm_weight) (the routed-expert norm)

MXFP4 weights are dequantised exactly (e2m1 x 2^(scale-127) is representable in bf16).
``compute_dtype=float64`` with ``rounding=False`` is the oracle the GPU tests measure against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...reference.common import rms_norm, situ_glu
from .layout import ExpertWeights


def moe_experts_ref(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights, *,
                    beta: float = 4.0, linear_beta: float = 25.0, norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-5, compute_dtype: torch.dtype = torch.float32, rounding: bool = True,
                    out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``z [N, L]``, ``ids [N, k]`` (int32/int64), ``weights [N, k]`` -> FP32 ``[N, L]`` (compute_dtype
    without rounding), or bf16 normed with ``norm_weight``."""
    cdt = compute_dtype
    dt = z.dtype if rounding else cdt
    zz = z.to(dt)
    acc = torch.zeros(z.shape, dtype=cdt, device=z.device)
    idl = ids.long()
    for e in torch.unique(idl).tolist():
        rows, slot = (idl == e).nonzero(as_tuple=True)
        x = zz[rows]
        g = F.linear(x, experts.dense("w1", e, dt))
        u = F.linear(x, experts.dense("w3", e, dt))
        h = situ_glu(g, u, beta, linear_beta).to(dt)
        y = F.linear(h, experts.dense("w2", e, dt))
        acc.index_add_(0, rows, y.to(cdt) * weights[rows, slot].to(cdt).unsqueeze(-1))
    if norm_weight is not None:
        res = rms_norm(acc, norm_weight.to(cdt), eps)
        res = res.to(torch.bfloat16) if rounding else res
    else:
        res = acc
    if out is not None:
        out.copy_(res)
        return out
    return res


__all__ = ["moe_experts_ref"]
