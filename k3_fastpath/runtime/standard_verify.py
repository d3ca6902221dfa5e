"""The standard path's KDA verify step: ``kernels.kda_decode``'s verify contract (``slot_out``, ``tokens``) in
the library code a serving engine runs on Hopper, vLLM's speculative KDA decode.

Rows ``b*T .. b*T + T-1`` are sequence b's T tokens; its caches are read at ``slot[b]``, the conv window
and recurrent state after token t are written at ``slot_out[b*T + t]`` (0: padded tokens, which land in the
empty slot 0 and are never read as a sequence's). On a GPU with fla:

* conv: each sequence's window ``[conv_pool[slot], x_0 .. x_{T-1}]`` in PyTorch; token t's output is the
  SiLU of the 4-tap conv over positions t .. t+3, its window positions t+1 .. t+3 (one ``index_copy_``);
* recurrence: one ``fused_recurrent_kda_fwd`` over the [B, T] tokens with 2-D ``ssm_state_indices`` =
  ``slot_out`` (fla's speculative-decoding layout: the initial state read at the first token's index, each
  token's state written at its own), after copying each sequence's state into its first token's slot;
* gated RMSNorm: fla's ``rms_norm_gated``; rows of empty sequences zeroed.

Without fla (a CPU) it runs the decode op token by token, copying each sequence's caches forward from
slot to slot (the same math).
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.kda_decode.reference import _conv_w3


def _conv_verify(x: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, slot: torch.Tensor, out_slots: torch.Tensor,
                 T: int) -> torch.Tensor:
    """SiLU causal conv of T new inputs per sequence; each token's window stored at its out slot."""
    B = slot.shape[0]
    C = x.shape[1]
    width = pool.shape[1] + 1
    win = torch.cat([pool.index_select(0, slot), x.view(B, T, C).to(pool.dtype)], dim=1)  # [B, W-1+T, C]
    wt = _conv_w3(w)[:, 0, :].t().float()  # [W, C]
    frames = win.unfold(1, width, 1)  # [B, T, C, W]: token t's taps, oldest first
    y = torch.nn.functional.silu((frames.float() * wt.t()[None, None]).sum(-1))
    kept = frames[..., 1:].permute(0, 1, 3, 2).reshape(B * T, width - 1, C)
    pool.index_copy_(0, out_slots, kept)
    return y.reshape(B * T, C)


def kda_verify_standard(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                        conv_q, conv_k, conv_v, state, *, eps: float, lower_bound: float, slot_out: torch.Tensor,
                        tokens: int, fla: Any, decode_step: Any, glue=None) -> torch.Tensor:
    """The verify step (module docstring) -> y [B*T, C] in q's dtype. ``fla``: ``standard_ops.fla_kda()``'s
    pair or None; ``decode_step``: the decode op (``standard_ops.kda_step_standard``) the CPU path repeats."""
    B, T = int(slot.shape[0]), int(tokens)
    R, C = q.shape
    _, H, D, _ = state.shape
    if R != B * T or slot_out.shape[0] != R:
        raise ValueError(f"kda verify: {R} rows / {slot_out.shape[0]} slot_out entries for {B} sequences x {T}")
    src, dst = slot.long(), slot_out.long()
    if fla is None:
        y = torch.empty_like(q)
        prev = src
        for t in range(T):
            rows = torch.arange(B, device=q.device) * T + t
            cur = dst[rows] * (src != 0)
            for pool in (conv_q, conv_k, conv_v, state):
                pool.index_copy_(0, cur, pool.index_select(0, prev))
            y[rows] = decode_step(*(x[rows] for x in (q, k, v, g, a, beta_logits)), conv_q_w, conv_k_w,
                                  conv_v_w, A_log, dt_bias, o_norm_w, cur.to(torch.int32), conv_q, conv_k,
                                  conv_v, state, eps=eps, lower_bound=lower_bound, glue=glue)
            prev = cur
        return y
    fused_recurrent_kda_fwd, rms_norm_gated = fla
    qc, kc, vc = (_conv_verify(x, w, pool, src, dst, T).to(q.dtype)
                  for x, w, pool in ((q, conv_q_w, conv_q), (k, conv_k_w, conv_k), (v, conv_v_w, conv_v)))
    first = dst.view(B, T)[:, 0]
    state.index_copy_(0, first, state.index_select(0, src))
    o, _ = fused_recurrent_kda_fwd(
        qc.view(B, T, H, D), kc.view(B, T, H, D), vc.view(B, T, H, D), a.view(B, T, H, D), beta_logits.view(B, T, H),
        A_log=A_log[:H].contiguous(), dt_bias=dt_bias.reshape(H, D).contiguous(), scale=D ** -0.5,
        initial_state=state, output_final_state=True, inplace_final_state=True,
        ssm_state_indices=slot_out.view(B, T), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)
    y = rms_norm_gated(o.view(R * H, D), g.reshape(R * H, D), o_norm_w, None, activation="sigmoid",
                       eps=eps).view(R, C)
    live = (src != 0).repeat_interleave(T)
    return (y * live.to(y.dtype)[:, None]).to(q.dtype)
