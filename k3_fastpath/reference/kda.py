"""KDA (Kimi Delta Attention): the PyTorch reference ("standard path") of K3's linear-attention layer.

The fast kernels are compared against this module, so it favours the obvious formulation over speed.
Notation: ``H`` hidden size, ``h`` heads (``num_heads``), ``D`` head dim (keys and values, K = V = D),
``C = h*D``, ``W`` the short-conv width. Per token ``x`` (K3.md, "KDA layer"):

1. ``q, k, v = q_proj(x), k_proj(x), v_proj(x)`` (each ``C`` wide, in ``x.dtype``);
2. each passes its own causal depthwise conv, ``out[t] = sum_j w[c, 0, j] * in[t - (W-1) + j]``, then SiLU;
   the conv state is the last ``W-1`` inputs per channel, oldest first;
3. per head ``q`` and ``k`` are L2-normalised, ``x * rsqrt(sum(x^2) + 1e-6)`` (eps on the SUM), and ``q``
   is scaled by ``D**-0.5``;
4. decay per channel: ``a = f_b_proj(f_a_proj(x))``, ``g_log = lower_bound * sigmoid(exp(A_log[head]) *
   (a + dt_bias))``, ``alpha = exp(g_log)`` in ``[exp(lower_bound), 1]`` (``A_log`` is stored zero-padded to
   ``max(D, h)`` entries; only the first ``h`` are read);
5. ``beta = sigmoid(b_proj(x))``, one per head;
6. recurrence per head, state ``S [K, V]``: ``S <- diag(alpha) S; v' = beta (v - S^T k); S <- S + k v'^T;
   o = S^T q``;
7. ``y = o_proj(RMSNorm_D(o) * o_norm.weight * sigmoid(g_proj(x)))``.

Precision: the projections run in ``x.dtype``; conv, L2 norm, gates, recurrence and RMSNorm in FP32 (FP64 when
``x`` is FP64; the recurrence also widens to the state's dtype, e.g. an FP64 oracle state); the value fed to
``o_proj`` is rounded back to ``x.dtype``. The FP32 parameters (conv weights, ``A_log``, ``dt_bias``,
``o_norm.weight``) stay FP32 whatever ``dtype`` the module is built in (K3.md, failure mode 6).

Two algorithms for step 6: ``kda_recurrent_step`` (one token: decode) and ``kda_chunked`` (the chunked
WY / UT-transform form of fla's ``chunk_kda``: prefill). ``KimiDeltaAttention.forward`` uses the first for
``T == 1`` and the second for ``T > 1``; they agree to rounding (tests/test_reference_kda.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import K3Config
from .common import RMSNorm, compute_dtype

L2_NORM_EPS = 1e-6  # added to the sum of squares of each q / k head (fla's l2norm)
DEFAULT_CHUNK_SIZE = 64
# the most bytes one chunk's decay tensor ``[B, h, L, L, K]`` may take: above it ``kda_chunked`` runs the
# heads (then the sequences) in groups, each independent of the others (an FP32 chunk of 64 at batch 64
# and K3's 96 heads is 12 GiB)
MAX_DECAY_BYTES = 1 << 30


# --------------------------------------------------------------------------------------------- helpers
def _wider(*dtypes: torch.dtype) -> torch.dtype:
    """FP64 if any of ``dtypes`` is FP64, else FP32: the dtype a reference computation runs in."""
    return torch.float64 if any(compute_dtype(d) == torch.float64 for d in dtypes) else torch.float32


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in ``x.dtype`` (the weight is cast if the module was built in another dtype)."""
    return F.linear(x, weight.to(x.dtype))


def l2_normalize(x: Tensor, eps: float = L2_NORM_EPS) -> Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, in ``x``'s dtype (call it on FP32/FP64 values)."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def valid_mask(lengths: Tensor | None, batch: int, seq_len: int, device: torch.device) -> Tensor | None:
    """``[B, T]`` bool, True where ``t < lengths[b]``; None when every position is valid (``lengths`` None)."""
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape [{batch}], got {list(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > seq_len).any()):
        raise ValueError(f"lengths must lie in [0, {seq_len}], got {lengths.tolist()}")
    return torch.arange(seq_len, device=device)[None, :] < lengths[:, None]


# ------------------------------------------------------------------------------------------------ cache
@dataclass
class KDACache:
    """One KDA layer's decode state for a batch of sequences; ``forward`` updates it in place.

    ``conv_*``: ``[B, W-1, C]``, the last ``W-1`` conv INPUTS (projection outputs), oldest first, in the conv
    dtype (BF16 in serving; values are rounded to it when stored). ``state``: ``[B, h, K, V]``, FP32 (FP64 for
    oracle runs).
    """

    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    state: Tensor

    @classmethod
    def empty(cls, cfg: K3Config, batch: int, device: torch.device | str | None = None,
              conv_dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32) -> KDACache:
        """A zero cache (the state before the first token)."""
        lac = cfg.linear_attn_config
        c, w, d = lac.projection_dim, lac.short_conv_kernel_size, lac.head_dim

        def conv() -> Tensor:
            return torch.zeros(batch, w - 1, c, dtype=conv_dtype, device=device)

        state = torch.zeros(batch, lac.num_heads, d, d, dtype=state_dtype, device=device)
        return cls(conv(), conv(), conv(), state)

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.conv_q, self.conv_k, self.conv_v, self.state

    def clone(self) -> KDACache:
        return KDACache(*(t.clone() for t in self.tensors()))

    def index_select(self, idx: Tensor | list[int]) -> KDACache:
        """A new cache holding the sequences ``idx`` (a copy, in that order)."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.state.device)
        return KDACache(*(t.index_select(0, idx) for t in self.tensors()))

    def copy_(self, other: KDACache) -> KDACache:
        """Overwrite this cache's tensors in place with ``other``'s (same shapes)."""
        for dst, src in zip(self.tensors(), other.tensors(), strict=True):
            dst.copy_(src)
        return self


# ------------------------------------------------------------------------------------ pure functions
def conv_update(x: Tensor, weight: Tensor, conv_state: Tensor, lengths: Tensor | None = None,
                activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """Causal depthwise conv with state: ``x [B, T, C]`` new inputs, ``weight [C, 1, W]``, ``conv_state
    [B, W-1, C]`` (the previous ``W-1`` inputs, oldest first).

    ``out[t] = sum_j weight[c, 0, j] * in[t - (W-1) + j]`` over the inputs ``conv_state ++ x``, then SiLU
    (``activation=None`` skips it). Returns ``(out [B, T, C]`` in FP32 / FP64, ``new_state [B, W-1, C]`` in
    ``conv_state.dtype)``: the last ``W-1`` inputs after the first ``lengths[b]`` (default ``T``) tokens of
    ``x``, so later tokens of a sequence do not enter its state. Does not modify ``conv_state``.
    """
    b, t, c = x.shape
    w = weight.shape[-1]
    if weight.shape != (c, 1, w) or conv_state.shape != (b, w - 1, c):
        raise ValueError(f"conv_update: x {list(x.shape)}, weight {list(weight.shape)} and conv_state "
                         f"{list(conv_state.shape)} disagree (want [C,1,W] and [B,W-1,C])")
    cdt = _wider(x.dtype, conv_state.dtype, weight.dtype)
    full = torch.cat([conv_state.to(cdt), x.to(cdt)], dim=1)  # [B, W-1+T, C]: input index i <-> time i-(W-1)
    wt = weight.to(cdt)[:, 0, :]  # [C, W]
    out = torch.zeros(b, t, c, dtype=cdt, device=x.device)
    for j in range(w):  # tap j multiplies input t-(W-1)+j, i.e. full[t+j]
        out = out + full[:, j:j + t, :] * wt[:, j]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"conv_update: unknown activation {activation!r}")
    n = torch.full((b,), t, device=x.device) if lengths is None else torch.as_tensor(lengths, device=x.device)
    # the W-1 inputs ending at the last valid token: full[n_b + i], i = 0..W-2
    idx = n.long()[:, None] + torch.arange(w - 1, device=x.device)[None, :]
    new_state = torch.gather(full, 1, idx[:, :, None].expand(b, w - 1, c))
    return out, new_state.to(conv_state.dtype)


def kda_gate(a: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """Log-decay per channel: ``lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias))``.

    ``a [..., h, D]``; ``A_log`` has at least ``h`` entries (the checkpoint pads it; entries past ``h`` are
    ignored); ``dt_bias [h*D]`` or ``[h, D]``. Returns ``g_log [..., h, D]`` in FP32 (FP64 for FP64 ``a``);
    ``alpha = exp(g_log)`` lies in ``[exp(lower_bound), 1]``.
    """
    h, d = a.shape[-2:]
    cdt = compute_dtype(a.dtype)
    rate = torch.exp(A_log[:h].to(cdt))[:, None]  # [h, 1]
    return lower_bound * torch.sigmoid(rate * (a.to(cdt) + dt_bias.to(cdt).reshape(h, d)))


def kda_recurrent_step(q: Tensor, k: Tensor, v: Tensor, g_log: Tensor, beta: Tensor,
                       state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of the recurrence, batched: ``q, k, g_log [..., K]``, ``v [..., V]``, ``beta [...]``,
    ``state [..., K, V]`` (e.g. ``[B, h, ...]``). ``q`` and ``k`` are already normalised, ``q`` scaled.

    ``S <- diag(exp(g_log)) S; v' = beta (v - S^T k); S <- S + k v'^T; o = S^T q``, in FP32 (FP64 if the
    state or the inputs are FP64). Returns ``(o [..., V]`` in that dtype, ``new_state`` in ``state.dtype)``;
    ``state`` itself is not modified.
    """
    cdt = _wider(state.dtype, q.dtype, k.dtype, v.dtype)
    q, k, v, g_log, beta = (t.to(cdt) for t in (q, k, v, g_log, beta))
    s = state.to(cdt) * torch.exp(g_log)[..., :, None]
    v_new = beta[..., None] * (v - torch.einsum("...k,...kv->...v", k, s))
    s = s + k[..., :, None] * v_new[..., None, :]
    o = torch.einsum("...k,...kv->...v", q, s)
    return o, s.to(state.dtype)


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g_log: Tensor, beta: Tensor, state: Tensor | None = None,
                chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """The recurrence over a sequence in chunks (the WY / UT-transform form of fla's ``chunk_kda``).

    Inputs ``q, k, g_log [B, T, h, K]``, ``v [B, T, h, V]``, ``beta [B, T, h]``, ``state [B, h, K, V]`` (None:
    zeros); ``q``/``k`` normalised, ``q`` scaled. Returns ``(o [B, T, h, V]``, ``final_state)``; computes in
    FP32 (FP64 if the state or inputs are FP64), the final state in ``state.dtype``. ``T`` need not be a
    multiple of ``chunk_size``: the tail is padded with ``g_log = 0, beta = 0`` tokens, which leave the state
    unchanged; ``T < chunk_size`` is one chunk of ``T``. One chunk's decay tensor is ``[B, h, L, L, K]``: over
    ``MAX_DECAY_BYTES`` the heads, then the sequences, run in groups (``_in_groups``).

    Within one chunk (positions r = 0..L-1, start state S0), with ``G_r = sum_{i<=r} g_log_i`` (per channel):

    * unrolled, ``S_r = diag(e^{G_r}) S0 + sum_{j<=r} diag(e^{G_r - G_j}) k_j v'_j^T``, so
      ``v'_r = beta_r (v_r - (k_r * e^{G_r})^T S0 - sum_{j<r} <k_r, e^{G_r - G_j} * k_j> v'_j)``;
    * with ``A[r, j] = beta_r <k_r, e^{G_r - G_j} * k_j>`` (j < r, strictly lower), ``(I + A) V' =
      diag(beta) (V - (K * e^G) S0)``. The UT transform ``T = (I + A)^{-1} diag(beta)`` (a unit-lower
      triangular solve) gives ``W = T (K * e^G)``, ``U = T V`` and ``V' = U - W S0``;
    * ``O = (Q * e^G) S0 + P V'`` with ``P[r, j] = <q_r, e^{G_r - G_j} * k_j>`` (j <= r);
    * ``S_L = diag(e^{G_{L-1}}) S0 + (K * e^{G_{L-1} - G})^T V'``.

    Every exponent is a difference ``G_r - G_j`` with ``r >= j`` (so <= 0) formed before ``exp``: at K3's
    decays ``G`` reaches ``-5 * 64`` within a chunk and ``e^{-G_j}`` alone would overflow FP32.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        state = torch.zeros(b, h, dk, dv, dtype=_wider(q.dtype, v.dtype), device=q.device)
    if state.shape != (b, h, dk, dv):
        raise ValueError(f"kda_chunked: state {list(state.shape)} does not match [B, h, K, V] = {[b, h, dk, dv]}")
    cdt = _wider(state.dtype, q.dtype, k.dtype, v.dtype)
    if t == 0:
        return q.new_zeros(b, 0, h, dv, dtype=cdt), state.clone()
    size = min(chunk_size, t)  # a sequence shorter than a chunk is one chunk of its own length
    decay_bytes = b * h * size * size * dk * torch.finfo(cdt).bits // 8
    if decay_bytes > MAX_DECAY_BYTES and (h > 1 or b > 1):
        return _in_groups(q, k, v, g_log, beta, state, chunk_size, dim=2 if h > 1 else 0)
    n_chunks = -(-t // size)
    pad = n_chunks * size - t

    def chunks(x: Tensor) -> Tensor:  # [B, T, h, ...] -> [B, h, N, L, ...] in cdt, zero tail
        x = x.to(cdt)
        if pad:
            x = torch.cat([x, x.new_zeros(b, pad, *x.shape[2:])], dim=1)
        x = x.reshape(b, n_chunks, size, *x.shape[2:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g_log, beta))
    pos = torch.arange(size, device=q.device)
    causal = pos[:, None] >= pos[None, :]  # [r, j]: j <= r
    strict = pos[:, None] > pos[None, :]  # j < r
    eye = torch.eye(size, dtype=cdt, device=q.device)

    s = state.to(cdt, copy=True)  # not an alias of the caller's state: a cache updated in place after the
    # call must not change what autograd saved
    out = []
    for n in range(n_chunks):
        qn, kn, vn, bn = qc[:, :, n], kc[:, :, n], vc[:, :, n], bc[:, :, n]  # [B, h, L, D] / [B, h, L]
        cum = gc[:, :, n].cumsum(dim=-2)  # G_r, [B, h, L, K]
        diff = cum[..., :, None, :] - cum[..., None, :, :]  # G_r - G_j, [B, h, L(r), L(j), K]
        decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))  # 0 above the diagonal
        kk = (kn[..., :, None, :] * decay * kn[..., None, :, :]).sum(dim=-1)  # <k_r, e^{G_r-G_j} k_j>
        a = (kk * bn[..., :, None]).masked_fill(~strict, 0.0)
        ut = torch.linalg.solve_triangular(eye + a, torch.diag_embed(bn), upper=False, unitriangular=True)
        e_cum = torch.exp(cum)
        w = ut @ (kn * e_cum)
        u = ut @ vn
        v_new = u - w @ s  # V'
        p = (qn[..., :, None, :] * decay * kn[..., None, :, :]).sum(dim=-1).masked_fill(~causal, 0.0)
        out.append((qn * e_cum) @ s + p @ v_new)
        last = cum[..., -1:, :]  # G_{L-1}, [B, h, 1, K]
        s = torch.exp(last).transpose(-1, -2) * s + (kn * torch.exp(last - cum)).transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(b, h, n_chunks * size, dv)[:, :, :t]
    return o.transpose(1, 2), s.to(state.dtype)


def _in_groups(q: Tensor, k: Tensor, v: Tensor, g_log: Tensor, beta: Tensor, state: Tensor, chunk_size: int,
               dim: int) -> tuple[Tensor, Tensor]:
    """``kda_chunked`` over the two halves of the heads (``dim`` 2) or sequences (``dim`` 0), which do not
    interact, joined again: each half's decay tensor is half the size (halved again inside as needed)."""
    n = q.shape[dim]
    cut = n // 2
    parts = [slice(0, cut), slice(cut, n)]
    outs, states = [], []
    for sl in parts:
        idx = (slice(None),) * dim + (sl,)
        sdx = (sl,) if dim == 0 else (slice(None), sl)  # state [B, h, K, V]: heads are its dim 1
        o, s = kda_chunked(q[idx], k[idx], v[idx], g_log[idx], beta[idx], state[sdx], chunk_size)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=dim), torch.cat(states, dim=0 if dim == 0 else 1)


# ------------------------------------------------------------------------------------------------ layer
class KimiDeltaAttention(nn.Module):
    """One K3 KDA layer. ``state_dict()`` keys are the checkpoint's ``model.layers.{i}.self_attn.*`` names
    with that prefix stripped (k3_fastpath/manifest.py), with the same shapes and dtypes: the BF16 tensors
    in ``dtype``, the FP32 ones (conv weights, ``A_log``, ``dt_bias``, ``o_norm.weight``) in FP32.
    """

    def __init__(self, cfg: K3Config, layer_idx: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__()
        if not cfg.is_kda_layer(layer_idx):
            raise ValueError(f"layer {layer_idx} (0-based) is not a KDA layer of config {cfg.name!r}")
        lac = cfg.linear_attn_config
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.num_heads = lac.num_heads
        self.head_dim = lac.head_dim
        self.conv_size = lac.short_conv_kernel_size
        self.lower_bound = lac.gate_lower_bound
        self.chunk_size = chunk_size
        # the T > 1 recurrence (``kda_chunked``'s contract); training may swap in a fused one
        # (``sentinel.fla_kda``), the reference model keeps this
        self.chunked = kda_chunked
        hid, c, d = cfg.hidden_size, lac.projection_dim, lac.head_dim
        f32 = torch.float32

        def lin(n_in: int, n_out: int) -> nn.Linear:
            return nn.Linear(n_in, n_out, bias=False, dtype=dtype, device=device)

        def conv() -> nn.Conv1d:  # only its weight is used (conv_update); [C, 1, W] like the checkpoint
            return nn.Conv1d(c, c, self.conv_size, groups=c, bias=False, dtype=f32, device=device)

        self.q_proj, self.k_proj, self.v_proj = lin(hid, c), lin(hid, c), lin(hid, c)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj = lin(hid, d)
        self.f_b_proj = lin(d, c)
        self.A_log = nn.Parameter(torch.zeros(max(d, lac.num_heads), dtype=f32, device=device))
        self.dt_bias = nn.Parameter(torch.zeros(c, dtype=f32, device=device))
        self.b_proj = lin(hid, lac.num_heads)
        self.g_proj = lin(hid, c)
        self.o_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=f32, device=device)
        self.o_proj = lin(c, hid)

    def empty_cache(self, batch: int, conv_dtype: torch.dtype = torch.bfloat16,
                    state_dtype: torch.dtype = torch.float32) -> KDACache:
        return KDACache.empty(self.cfg, batch, self.A_log.device, conv_dtype, state_dtype)

    def forward(self, x: Tensor, cache: KDACache | None = None, lengths: Tensor | None = None) -> Tensor:
        """``x [B, T, H]`` (right-padded) -> ``[B, T, H]`` in ``x.dtype``.

        With ``cache``, continues from its conv / recurrent state and updates it IN PLACE to the state after
        each sequence's valid tokens. ``lengths[b]`` (default ``T``) valid tokens per sequence: later
        positions leave that sequence's cache untouched and output 0. ``T == 1``: ``kda_recurrent_step``;
        ``T > 1``: ``kda_chunked``.
        """
        bsz, t, _ = x.shape
        h, d = self.num_heads, self.head_dim
        cdt = compute_dtype(x.dtype)
        valid = valid_mask(lengths, bsz, t, x.device)
        if cache is None:
            cache_in = KDACache.empty(self.cfg, bsz, x.device, conv_dtype=x.dtype, state_dtype=cdt)
        else:
            cache_in = cache
            if cache.batch_size != bsz or cache.state.shape[1:] != (h, d, d):
                raise ValueError(f"cache holds state {list(cache.state.shape)}; input batch {bsz}, {h} heads of {d}")

        # 1-2. projections (x.dtype), short convs + SiLU (FP32 / FP64)
        convs = []
        for proj, conv, conv_state in ((self.q_proj, self.q_conv1d, cache_in.conv_q),
                                       (self.k_proj, self.k_conv1d, cache_in.conv_k),
                                       (self.v_proj, self.v_conv1d, cache_in.conv_v)):
            convs.append(conv_update(_linear(x, proj.weight), conv.weight, conv_state, lengths))
        (q, conv_q), (k, conv_k), (v, conv_v) = convs
        # 3. per-head L2 norm; q scaled
        q = l2_normalize(q.reshape(bsz, t, h, d)) * d ** -0.5
        k = l2_normalize(k.reshape(bsz, t, h, d))
        v = v.reshape(bsz, t, h, d)
        # 4-5. decay and beta
        a = _linear(_linear(x, self.f_a_proj.weight), self.f_b_proj.weight)
        g_log = kda_gate(a.reshape(bsz, t, h, d).to(cdt), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(_linear(x, self.b_proj.weight).to(cdt))
        if valid is not None:  # padding tokens: alpha = 1, beta = 0 (state unchanged), no NaN can leak in
            m = valid[:, :, None, None]
            q, k, v, g_log = (torch.where(m, z, 0.0) for z in (q, k, v, g_log))
            beta = torch.where(valid[:, :, None], beta, 0.0)
        # 6. recurrence
        if t == 1:
            o, state = kda_recurrent_step(q[:, 0], k[:, 0], v[:, 0], g_log[:, 0], beta[:, 0], cache_in.state)
            o = o[:, None]
        else:
            o, state = self.chunked(q, k, v, g_log, beta, cache_in.state, self.chunk_size)
        # 7. gated RMSNorm (FP32 / FP64), rounded to x.dtype for o_proj
        gate = torch.sigmoid(_linear(x, self.g_proj.weight).to(o.dtype)).reshape(bsz, t, h, d)
        y = (self.o_norm(o) * gate).reshape(bsz, t, h * d).to(x.dtype)
        y = _linear(y, self.o_proj.weight)
        if valid is not None:
            y = torch.where(valid[:, :, None], y, 0.0)

        if cache is not None:
            if lengths is not None:  # sequences with no valid token keep their state bit for bit
                keep = (torch.as_tensor(lengths, device=x.device) == 0)[:, None, None, None]
                state = torch.where(keep, cache.state, state.to(cache.state.dtype))
            # detached: a cache carried across decode steps must not chain their autograd graphs
            cache.conv_q.copy_(conv_q.detach())
            cache.conv_k.copy_(conv_k.detach())
            cache.conv_v.copy_(conv_v.detach())
            cache.state.copy_(state.detach())
        return y
