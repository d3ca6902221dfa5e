"""FP32 oracle of AttnRes source mixing (K3.md, "AttnRes").

    w        = norm_w * proj_w
    logit_s  = <w, v_s> * rsqrt(mean(v_s^2) + eps)          per row, s = 0..S-1
    p        = softmax over s
    mix      = bf16(sum_s p_s v_s)
    normed   = bf16(mix * rsqrt(mean(mix^2) + out_eps) * out_w)   (only with out_w; norm of the rounded mix)

This is the kernel's contract; ``k3_fastpath/reference/attn_res.py`` (the model reference) must agree
with it where it uses this op (rounding points: mix rounded to bf16 before the output norm).
"""

from __future__ import annotations

import torch


def attn_res_mix_ref(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                     out_w: torch.Tensor | None = None, out_eps: float | None = None,
                     compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sources [S, M, H] -> (mix [M, H], normed [M, H] or None), both in sources.dtype."""
    v = sources.to(compute_dtype)
    w = norm_w.to(compute_dtype) * proj_w.to(compute_dtype)
    rstd = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [S, M]
    logits = (v * w).sum(-1) * rstd
    p = torch.softmax(logits, dim=0)
    mix = (p.unsqueeze(-1) * v).sum(0).to(sources.dtype)
    if out_w is None:
        return mix, None
    mf = mix.to(compute_dtype)
    e = eps if out_eps is None else out_eps
    normed = (mf * torch.rsqrt(mf.pow(2).mean(-1, keepdim=True) + e) * out_w.to(compute_dtype)).to(sources.dtype)
    return mix, normed
