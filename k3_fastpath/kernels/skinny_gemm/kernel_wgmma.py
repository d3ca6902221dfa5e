"""Skinny GEMM on Hopper tensor cores: y[M, N] = x[M, K] @ W[N, K]^T (+ residual), 8 < M <= 64 (the
default above M = 8: ``config.select``).

Why: the mma.sync variant (kernel.py) loads W straight into registers and re-reads 8-row slices of x from
L1 for every 16 weight rows; at m_max = 64 the x traffic from L1 is 4x the weight traffic and the kernel
reached 30-40% of the HBM floor where cuBLAS reached 64-69%. Here every x tile comes into shared memory
once per K stage by TMA and feeds all the CTA's weight rows through wgmma.

Algorithm (swap-AB: the weights are the wgmma A operand, the batch its N extent):
1. CTA (blk, split) owns weight rows [blk * BM, (blk + 1) * BM) (BM = rows_per_cta = 64 per wgmma tile)
   and a contiguous run of K stages (BK = 64 * k_unroll columns each; the k_stages // split_k stages per
   split go one more to the first k_stages % split_k splits).
2. Pipeline: ``stages`` shared-memory slots, each holding the W tile [BM, BK] and the x tile
   [m_max, BK] (both K-major, 128-byte swizzled, loaded by TMA; rows of x >= M, rows of W >= N and
   columns >= K are zero-filled by the TMA unit, so no load is predicated). A full mbarrier per slot
   counts the bytes in; an empty mbarrier per slot collects one arrive per consumer warp. Thread 0
   fills every slot up front, then refills a slot as soon as the warps release it, so ``stages - 1``
   loads stay in flight while wgmma consumes the current one.
3. Each warpgroup issues wgmma m64n{m_max}k16 (BF16 in, FP32 accumulate, both operands from shared
   memory) on its 64-row slices of the W tile against the whole x tile; the accumulator tile is
   [BM, m_max] = y^T for the CTA's rows.
4. Split-K (split_k > 1) as in kernel.py: every CTA stores its FP32 partial tile in fragment order to the
   workspace, the last CTA of a row block to arrive (atomic counter, acq_rel) sums splits 0..split_k-1
   in order (deterministic; its own partial is re-read like the others) and resets the counter.
5. Epilogue: accumulators -> shared memory [m, n] (padded rows) -> each thread 8 consecutive outputs of
   one batch row: + residual, bf16 or fp32, 16-byte stores; rows m >= M and columns n >= N never stored.

With ``config.pdl`` the W tiles of the first slots are requested before ``griddepcontrol.wait`` (weights
are never written by a decode step); x, the residual and the workspace are touched only after it.

Constraints: K % 8 == 0 and N % 8 == 0 (16-byte TMA strides and output vectors); rows of x, W, y
16-byte aligned; M <= m_max; split_k <= the number of K stages. The split-K workspace and counters must
not be shared by two launches running at the same time (as for kernel.py).
"""
# ruff: noqa: UP045  (the DSL reads Optional[...] annotations to accept None operands)

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..common.pdl import PdlOrder
from .config import VEC, SkinnyGemmConfig

# L2 cache hints of the TMA loads (CUTLASS's CacheHintSm90): weights are read once, x by every CTA.
_EVICT_FIRST = 0x12F0000000000000
_EVICT_LAST = 0x14F0000000000000


class SkinnyGemmWgmmaKernel:
    def __init__(self, N: int, K: int, config: SkinnyGemmConfig):
        if config.variant != "wgmma":
            raise ValueError(f"SkinnyGemmWgmmaKernel needs a wgmma config, got {config.variant}")
        if K % VEC or N % VEC:
            raise ValueError(f"wgmma skinny GEMM needs K and N multiples of {VEC}, got N={N}, K={K}")
        self.N, self.K, self.cfg = N, K, config
        self.BM, self.BN, self.BK = config.rows_per_cta, config.m_max, config.block_k
        self.S, self.stages = config.split_k, config.stages
        self.wg = config.warps_n // 4
        self.threads = config.threads
        self.num_blocks = config.num_blocks(N)
        self.k_stages = -(-K // self.BK)
        if self.S > self.k_stages:
            raise ValueError(f"split_k = {self.S} > {self.k_stages} K stages of {self.BK} (K = {K})")
        self.k_base, self.k_rem = divmod(self.k_stages, self.S)
        self.acc_n = config.acc_per_thread
        self.out_dtype = Float32 if config.out_fp32 else BFloat16
        self.out_ld = self.BM + 4  # padded s_out row: conflict-free accumulator writes
        self.store_steps = -(-self.BN * self.BM // VEC // self.threads)

    # ------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mR: Optional[cute.Tensor],
                 mWs: Optional[cute.Tensor], mCnt: Optional[cute.Tensor], stream: cuda.CUstream):
        k_mode = LayoutEnum.ROW_MAJOR  # W [N, K] and x [M, K]: K contiguous for both operands
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_mode.sm90_mma_major_mode(), k_mode.sm90_mma_major_mode(), Float32,
            (self.wg, 1, 1), tiler_mn=(64, self.BN))
        tile = (self.BM, self.BN, self.BK)
        a_layout = sm90_utils.make_smem_layout_a(k_mode, tile, BFloat16, self.stages)
        b_layout = sm90_utils.make_smem_layout_b(k_mode, tile, BFloat16, self.stages)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tW = cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(a_layout, (None, None, 0)),
                                                (self.BM, self.BK))
        tma_x, tX = cpasync.make_tiled_tma_atom(g2s, mX, cute.slice_(b_layout, (None, None, 0)),
                                                (self.BN, self.BK))

        @cute.struct
        class Storage:  # W slots, then x slots (one buffer: the epilogue tile reuses its start)
            mbar: cute.struct.MemRange[Int64, self.stages * 2]
            flag: cute.struct.MemRange[Int32, 4]
            sAB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_layout) + cute.cosize(b_layout)],
                                   1024]

        self.storage = Storage
        self.kernel(tma_w, tW, tma_x, tX, mY, mR, mWs, mCnt, tiled_mma, a_layout, b_layout).launch(
            grid=[self.num_blocks, self.S, 1], block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.cfg.min_ctas_per_sm, use_pdl=self.cfg.pdl)

    # ---------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, tW: cute.Tensor, tma_x: cute.CopyAtom, tX: cute.Tensor,
               mY: cute.Tensor, mR: Optional[cute.Tensor], mWs: Optional[cute.Tensor],
               mCnt: Optional[cute.Tensor], tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout,
               b_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        blk, split, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        order = PdlOrder(self.cfg.pdl)
        mY, mR, mWs, mCnt = order.after_wait(mY, mR, mWs, mCnt)
        if warp == 0:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)

        smem = SmemAllocator()
        st = smem.allocate(self.storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=self.cfg.stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        base = st.sAB.data_ptr()
        sA = cute.make_tensor(cute.recast_ptr(base, a_layout.inner), a_layout.outer)  # (BM, BK, stages)
        sB = cute.make_tensor(cute.recast_ptr(base + cute.cosize(a_layout), b_layout.inner),
                              b_layout.outer)  # (BN, BK, stages)

        # K stages of this split: [k0, k1); the first k_rem splits take one more
        k0 = split * self.k_base + cutlass.min(split, self.k_rem)
        k1 = (split + 1) * self.k_base + cutlass.min(split + 1, self.k_rem)
        nk = k1 - k0
        gW = cute.local_tile(tW, (self.BM, self.BK), (blk, None))  # (BM, BK, k_stages)
        gX = cute.local_tile(tX, (self.BN, self.BK), (0, None))  # (BN, BK, k_stages)
        tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                         cute.group_modes(gW, 0, 2))
        tXs, tXg = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                         cute.group_modes(gX, 0, 2))
        tXg = order.after_wait(tXg)  # x's tiles: the predecessor's output

        # Prologue: fill min(stages, nk) slots. W first (before the PDL wait), then x.
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        n_pro = cutlass.min(nk, self.stages)
        if warp == 0:
            for _ in cutlass.range(n_pro, unroll=1):
                pipe.producer_acquire(prod)
                cute.copy(tma_w, tWg[(None, k0 + prod.count)], tWs[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod), cache_policy=Int64(_EVICT_FIRST))
                prod.advance()
        order.wait()
        tXg, mY, mR, mWs, mCnt = order.open(tXg, mY, mR, mWs, mCnt)
        if warp == 0:
            for i in cutlass.range(n_pro, unroll=1):
                cute.copy(tma_x, tXg[(None, k0 + i)], tXs[(None, i)],
                          tma_bar_ptr=pipe.sync_object_full.get_barrier(i), cache_policy=Int64(_EVICT_LAST))
        order.launch_dependents()

        # Main loop: wgmma on slot i while the next stages - 1 are in flight; refill each freed slot.
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(wg_idx * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.BM, self.BN)))
        acc = cute.make_rmem_tensor(tCcC.shape, Float32)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        kblocks = cute.size(tCrA, mode=[2])
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for kt in cutlass.range(nk, unroll=1):
            pipe.consumer_wait(cons)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(kblocks):
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb, cons.index], tCrB[None, None, kb, cons.index], acc)
            warpgroup.commit_group()
            cons.advance()
            if kt > 0:  # the previous stage's wgmmas have retired: its slot is free
                warpgroup.wait_group(1)
                pipe.consumer_release(rel)
                rel.advance()
                if warp == 0 and prod.count < nk:
                    pipe.producer_acquire(prod)
                    cute.copy(tma_w, tWg[(None, k0 + prod.count)], tWs[(None, prod.index)],
                              tma_bar_ptr=pipe.producer_get_barrier(prod), cache_policy=Int64(_EVICT_FIRST))
                    cute.copy(tma_x, tXg[(None, k0 + prod.count)], tXs[(None, prod.index)],
                              tma_bar_ptr=pipe.producer_get_barrier(prod), cache_policy=Int64(_EVICT_LAST))
                    prod.advance()
        warpgroup.wait_group(0)

        # The epilogue tile [m_max, BM + 4] FP32 overwrites the start of the slots: every load issued was
        # consumed and this warpgroup's wgmmas retired; the barrier below covers the other warpgroup's.
        s_out = cute.make_tensor(cute.recast_ptr(base, dtype=Float32),
                                 cute.make_layout((self.BN, self.BM), stride=(self.out_ld, 1)))
        s_flag = st.flag.get_tensor(cute.make_layout((4,)))
        if cutlass.const_expr(self.S == 1):
            cute.arch.sync_threads()
            self._stage_out(s_out, acc, tCcC)
            cute.arch.sync_threads()
            self._store_out(mY, mR, s_out, tidx, blk)
        else:
            accv = cute.make_tensor(acc.iterator, cute.make_layout((self.acc_n,)))  # flat, fragment order
            part = cute.make_rmem_tensor((self.acc_n,), Float32)
            vst = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            ld_l2 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
                                        load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)  # skip stale L1
            part.store(accv.load())
            cute.copy(vst, part, mWs[split, blk, tidx, None])
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
                accv.fill(0.0)
                for s in cutlass.range(self.S, unroll=1):
                    cute.copy(ld_l2, mWs[s, blk, tidx, None], part)
                    accv.store(accv.load() + part.load())
                self._stage_out(s_out, acc, tCcC)
                cute.arch.sync_threads()
                self._store_out(mY, mR, s_out, tidx, blk)

    @cute.jit
    def _stage_out(self, s_out: cute.Tensor, acc: cute.Tensor, tCcC: cute.Tensor):
        """Accumulator element i holds y^T[row, m] at coordinate tCcC[i] = (row, m) -> s_out[m, row]."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            row, m = tCcC[i]
            s_out[m, row] = acc[i]

    @cute.jit
    def _store_out(self, mY: cute.Tensor, mR: Optional[cute.Tensor], s_out: cute.Tensor, tidx, blk):
        """Every thread: 8 consecutive outputs of one batch row per step, 16-byte loads and stores."""
        M = mY.shape[0]
        vec_in = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        vec_out = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        per_row = self.BM // VEC
        for i in cutlass.range_constexpr(self.store_steps):
            vid = tidx + i * self.threads
            m = vid // per_row
            c = vid % per_row
            nv = blk * per_row + c  # 8-wide vector index along N
            if m < M and nv < self.N // VEC and vid < self.BN * per_row:
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

