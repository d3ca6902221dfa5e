"""Weight-streaming skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ residual), M <= 64.

Decode GEMMs read every weight byte once and do 2*M flops per weight element, so the kernel is built
around streaming W at full bandwidth with 16-byte loads straight into registers (no shared-memory
staging of W); x (at most 64 x K bf16) is re-read by every CTA from L1/L2.

Variant "fma" (M <= m_max <= 8, meant for M = 1, 2):
1. warp (wn, wk) of CTA (blk) owns rows blk * rows_per_cta + wn * R + [0, R);
2. lane l of k-lane group kl = split * warps_k + wk reads 16-byte vectors v = kl*32 + l + i*32*KL of
   each of its R rows and the same vector of the m_max rows of x (rows >= M are clamped to M - 1 and
   never stored); FP32 FMAs into R * m_max accumulators;
3. butterfly-shuffle sum over the 32 lanes, one value per (row, m) per warp to shared memory, then
   lane i of warp wk = 0 sums warp k-slices 0..warps_k-1 in order and stores output i.

Variant "mma" (m_max in 8/16/32/64):
1. swap-AB: the weights are the A operand (16 rows per m16n8k16 tile), the batch is the N operand
   (8 rows of x per n-tile, m_max / 8 tiles);
2. per 32-wide K step, thread (g = lane / 4, q = lane % 4) loads one 16-byte vector (k = 8q..8q+7)
   of weight rows g and g + 8 of each tile and of x row g of each n-tile. Two mma.sync m16n8k16
   consume it: the thread's A/B fragment pairs {k 2q, 2q+1} and {2q+8, 2q+9} of half h are fed
   with its physical pairs {8q + 4h, +1} and {8q + 4h + 2, +3}. A and B use the same permutation of
   K, so the dot products are exact (the sum order differs from a plain loop, not the terms);
3. K steps are distributed over k-lanes (split * warps_k + wk) round-robin; warps_k partials meet in
   shared memory; split_k partials go to an FP32 workspace, and the last CTA of a row block to arrive
   (atomic counter, acq_rel) sums them in split order 0..split_k-1 (deterministic) and resets its
   counter to 0 for the next launch;
4. epilogue: accumulator (row g + 8 * (e // 2), batch 2q + e % 2) -> + residual -> bf16 or fp32 store.

With ``config.pdl`` (programmatic dependent launch, opted into by the decode executor) both variants start
with a prologue: warp 0 issues ``cp.async.bulk.prefetch.L2`` for the CTA's share of W (at most
PDL_PREFETCH_BYTES per GEMM), every thread then waits on ``griddepcontrol.wait`` before any load of x or
the residual, and triggers ``griddepcontrol.launch_dependents`` so the next kernel can start its own prologue.

Constraints: K % 8 == 0 (fma) or K % 32 == 0 (mma); rows of x and W 16-byte aligned; any N (rows past
N are clamped loads, never stored); M <= m_max. The workspace and counters of a split-K config must not
be shared by two launches running at the same time (one stream per shape, or separate buffers).
"""
# ruff: noqa: UP045  (the DSL reads Optional[...] annotations to accept None operands)

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ..common.pdl import PdlOrder
from ..common.primitives import prefetch_weights_l2
from .config import MMA_K, PDL_PREFETCH_BYTES, VEC, SkinnyGemmConfig

_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};")


@cutlass.dsl_user_op
def _sreg(name: str, *, loc=None, ip=None) -> Int32:
    """A special register read the compiler cannot CSE with an earlier read (volatile inline asm)."""
    from cutlass._mlir.dialects import llvm

    return Int32(llvm.inline_asm(Int32.mlir_type, [], f"mov.u32 $0, {name};", "=r", has_side_effects=True,
                                 loc=loc, ip=ip))


class SkinnyGemmKernel:
    def __init__(self, N: int, K: int, config: SkinnyGemmConfig):
        if K % config.k_granule:
            raise ValueError(f"K = {K} is not a multiple of {config.k_granule} ({config.variant})")
        self.N, self.K, self.cfg = N, K, config
        self.mma = config.variant == "mma"
        self.R = config.rows_per_warp
        self.WN, self.WK, self.S = config.warps_n, config.warps_k, config.split_k
        self.rows_per_cta = config.rows_per_cta
        self.num_blocks = config.num_blocks(N)
        self.n_tail = N % self.rows_per_cta != 0
        self.NJ = config.m_max // 8 if self.mma else 0
        self.acc_n = config.acc_per_thread
        # K work units: 32-wide mma steps, or 8-wide vectors spread over 32 lanes per k-lane
        units = K // (MMA_K if self.mma else VEC)
        lanes = self.S * self.WK * (1 if self.mma else 32)
        self.k_lanes = lanes
        self.k_base, self.k_rem = divmod(units, lanes)
        self.out_dtype = Float32 if config.out_fp32 else BFloat16
        if self.mma and N % VEC:
            raise ValueError(f"N = {N} must be a multiple of {VEC} (16-byte output stores)")
        self.out_ld = self.rows_per_cta + 4  # padded s_out row: conflict-free staging writes
        self.store_steps = -(-config.m_max * self.rows_per_cta // VEC // config.threads)
        # PDL prologue (config.pdl): CTA c = blk * S + split owns bytes [c * pf_region, (c + 1) * pf_region)
        # of W and prefetches the first 32 * pf_chunk of them (lane i of warp 0: chunk i), within the budget
        ctas = self.num_blocks * (self.S if self.mma else 1)
        self.pf_region = (N * K * 2 // ctas) // 16 * 16
        self.pf_chunk = (min(self.pf_region, PDL_PREFETCH_BYTES // ctas) // 32) // 16 * 16

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mR: Optional[cute.Tensor],
                 mWs: Optional[cute.Tensor], mCnt: Optional[cute.Tensor], stream: cuda.CUstream):
        # min_blocks_per_mp (PTX .minnctapersm) stops ptxas -O3 from capping registers for occupancy:
        # without it, it spilled the K-loop counter at 40 registers (fma, 768x7168, m_max=2).
        if cutlass.const_expr(self.mma):
            self.kernel_mma(mX, mW, mY, mR, mWs, mCnt).launch(
                grid=[self.num_blocks, self.S, 1], block=[self.cfg.threads, 1, 1], stream=stream,
                min_blocks_per_mp=self.cfg.min_ctas_per_sm, use_pdl=self.cfg.pdl)
        else:
            self.kernel_fma(mX, mW, mY, mR).launch(
                grid=[self.num_blocks, 1, 1], block=[self.cfg.threads, 1, 1], stream=stream,
                min_blocks_per_mp=self.cfg.min_ctas_per_sm, use_pdl=self.cfg.pdl)

    @cute.jit
    def _prefetch_weights(self, mW: cute.Tensor, tidx, cta):
        """The PDL build's prologue: this CTA's share of W toward L2 (weights are never written by a step)."""
        if cutlass.const_expr(self.cfg.pdl and self.pf_chunk > 0):
            if tidx < 32:
                addr = mW.iterator.toint() + Int64(cta) * self.pf_region + Int64(tidx) * self.pf_chunk
                prefetch_weights_l2(addr, Int32(self.pf_chunk))

    def _pdl_order(self, mW: cute.Tensor, activations: tuple, tidx, cta) -> tuple:
        """W toward L2, then wait for the predecessor grid (its outputs are this kernel's x / residual), then
        let the successor launch; returns the activations, opened."""
        order = PdlOrder(self.cfg.pdl)
        handles = order.after_wait(*activations)
        self._prefetch_weights(order.weight(mW), tidx, cta)
        order.wait()
        order.launch_dependents()
        return order.open(*handles)

    # ------------------------------------------------------------------------------------- shared
    @cute.jit
    def _store(self, mY: cute.Tensor, mR: Optional[cute.Tensor], m, n, val: Float32):
        if cutlass.const_expr(self.cfg.residual):
            val = val + mR[m, n].to(Float32)
        mY[m, n] = val.to(self.out_dtype)

    # ---------------------------------------------------------------------------------------- fma
    @cute.jit
    def _fma_step(self, mX: cute.Tensor, mW: cute.Tensor, acc: cute.Tensor, v, row0, M):
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        wf = []
        for r in cutlass.range_constexpr(self.R):
            row = row0 + r
            if cutlass.const_expr(self.n_tail):
                row = cutlass.min(row, self.N - 1)
            rw = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.copy(vec, cute.local_tile(mW[row, None], (VEC,), (v,)), rw)
            f = cute.make_rmem_tensor((VEC,), Float32)
            f.store(rw.load().to(Float32))
            wf.append(f)
        for m in cutlass.range_constexpr(self.cfg.m_max):
            xr = cutlass.min(Int32(m), M - 1)
            rx = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.copy(vec, cute.local_tile(mX[xr, None], (VEC,), (v,)), rx)
            xf = cute.make_rmem_tensor((VEC,), Float32)
            xf.store(rx.load().to(Float32))
            for r in cutlass.range_constexpr(self.R):
                a = acc[m, r]
                for e in cutlass.range_constexpr(VEC):
                    a = cute.fma(wf[r][e], xf[e], a)
                acc[m, r] = a

    @cute.kernel
    def kernel_fma(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mR: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        blk, _, _ = cute.arch.block_idx()
        mX, mY, mR = self._pdl_order(mW, (mX, mY, mR), tidx, blk)
        warp = tidx // 32
        lane = tidx % 32
        wn = warp % self.WN
        wk = warp // self.WN
        M = mX.shape[0]
        row0 = blk * self.rows_per_cta + wn * self.R
        smem = SmemAllocator()
        s_red = smem.allocate_tensor(Float32, cute.make_layout((self.acc_n, self.WN, self.WK)), byte_alignment=16)

        acc = cute.make_rmem_tensor((self.cfg.m_max, self.R), Float32)
        acc.fill(0.0)
        gl = wk * 32 + lane
        for i in cutlass.range(self.k_base, unroll=self.cfg.k_unroll):
            self._fma_step(mX, mW, acc, gl + i * self.k_lanes, row0, M)
        if cutlass.const_expr(self.k_rem > 0):
            if gl < self.k_rem:
                self._fma_step(mX, mW, acc, gl + self.k_base * self.k_lanes, row0, M)

        for m in cutlass.range_constexpr(self.cfg.m_max):
            for r in cutlass.range_constexpr(self.R):
                tot = cute.arch.warp_reduction_sum(acc[m, r])
                if lane == 0:
                    s_red[m * self.R + r, wn, wk] = tot
        cute.arch.sync_threads()
        # Re-read the indices instead of keeping them live across the K loop: ptxas otherwise parks
        # one of them in local memory for some shapes (1 STL + 1 LDL, seen at K = 1536 / 3584).
        tidx, blk = _sreg("%tid.x"), _sreg("%ctaid.x")
        warp = tidx // 32
        lane = tidx % 32
        wn = warp % self.WN
        wk = warp // self.WN
        if wk == 0 and lane < self.acc_n:
            tot = Float32(0.0)
            for w in cutlass.range_constexpr(self.WK):
                tot = tot + s_red[lane, wn, w]
            m = lane // self.R
            n = blk * self.rows_per_cta + wn * self.R + lane % self.R
            if m < M and n < self.N:
                self._store(mY, mR, m, n, tot)

    # ---------------------------------------------------------------------------------------- mma
    @cute.jit
    def _mma_step(self, mX: cute.Tensor, mW: cute.Tensor, acc: cute.Tensor, c, row0, g, q, M):
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        kv = c * (MMA_K // VEC) + q  # this thread's 16-byte vector within the row
        w32 = []  # w32[t][h]: 4 x b32 of weight row (t*16 + h*8 + g)
        for t in cutlass.range_constexpr(self.R):
            halves = []
            for h in cutlass.range_constexpr(2):
                row = row0 + t * 16 + h * 8 + g
                if cutlass.const_expr(self.n_tail):
                    row = cutlass.min(row, self.N - 1)
                rw = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.copy(vec, cute.local_tile(mW[row, None], (VEC,), (kv,)), rw)
                halves.append(cute.recast_tensor(rw, Uint32))
            w32.append(halves)
        x32 = []  # x32[j]: 4 x b32 of x row (j*8 + g), clamped to M - 1
        for j in cutlass.range_constexpr(self.NJ):
            xr = cutlass.min(j * 8 + g, M - 1)
            rx = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.copy(vec, cute.local_tile(mX[xr, None], (VEC,), (kv,)), rx)
            x32.append(cute.recast_tensor(rx, Uint32))
        for t in cutlass.range_constexpr(self.R):
            for j in cutlass.range_constexpr(self.NJ):
                for h in cutlass.range_constexpr(2):
                    d = cute.arch.inline_ptx(
                        _MMA, write_only_types=[Float32] * 4,
                        read_only_args=[w32[t][0][2 * h], w32[t][1][2 * h], w32[t][0][2 * h + 1],
                                        w32[t][1][2 * h + 1], x32[j][2 * h], x32[j][2 * h + 1],
                                        acc[0, j, t], acc[1, j, t], acc[2, j, t], acc[3, j, t]])
                    for e in cutlass.range_constexpr(4):
                        acc[e, j, t] = d[e]

    @cute.kernel
    def kernel_mma(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mR: Optional[cute.Tensor],
                   mWs: Optional[cute.Tensor], mCnt: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        blk, split, _ = cute.arch.block_idx()
        mX, mY, mR, mWs, mCnt = self._pdl_order(mW, (mX, mY, mR, mWs, mCnt), tidx, blk * self.S + split)
        warp = tidx // 32
        lane = tidx % 32
        wn = warp % self.WN
        wk = warp // self.WN
        g = lane // 4
        q = lane % 4
        M = mX.shape[0]
        row0 = blk * self.rows_per_cta + wn * (16 * self.R)
        smem = SmemAllocator()
        s_flag = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)

        acc = cute.make_rmem_tensor((4, self.NJ, self.R), Float32)
        acc.fill(0.0)
        kl = split * self.WK + wk
        for i in cutlass.range(self.k_base, unroll=self.cfg.k_unroll):
            self._mma_step(mX, mW, acc, kl + i * self.k_lanes, row0, g, q, M)
        if cutlass.const_expr(self.k_rem > 0):
            if kl < self.k_rem:
                self._mma_step(mX, mW, acc, kl + self.k_base * self.k_lanes, row0, g, q, M)

        # Re-read the indices after the K loop (see kernel_fma): nothing index-like stays live across it.
        tidx, blk, split = _sreg("%tid.x"), _sreg("%ctaid.x"), _sreg("%ctaid.y")
        warp = tidx // 32
        lane = tidx % 32
        wn = warp % self.WN
        wk = warp // self.WN
        g = lane // 4
        q = lane % 4
        accv = cute.make_tensor(acc.iterator, cute.make_layout((self.acc_n,)))  # flat view, same order
        if cutlass.const_expr(self.WK > 1):
            s_acc = smem.allocate_tensor(Float32, cute.make_layout((32, self.acc_n, self.WN, self.WK)),
                                         byte_alignment=16)
            for v in cutlass.range_constexpr(self.acc_n):
                s_acc[lane, v, wn, wk] = accv[v]
            cute.arch.sync_threads()
            if wk == 0:
                for v in cutlass.range_constexpr(self.acc_n):
                    tot = s_acc[lane, v, wn, 0]
                    for w in cutlass.range_constexpr(1, self.WK):
                        tot = tot + s_acc[lane, v, wn, w]
                    accv[v] = tot

        s_out = smem.allocate_tensor(Float32, cute.make_layout((self.cfg.m_max, self.rows_per_cta),
                                                               stride=(self.out_ld, 1)), byte_alignment=16)
        if cutlass.const_expr(self.S == 1):
            if wk == 0:
                self._stage_out(s_out, acc, wn, g, q)
            cute.arch.sync_threads()
            self._store_out(mY, mR, s_out, tidx, blk, M)
        else:
            tn = wn * 32 + lane
            st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            ld_l2 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
                                        load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)  # skip stale L1
            part = cute.make_rmem_tensor((self.acc_n,), Float32)
            if wk == 0:
                part.store(accv.load())
                cute.copy(st, part, mWs[split, blk, tn, None])
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                old = cute.arch.atomic_add(mCnt.iterator + blk, Int32(1), sem="acq_rel", scope="gpu")
                s_flag[0] = Int32(old == self.S - 1)
            cute.arch.sync_threads()
            if s_flag[0] != 0:  # CTA-uniform: this CTA arrived last and reduces every split, in order
                cute.arch.fence_acq_rel_gpu()
                if tidx == 0:
                    mCnt[blk] = Int32(0)
                if wk == 0:
                    accv.fill(0.0)
                    for s in cutlass.range(self.S, unroll=1):
                        cute.copy(ld_l2, mWs[s, blk, tn, None], part)
                        accv.store(accv.load() + part.load())
                    self._stage_out(s_out, acc, wn, g, q)
                cute.arch.sync_threads()
                self._store_out(mY, mR, s_out, tidx, blk, M)

    @cute.jit
    def _stage_out(self, s_out: cute.Tensor, acc: cute.Tensor, wn, g, q):
        """Accumulator (row g + 8*(e//2) of tile t, batch j*8 + 2q + e%2) -> s_out[batch, local row]."""
        for t in cutlass.range_constexpr(self.R):
            for j in cutlass.range_constexpr(self.NJ):
                for e in cutlass.range_constexpr(4):
                    s_out[j * 8 + 2 * q + e % 2, wn * 16 * self.R + t * 16 + g + 8 * (e // 2)] = acc[e, j, t]

    @cute.jit
    def _store_out(self, mY: cute.Tensor, mR: Optional[cute.Tensor], s_out: cute.Tensor, tidx, blk, M):
        """Every thread: 8 consecutive outputs of one batch row per step, 16-byte loads and stores."""
        vec_in = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        vec_out = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        per_row = self.rows_per_cta // VEC
        for i in cutlass.range_constexpr(self.store_steps):
            vid = tidx + i * self.cfg.threads
            m = vid // per_row
            c = vid % per_row
            nv = blk * per_row + c  # 8-wide vector index along N
            if m < M and nv < self.N // VEC and vid < self.cfg.m_max * per_row:
                y = cute.make_rmem_tensor((VEC,), Float32)
                cute.autovec_copy(cute.local_tile(s_out[m, None], (VEC,), (c,)), y)
                val = y.load()
                if cutlass.const_expr(self.cfg.residual):
                    r = cute.make_rmem_tensor((VEC,), BFloat16)
                    cute.copy(vec_in, cute.local_tile(mR[m, None], (VEC,), (nv,)), r)
                    val = val + r.load().to(Float32)
                o = cute.make_rmem_tensor((VEC,), self.out_dtype)
                o.store(val.to(self.out_dtype))
                cute.copy(vec_out, o, cute.local_tile(mY[m, None], (VEC,), (nv,)))
