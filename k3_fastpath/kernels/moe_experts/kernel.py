"""Routed experts of LatentMoE for decode batches (CuTe DSL, sm_90a): plan, two grouped expert GEMMs, combine.

Pairs p = token * k + slot (P = N * k <= 1024). Four launches, no host synchronisation:
1. Plan (one CTA of SORT = next power of two >= P threads): bitonic sort of the keys expert << 10 | p in
   shared memory (unique keys: deterministic); the first pair of every expert run starts a segment; a
   block scan numbers the segments -> n_active, act_expert[a] (ascending ids), act_start[a], act_count[a],
   sorted_pair[P] (pairs grouped by expert, ascending pair index within an expert).
2. Gate/up GEMM (``glu``): persistent CTAs loop over work items (a, row block) = n_active x ceil(I / rows
   per item); every touched expert's w1/w3 rows stream once whatever the batch (its tokens, at most 64,
   are the mma N dimension in passes of 8 * tiles_per_pass). Per 64-wide K step a lane loads 16 bytes of
   each matrix in the fragment layout (layout.py) + 4 scale bytes, dequantises the e2m1 nibbles through
   a shared-memory table (one 32-bit load per byte gives both bf16 values; 32 copies of the 256-entry
   table, one per bank, so the lookups never conflict), runs two mma.sync m16n8k16 per MX group against
   the tokens' z (one 16-byte load per group and token tile, same K permutation) and adds the FP32 result
   times the group scale 2^(s-127) per row. ``warps_k`` warps split K; partials meet in shared memory in
   warp order. Epilogue: g, u rounded to bf16 (as F.linear rounds), h = SiTU-GLU in FP32 -> bf16 h[pair].
   BF16 experts: the same with the weights loaded directly (16 bytes per row and group) and no scale.
3. Down GEMM: the same kernel without the GLU: y[pair] = bf16(h[pair] W2_e^T) (rows = latent 3584).
4. Combine, one CTA per token: acc = sum_slot w[t, slot] * y[t * k + slot] in slot order (FP32); either
   stored (FP32) or normed: bf16(acc * rsqrt(mean(acc^2) + eps) * norm_weight) (the latent RMSNorm).

With programmatic dependent launch (``pdl``: the decode executor opts in) all four launches carry the PDL
attribute and every thread waits (``griddepcontrol.wait``) before its first global read of anything a step
writes and before any global write. Which expert weights a GEMM reads depends on the router's output (an
activation), so no launch touches expert weights before the wait: the plan waits first (it reads ids), the
GEMMs build their dequantisation table in shared memory (no global access) and then wait, the combine loads
its norm weight (a parameter) first. ``launch_dependents``: the plan after reading ids, a GEMM CTA when its
last work item's K loop is issued, the combine after its last y load.

Constraints: rows % 16 == 0, K % 64 == 0 (TP16's I = 192 qualifies), token count <= 64, top-k <= 16,
experts < 2^21, ids in [0, E) (clamped: an out-of-range id never reads outside the weights).
"""
# ruff: noqa: UP045  (the DSL reads Optional[...] annotations to accept None operands)

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8, Uint32
from cutlass.memory import SmemAllocator

from ..common.pdl import PdlOrder
from ..common.primitives import sigmoid
from ..common.ptx import mma_bf16
from .config import GP

_INT_MAX = 2**31 - 1



def _exp2_scale(s):
    """ue8m0 byte -> FP32 2^(s - 127) (the bits s << 23; s = 0 gives 0 instead of 2^-127)."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32],
                                read_only_args=[Uint32(s) << 23])


class PlanKernel:
    def __init__(self, E: int, sort_n: int, pdl: bool = False):
        if sort_n & (sort_n - 1) or not 32 <= sort_n <= 1024:
            raise ValueError(f"sort_n must be a power of two in 32..1024, got {sort_n}")
        if E >= 2**21:
            raise ValueError("at most 2^21 experts")
        self.E, self.N = E, sort_n
        self.pdl = pdl
        self.NW = sort_n // 32
        self.stages = [(1 << a, 1 << b) for a in range(1, sort_n.bit_length()) for b in range(a - 1, -1, -1)]

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mNact: cute.Tensor, mActE: cute.Tensor, mActStart: cute.Tensor,
                 mActCount: cute.Tensor, mSorted: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mIds, mNact, mActE, mActStart, mActCount, mSorted).launch(
            grid=[1, 1, 1], block=[self.N, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mNact: cute.Tensor, mActE: cute.Tensor, mActStart: cute.Tensor,
               mActCount: cute.Tensor, mSorted: cute.Tensor):
        t, _, _ = cute.arch.thread_idx()
        lane = t % 32
        warp = t // 32
        order = PdlOrder(self.pdl)  # no weights: nothing global before the wait
        mIds, mNact, mActE, mActStart, mActCount, mSorted = order.after_wait(
            mIds, mNact, mActE, mActStart, mActCount, mSorted)
        P = mIds.shape[0]
        smem = SmemAllocator()
        sKey = smem.allocate_tensor(Int32, cute.make_layout((self.N,)), byte_alignment=16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((self.NW,)), byte_alignment=16)
        sStart = smem.allocate_tensor(Int32, cute.make_layout((self.N + 1,)), byte_alignment=16)
        order.wait()  # ids are the router's output
        mIds, mNact, mActE, mActStart, mActCount, mSorted = order.open(
            mIds, mNact, mActE, mActStart, mActCount, mSorted)
        key = Int32(_INT_MAX)
        if t < P:
            e = cutlass.max(cutlass.min(mIds[t], Int32(self.E - 1)), Int32(0))
            key = (e << 10) | t
        sKey[t] = key
        order.launch_dependents()  # the only global read is done
        cute.arch.sync_threads()
        # bitonic sort, ascending: stages (k, j) for k = 2, 4, .., N and j = k/2, .., 1
        for st in cutlass.range_constexpr(len(self.stages)):
            k, j = self.stages[st]
            partner = t ^ j
            if partner > t:
                a = sKey[t]
                b = sKey[partner]
                up = (t & k) == 0
                if (a > b) == up:
                    sKey[t] = b
                    sKey[partner] = a
            cute.arch.sync_threads()
        key = sKey[t]
        valid = t < P
        e = key >> 10
        prev = sKey[cutlass.max(t - 1, Int32(0))] >> 10
        start = valid & ((t == 0) | (e != prev))
        if valid:
            mSorted[t] = key & 1023
        # block inclusive scan of the segment starts
        v = Int32(cutlass.select_(start, 1, 0))
        for s in cutlass.range_constexpr(5):
            o = cute.arch.shuffle_sync_up(v, offset=1 << s)
            if lane >= (1 << s):
                v = v + o
        if lane == 31:
            sWarp[warp] = v
        cute.arch.sync_threads()
        pre = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(self.NW):
            x = sWarp[w]
            if w < warp:
                pre = pre + x
            total = total + x
        a = pre + v - 1
        if start:
            sStart[a] = t
            mActE[a] = e
        if t == 0:
            sStart[total] = P
            mNact[0] = total
        cute.arch.sync_threads()
        if t < total:
            s0 = sStart[t]
            mActStart[t] = s0
            mActCount[t] = sStart[t + 1] - s0


class ExpertGemmKernel:
    """Grouped expert GEMM over the plan's segments (glu: w1/w3 -> SiTU-GLU -> h; else w2 -> y)."""

    def __init__(self, E: int, rows: int, K: int, config, k_top: int, beta: float, linear_beta: float,
                 max_ctas: int):
        if rows % 16 or K % GP:
            raise ValueError(f"rows={rows} must be a multiple of 16 and K={K} of {GP}")
        RT = rows // 16
        if RT % config.warps_n:
            raise ValueError(f"{RT} row tiles do not split into warps_n={config.warps_n}")
        self.E, self.rows, self.K, self.cfg = E, rows, K, config
        self.mx = config.fmt == "mxfp4"
        self.glu = config.glu
        self.mats = 2 if config.glu else 1
        self.WN, self.WK, self.TPP = config.warps_n, config.warps_k, config.tiles_per_pass
        self.RB = RT // config.warps_n
        self.GPS = K // GP
        self.k_top = k_top
        self.beta, self.lbeta = float(beta), float(linear_beta)
        self.T = config.threads
        self.max_ctas = max_ctas
        self.NACC = 4 * self.TPP * self.mats
        self.lut_iters = -(-256 // self.T)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mA0: cute.Tensor, mS0: Optional[cute.Tensor], mA1: Optional[cute.Tensor],
                 mS1: Optional[cute.Tensor], mNact: cute.Tensor, mActE: cute.Tensor, mActStart: cute.Tensor,
                 mActCount: cute.Tensor, mSorted: cute.Tensor, mOut: cute.Tensor, grid: Int32, stream: cuda.CUstream):
        self.kernel(mX, mA0, mS0, mA1, mS1, mNact, mActE, mActStart, mActCount, mSorted, mOut).launch(
            grid=[grid, 1, 1], block=[self.T, 1, 1], stream=stream, min_blocks_per_mp=1, use_pdl=self.cfg.pdl)

    @cute.jit
    def lut_value(self, byte):
        """bf16x2 of the byte's two e2m1 nibbles (low nibble = element 2i in the low half), unscaled."""
        res = Uint32(0)
        for h in cutlass.range_constexpr(2):
            n = (byte >> (4 * h)) & 15
            ex = (n >> 1) & 3
            m = n & 1
            normal = Uint32(((ex + 126) << 7) | (m << 6))
            sub = Uint32(cutlass.select_(m == 1, 0x3F00, 0))
            bits = Uint32(cutlass.select_(ex == 0, sub, normal)) | Uint32((n & 8) << 12)
            res = res | (bits << (16 * h))
        return res

    @cute.jit
    def dequant_word(self, w: Uint32, lut: Int32, lane):
        """4 packed bytes (8 e2m1 values) -> 4 x b32 of bf16 pairs via the per-lane table."""
        out = []
        for b in cutlass.range_constexpr(4):
            byte = (w >> (8 * b)) & 255
            addr = lut + Int32(((byte << 5) | lane) << 2)
            v = cute.arch.inline_ptx("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[addr])
            out.append(v)
        return out

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mA0: cute.Tensor, mS0: Optional[cute.Tensor], mA1: Optional[cute.Tensor],
               mS1: Optional[cute.Tensor], mNact: cute.Tensor, mActE: cute.Tensor, mActStart: cute.Tensor,
               mActCount: cute.Tensor, mSorted: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        blk, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        wn = warp % self.WN
        wk = warp // self.WN
        # which experts' weights are read depends on the router: every operand only after the wait
        order = PdlOrder(self.cfg.pdl)
        mX, mA0, mS0, mA1, mS1, mNact, mActE, mActStart, mActCount, mSorted, mOut = order.after_wait(
            mX, mA0, mS0, mA1, mS1, mNact, mActE, mActStart, mActCount, mSorted, mOut)
        smem = SmemAllocator()
        lut = Int32(0)
        if cutlass.const_expr(self.mx):
            sLut = smem.allocate_tensor(Uint32, cute.make_layout((256 * 32,)), byte_alignment=128)
            # 32 copies of each entry (copy c in bank c); thread t fills byte t's copies, rotated by lane
            # so a warp's stores hit 32 distinct banks
            for i in cutlass.range_constexpr(self.lut_iters):
                byte = tidx + self.T * i
                if byte < 256:
                    val = self.lut_value(Uint32(byte))
                    for c in cutlass.range_constexpr(32):
                        sLut[byte * 32 + (c + lane) % 32] = val
            lut = sLut.iterator.toint()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((self.NACC, 32, self.WN, self.WK)), byte_alignment=16)
        # the table above touched no global memory; everything below (the plan, x, and which expert weights
        # to read) depends on the predecessors' outputs
        order.wait()
        mX, mA0, mS0, mA1, mS1, mNact, mActE, mActStart, mActCount, mSorted, mOut = order.open(
            mX, mA0, mS0, mA1, mS1, mNact, mActE, mActStart, mActCount, mSorted, mOut)
        cute.arch.sync_threads()

        acc = cute.make_rmem_tensor((4, self.TPP, self.mats), Float32)
        tmp = cute.make_rmem_tensor((4,), Float32)
        rzb = cute.make_rmem_tensor((8, 2, self.TPP), BFloat16)
        xrow = cute.make_rmem_tensor((self.TPP,), Int32)
        n_items = mNact[0] * self.RB
        for item in cutlass.range(blk, n_items, nblk, unroll=1):
            a = item // self.RB
            rt = (item % self.RB) * self.WN + wn
            ex = mActE[a]
            start = mActStart[a]
            cnt = mActCount[a]
            for p0 in cutlass.range(0, cnt, 8 * self.TPP, unroll=1):
                acc.fill(0.0)
                for j in cutlass.range_constexpr(self.TPP):
                    slot = cutlass.min(p0 + j * 8 + g, cnt - 1)
                    pair = mSorted[start + slot]
                    if cutlass.const_expr(self.glu):
                        xrow[j] = pair // self.k_top
                    else:
                        xrow[j] = pair
                for gi in cutlass.range(wk, self.GPS, self.WK, unroll=self.cfg.k_unroll):
                    self.k_step(mX, mA0, mS0, mA1, mS1, ex, rt, gi, xrow, rzb, acc, tmp, lut, lane, g, q)
                if cutlass.const_expr(self.cfg.pdl):
                    if item + nblk >= n_items and p0 + 8 * self.TPP >= cnt:  # CTA-uniform: its last loads
                        order.launch_dependents()
                self.finish(mSorted, mOut, acc, sRed, start, cnt, p0, rt, wn, wk, lane, g, q)

    @cute.jit
    def k_step(self, mX, mA0, mS0, mA1, mS1, ex, rt, gi, xrow, rzb, acc, tmp, lut, lane, g, q):
        """One 64-wide K step (two MX groups) for every matrix and token tile of the pass."""
        vec_bf = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        vec_u8 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint8, num_bits_per_copy=128)
        vec_s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint8, num_bits_per_copy=32)
        # activations: elements 8q..8q+7 of each group (16 bytes) for the token row of every tile
        for j in cutlass.range_constexpr(self.TPP):
            for G in cutlass.range_constexpr(2):
                cute.copy(vec_bf, cute.local_tile(mX[xrow[j], None], (8,), (gi * 8 + G * 4 + q,)), rzb[None, G, j])
        rz = cute.recast_tensor(rzb, Uint32)  # (4, 2, TPP): bf16 pairs (8q, 8q+1) .. (8q+6, 8q+7)
        for mat in cutlass.range_constexpr(self.mats):
            mA = mA0 if mat == 0 else mA1
            mS = mS0 if mat == 0 else mS1
            if cutlass.const_expr(self.mx):
                wq8 = cute.make_rmem_tensor((16,), Uint8)
                cute.copy(vec_u8, mA[ex, rt, gi, lane, None], wq8)
                wq = cute.recast_tensor(wq8, Uint32)  # [G0 row g, G0 row g+8, G1 row g, G1 row g+8]
                sc = cute.make_rmem_tensor((4,), Uint8)
                cute.copy(vec_s, mS[ex, rt, gi, g, None], sc)
                for G in cutlass.range_constexpr(2):
                    wg = self.dequant_word(wq[2 * G], lut, lane)
                    wg8 = self.dequant_word(wq[2 * G + 1], lut, lane)
                    s_g = _exp2_scale(sc[2 * G])
                    s_g8 = _exp2_scale(sc[2 * G + 1])
                    for j in cutlass.range_constexpr(self.TPP):
                        tmp.fill(0.0)
                        mma_bf16(tmp, wg[0], wg8[0], wg[1], wg8[1], rz[0, G, j], rz[1, G, j])
                        mma_bf16(tmp, wg[2], wg8[2], wg[3], wg8[3], rz[2, G, j], rz[3, G, j])
                        acc[0, j, mat] = acc[0, j, mat] + s_g * tmp[0]
                        acc[1, j, mat] = acc[1, j, mat] + s_g * tmp[1]
                        acc[2, j, mat] = acc[2, j, mat] + s_g8 * tmp[2]
                        acc[3, j, mat] = acc[3, j, mat] + s_g8 * tmp[3]
            else:
                for G in cutlass.range_constexpr(2):
                    wrb = cute.make_rmem_tensor((8, 2), BFloat16)
                    for h in cutlass.range_constexpr(2):
                        row = rt * 16 + g + 8 * h
                        cute.copy(vec_bf, cute.local_tile(mA[ex, row, None], (8,), (gi * 8 + G * 4 + q,)),
                                  wrb[None, h])
                    wr = cute.recast_tensor(wrb, Uint32)  # (4, 2): pairs of row g (h=0) / g+8 (h=1)
                    for j in cutlass.range_constexpr(self.TPP):
                        mma_bf16(acc[None, j, mat], wr[0, 0], wr[0, 1], wr[1, 0], wr[1, 1], rz[0, G, j], rz[1, G, j])
                        mma_bf16(acc[None, j, mat], wr[2, 0], wr[2, 1], wr[3, 0], wr[3, 1], rz[2, G, j], rz[3, G, j])

    @cute.jit
    def finish(self, mSorted, mOut, acc, sRed, start, cnt, p0, rt, wn, wk, lane, g, q):
        """Sum the K-split partials (warp order), then the epilogue of warp wk = 0: GLU or plain, bf16."""
        if cutlass.const_expr(self.WK > 1):
            accv = cute.make_tensor(acc.iterator, cute.make_layout((self.NACC,)))
            for v in cutlass.range_constexpr(self.NACC):
                sRed[v, lane, wn, wk] = accv[v]
            cute.arch.sync_threads()
            if wk == 0:
                for v in cutlass.range_constexpr(self.NACC):
                    tot = sRed[v, lane, wn, 0]
                    for w in cutlass.range_constexpr(1, self.WK):
                        tot = tot + sRed[v, lane, wn, w]
                    accv[v] = tot
        if wk == 0:
            for j in cutlass.range_constexpr(self.TPP):
                for e in cutlass.range_constexpr(4):
                    slot = p0 + j * 8 + 2 * q + e % 2
                    if slot < cnt:
                        pair = mSorted[start + slot]
                        row = rt * 16 + g + 8 * (e // 2)
                        if cutlass.const_expr(self.glu):
                            gv = acc[e, j, 0].to(BFloat16).to(Float32)
                            uv = acc[e, j, 1].to(BFloat16).to(Float32)
                            b, lb = Float32(self.beta), Float32(self.lbeta)
                            h = b * cute.math.tanh(gv / b) * sigmoid(gv) * (lb * cute.math.tanh(uv / lb))
                            mOut[pair, row] = h.to(BFloat16)
                        else:
                            mOut[pair, row] = acc[e, j, 0].to(BFloat16)
        if cutlass.const_expr(self.WK > 1):
            cute.arch.sync_threads()


class CombineKernel:
    """out[t] = sum_slot w[t, slot] * y[t*k + slot] (FP32, slot order), optionally RMSNorm'ed to bf16."""

    def __init__(self, L: int, k_top: int, norm: bool, threads: int, pdl: bool = False):
        if L % 8:
            raise ValueError(f"L={L} must be a multiple of 8")
        self.L, self.k, self.norm, self.T = L, k_top, norm, threads
        self.pdl = pdl
        self.NV = L // 8
        self.VPT = -(-self.NV // threads)
        self.pred = self.VPT * threads != self.NV
        self.NW = threads // 32

    @cute.jit
    def __call__(self, mY: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mNw: Optional[cute.Tensor],
                 eps: Float32, stream: cuda.CUstream):
        self.kernel(mY, mW, mOut, mNw, eps).launch(grid=[mW.shape[0], 1, 1], block=[self.T, 1, 1], stream=stream,
                                                   use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, mNw: Optional[cute.Tensor], eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        smem = SmemAllocator()
        s_red = smem.allocate_tensor(Float32, cute.make_layout((self.NW,)), byte_alignment=16)
        vec_bf = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        vec_f = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        acc = cute.make_rmem_tensor((8, self.VPT), Float32)
        acc.fill(0.0)
        ry = cute.make_rmem_tensor((8,), BFloat16)
        rw = cute.make_rmem_tensor((8, self.VPT), BFloat16)
        order = PdlOrder(self.pdl)
        mNw = order.weight(mNw)
        mY, mW, mOut = order.after_wait(mY, mW, mOut)
        if cutlass.const_expr(self.norm):  # the norm weight (a parameter) first
            for i in cutlass.range_constexpr(self.VPT):
                v = tidx + self.T * i
                if v < self.NV:
                    cute.copy(vec_bf, cute.local_tile(mNw, (8,), (v,)), rw[None, i])
        order.wait()  # y and the routing weights are this step's activations
        mY, mW, mOut = order.open(mY, mW, mOut)
        for s in cutlass.range_constexpr(self.k):
            w = mW[t, s]
            for i in cutlass.range_constexpr(self.VPT):
                v = tidx + self.T * i
                if v < self.NV:
                    cute.copy(vec_bf, cute.local_tile(mY[t * self.k + s, None], (8,), (v,)), ry)
                    for e in cutlass.range_constexpr(8):
                        acc[e, i] = acc[e, i] + w * ry[e].to(Float32)
        order.launch_dependents()  # every y load is issued
        if cutlass.const_expr(self.norm):
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(self.VPT):
                for e in cutlass.range_constexpr(8):
                    ss = ss + acc[e, i] * acc[e, i]
            ss = cute.arch.warp_reduction_sum(ss)
            if lane == 0:
                s_red[warp] = ss
            cute.arch.sync_threads()
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(self.NW):
                tot = tot + s_red[w]
            rstd = cute.math.rsqrt(tot / Float32(self.L) + eps)
            for i in cutlass.range_constexpr(self.VPT):
                v = tidx + self.T * i
                if v < self.NV:
                    for e in cutlass.range_constexpr(8):
                        ry[e] = (acc[e, i] * rstd * rw[e, i].to(Float32)).to(BFloat16)
                    cute.copy(vec_bf, ry, cute.local_tile(mOut[t, None], (8,), (v,)))
        else:
            ro = cute.make_rmem_tensor((4,), Float32)
            for i in cutlass.range_constexpr(self.VPT):
                v = tidx + self.T * i
                if v < self.NV:
                    for hh in cutlass.range_constexpr(2):
                        for e in cutlass.range_constexpr(4):
                            ro[e] = acc[4 * hh + e, i]
                        cute.copy(vec_f, ro, cute.local_tile(mOut[t, None], (4,), (2 * v + hh,)))
