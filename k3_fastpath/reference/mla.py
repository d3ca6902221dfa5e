"""Gated NoPE MLA (multi-head latent attention), the K3 full-attention layer: PyTorch reference.

Per token x [H] (K3.md, "MLA layer"):

1. q path: ``q = q_b_proj(RMSNorm(q_a_proj(x)))`` -> per head ``[nope | rope]`` (128 + 64 for K3);
2. kv path: ``kv_a_proj_with_mqa(x) = [c_kv | k_pe]``; ``c_kv`` is RMSNorm'ed (``kv_a_layernorm``); the
   cache stores one latent per token, ``concat(c_kv, k_pe)`` (``kv_lora_rank + rope`` = 576 wide);
3. NoPE: the rope dims are never rotated; ``score = (q_nope.k_nope + q_pe.k_pe) * q_head_dim**-0.5``;
   ``kv_b_proj.weight [heads*(nope+v), kv_lora_rank]`` holds per head the rows ``[W_UK (nope) | W_UV (v)]``;
4. gate: ``o_proj(attn_out * sigmoid(g_proj(x)))``.

Two equivalent forms of step 3:

* ``plain`` (prefill): up-project the cached latents, ``k_nope = W_UK c``, ``v = W_UV c``, then standard
  causal attention;
* ``absorbed`` (decode): ``q_lat = q_nope W_UK`` is a query in latent space scored against the cached
  ``c`` directly, and the latent-space output times ``W_UV`` gives each head's value.

Both forms read the keys from the cache after the current tokens are written, so prefill and decode see
the same (possibly FP8-rounded) latents. Scores, softmax and the probability-weighted sums are FP32 (FP64
for an FP64 model); the GEMM outputs are rounded to the model dtype where a serving GEMM would round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K3Config
from .common import RMSNorm, compute_dtype

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class MLACache:
    """The latent cache of one MLA layer.

    ``latent [B, max_len, kv_lora_rank + rope]`` holds ``concat(normed c_kv, k_pe)`` per position, in BF16
    (or FP32/FP64 for oracle runs) or FP8 e4m3 (``torch.float8_e4m3fn``). ``scale`` is a per-tensor FP32
    scalar: the stored value is ``latent / scale`` and a read multiplies it back. The scale is FIXED AT
    CACHE CREATION (``empty(..., scale=)``), never data-dependent, so every write and read of a sequence
    uses the same one; the default is 1.0 (vLLM's default ``k_scale`` when a checkpoint ships no calibrated
    KV scale; K3's normed latents are O(1), far inside e4m3's +-448). FP8 writes saturate at +-448*scale
    instead of producing NaN. For non-FP8 caches the scale is 1.0 and exact.
    """

    latent: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def empty(cls, cfg: K3Config, batch: int, max_len: int, dtype: torch.dtype = torch.bfloat16,
              device: torch.device | str | None = None, scale: float | None = None) -> MLACache:
        if not (dtype == FP8 or dtype.is_floating_point):
            raise TypeError(f"MLA cache dtype must be a float type or float8_e4m3fn, got {dtype}")
        if scale is not None and dtype != FP8 and scale != 1.0:
            raise ValueError("a non-FP8 MLA cache stores latents unscaled; scale must be 1.0")
        s = torch.tensor(1.0 if scale is None else float(scale), dtype=torch.float32, device=device)
        if not (torch.isfinite(s) and s > 0):
            raise ValueError(f"MLA cache scale must be a positive finite number, got {scale}")
        latent = torch.zeros(batch, max_len, cfg.mla_latent_dim, dtype=dtype, device=device)
        return cls(latent=latent, scale=s)

    @property
    def max_len(self) -> int:
        return self.latent.shape[1]

    @property
    def is_fp8(self) -> bool:
        return self.latent.dtype == FP8

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Model-dtype latents -> the stored representation (FP8: ``clamp(v / scale)`` rounded to e4m3)."""
        if self.is_fp8:
            return (values.float() / self.scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return values.to(self.latent.dtype)

    def write(self, batch_idx: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values [N, D]`` at ``(batch_idx[n], pos[n])``."""
        if pos.numel() and int(pos.max()) >= self.max_len:
            raise IndexError(f"MLA cache write at position {int(pos.max())} beyond max_len {self.max_len}")
        self.latent[batch_idx, pos] = self.encode(values)

    def read(self, upto: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions ``[0, upto)`` of every sequence, dequantized to ``dtype`` -> ``[B, upto, D]``."""
        lat = self.latent[:, :upto]
        if self.is_fp8:
            return (lat.float() * self.scale).to(dtype)
        return lat.to(dtype)


SCORE_ELEMENTS = 1 << 28  # the most attention scores (FP32: 1 GiB) one pass materialises; a longer prefill
# attends in slices of queries (an 8K-token prompt batch of 10 would otherwise hold ~16 GB per copy)


class GatedMLA(nn.Module):
    """One K3 MLA layer; parameter names are the checkpoint's (``self_attn.q_a_proj.weight`` ...)."""

    def __init__(self, cfg: K3Config, layer_idx: int, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        h = cfg.hidden_size
        nh = cfg.num_attention_heads
        self.num_heads = nh
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.softmax_scale = cfg.q_head_dim ** -0.5
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, **kw)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, device)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.q_head_dim, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.mla_latent_dim, **kw)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype, device)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (self.nope + self.v_dim), **kw)
        self.g_proj = nn.Linear(h, nh * self.v_dim, **kw) if cfg.mla_use_output_gate else None
        self.o_proj = nn.Linear(nh * self.v_dim, h, **kw)

    # ------------------------------------------------------------------ pieces
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [heads, nope, rank]`` and ``W_UV [heads, v, rank]`` views of ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope:]

    def project_q(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, H]`` -> ``q_nope [B, T, heads, nope]``, ``q_pe [B, T, heads, rope]`` (model dtype)."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.num_heads, -1)
        return q[..., : self.nope], q[..., self.nope:]

    def project_latent(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, H]`` -> the latent to cache, ``concat(RMSNorm(c_kv), k_pe) [B, T, rank + rope]``."""
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = kv[..., : self.rank], kv[..., self.rank:]
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def _attend_plain(self, q_nope, q_pe, lat, mask, keys=None):
        """Up-projected keys/values. ``lat [B, S, D]``; ``mask [B, T, S]`` -> ``[B, T, heads, v]``; ``keys``:
        ``_plain_keys(lat)`` when the caller has them (a sliced prefill computes them once)."""
        dt = q_nope.dtype
        cdt = compute_dtype(dt)
        k_nope, v, k_pe = self._plain_keys(lat, cdt) if keys is None else keys
        scores = (torch.einsum("bthd,bshd->bhts", q_nope.to(cdt), k_nope)
                  + torch.einsum("bthd,bsd->bhts", q_pe.to(cdt), k_pe)) * self.softmax_scale
        probs = self._softmax(scores, mask)
        return torch.einsum("bhts,bshd->bthd", probs, v).to(dt)

    def _plain_keys(self, lat: torch.Tensor, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projected keys and values of ``lat [B, S, D]`` in ``cdt``: ``(k_nope, v, k_pe)``."""
        c, k_pe = lat[..., : self.rank], lat[..., self.rank:]
        kv = F.linear(c, self.kv_b_proj.weight).view(*c.shape[:2], self.num_heads, self.nope + self.v_dim)
        return kv[..., : self.nope].to(cdt), kv[..., self.nope:].to(cdt), k_pe.to(cdt)

    def _attend_absorbed(self, q_nope, q_pe, lat, mask):
        """Scores against the cached latent directly; the output is up-projected after the sum."""
        dt = q_nope.dtype
        cdt = compute_dtype(dt)
        w_uk, w_uv = self._w_uk_uv()
        c, k_pe = lat[..., : self.rank], lat[..., self.rank:]
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope.to(cdt), w_uk.to(cdt)).to(dt)  # a GEMM: rounded
        scores = (torch.einsum("bthr,bsr->bhts", q_lat.to(cdt), c.to(cdt))
                  + torch.einsum("bthd,bsd->bhts", q_pe.to(cdt), k_pe.to(cdt))) * self.softmax_scale
        probs = self._softmax(scores, mask)
        o_lat = torch.einsum("bhts,bsr->bthr", probs, c.to(cdt)).to(dt)  # latent-space output
        return torch.einsum("bthr,hdr->bthd", o_lat.to(cdt), w_uv.to(cdt)).to(dt)

    @staticmethod
    def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax over keys of ``scores [B, heads, T, S]`` where ``mask [B, T, S]``; fully masked rows -> 0."""
        m = mask.unsqueeze(1)
        probs = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1)
        return torch.where(m, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, cache: MLACache, start_pos: torch.Tensor,
                lengths: torch.Tensor | None = None, mode: str = "auto") -> torch.Tensor:
        """``x [B, T, H]`` -> ``[B, T, H]``; token ``t`` of sequence ``b`` sits at ``start_pos[b] + t``.

        Token ``t`` is valid if ``t < lengths[b]`` (default: all ``T``). Valid tokens write their latent at
        their position, then attend to cache positions ``0 .. their own`` (so a continuation after an earlier
        prefill sees the earlier tokens). Padded tokens write nothing and output exactly 0. ``mode``:
        ``"plain"``, ``"absorbed"`` or ``"auto"`` (absorbed for ``T == 1``, plain otherwise).
        """
        if mode == "auto":
            mode = "absorbed" if x.shape[1] == 1 else "plain"
        if mode not in ("plain", "absorbed"):
            raise ValueError(f"MLA mode must be 'auto', 'plain' or 'absorbed', got {mode!r}")
        b, t, _ = x.shape
        dev = x.device
        start_pos = start_pos.to(device=dev, dtype=torch.long).reshape(b)
        if lengths is None:
            lengths = torch.full((b,), t, dtype=torch.long, device=dev)
        lengths = lengths.to(device=dev, dtype=torch.long).reshape(b)
        if cache.latent.shape[0] != b:
            raise ValueError(f"MLA cache holds {cache.latent.shape[0]} sequences, input has {b}")
        tt = torch.arange(t, device=dev)
        valid = tt[None, :] < lengths[:, None]  # [B, T]
        pos = start_pos[:, None] + tt[None, :]  # [B, T]

        latent = self.project_latent(x)
        bi, ti = valid.nonzero(as_tuple=True)
        cache.write(bi, pos[bi, ti], latent[bi, ti])

        end = start_pos + lengths  # per sequence: positions [0, end) hold valid latents
        s = int(end.max()) if b else 0
        if s == 0:
            return torch.zeros_like(x)
        lat = cache.read(s, x.dtype)
        ss = torch.arange(s, device=dev)
        key_ok = ss[None, :] < end[:, None]  # [B, S]; never multiply probabilities by stale slots
        lat = torch.where(key_ok[..., None], lat, torch.zeros((), dtype=lat.dtype, device=dev))
        mask = (ss[None, None, :] <= pos[:, :, None]) & key_ok[:, None, :] & valid[:, :, None]  # [B, T, S]

        q_nope, q_pe = self.project_q(x)
        attend = self._attend_plain if mode == "plain" else self._attend_absorbed
        rows = max(1, SCORE_ELEMENTS // max(1, b * self.num_heads * s))  # queries per pass
        if rows >= t:
            o = attend(q_nope, q_pe, lat, mask)
        else:  # a long prefill: the queries in slices (each row's softmax is its own), scores bounded; the
            # plain path's keys and values up-projected once for all slices
            kw = {"keys": self._plain_keys(lat, compute_dtype(x.dtype))} if mode == "plain" else {}
            o = torch.cat([attend(q_nope[:, i: i + rows], q_pe[:, i: i + rows], lat, mask[:, i: i + rows], **kw)
                           for i in range(0, t, rows)], dim=1)
        o = o.reshape(b, t, self.num_heads * self.v_dim)
        if self.g_proj is not None:
            cdt = compute_dtype(x.dtype)
            o = (o.to(cdt) * torch.sigmoid(self.g_proj(x).to(cdt))).to(x.dtype)
        out = self.o_proj(o)
        return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype, device=dev))
