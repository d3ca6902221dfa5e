"""FP32 / FP64 oracle of absorbed MLA decode over a paged latent cache (the semantics of
``reference.mla.GatedMLA._attend_absorbed`` for one new token per sequence, after its latent is cached).

Per sequence b (its positions 0 .. ctx_len[b]-1 live in pages ``block_table[b, t // page_size]``, row
``t % page_size``), per head h:

    c_t      = cache[page, row]                   FP8: bf16(e4m3.float() * scale) (MLACache.read)
    score_t  = (q_lat[b,h] . c_t[:R] + q_pe[b,h] . c_t[R:]) * softmax_scale
    o_lat    = sum_t softmax(score)_t c_t[:R]      lse = log sum_t exp(score_t)
    o        = W_UV[h] o_lat                       (o_lat rounded to bf16 first, as the model does)
    y[b, h*V:(h+1)*V] = bf16(o * sigmoid(gate[b, h*V:(h+1)*V]))   (no gate: y = bf16(o))

``rounding=True`` rounds where the serving model rounds (o_lat, o, y to bf16: the "same-dtype torch"
implementation); ``compute_dtype=float64, rounding=False`` is the oracle the GPU tests measure against.
An empty sequence (ctx_len 0) gives o_lat = 0, lse = -inf, y = 0.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, ctx_len: torch.Tensor, b: int,
                   cache_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Positions 0 .. ctx_len[b]-1 of sequence b as ``MLACache.read(.., bfloat16)`` returns them: an FP8
    cache dequantized to bf16 (``(e4m3.float() * scale).to(bfloat16)``), any other cache as stored."""
    page_size = cache.shape[1]
    n = int(ctx_len[b])
    t = torch.arange(n, device=cache.device)
    pages = block_table[b].long()[t // page_size]
    if cache.dtype == FP8:  # gather the bytes (float8 indexing is not implemented everywhere)
        lat = cache.view(torch.uint8)[pages, t % page_size].view(FP8)
    else:
        lat = cache[pages, t % page_size]
    if lat.dtype == FP8:
        s = cache_scale if cache_scale is not None else torch.ones((), device=cache.device)
        return (lat.float() * s.float().reshape(())).to(torch.bfloat16)
    return lat


def mla_attention_ref(q_lat, q_pe, cache, block_table, ctx_len, *, softmax_scale: float,
                      cache_scale: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_lat [B, H, R], lse [B, H]) in ``compute_dtype``: the normalised latent output and the natural-log
    sum of exp of the scaled scores (what one rank of context parallelism contributes)."""
    B, H, R = q_lat.shape
    cdt = compute_dtype
    o = torch.zeros(B, H, R, dtype=cdt, device=q_lat.device)
    lse = torch.full((B, H), float("-inf"), dtype=cdt, device=q_lat.device)
    for b in range(B):
        if int(ctx_len[b]) == 0:
            continue
        lat = gather_latents(cache, block_table, ctx_len, b, cache_scale).to(cdt)  # [n, D]
        c, k_pe = lat[:, :R], lat[:, R:]
        scores = (q_lat[b].to(cdt) @ c.T + q_pe[b].to(cdt) @ k_pe.T) * softmax_scale  # [H, n]
        lse[b] = torch.logsumexp(scores, dim=-1)
        o[b] = torch.softmax(scores, dim=-1) @ c
    return o, lse


def up_project_ref(o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor | None, *, rounding: bool = True,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[B, H, R] latent output -> [B, H*V]: W_UV per head, then the sigmoid output gate."""
    cdt = o_lat.dtype
    B, H, _ = o_lat.shape
    bf = torch.bfloat16
    x = o_lat.to(bf).to(cdt) if rounding else o_lat
    o = torch.einsum("bhr,hvr->bhv", x, w_uv.to(cdt)).reshape(B, -1)
    if rounding:
        o = o.to(bf).to(cdt)
    if gate is not None:
        o = o * torch.sigmoid(gate.to(cdt))
    return o.to(out_dtype) if rounding else o


def mla_decode_ref(q_lat, q_pe, cache, block_table, ctx_len, w_uv, gate=None, *, softmax_scale: float,
                   cache_scale: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32,
                   rounding: bool = True, out: torch.Tensor | None = None, max_ctx=None, config=None
                   ) -> torch.Tensor:
    """The op (same signature as ``api.mla_decode``): y [B, H*V], bf16 with ``rounding``."""
    o_lat, _ = mla_attention_ref(q_lat, q_pe, cache, block_table, ctx_len, softmax_scale=softmax_scale,
                                 cache_scale=cache_scale, compute_dtype=compute_dtype)
    y = up_project_ref(o_lat, w_uv, gate, rounding=rounding)
    if out is not None:
        out.copy_(y)
        return out
    return y


def mla_merge_ref(o_parts: torch.Tensor, lse_parts: torch.Tensor, w_uv: torch.Tensor | None = None,
                  gate: torch.Tensor | None = None, *, rounding: bool = True):
    """Merge G partials ``o_parts [G, B, H, R]`` / ``lse_parts [G, B, H]`` by their LSE. Without ``w_uv``:
    (o_lat [B, H, R], lse [B, H]); with it: y [B, H*V] (``up_project_ref``)."""
    lse = torch.logsumexp(lse_parts, dim=0)  # [B, H]; all -inf -> -inf
    w = torch.exp(lse_parts - lse.unsqueeze(0))
    w = torch.where(torch.isfinite(lse).unsqueeze(0), w, torch.zeros_like(w))
    o_lat = (w.unsqueeze(-1) * o_parts).sum(dim=0)
    if w_uv is None:
        return o_lat, lse
    return up_project_ref(o_lat, w_uv, gate, rounding=rounding)


__all__ = ["gather_latents", "mla_attention_ref", "mla_decode_ref", "mla_merge_ref", "up_project_ref"]
