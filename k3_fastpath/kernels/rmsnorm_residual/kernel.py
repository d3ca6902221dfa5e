"""Fused residual add + RMSNorm for decode rows (CuTe DSL, sm_90a).

Algorithm, one CTA per row m (grid = M, so any M works without recompiling):
1. Each thread loads its 16-byte vectors of x[m], residual[m] and weight (vector t, t+T, t+2T, ... of
   the row: a warp reads contiguous 512-byte runs).
2. FP32: s = x + residual; h = bf16(s) is the new residual (rounded once, as ``torch`` rounds x + r);
   the norm is taken of h in FP32: ss = sum(h^2) per thread.
3. Block reduction of ss: butterfly shuffle in each warp, one FP32 per warp to shared memory, then
   every thread sums the warp partials in the same fixed order (deterministic, identical in all threads).
4. rstd = rsqrt(ss / H + eps); out = bf16(h * rstd * weight); store out and h with 16-byte stores.

Without a residual (``has_residual=False``) steps 1-2 skip the add and h = x (plain RMSNorm).

With ``config.pdl`` (programmatic dependent launch) step 1 is split: the weight vectors are loaded first
(a step never writes them), then ``griddepcontrol.wait`` (the predecessor grid has completed and its
writes are visible), then x and residual; ``griddepcontrol.launch_dependents`` follows once those loads
are issued. Every global write comes after the wait. Without it the loads are issued in the same order.
In-place use is safe: every element is read and written by the same thread, reads first.

Constraints: bf16 tensors, H % 8 == 0, rows contiguous and 16-byte aligned, H <= 8 * 1024 * vec_per_thread.
"""
# ruff: noqa: UP045  (the DSL reads Optional[...] annotations to accept None operands)

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from ..common.pdl import PdlOrder
from .config import VEC, RMSNormConfig


class RMSNormResidualKernel:
    def __init__(self, H: int, config: RMSNormConfig):
        if H % VEC:
            raise ValueError(f"H = {H} must be a multiple of {VEC}")
        self.H = H
        self.cfg = config
        self.num_vec = H // VEC
        self.threads = config.threads
        self.vpt = config.vec_per_thread
        self.num_warps = config.threads // 32
        if self.threads * self.vpt < self.num_vec:
            raise ValueError(f"config {config} covers {self.threads * self.vpt} vectors < {self.num_vec}")
        self.predicated = self.threads * self.vpt != self.num_vec

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, H) bf16
        mR: Optional[cute.Tensor],  # (M, H) bf16 residual in, or None
        mW: cute.Tensor,  # (H,) bf16
        mO: cute.Tensor,  # (M, H) bf16 normed out
        mRO: Optional[cute.Tensor],  # (M, H) bf16 new residual out, or None
        eps: Float32,
        stream: cuda.CUstream,
    ):
        self.kernel(mX, mR, mW, mO, mRO, eps).launch(
            grid=[mX.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

    @cute.jit
    def _load_row(self, src: cute.Tensor, dst: cute.Tensor, tidx):
        """This thread's 16-byte vectors (t, t + T, ...) of a length-H row into dst (VEC, vpt)."""
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        for v in cutlass.range_constexpr(self.vpt):
            idx = v * self.threads + tidx
            if cutlass.const_expr(self.predicated):
                if idx < self.num_vec:
                    cute.copy(vec, cute.local_tile(src, (VEC,), (idx,)), dst[None, v])
            else:
                cute.copy(vec, cute.local_tile(src, (VEC,), (idx,)), dst[None, v])

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: Optional[cute.Tensor], mW: cute.Tensor, mO: cute.Tensor,
               mRO: Optional[cute.Tensor], eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        smem = SmemAllocator()
        s_red = smem.allocate_tensor(Float32, cute.make_layout((self.num_warps,)), byte_alignment=16)

        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        # register fragments: (8 elements, vpt vectors); column-major so each vector is contiguous
        rX = cute.make_rmem_tensor((VEC, self.vpt), BFloat16)
        rR = cute.make_rmem_tensor((VEC, self.vpt), BFloat16)
        rW = cute.make_rmem_tensor((VEC, self.vpt), BFloat16)
        rX.fill(0.0)
        rR.fill(0.0)
        rW.fill(0.0)
        # 1. the weight first (never written by a step: PDL may read it before the wait), then x, residual
        order = PdlOrder(self.cfg.pdl)
        mW = order.weight(mW)
        mX, mR, mO, mRO = order.after_wait(mX, mR, mO, mRO)
        self._load_row(mW, rW, tidx)
        order.wait()
        self._load_row(mX[row, None], rX, tidx)
        if cutlass.const_expr(self.cfg.has_residual):
            self._load_row(mR[row, None], rR, tidx)
        order.launch_dependents()

        if cutlass.const_expr(self.cfg.has_residual):
            s = rX.load().to(Float32) + rR.load().to(Float32)
            h = s.to(BFloat16)
            rR.store(h)  # rR now holds the new residual (bf16)
            hf = h.to(Float32)
        else:
            hf = rX.load().to(Float32)
        ss = (hf * hf).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)

        ss = cute.arch.warp_reduction_sum(ss)
        if lane == 0:
            s_red[warp] = ss
        cute.arch.sync_threads()
        total = Float32(0.0)
        for w in cutlass.range_constexpr(self.num_warps):
            total = total + s_red[w]
        rstd = cute.math.rsqrt(total / Float32(self.H) + eps)

        y = (hf * rstd) * rW.load().to(Float32)
        rX.store(y.to(BFloat16))  # rX now holds the normed output

        gO = mO[row, None]
        for v in cutlass.range_constexpr(self.vpt):
            idx = v * self.threads + tidx
            if cutlass.const_expr(self.predicated):
                if idx < self.num_vec:
                    cute.copy(vec, rX[None, v], cute.local_tile(gO, (VEC,), (idx,)))
                    if cutlass.const_expr(self.cfg.has_residual):
                        cute.copy(vec, rR[None, v], cute.local_tile(mRO[row, None], (VEC,), (idx,)))
            else:
                cute.copy(vec, rX[None, v], cute.local_tile(gO, (VEC,), (idx,)))
                if cutlass.const_expr(self.cfg.has_residual):
                    cute.copy(vec, rR[None, v], cute.local_tile(mRO[row, None], (VEC,), (idx,)))
