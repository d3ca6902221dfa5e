"""FP32 oracle of the skinny GEMM: y = x @ W^T (+ residual), accumulated in FP32, rounded once.

``compute_dtype=torch.float64`` gives the FP64 reference the GPU tests measure errors against.
"""

from __future__ import annotations

import torch


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16,
                    compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    y = x.to(compute_dtype) @ w.to(compute_dtype).t()
    if residual is not None:
        y = y + residual.to(compute_dtype)
    return y.to(out_dtype)
