"""Helpers shared by the reference ("standard path") modules: RMSNorm, the SiTU-GLU activation, dtypes.

Every helper is dtype-generic: BF16/FP16/FP32 inputs compute in FP32, FP64 inputs compute in FP64 (the
oracle runs), and results are cast back to the input dtype unless stated otherwise.
"""

from __future__ import annotations

import torch
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for a model dtype: FP64 stays FP64, everything else computes in FP32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in FP32 (FP64 for FP64 input); rounded once."""
    cdt = compute_dtype(x.dtype)
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(cdt)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a ``weight`` parameter (the checkpoint's ``*_layernorm.weight`` / ``*_norm.weight``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU: ``beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb)`` in FP32 (FP64 for FP64 input).

    Returns the compute dtype (FP32 / FP64); the caller rounds to the model dtype where its GEMM would.
    """
    cdt = compute_dtype(g.dtype)
    gf = g.to(cdt)
    uf = u.to(cdt)
    return beta * torch.tanh(gf / beta) * torch.sigmoid(gf) * (linear_beta * torch.tanh(uf / linear_beta))
