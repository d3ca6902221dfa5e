"""Oracle of the SiTU-GLU activation kernel (the semantics it must reproduce).

    h = bf16( beta * tanh(g / beta) * sigmoid(g) * (linear_beta * tanh(u / linear_beta)) )

with g, u the gate / up projections (bf16) taken to FP32 (``compute_dtype=torch.float64``: FP64, which tests
compare against, unrounded with ``out_dtype``), evaluated left to right as ``reference.common.situ_glu`` does,
rounded to g's dtype once.
"""

from __future__ import annotations

import torch

from ...reference.common import situ_glu


def situ_glu_ref(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float,
                 compute_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``h`` in ``out_dtype`` (default g's dtype: the kernel's output)."""
    return situ_glu(g.to(compute_dtype), u.to(compute_dtype), beta, linear_beta).to(out_dtype or g.dtype)
