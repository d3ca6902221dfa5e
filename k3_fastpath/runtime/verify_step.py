"""A speculative verify step on the executor's pools: ``T = 1 + drafts`` tokens per sequence in one model
pass, one CUDA graph per (sequence bucket, T).

The step is ``fast_step.run_step`` over ``Bk * T`` rows, row ``b*T + t`` holding token t of sequence b
(``StepIO`` with ``tokens_per_seq = T``). Everything but attention is row-parallel, so the GEMMs, router and
experts run once at ``M = Bk * T``. Attention:

* MLA: each row is a decode row of its sequence's slot at position ``length + t`` (``write_latent`` stores
  every row's latent before ``mla_decode`` reads the pool, and ``ctx_len = pos + 1`` masks the later
  drafts: causal inside the draft). Latents of drafts that are rejected lie past the committed length and
  are overwritten by the next step, never attended;
* KDA: one ``kda_step`` launch runs each sequence's T tokens in order from its slot (``kda_slot``) and keeps
  the state after row r in the pool's scratch slot ``scratch_base + r`` (``kda_out``); the sequence's own
  slot is not written.

``commit`` then makes each sequence's state that after its ``keep`` accepted rows: the scratch slot of row
``b*T + keep - 1`` copied into its slot for every KDA layer (``CachePool.commit_scratch``) and its length
advanced by ``keep``. Padded rows (a sequence with fewer drafts, or past the batch) are inactive: slot 0,
no scratch slot, logits 0.

A fused verify step needs the executor built with ``spec_tokens >= T`` (scratch slots in the pool) and at
most ``MAX_VERIFY_ROWS`` rows (the skinny GEMM's and the router's largest M), or, with
``DecodeExecutor(spec_all_rows=True)`` (scratch for every row of the largest bucket), several launches of at
most that many rows each (``verify_launches``: whole sequences per launch, each a replay of the same
per-(bucket, T) graph); otherwise ``spec_decode.verify_step`` runs the T positions as T decode steps, and
the executor records why. Each launch or decode step reads every weight once: B x T rows cost
ceil(B T / 64) weight passes as launches against T as decode steps (2 against 8 at 16 x 8, 4 against 8 at
32 x 8, equal at 64 x 8, where only kernels taking M > 64 would read the weights fewer times).

Scratch costs a full KDA state per row and layer: 26.8 MiB per row at a TP16 rank's shapes (6 heads of
128 x 128 FP32 and their conv windows in 69 KDA layers; 53.6 MiB at TP8), 1.7 GiB for the 64 rows. Fusing
more rows as several launches of <= 64 rows needs every row's state kept until the commit (the vLLM route
commits a step only at the next one): 13.4 GiB at batch 64 x 8 tokens on a TP16 rank (26.8 GiB at TP8),
hence ``spec_all_rows`` is opt-in; a per-token record from which the accepted state is recomputed at
commit (what vLLM's recoverssm keeps) would cost less.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels.moe_router.api import MAX_M as ROUTER_MAX_M
from ..kernels.skinny_gemm.config import MAX_M as GEMM_MAX_M
from .fast_step import StepIO

VerifyKey = tuple[str, int, int]  # ("verify", sequence bucket Bk, tokens per sequence T): a graph key
MAX_VERIFY_ROWS = min(GEMM_MAX_M, ROUTER_MAX_M)  # the rows of one fused step: the largest M both kernels take


def verify_rows(spec_tokens: int, buckets: Sequence[int], all_rows: bool = False) -> int:
    """Scratch KDA slots a pool needs for verify steps of up to ``spec_tokens`` tokens per sequence: one per
    row of the largest fused launch (0 when ``spec_tokens`` is 0), or with ``all_rows`` one per row of the
    largest bucket's verify step (fused as several launches, ``verify_launches``)."""
    if spec_tokens <= 0:
        return 0
    rows = max(buckets) * spec_tokens
    return rows if all_rows else min(MAX_VERIFY_ROWS, rows)


def verify_launches(batch: int, tokens: int, buckets: Sequence[int], scratch: int
                    ) -> list[tuple[int, int, int]] | None:
    """How a verify step of ``batch`` sequences x ``tokens`` rows runs fused: (first sequence, sequences,
    bucket) per launch of at most ``MAX_VERIFY_ROWS`` rows, in order; None where the scratch cannot keep every
    row's state to the commit. Sequence b's row t keeps its state in scratch slot ``b * tokens + t`` whatever
    launch runs it, so ``commit_verify`` does not see the launches."""
    limit = min(scratch, MAX_VERIFY_ROWS)
    one = verify_bucket(batch, tokens, buckets, limit)
    if one is not None:
        return [(0, batch, one)]
    per = max((b for b in buckets if b * tokens <= limit), default=0)
    if batch * tokens > scratch or per == 0:
        return None
    out = []
    for first in range(0, batch, per):
        n = min(per, batch - first)
        out.append((first, n, verify_bucket(n, tokens, buckets, limit)))
    return out


def verify_bucket(batch: int, tokens: int, buckets: Sequence[int], max_rows: int) -> int | None:
    """The smallest sequence bucket holding ``batch`` sequences whose ``tokens`` rows each fit ``max_rows``
    (None: none does)."""
    for b in sorted(buckets):
        if batch <= b and b * tokens <= max_rows:
            return b
    return None


def verify_io(bucket: int, tokens: int, vocab: int, device: torch.device,
              hidden: tuple[int, torch.dtype] | None = None) -> StepIO:
    """The static buffers of one (bucket, T) verify step: ``bucket * T`` rows, every row empty (``hidden``:
    ``StepIO.zeros``')."""
    io = StepIO.zeros(bucket * tokens, vocab, device, hidden)
    io.kda_slot = torch.zeros(bucket, dtype=torch.int32, device=device)
    io.kda_out = torch.zeros(bucket * tokens, dtype=torch.int32, device=device)
    io.tokens_per_seq = tokens
    return io


def load_verify(io: StepIO, feed: torch.Tensor, active: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                scratch_base: int) -> None:
    """Stage a verify step of ``feed [B, T]`` (``active [B, T]``: which rows are real; a row's later rows
    never active after an inactive one) on sequences at ``slots`` / ``lengths`` without a host sync."""
    T = io.tokens_per_seq
    b = int(feed.shape[0])
    n = b * T
    dev = io.tokens.device
    act = active.to(dev).reshape(n)
    io.tokens[:n].copy_(feed.reshape(n), non_blocking=True)
    io.active[:n].copy_(act)
    seq_slot = slots.to(dev).to(torch.int32)
    torch.mul(seq_slot.repeat_interleave(T), act, out=io.slot[:n])
    pos = lengths.to(dev)[:, None] + torch.arange(T, device=dev)[None, :]
    torch.mul(pos.reshape(n), act, out=io.pos[:n])
    torch.mul(seq_slot, act.view(b, T)[:, 0], out=io.kda_slot[:b])
    rows = torch.arange(n, dtype=torch.int32, device=dev) + scratch_base
    torch.mul(rows, act, out=io.kda_out[:n])
    for t in (io.tokens, io.slot, io.pos, io.active, io.kda_out):
        t[n:].zero_()
    io.kda_slot[b:].zero_()


def commit_verify(pool, cache, keep: torch.Tensor, tokens: int) -> None:
    """Each sequence b of ``cache`` with ``keep[b] > 0`` to its state after its first ``keep[b]`` rows of the
    last verify step (module docstring); sequences with ``keep[b] == 0`` untouched."""
    dev = cache.lengths.device
    keep = keep.long()
    rows = (keep > 0).nonzero().flatten()  # on keep's device (the generator's: the host, no GPU sync)
    if len(rows):
        src = (pool.scratch_base + rows * tokens + keep[rows] - 1).to(dev)
        pool.commit_scratch(cache.slots.index_select(0, rows.to(dev)), src)
    cache.lengths = cache.lengths + keep.to(dev)
    cache.length_bound += tokens  # a host-side bound (no read of the GPU)
