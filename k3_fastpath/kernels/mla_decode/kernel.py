"""Absorbed MLA decode attention over the latent cache, split-KV (CuTe DSL, sm_90a, mma.sync + cp.async).

Attention kernel, grid = (splits, B, head groups); CTA (s, b, g) handles heads h0 = g*HG .. h0+HG-1
(HG = 8 or 16, padded heads are computed on zero queries and never stored) of sequence b over positions
[s*chunk, min((s+1)*chunk, ctx_len[b])) (chunk a multiple of TILE = 64, a page size a multiple of 64, so a
tile never straddles a page). D = R + P = 512 + 64 latent columns, 8 warps.
0. Empty range (s*chunk >= ctx_len[b]): write lse = -inf and a zero partial for the group's heads, done.
1. Q = [q_lat | q_pe] of the group's heads -> shared memory (BF16 rows of D + 8, zero rows for padding).
2. Tiles of 64 positions stream through ``stages`` shared-memory buffers with cp.async (16-byte chunks,
   ``.cg``; positions past ctx_len are zero-filled, never read: the pool may hold anything there). A tile
   is 64 consecutive rows of one page: base = cache + page * page_stride + (t0 % page_size) * row_bytes with
   page = block_table[b, t0 / page_size], all in 64-bit (``page_stride``, in bytes, a launch parameter:
   page_size * row_bytes for a compact cache, more for vLLM's layouts that interleave layers by block). FP8 caches land as raw e4m3 bytes and every
   thread converts 16-byte chunks into the BF16 tile: bf16(e4m3 * scale), bitwise the reference's
   ``(latent.float() * scale).to(bfloat16)``.
3. Scores S^T[t, h] = sum_d C[t, d] Q[h, d] with mma.sync m16n8k16 (cache tile = A via ldmatrix, Q = B via
   ldmatrix; warps split 4 position tiles x head tiles, and the 36 k-steps in two halves when there is a
   single head tile; 4 accumulators per warp, k-step k into k % 4, summed in a fixed order); FP32 partials
   -> shared memory.
4. Online softmax, 256/HG threads per head (m, l kept redundantly in every thread of the head's group):
   s = S * softmax_scale * log2(e), positions past the range -> -inf; m' = max(m, max_t s);
   p = bf16(exp2(s - m')) -> shared memory; l = l * exp2(m - m') + sum(p) (the rounded p, so numerator and
   denominator agree); alpha = exp2(m - m') -> shared memory.
5. O^T[r, h] = alpha[h] O^T[r, h] + sum_t C[t, r] P[h, t]: mma.sync with the cache tile transposed by
   ldmatrix.trans as A (r rows, 64 per warp: the 512 latent columns over 8 warps) and P as B.
6. Epilogue: o = O / l staged through shared memory, 16-byte stores of o_part[s, b, h, :] (FP32) and
   lse[s, b, h] = (m + log2 l) * ln 2 (natural log of sum_t exp(score_t * softmax_scale)).
Barriers per tile: after the tile lands, after the scores, after the softmax (3; 4 with FP8).

Combine kernel, grid = (H, ceil(B / rows)); CTA (h, j) merges the S partials of head h for up to ``rows``
sequences (the same merge serves context parallelism: the "splits" are then ranks):
1. warp w (row b): M = max_s lse[s, b, h]; w_s = exp(lse_s - M) / sum_s exp(lse_s - M) (all -inf -> all
   weights 0: an empty sequence outputs 0);
2. o_lat[b, h, :] = sum_s w_s o_part[s, b, h, :] (FP32, splits strided over thread groups, summed in a
   fixed order: deterministic). ``final=False`` stores o_lat and lse = M + log(sum) (FP32) and stops;
3. ``final``: o_lat rounded to BF16 (the reference rounds the latent output), then the W_UV
   up-projection: o[b, h*V + d] = bf16(sum_r W_UV[h, d, r] o_lat[r]) (FP32 FMAs, W_UV[h] read once per
   CTA for all its rows), then the output gate y = bf16(o * sigmoid(gate[b, h*V + d])).

With ``config.pdl`` (programmatic dependent launch) both kernels launch with the PDL attribute. The attention
kernel waits (``griddepcontrol.wait``) before its first global access: q, ctx_len, the block table and
the latent cache are all written by this step or an earlier one (the latent row of this step by the glue
right before it). It triggers ``launch_dependents`` at the start of its epilogue (or at once for an empty
range). The combine first lets warp 0 of CTA (h, 0) issue ``cp.async.bulk.prefetch.L2`` over W_UV[h]
(a parameter), then waits before reading the partials, and triggers after its last partial load.

Constraints: D % 16 == 0, R % 16 == 0, page_size % 64 == 0, q_lat [B, H, R] / q_pe [B, H, P] BF16, cache
[pages, page_size, D] BF16 or e4m3 (as bytes), block_table [B, max_pages] / ctx_len [B] int32, W_UV
[H, V, R] BF16, V <= 128, gate [B, H*V] BF16; everything contiguous and 16-byte aligned.
"""
# ruff: noqa: UP045  (the DSL reads Optional[...] annotations to accept None operands)

from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ..common.pdl import PdlOrder
from ..common.primitives import prefetch_weights_l2, sigmoid
from ..common.ptx import (
    cp_async_16,
    e4m3x4_to_bf16,
    ldmatrix_x2,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    lds_128,
    mma_bf16,
    sts_128,
)
from .config import THREADS, TILE, MLADecodeConfig, ksplit

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_NEG_INF = float("-inf")



class MLAAttentionKernel:
    def __init__(self, H: int, R: int, P: int, page_size: int, config: MLADecodeConfig):
        D = R + P
        if D % 16 or R % 16:
            raise ValueError(f"latent width D={D} and rank R={R} must be multiples of 16")
        if page_size % TILE:
            raise ValueError(f"page_size={page_size} must be a multiple of {TILE}")
        self.H, self.R, self.P, self.D, self.PS, self.cfg = H, R, P, D, page_size, config
        self.HG = config.heads_per_cta
        self.NT = config.n_tiles
        self.ST = config.stages
        self.fp8 = config.fp8
        self.ROW = 2 * D + 16  # bytes of a padded BF16 row in shared memory (conflict-free ldmatrix)
        self.ROWB = D * (1 if self.fp8 else 2)  # bytes of a cache row in global memory
        self.CH = self.ROWB // 16  # 16-byte chunks per cache row
        self.TILE_B = TILE * self.ROW  # a BF16 tile buffer
        self.STAGE_B = TILE * D if self.fp8 else self.TILE_B
        self.KS = D // 16
        self.KSPLIT = ksplit(self.HG, D)
        self.KPW = self.KS // self.KSPLIT  # k-steps per QK warp
        self.QK_WARPS = (TILE // 16) * self.NT * self.KSPLIT
        self.MT_R = R // 16
        self.MTW = -(-self.MT_R // (THREADS // 32))  # 16-row latent tiles per PV warp
        self.TPH = THREADS // self.HG  # softmax threads per head
        self.TPT = TILE // self.TPH  # positions per softmax thread
        self.PROW = (TILE + 8) * 2  # bytes of a padded P row
        self.LD_S = TILE + 4
        self.LD_O = R + 4
        if self.HG * self.LD_O * 4 > self.TILE_B:
            raise ValueError("the epilogue staging does not fit the tile buffer")
        self.copy_iters = -(-TILE * self.CH // THREADS)
        self.copy_pred = self.copy_iters * THREADS != TILE * self.CH
        self.q_vec = D // 8
        self.q_iters = -(-self.HG * self.q_vec // THREADS)
        self.o_vec = R // 4
        self.o_iters = -(-self.HG * self.o_vec // THREADS)

    @cute.jit
    def __call__(self, mQl: cute.Tensor, mQp: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor,
                 mLen: cute.Tensor, mScale: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor,
                 scale_log2: Float32, chunk: Int32, page_stride: Int64, stream: cuda.CUstream):
        groups = (self.H + self.HG - 1) // self.HG
        self.kernel(mQl, mQp, mCache, mBT, mLen, mScale, mO, mLse, scale_log2, chunk, page_stride).launch(
            grid=[mO.shape[0], mQl.shape[0], groups], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=1,
            use_pdl=self.cfg.pdl)

    # ------------------------------------------------------------------------------------------ copies
    @cute.jit
    def issue_tile(self, mCache: cute.Tensor, mBT: cute.Tensor, b, t0, end, buf: Int32, tidx, page_stride):
        """cp.async of positions t0 .. t0+63 (rows past ``end`` zero-filled) into the buffer at ``buf``."""
        page = mBT[b, t0 // self.PS]
        base = (mCache.iterator.toint() + Int64(page) * page_stride
                + Int64(t0 % self.PS) * Int64(self.ROWB))
        nvalid = end - t0
        for i in cutlass.range_constexpr(self.copy_iters):
            c = tidx + THREADS * i
            row = c // self.CH
            col = c % self.CH
            if cutlass.const_expr(self.fp8):
                dst = buf + c * 16
            else:
                dst = buf + row * self.ROW + col * 16
            ok = row < nvalid
            src = base + Int64(cutlass.select_(ok, c * 16, 0))
            nbytes = Int32(cutlass.select_(ok, 16, 0))
            if cutlass.const_expr(self.copy_pred):
                if c < TILE * self.CH:
                    cp_async_16(dst, src, nbytes)
            else:
                cp_async_16(dst, src, nbytes)

    @cute.jit
    def convert_chunk(self, stage: Int32, tile: Int32, scale: Float32, c):
        """16 e4m3 bytes (chunk c of the row-major stage) -> 32 bytes of BF16 in the padded tile row."""
        row = c // self.CH
        col = c % self.CH
        v = lds_128(stage + c * 16)
        dst = tile + row * self.ROW + col * 32
        w0, w1 = e4m3x4_to_bf16(v[0], scale)
        w2, w3 = e4m3x4_to_bf16(v[1], scale)
        sts_128(dst, w0, w1, w2, w3)
        w4, w5 = e4m3x4_to_bf16(v[2], scale)
        w6, w7 = e4m3x4_to_bf16(v[3], scale)
        sts_128(dst + 16, w4, w5, w6, w7)

    @cute.jit
    def convert_tile(self, stage: Int32, tile: Int32, scale: Float32, tidx):
        """FP8 stage (row-major e4m3 bytes) -> BF16 tile (padded rows)."""
        for i in cutlass.range_constexpr(self.copy_iters):
            c = tidx + THREADS * i
            if cutlass.const_expr(self.copy_pred):
                if c < TILE * self.CH:
                    self.convert_chunk(stage, tile, scale, c)
            else:
                self.convert_chunk(stage, tile, scale, c)

    # ------------------------------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, mQl: cute.Tensor, mQp: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor,
               mLen: cute.Tensor, mScale: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor,
               scale_log2: Float32, chunk: Int32, page_stride: Int64):
        HG, D, R = self.HG, self.D, self.R
        tidx, _, _ = cute.arch.thread_idx()
        split, b, grp = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        h0 = grp * HG
        order = PdlOrder(self.cfg.pdl)  # every input here is an activation or the cache: nothing before the wait
        mQl, mQp, mCache, mBT, mLen, mScale, mO, mLse = order.after_wait(
            mQl, mQp, mCache, mBT, mLen, mScale, mO, mLse)

        smem = SmemAllocator()
        p_stage = smem.allocate(self.ST * self.STAGE_B, byte_alignment=128)
        p_tile = smem.allocate(self.TILE_B, byte_alignment=128) if self.fp8 else p_stage
        p_q = smem.allocate(HG * self.ROW, byte_alignment=128)
        sS = smem.allocate_tensor(Float32, cute.make_layout((self.KSPLIT, HG, self.LD_S),
                                                            stride=(HG * self.LD_S, self.LD_S, 1)),
                                  byte_alignment=16)
        p_p = smem.allocate(HG * self.PROW, byte_alignment=128)
        sP = cute.make_tensor(cute.recast_ptr(p_p, dtype=BFloat16), cute.make_layout((HG, TILE + 8), stride=(TILE + 8, 1)))
        sAl = smem.allocate_tensor(Float32, cute.make_layout((HG,)), byte_alignment=16)
        sML = smem.allocate_tensor(Float32, cute.make_layout((2, HG)), byte_alignment=16)
        sO = cute.make_tensor(cute.recast_ptr(p_tile, dtype=Float32),
                             cute.make_layout((HG, self.LD_O), stride=(self.LD_O, 1)))
        sQ = cute.make_tensor(cute.recast_ptr(p_q, dtype=BFloat16), cute.make_layout((HG, D + 8), stride=(D + 8, 1)))
        a_stage = p_stage.toint()
        a_tile = p_tile.toint()
        a_q = p_q.toint()
        a_p = p_p.toint()
        vec_bf = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        vec_f = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)

        order.wait()
        mQl, mQp, mCache, mBT, mLen, mScale, mO, mLse = order.open(mQl, mQp, mCache, mBT, mLen, mScale, mO, mLse)
        L = mLen[b]
        start = split * chunk
        end = cutlass.min(start + chunk, L)
        if start >= L:
            # 0. empty range: lse = -inf and a zero partial, so the combine never reads garbage
            order.launch_dependents()
            z = cute.make_rmem_tensor((4,), Float32)
            z.fill(0.0)
            for i in cutlass.range_constexpr(self.o_iters):
                v = tidx + THREADS * i
                hh = v // self.o_vec
                if hh < HG and h0 + hh < self.H:
                    cute.copy(vec_f, z, cute.local_tile(mO[split, b, h0 + hh, None], (4,), (v % self.o_vec,)))
            if tidx < HG and h0 + tidx < self.H:
                mLse[split, b, h0 + tidx] = Float32(_NEG_INF)
        else:
            n_tiles = (end - start + TILE - 1) // TILE
            # 2. prologue: the first stages - 1 tiles in flight
            for j in cutlass.range_constexpr(self.ST - 1):
                if j < n_tiles:
                    self.issue_tile(mCache, mBT, b, start + j * TILE, end, a_stage + j * self.STAGE_B, tidx,
                                    page_stride)
                cute.arch.cp_async_commit_group()
            # 1. queries of the group (zero rows for padded heads)
            rq = cute.make_rmem_tensor((8,), BFloat16)
            for i in cutlass.range_constexpr(self.q_iters):
                v = tidx + THREADS * i
                hh = v // self.q_vec
                c = v % self.q_vec
                if v < HG * self.q_vec:
                    rq.fill(0.0)
                    if h0 + hh < self.H:
                        if c < R // 8:
                            cute.copy(vec_bf, cute.local_tile(mQl[b, h0 + hh, None], (8,), (c,)), rq)
                        else:
                            cute.copy(vec_bf, cute.local_tile(mQp[b, h0 + hh, None], (8,), (c - R // 8,)), rq)
                    cute.copy(vec_bf, rq, cute.local_tile(sQ[hh, None], (8,), (c,)))
            scale = Float32(1.0)
            if cutlass.const_expr(self.fp8):
                scale = mScale[0]

            # softmax state (every thread of a head's group holds the same values)
            sh = tidx // self.TPH
            sj = tidx % self.TPH
            m_run = Float32(_NEG_INF)
            l_run = Float32(0.0)
            oacc = cute.make_rmem_tensor((4, self.MTW, self.NT), Float32)
            oacc.fill(0.0)

            for it in cutlass.range(n_tiles, unroll=1):
                t0 = start + it * TILE
                cute.arch.cp_async_wait_group(self.ST - 2)
                cute.arch.sync_threads()
                nxt = it + self.ST - 1
                if nxt < n_tiles:
                    self.issue_tile(mCache, mBT, b, start + nxt * TILE, end,
                                    a_stage + (nxt % self.ST) * self.STAGE_B, tidx, page_stride)
                cute.arch.cp_async_commit_group()
                a_cur = a_stage + (it % self.ST) * self.STAGE_B
                if cutlass.const_expr(self.fp8):
                    self.convert_tile(a_cur, a_tile, scale, tidx)
                    cute.arch.sync_threads()
                    a_cur = a_tile

                # 3. scores
                if warp < self.QK_WARPS:
                    self.qk(a_cur, a_q, sS, warp, lane, g, q)
                cute.arch.sync_threads()

                # 4. online softmax
                nvalid = end - t0
                sv = cute.make_rmem_tensor((self.TPT,), Float32)
                tmax = Float32(_NEG_INF)
                for u in cutlass.range_constexpr(self.TPT):
                    t = sj * self.TPT + u
                    s = sS[0, sh, t]
                    if cutlass.const_expr(self.KSPLIT == 2):
                        s = s + sS[1, sh, t]
                    s = Float32(cutlass.select_(t < nvalid, s * scale_log2, Float32(_NEG_INF)))
                    sv[u] = s
                    tmax = cute.arch.fmax(tmax, s)
                tmax = cute.arch.warp_reduction_max(tmax, threads_in_group=self.TPH)
                m_new = cute.arch.fmax(m_run, tmax)
                alpha = cute.math.exp2(m_run - m_new, fastmath=True)
                psum = Float32(0.0)
                for u in cutlass.range_constexpr(self.TPT):
                    pb = cute.math.exp2(sv[u] - m_new, fastmath=True).to(BFloat16)
                    sP[sh, sj * self.TPT + u] = pb
                    psum = psum + pb.to(Float32)
                psum = cute.arch.warp_reduction_sum(psum, threads_in_group=self.TPH)
                l_run = l_run * alpha + psum
                m_run = m_new
                if sj == 0:
                    sAl[sh] = alpha
                cute.arch.sync_threads()

                # 5. O^T += C^T P^T
                self.pv(a_cur, a_p, sAl, oacc, warp, lane, g, q)

            # 6. epilogue
            order.launch_dependents()  # every cache tile is requested
            cute.arch.cp_async_wait_group(0)
            if sj == 0:
                sML[0, sh] = m_run
                sML[1, sh] = l_run
            cute.arch.sync_threads()
            for mt in cutlass.range_constexpr(self.MTW):
                r0 = (warp * self.MTW + mt) * 16
                if r0 < R:
                    for n in cutlass.range_constexpr(self.NT):
                        for e in cutlass.range_constexpr(4):
                            hh = n * 8 + 2 * q + e % 2
                            sO[hh, r0 + g + 8 * (e // 2)] = oacc[e, mt, n] / sML[1, hh]
            cute.arch.sync_threads()
            ro = cute.make_rmem_tensor((4,), Float32)
            for i in cutlass.range_constexpr(self.o_iters):
                v = tidx + THREADS * i
                hh = v // self.o_vec
                c = v % self.o_vec
                if hh < HG and h0 + hh < self.H:
                    cute.autovec_copy(cute.local_tile(sO[hh, None], (4,), (c,)), ro)
                    cute.copy(vec_f, ro, cute.local_tile(mO[split, b, h0 + hh, None], (4,), (c,)))
            if tidx < HG and h0 + tidx < self.H:
                mLse[split, b, h0 + tidx] = (sML[0, tidx] + cute.math.log2(sML[1, tidx])) * Float32(LN2)

    @cute.jit
    def qk(self, a_tile: Int32, a_q: Int32, sS: cute.Tensor, warp, lane, g, q):
        """S^T tile of 16 positions x 8 heads for warp (m, n, k-part) over its k-steps -> sS."""
        m = warp % (TILE // 16)
        rest = warp // (TILE // 16)
        n = rest % self.NT
        kp = rest // self.NT
        # NACC independent accumulators (k-step kk feeds kk % NACC): the mma chain per accumulator is
        # KPW / NACC long instead of KPW (36 dependent mma.sync would serialise on their latency)
        nacc = min(4, self.KPW)
        acc = cute.make_rmem_tensor((4, nacc), Float32)
        acc.fill(0.0)
        a_row = a_tile + (m * 16 + lane % 8 + 8 * ((lane // 8) % 2)) * self.ROW + 16 * (lane // 16)
        b_row = a_q + (n * 8 + lane % 8) * self.ROW + 16 * (lane // 8)
        b_row2 = a_q + (n * 8 + lane % 8) * self.ROW + 16 * ((lane // 8) % 2)
        k0 = kp * self.KPW
        bq = [Uint32(0), Uint32(0), Uint32(0), Uint32(0)]
        for kk in cutlass.range_constexpr(self.KPW):
            ks = k0 + kk
            if cutlass.const_expr(kk % 2 == 0):
                if cutlass.const_expr(kk + 1 < self.KPW):
                    b0, b1, b2, b3 = ldmatrix_x4(b_row + ks * 32)
                    bq = [b0, b1, b2, b3]
                else:
                    b0, b1 = ldmatrix_x2(b_row2 + ks * 32)
                    bq = [b0, b1, b0, b1]
            a0, a1, a2, a3 = ldmatrix_x4(a_row + ks * 32)
            hi = 2 * (kk % 2)
            mma_bf16(acc[None, kk % nacc], a0, a1, a2, a3, bq[hi], bq[hi + 1])
        for e in cutlass.range_constexpr(4):
            tot = acc[e, 0]
            for j in cutlass.range_constexpr(1, nacc):
                tot = tot + acc[e, j]
            sS[kp, n * 8 + 2 * q + e % 2, m * 16 + g + 8 * (e // 2)] = tot

    @cute.jit
    def pv(self, a_tile: Int32, a_p: Int32, sAl: cute.Tensor, oacc: cute.Tensor, warp, lane, g, q):
        """Rescale the warp's O^T rows by alpha, then add this tile: C^T (ldmatrix.trans) times P^T."""
        al = cute.make_rmem_tensor((2, self.NT), Float32)
        for n in cutlass.range_constexpr(self.NT):
            al[0, n] = sAl[n * 8 + 2 * q]
            al[1, n] = sAl[n * 8 + 2 * q + 1]
        for mt in cutlass.range_constexpr(self.MTW):
            for n in cutlass.range_constexpr(self.NT):
                for e in cutlass.range_constexpr(4):
                    oacc[e, mt, n] = oacc[e, mt, n] * al[e % 2, n]
        p_row = a_p + (lane % 8) * self.PROW + 16 * (lane // 8)
        c_row = a_tile + (lane % 8 + 8 * (lane // 16)) * self.ROW + 16 * ((lane // 8) % 2)
        pb = cute.make_rmem_tensor((4, self.NT), Uint32)
        for kk in cutlass.range_constexpr(TILE // 16):
            if cutlass.const_expr(kk % 2 == 0):
                for n in cutlass.range_constexpr(self.NT):
                    p0, p1, p2, p3 = ldmatrix_x4(p_row + n * 8 * self.PROW + kk * 32)
                    pb[0, n] = p0
                    pb[1, n] = p1
                    pb[2, n] = p2
                    pb[3, n] = p3
            hi = 2 * (kk % 2)
            for mt in cutlass.range_constexpr(self.MTW):
                r0 = (warp * self.MTW + mt) * 16
                if cutlass.const_expr(self.MT_R % (THREADS // 32) == 0):
                    a0, a1, a2, a3 = ldmatrix_x4_trans(c_row + kk * 16 * self.ROW + r0 * 2)
                    for n in cutlass.range_constexpr(self.NT):
                        mma_bf16(oacc[None, mt, n], a0, a1, a2, a3, pb[hi, n], pb[hi + 1, n])
                else:
                    if r0 < self.R:
                        a0, a1, a2, a3 = ldmatrix_x4_trans(c_row + kk * 16 * self.ROW + r0 * 2)
                        for n in cutlass.range_constexpr(self.NT):
                            mma_bf16(oacc[None, mt, n], a0, a1, a2, a3, pb[hi, n], pb[hi + 1, n])


class MLACombineKernel:
    """LSE merge of split (or context-parallel) partials, then (``final``) W_UV and the output gate."""

    def __init__(self, H: int, R: int, V: int, final: bool, gate: bool, rows: int, max_splits: int,
                 pdl: bool = False):
        if R % 16 or not 1 <= V <= THREADS // 2:
            raise ValueError(f"needs R % 16 == 0 and V <= {THREADS // 2}, got R={R}, V={V}")
        self.H, self.R, self.V, self.final, self.gate = H, R, V, final, gate
        self.rows = rows
        self.S_MAX = max_splits
        self.RV = R // 4  # 16-byte FP32 vectors per latent row
        if THREADS % self.RV or THREADS // self.RV < 2:
            raise ValueError(f"R={R}: R/4 must divide {THREADS // 2}")
        self.SG = THREADS // self.RV  # thread groups striding over the splits
        self.LD_X = R + 4
        self.RH = R // 2  # W_UV K-range per thread (two threads per output column)
        self.KV = self.RH // 8
        self.pdl = pdl
        # PDL prologue (final): lane i of warp 0 of CTA (h, 0) prefetches bytes [i * pf_chunk, +pf_chunk) of
        # W_UV[h] (V * R * 2 bytes, a multiple of 32) toward L2
        self.w_bytes = V * R * 2
        self.pf_lanes = min(32, self.w_bytes // 16)
        self.pf_chunk = self.w_bytes // self.pf_lanes // 16 * 16

    @cute.jit
    def __call__(self, mO: cute.Tensor, mLse: cute.Tensor, mW: Optional[cute.Tensor], mG: Optional[cute.Tensor],
                 mOut: Optional[cute.Tensor], mOlat: Optional[cute.Tensor], mLseOut: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        B = mO.shape[1]
        self.kernel(mO, mLse, mW, mG, mOut, mOlat, mLseOut).launch(
            grid=[self.H, (B + self.rows - 1) // self.rows, 1], block=[THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=1, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mLse: cute.Tensor, mW: Optional[cute.Tensor], mG: Optional[cute.Tensor],
               mOut: Optional[cute.Tensor], mOlat: Optional[cute.Tensor], mLseOut: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        h, bj, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        order = PdlOrder(self.pdl)
        mW = order.weight(mW)
        mO, mLse, mG, mOut, mOlat, mLseOut = order.after_wait(mO, mLse, mG, mOut, mOlat, mLseOut)
        S = mO.shape[0]
        B = mO.shape[1]
        b0 = bj * self.rows
        smem = SmemAllocator()
        sW = smem.allocate_tensor(Float32, cute.make_layout((self.rows, self.S_MAX)), byte_alignment=16)
        sX = smem.allocate_tensor(Float32, cute.make_layout((self.SG, self.rows, self.LD_X),
                                                            stride=(self.rows * self.LD_X, self.LD_X, 1)),
                                  byte_alignment=16)
        vec_f = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        if cutlass.const_expr(self.pdl):
            if cutlass.const_expr(self.final):  # W_UV[h] (a parameter) toward L2, once per head
                if bj == 0 and tidx < self.pf_lanes:
                    addr = mW.iterator.toint() + Int64(h) * self.w_bytes + Int64(tidx) * self.pf_chunk
                    prefetch_weights_l2(addr, Int32(self.pf_chunk))
        order.wait()  # the partials are the attention kernel's output
        mO, mLse, mG, mOut, mOlat, mLseOut = order.open(mO, mLse, mG, mOut, mOlat, mLseOut)

        # 1. split weights, one warp per row
        if warp < self.rows:
            b = b0 + warp
            if b < B:
                mx = Float32(_NEG_INF)
                for s in cutlass.range(lane, S, 32, unroll=1):
                    mx = cute.arch.fmax(mx, mLse[s, b, h])
                mx = cute.arch.warp_reduction_max(mx)
                tot = Float32(0.0)
                for s in cutlass.range(lane, S, 32, unroll=1):
                    ls = mLse[s, b, h]
                    e = Float32(cutlass.select_(ls > Float32(_NEG_INF), cute.math.exp(ls - mx), Float32(0.0)))
                    sW[warp, s] = e
                    tot = tot + e
                tot = cute.arch.warp_reduction_sum(tot)
                inv = Float32(cutlass.select_(tot > Float32(0.0), Float32(1.0) / tot, Float32(0.0)))
                for s in cutlass.range(lane, S, 32, unroll=1):
                    sW[warp, s] = sW[warp, s] * inv
                if cutlass.const_expr(not self.final):
                    if lane == 0:
                        mLseOut[b, h] = Float32(cutlass.select_(tot > Float32(0.0), mx + cute.math.log(tot),
                                                                Float32(_NEG_INF)))
        cute.arch.sync_threads()

        # 2. weighted sum of the partials: thread (group sg, vector c) sums splits sg, sg + SG, ...
        c = tidx % self.RV
        sg = tidx // self.RV
        acc = cute.make_rmem_tensor((4,), Float32)
        part = cute.make_rmem_tensor((4,), Float32)
        for row in cutlass.range_constexpr(self.rows):
            b = b0 + row
            acc.fill(0.0)
            if b < B:
                for s in cutlass.range(sg, S, self.SG, unroll=4):
                    w = sW[row, s]
                    cute.copy(vec_f, cute.local_tile(mO[s, b, h, None], (4,), (c,)), part)
                    for e in cutlass.range_constexpr(4):
                        acc[e] = acc[e] + w * part[e]
            cute.autovec_copy(acc, cute.local_tile(sX[sg, row, None], (4,), (c,)))
        cute.arch.sync_threads()
        order.launch_dependents()  # every partial is read (the gate is the epilogue's)
        for row in cutlass.range_constexpr(self.rows):
            b = b0 + row
            if b < B and sg == 0:
                cute.autovec_copy(cute.local_tile(sX[0, row, None], (4,), (c,)), acc)
                for gi in cutlass.range_constexpr(1, self.SG):
                    cute.autovec_copy(cute.local_tile(sX[gi, row, None], (4,), (c,)), part)
                    for e in cutlass.range_constexpr(4):
                        acc[e] = acc[e] + part[e]
                if cutlass.const_expr(self.final):
                    for e in cutlass.range_constexpr(4):
                        acc[e] = acc[e].to(BFloat16).to(Float32)  # the reference rounds o_lat to bf16
                    cute.autovec_copy(acc, cute.local_tile(sX[0, row, None], (4,), (c,)))
                else:
                    cute.copy(vec_f, acc, cute.local_tile(mOlat[b, h, None], (4,), (c,)))
        if cutlass.const_expr(self.final):
            cute.arch.sync_threads()
            self.up_project(mW, mG, mOut, sX, tidx, h, b0, B)

    @cute.jit
    def up_project(self, mW: cute.Tensor, mG: Optional[cute.Tensor], mOut: cute.Tensor, sX: cute.Tensor, tidx,
                   h, b0, B):
        """o[b, h*V + d] = bf16(W_UV[h, d, :] . o_lat[b]) (two threads per d, halves summed in order), then
        the gate. sX[0] holds the rounded o_lat rows; sX[1] (or sW's space) collects the upper halves."""
        V = self.V
        d = tidx % V
        kh = tidx // V
        vec_bf = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        acc = cute.make_rmem_tensor((self.rows,), Float32)
        acc.fill(0.0)
        rw = cute.make_rmem_tensor((8,), BFloat16)
        rx = cute.make_rmem_tensor((8,), Float32)
        if kh < 2:
            for kv in cutlass.range(self.KV, unroll=2):
                k = kh * self.RH + kv * 8
                cute.copy(vec_bf, cute.local_tile(mW[h, d, None], (8,), (k // 8,)), rw)
                wf = cute.make_rmem_tensor((8,), Float32)
                wf.store(rw.load().to(Float32))
                for row in cutlass.range_constexpr(self.rows):
                    cute.autovec_copy(cute.local_tile(sX[0, row, None], (8,), (k // 8,)), rx)
                    a = acc[row]
                    for e in cutlass.range_constexpr(8):
                        a = a + wf[e] * rx[e]
                    acc[row] = a
        sRed = cute.make_tensor(sX.iterator + self.rows * self.LD_X, cute.make_layout((self.rows, V)))
        if kh == 1:
            for row in cutlass.range_constexpr(self.rows):
                sRed[row, d] = acc[row]
        cute.arch.sync_threads()
        if kh == 0:
            for row in cutlass.range_constexpr(self.rows):
                b = b0 + row
                if b < B:
                    o = (acc[row] + sRed[row, d]).to(BFloat16)
                    if cutlass.const_expr(self.gate):
                        y = (o.to(Float32) * sigmoid(mG[b, h * V + d].to(Float32))).to(BFloat16)
                        mOut[b, h * V + d] = y
                    else:
                        mOut[b, h * V + d] = o
