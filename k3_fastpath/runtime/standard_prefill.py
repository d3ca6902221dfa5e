"""The prefill half of a mixed step (``mixed_step.py``), in the libraries a serving engine runs on Hopper.

A mixed step carries decode rows (one token each, served by the standard op table's ``kda_step`` and
``mla_attention``) and the ``P`` prompt tokens of one sequence that prefills from position ``start``. The
token-parallel ops (projections, norms, AttnRes, router, experts) run on all rows at once; only attention
needs the sequence. These two ops serve it, on the executor's slot pools (the prefilling sequence's slot
given as a one-element device tensor, so a captured step reads it from a static buffer):

| op              | implementation                                                                          |
|-----------------|-----------------------------------------------------------------------------------------|
| ``kda_prefill`` | the three causal convs from the slot's conv state (``reference.kda.conv_update``, state  |
|                 | written back), q / k L2 norm, the gate and beta in PyTorch, then fla's ``chunk_kda``     |
|                 | (chunked WY form, Triton) from the slot's recurrent state, final state written back;     |
|                 | without fla or a GPU the reference's ``kda_chunked`` (same math); gated RMSNorm          |
| ``mla_prefill`` | the new latents written at ``(slot, start .. start + P - 1)``, the slot's latents        |
|                 | ``0 .. start + P - 1`` up-projected through W_UK / W_UV (the plain, non-absorbed form a   |
|                 | prefill uses), ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-     |
|                 | efficient kernels on a GPU; causal, offset by ``start``), the output gate                 |

Both follow the reference model's prefill (``reference.kda.KimiDeltaAttention.forward`` with ``T > 1``,
``reference.mla.GatedMLA`` in ``plain`` mode) op for op in precision: convs, norms, gates and the
recurrence in FP32, K / V rounded to the model dtype as the reference's ``kv_b_proj`` output is; the
attention itself accumulates in FP32 inside SDPA. Capturable: static shapes (``P`` and the context
``start + P`` fixed per captured step), no host synchronisation.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels.kda_decode.reference import _conv_w3
from ..kernels.mla_decode.api import write_latent
from ..reference.common import compute_dtype, rms_norm
from ..reference.kda import conv_update, kda_chunked, kda_gate, l2_normalize
from ..reference.mla import FP8

FLA_CHUNK = "fla chunk_kda (Triton)"
REFERENCE_CHUNK = "reference kda_chunked (PyTorch)"


@functools.lru_cache(maxsize=1)
def fla_chunk_kda() -> Any:
    """fla's ``chunk_kda``, or None when fla is not importable."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:
        return None
    return chunk_kda


def kda_recurrence_library(device: torch.device | str) -> str:
    """Which implementation ``kda_prefill_standard`` runs the recurrence with on ``device``."""
    return FLA_CHUNK if str(device).startswith("cuda") and fla_chunk_kda() is not None else REFERENCE_CHUNK


def kda_prefill_standard(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w,
                         pslot, conv_q, conv_k, conv_v, state, *, eps: float = 1e-5,
                         lower_bound: float = -5.0) -> torch.Tensor:
    """One sequence's ``P`` tokens of a KDA layer: ``q, k, v, g, a [P, C]`` (projections, model dtype),
    ``beta_logits [P, h]``; the conv pools ``[N, W-1, C]`` and the state pool ``[N, h, D, D]`` read and
    written at ``pslot`` (``[1]`` int64). Returns ``[P, C]`` in ``q.dtype`` (the value ``o_proj`` takes)."""
    P, C = q.shape
    H, D = state.shape[1], state.shape[2]
    cdt = compute_dtype(state.dtype)
    convs = []
    for x, w, pool in ((q, conv_q_w, conv_q), (k, conv_k_w, conv_k), (v, conv_v_w, conv_v)):
        y, new = conv_update(x[None], _conv_w3(w), pool.index_select(0, pslot))
        pool.index_copy_(0, pslot, new)
        convs.append(y.to(cdt))
    qc, kc, vc = convs
    qn = l2_normalize(qc.view(1, P, H, D)) * D ** -0.5
    kn = l2_normalize(kc.view(1, P, H, D))
    g_log = kda_gate(a.view(1, P, H, D).to(cdt), A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_logits.to(cdt)).view(1, P, H)
    s0 = state.index_select(0, pslot).to(cdt)
    if kda_recurrence_library(q.device) == FLA_CHUNK and cdt == torch.float32:
        o, s1 = fla_chunk_kda()(qn, kn, vc.view(1, P, H, D), g_log, beta, scale=1.0, initial_state=s0,
                                output_final_state=True)
    else:
        o, s1 = kda_chunked(qn, kn, vc.view(1, P, H, D), g_log, beta, s0)
    state.index_copy_(0, pslot, s1.to(state.dtype))
    gate = torch.sigmoid(g.to(cdt).view(1, P, H, D))
    return (rms_norm(o.to(cdt), o_norm_w.to(cdt), eps) * gate).reshape(P, C).to(q.dtype)


def mla_prefill_standard(q, kv, kv_norm_w, eps, latent, scale, pslot, ppos, w_uk, w_uv, softmax_scale,
                         gate=None, *, context: int) -> torch.Tensor:
    """One sequence's ``P`` tokens of a gated MLA layer: ``q [P, h, nope + rope]``, ``kv [P, rank + rope]``
    (kv_a output, c_kv not yet normed), the latent pool ``[N, L, rank + rope]`` (model dtype, or FP8 with
    ``scale``), the slot ``pslot [1]`` int64, positions ``ppos [P]`` int64 (``start .. start + P - 1``),
    W_UK ``[h, nope, rank]``, W_UV ``[h, v, rank]``, ``gate [P, h*v]`` or None; ``context`` = ``start + P``
    (static). Writes the latents, attends causally over positions ``0 .. context - 1`` -> ``[P, h*v]``."""
    P, h, _ = q.shape
    dt = q.dtype
    rank = w_uk.shape[2]
    write_latent(kv, kv_norm_w, eps, latent, scale, pslot.expand(P), ppos)
    lat = latent[pslot, :context][0]  # [S, rank + rope]
    lat = (lat.float() * scale).to(dt) if lat.dtype == FP8 else lat.to(dt)
    c, k_pe = lat[:, :rank], lat[:, rank:]
    k_nope = torch.einsum("sr,hdr->hsd", c.to(w_uk.dtype), w_uk).to(dt)  # the reference's kv_b_proj output
    v = torch.einsum("sr,hdr->hsd", c, w_uv.to(dt))
    k = torch.cat([k_nope, k_pe[None].expand(h, context, k_pe.shape[-1])], dim=-1)  # [h, S, nope + rope]
    qh = q.transpose(0, 1)  # [h, P, qd]
    if context == P:  # a prefill from position 0: plain causal
        o = F.scaled_dot_product_attention(qh[None], k[None], v[None], is_causal=True, scale=softmax_scale)
    else:  # a continuation: query i (position ppos[i]) sees keys 0 .. ppos[i]
        mask = torch.arange(context, device=q.device)[None, :] <= ppos[:, None]
        o = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, scale=softmax_scale)
    o = o[0].transpose(0, 1).reshape(P, h * v.shape[-1])
    if gate is not None:
        o = (o.float() * torch.sigmoid(gate.float())).to(dt)
    return o


def prefill_op_table(device: torch.device | str) -> dict[str, Any]:
    """``kda_prefill`` and ``mla_prefill`` as op-table entries, each naming the library that serves it on
    ``device`` (the mixed step adds them to the standard op table)."""
    from .fast_ops import OpImpl

    kda = f"standard path: PyTorch convs + gates, {kda_recurrence_library(device)}, PyTorch gated RMSNorm"
    mla = ("standard path: latents up-projected (W_UK / W_UV), torch scaled_dot_product_attention "
           "(causal), PyTorch gate")
    return {"kda_prefill": OpImpl("kda_prefill", kda_prefill_standard, standard_reason=kda),
            "mla_prefill": OpImpl("mla_prefill", mla_prefill_standard, standard_reason=mla)}
