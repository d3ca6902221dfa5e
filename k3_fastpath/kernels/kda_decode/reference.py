"""FP32 oracle of the KDA decode step, built from ``k3_fastpath.reference.kda`` (the model reference).

For every sequence b with ``slot[b] = s != 0`` (C = H*D, W = 4):

    q_b, cq' = conv_update(q[b], conv_q_w, conv_q[s])  (SiLU; likewise k, v)   ; conv_*[s] <- cq' (bf16 copy)
    q = l2_normalize(q) * D^-0.5 ; k = l2_normalize(k)                          (per head)
    g_log = kda_gate(a[b], A_log, dt_bias, lower_bound) ; beta = sigmoid(beta_logits[b])
    o, S' = kda_recurrent_step(q, k, v, g_log, beta, state[s])                  ; state[s] <- S'
    y[b] = bf16(rms_norm(o, o_norm_w, eps) * sigmoid(g[b]))

Sequences with ``slot[b] <= 0`` touch no cache and get y[b] = 0. ``kda_decode_ref_outputs`` computes the
new values of one token per sequence without writing anything (in ``compute_dtype``: tests use FP64);
``kda_decode_ref`` is the op (same signature as ``api.kda_decode``): T = 1 writes the pools in place; a
verify step (``tokens`` T, ``slot_out``) runs the T tokens of each sequence in order on a copy of its
caches and writes the state after token t at ``slot_out[b*T + t]`` (0: not written), never at ``slot[b]``.
``kda_decode_vllm_ref`` is the decode step on vLLM's layout (``api.kda_decode_vllm``): the same op on views of
the packed conv pool and of the transposed state.
"""

from __future__ import annotations

import torch

from ...reference.common import rms_norm
from ...reference.kda import conv_update, kda_gate, kda_recurrent_step, l2_normalize


def _conv_w3(w: torch.Tensor) -> torch.Tensor:
    """[C, W] or [C, 1, W] -> [C, 1, W] (conv_update's layout)."""
    return w if w.dim() == 3 else w[:, None, :]


def kda_decode_ref_outputs(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w,
                           slot, conv_q, conv_k, conv_v, state, *, eps: float = 1e-5, lower_bound: float = -5.0,
                           compute_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Pure: {"y": [B, C] compute_dtype (0 at empty slots), "active": [B] bool, "idx": slots of the active
    rows, "conv_q"/"conv_k"/"conv_v": their new conv rows [n, 3, C] (pool dtype), "state": their new
    states [n, H, D, D] (compute_dtype)}."""
    _, H, D, _ = state.shape
    B, C = q.shape
    cdt = compute_dtype
    active = slot.to(torch.long) > 0
    idx = slot.to(torch.long)[active]
    n = int(idx.numel())
    out = {"active": active, "idx": idx, "y": torch.zeros(B, C, dtype=cdt, device=q.device)}
    rows = [t[active].to(cdt) for t in (q, k, v, g, a, beta_logits)]
    qa, ka, va, ga, aa, ba = rows
    convs = []
    for name, x, w, pool in (("conv_q", qa, conv_q_w, conv_q), ("conv_k", ka, conv_k_w, conv_k),
                             ("conv_v", va, conv_v_w, conv_v)):
        o_c, out[name] = conv_update(x[:, None, :], _conv_w3(w).to(cdt), pool[idx])
        convs.append(o_c[:, 0].reshape(n, H, D))
    qc, kc, vc = convs
    qn = l2_normalize(qc) * D ** -0.5
    kn = l2_normalize(kc)
    g_log = kda_gate(aa.reshape(n, H, D), A_log.to(cdt), dt_bias.to(cdt), lower_bound)
    beta = torch.sigmoid(ba)
    o, s_new = kda_recurrent_step(qn, kn, vc, g_log, beta, state[idx].to(cdt).contiguous())  # [K, V] either layout
    y = rms_norm(o, o_norm_w.to(cdt), eps) * torch.sigmoid(ga.reshape(n, H, D))
    out["y"][active] = y.reshape(n, C)
    out["state"] = s_new
    return out


def kda_decode_ref(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                   conv_q, conv_k, conv_v, state, *, eps: float = 1e-5, lower_bound: float = -5.0,
                   out: torch.Tensor | None = None, config=None, slot_out: torch.Tensor | None = None,
                   tokens: int = 1) -> torch.Tensor:
    """The op in FP32 torch: returns y [B*T, C] in q.dtype (module docstring for the pool writes)."""
    if slot_out is not None:
        y = _verify_ref(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                        conv_q, conv_k, conv_v, state, eps, lower_bound, slot_out, tokens)
        return out.copy_(y) if out is not None else y
    r = kda_decode_ref_outputs(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias,
                               o_norm_w, slot, conv_q, conv_k, conv_v, state, eps=eps, lower_bound=lower_bound)
    idx = r["idx"]
    if idx.numel():
        conv_q[idx] = r["conv_q"]
        conv_k[idx] = r["conv_k"]
        conv_v[idx] = r["conv_v"]
        state[idx] = r["state"].to(state.dtype)
    y = r["y"].to(q.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def _verify_ref(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                conv_q, conv_k, conv_v, state, eps, lower_bound, slot_out, tokens):
    """T tokens per sequence on working copies of the sequences' caches (slot b + 1 of the copies, slot 0
    for empty sequences), each token's state copied out to ``slot_out``."""
    B = int(slot.shape[0])
    T = int(tokens)
    if q.shape[0] != B * T or slot_out.shape[0] != B * T:
        raise ValueError(f"kda_decode verify: {q.shape[0]} rows / {slot_out.shape[0]} slot_out entries for "
                         f"{B} sequences x {T} tokens")
    src = slot.long()
    live = src > 0
    work_slot = torch.where(live, torch.arange(1, B + 1, device=slot.device), 0).to(torch.int32)
    pools = [torch.zeros((B + 1, *p.shape[1:]), dtype=p.dtype, device=p.device)
             for p in (conv_q, conv_k, conv_v, state)]
    for w, p in zip(pools, (conv_q, conv_k, conv_v, state), strict=True):
        w[1:][live] = p[src[live]]
    wq, wk, wv, ws = pools
    y = torch.zeros_like(q)
    for t in range(T):
        rows = torch.arange(B, device=q.device) * T + t
        y[rows] = kda_decode_ref(*(x[rows] for x in (q, k, v, g, a, beta_logits)), conv_q_w, conv_k_w, conv_v_w,
                                 A_log, dt_bias, o_norm_w, work_slot, wq, wk, wv, ws, eps=eps,
                                 lower_bound=lower_bound)
        dst = slot_out[rows].long()
        keep = live & (dst != 0)
        for w, p in zip(pools, (conv_q, conv_k, conv_v, state), strict=True):
            p[dst[keep]] = w[1:][keep]
    return y


def vllm_views(conv: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """vLLM's packed conv pool [N, W-1, 3C] and state [N, H, V, K] as the executor's pools: (conv_q, conv_k,
    conv_v) [N, W-1, C] and state [N, H, K, V], views (writes through them land in vLLM's tensors)."""
    C = conv.shape[-1] // 3
    return conv[..., :C], conv[..., C:2 * C], conv[..., 2 * C:], state.transpose(-1, -2)


def kda_decode_vllm_ref(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                        conv, state, *, eps: float = 1e-5, lower_bound: float = -5.0,
                        out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """The decode step on vLLM's layout in FP32 torch (``kda_decode_ref`` on ``vllm_views``)."""
    return kda_decode_ref(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                          *vllm_views(conv, state), eps=eps, lower_bound=lower_bound, out=out)


__all__ = ["kda_decode_ref", "kda_decode_ref_outputs", "kda_decode_vllm_ref", "vllm_views"]
