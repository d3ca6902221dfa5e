"""The sentinel's training recurrence on CUDA: fla's ``chunk_kda`` (Triton forward and backward) under the
contract of ``reference.kda.kda_chunked``.

The reference's chunked form builds a ``[B, h, L, L, K]`` decay tensor per chunk and autograd keeps
several of them per layer (at batch 32 x 512 tokens, 6 heads of 128: ~400 MB each, 8 chunks, 5 KDA
layers); fla computes the same recurrence in fused kernels. ``fla_kda_chunked`` takes what
``kda_chunked`` takes (``q``/``k`` normalised, ``q`` already scaled, ``g_log`` the per-channel log decay,
``beta`` after its sigmoid, FP32) and returns ``(o [B, T, h, V], final_state [B, h, K, V])``; the GPU test
``tests/test_sentinel_fla_kda_gpu.py`` holds its outputs and gradients to the reference's. Only training
uses it (``TrainPlan.kda``): the reference model the fast path is compared against keeps its own
formulation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fla_unavailable_reason(device: str) -> str | None:
    """Why ``fla_kda_chunked`` cannot run on ``device`` (None when it can)."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return f"fla's chunk_kda runs on a CUDA device, not {device!r}"
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except ImportError as e:
        return f"fla is not importable ({e}): install fla-core (the gpu extra)"
    return None


def fla_kda_chunked(q: Tensor, k: Tensor, v: Tensor, g_log: Tensor, beta: Tensor, state: Tensor | None = None,
                    chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """``kda_chunked(q, k, v, g_log, beta, state, chunk_size)`` through fla (chunk size 32 or 64)."""
    from fla.ops.kda import chunk_kda

    b, _, h, dk = q.shape
    if state is None:
        state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=q.device)
    f32 = torch.float32
    # fla saves ``initial_state`` for its backward: a copy, because the caller's state is often a cache the
    # layer then updates in place (``cache.state.copy_``), which would invalidate the saved tensor
    o, final = chunk_kda(q.to(f32), k.to(f32), v.to(f32), g_log.to(f32), beta.to(f32), scale=1.0,
                         initial_state=state.to(f32).clone(), output_final_state=True,
                         chunk_size=64 if chunk_size >= 64 else 32)
    return o, final.to(state.dtype)
