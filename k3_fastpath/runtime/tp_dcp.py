"""Decode context parallelism (DCP) of K3's MLA layers inside tensor parallelism: the latent cache split
across the TP ranks by token, each rank attending over its share, the partial outputs merged by their
log-sum-exps (``kernels/mla_decode``'s merge, ``mla_merge_ref``; its fused kernel adds v-proj and gating)
as the reference a fused DCP step must reproduce; ``TPModel(dcp=True)`` runs it (DCP size = TP size, as vLLM's K3 path requires).

Layout: position ``p`` of a sequence lives on rank ``p % D`` at local row ``p // D`` (``D`` ranks,
interleave 1), so a rank's MLA cache holds ``ceil(max_len / D)`` rows: the per-rank latent memory is 1/D
of the replicated cache's. The latent projection (``kv_a``, replicated) runs on every rank and only the
owner writes a token's row.

One MLA call on rank ``r`` (prefill and decode alike, every query token):

1. the rank's heads: ``q_nope``, ``q_pe`` (column-parallel ``q_b``), absorbed into the latent space with its
   heads' ``W_UK`` -> ``q_lat [.., heads_r, rank]``; all-gathered across ranks -> every head's queries;
2. scores of every head against the rank's local keys (positions ``<=`` the query's, ``<`` the sequence's
   end), the local log-sum-exp ``lse_r`` and the local latent-space output ``o_r = softmax_local . c``;
3. every rank's ``(o_r, lse_r)`` all-gathered; the rank keeps its heads and merges them
   (``mla_merge_ref``: ``o = sum_r exp(lse_r - lse) o_r`` with ``lse = logsumexp_r lse_r``; no key: 0);
4. its heads' ``W_UV`` (v-proj), the output gate, the row-parallel ``o_proj``: the partial sum the TP
   all-reduce adds, as without DCP.

The merge exchanges every head's partials with every rank (an all-gather: ``D`` times the volume an
all-to-all of each head group to its owner would move): the reference keeps the collectives the
``Communicator`` already has. In FP64 a TP2 + DCP2 run equals the TP1 reference to ~1e-12
(``tests/test_tp_dcp_cpu.py``); a GPU run (two H200s) is issue #24's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.mla_decode.reference import mla_merge_ref
from ..reference.common import compute_dtype
from ..reference.mla import GatedMLA, MLACache


def local_rows(max_len: int, world: int) -> int:
    """Rows a rank's MLA cache holds for ``max_len`` positions split over ``world`` ranks."""
    return -(-max_len // world)


def dcp_mla_forward(attn: GatedMLA, x: torch.Tensor, cache: MLACache, start_pos: torch.Tensor,
                    lengths: torch.Tensor, comm: Any) -> torch.Tensor:
    """``GatedMLA.forward``'s contract (``x [B, T, H]`` -> the rank's ``o_proj`` partial ``[B, T, H]``, padded
    tokens 0) with ``cache`` this rank's token share (module docstring)."""
    b, t, _ = x.shape
    dev, dt = x.device, x.dtype
    cdt = compute_dtype(dt)
    world, rank = comm.world, comm.rank
    start_pos = start_pos.to(device=dev, dtype=torch.long).reshape(b)
    lengths = lengths.to(device=dev, dtype=torch.long).reshape(b)
    tt = torch.arange(t, device=dev)
    valid = tt[None, :] < lengths[:, None]
    pos = start_pos[:, None] + tt[None, :]

    latent = attn.project_latent(x)
    mine = valid & (pos % world == rank)
    bi, ti = mine.nonzero(as_tuple=True)
    cache.write(bi, pos[bi, ti] // world, latent[bi, ti])

    # 1. every head's latent-space queries
    q_nope, q_pe = attn.project_q(x)
    w_uk, w_uv = attn._w_uk_uv()
    hr = attn.num_heads
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope.to(cdt), w_uk.to(cdt)).to(dt)
    q_all = comm.all_gather_last(torch.cat([q_lat, q_pe], dim=-1).reshape(b, t, -1))
    q_all = q_all.view(b, t, world * hr, attn.rank + q_pe.shape[-1])
    q_lat_all, q_pe_all = q_all[..., : attn.rank], q_all[..., attn.rank:]

    # 2. partial attention over the local keys
    end = start_pos + lengths
    s_loc = int(local_rows(int(end.max()), world)) if b else 0
    heads = world * hr
    if s_loc:
        lat = cache.read(s_loc, dt)
        kpos = torch.arange(s_loc, device=dev) * world + rank  # the global position of each local row
        key_ok = kpos[None, :] < end[:, None]  # [B, S]
        lat = torch.where(key_ok[..., None], lat, torch.zeros((), dtype=lat.dtype, device=dev))
        mask = (kpos[None, None, :] <= pos[:, :, None]) & key_ok[:, None, :] & valid[:, :, None]  # [B, T, S]
        c, k_pe = lat[..., : attn.rank], lat[..., attn.rank:]
        scores = (torch.einsum("bthr,bsr->bhts", q_lat_all.to(cdt), c.to(cdt))
                  + torch.einsum("bthd,bsd->bhts", q_pe_all.to(cdt), k_pe.to(cdt))) * attn.softmax_scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, heads, T]; -inf: no local key
        p = torch.where(mask.unsqueeze(1), torch.exp(scores - torch.where(torch.isfinite(lse), lse,
                                                                          torch.zeros_like(lse)).unsqueeze(-1)),
                        torch.zeros((), dtype=scores.dtype, device=dev))
        o_loc = torch.einsum("bhts,bsr->bthr", p, c.to(cdt))  # [B, T, heads, rank]
        lse = lse.transpose(1, 2)  # [B, T, heads]
    else:
        o_loc = torch.zeros(b, t, heads, attn.rank, dtype=cdt, device=dev)
        lse = torch.full((b, t, heads), float("-inf"), dtype=cdt, device=dev)

    # 3. every rank's partials; this rank's heads merged
    packed = torch.cat([o_loc, lse.unsqueeze(-1)], dim=-1).reshape(b, t, -1)
    gathered = comm.all_gather_last(packed).view(b, t, world, heads, attn.rank + 1).movedim(2, 0)
    ours = gathered[:, :, :, rank * hr:(rank + 1) * hr]  # [D, B, T, hr, rank + 1]
    o_lat = mla_merge_ref(ours[..., : attn.rank], ours[..., attn.rank])[0].to(dt)

    # 4. v-proj, gate, the row-parallel output projection
    o = torch.einsum("bthr,hdr->bthd", o_lat.to(cdt), w_uv.to(cdt)).to(dt).reshape(b, t, hr * attn.v_dim)
    if attn.g_proj is not None:
        o = (o.to(cdt) * torch.sigmoid(attn.g_proj(x).to(cdt))).to(dt)
    out = attn.o_proj(o)
    return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype, device=dev))
