"""FP32 oracle of the fused residual add + RMSNorm (the semantics the kernel must reproduce).

    h   = bf16(x + residual)            (the new residual; rounded once, like torch's bf16 add)
    out = bf16(h * rsqrt(mean(h^2) + eps) * weight)     (all in FP32; the norm is of the rounded h)

Without a residual, h = x and only ``out`` is produced. ``dtype=torch.float64`` evaluates the same
formula in FP64 (tests compare against that).
"""

from __future__ import annotations

import torch


def rmsnorm_residual_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new_residual); new_residual is None without a residual input."""
    if residual is not None:
        h = (x.to(compute_dtype) + residual.to(compute_dtype)).to(x.dtype)
    else:
        h = x
    hf = h.to(compute_dtype)
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    out = (hf * rstd * weight.to(compute_dtype)).to(x.dtype)
    return out, (h if residual is not None else None)
