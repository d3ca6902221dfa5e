"""AttnRes source mixing for decode rows (CuTe DSL, sm_90a).

For each row m, over S <= 9 sources v_s (block snapshots and the running prefix of the residual stream):
    logit_s = <w, v_s> * rsqrt(mean(v_s^2) + eps),  w = norm_w * proj_w
    p = softmax(logit),  mix = bf16(sum_s p_s v_s),  [normed = bf16(mix * rsqrt(mean(mix^2) + eps2) * out_w)]

Algorithm, one CTA per row (grid = M):
1. each thread loads its 16-byte vectors of every source and of norm_w, proj_w (w = norm_w * proj_w
   in FP32) and forms 2S partial sums: <w, v_s> and sum(v_s^2);
2. block reduction of the 2S sums: butterfly in each warp, warp partials to shared memory, lane i of
   warp 0 sums partial i over warps in fixed order (deterministic) and publishes it;
3. every thread computes the same S logits, the max-subtracted softmax and p_s (FP32);
4. mix = sum_s p_s * v_s with FP32 FMAs in source order, rounded to bf16 and stored (the sources stay
   in registers from step 1, or with ``reload_sources`` are read again: L1/L2 hits, fewer registers);
5. with ``has_norm``: a second block reduction of sum(mix_bf16^2), then normed = bf16(mix * rstd * out_w).

With ``config.pdl`` (programmatic dependent launch) step 1 starts with the weights only: norm_w and proj_w
into registers (w formed) and, with ``has_norm``, one ``cp.async.bulk.prefetch.L2`` of out_w (H * 2 bytes,
thread 0 of CTA 0); then ``griddepcontrol.wait`` before the first source load; ``launch_dependents`` once
the last source load is issued (the mix pass). Every global write comes after the wait.

Constraints: bf16, H % 8 == 0, sources stacked as one contiguous [S, M, H] tensor, 16-byte aligned rows.
"""
# ruff: noqa: UP045  (the DSL reads Optional[...] annotations to accept None operands)

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from ..common.pdl import PdlOrder
from ..common.primitives import prefetch_weights_l2
from .config import VEC, AttnResConfig


class AttnResMixKernel:
    def __init__(self, S: int, H: int, config: AttnResConfig):
        self.S, self.H, self.cfg = S, H, config
        self.T = config.threads
        self.V = config.vec_per_thread
        self.num_warps = self.T // 32
        self.num_vec = H // VEC
        if self.T * self.V < self.num_vec:
            raise ValueError(f"config {config} covers {self.T * self.V} vectors < {self.num_vec}")
        self.predicated = self.T * self.V != self.num_vec
        self.nred = 2 * S

    @cute.jit
    def __call__(self, mV: cute.Tensor, mWn: cute.Tensor, mWp: cute.Tensor, mMix: cute.Tensor,
                 mWo: Optional[cute.Tensor], mOut: Optional[cute.Tensor], eps: Float32, out_eps: Float32,
                 stream: cuda.CUstream):
        self.kernel(mV, mWn, mWp, mMix, mWo, mOut, eps, out_eps).launch(
            grid=[mV.shape[1], 1, 1], block=[self.T, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

    @cute.jit
    def _load(self, src: cute.Tensor, dst: cute.Tensor, tidx):
        """This thread's vectors of a length-H row into dst (VEC, V); zero-filled where predicated off."""
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        dst.fill(0.0)
        for v in cutlass.range_constexpr(self.V):
            idx = v * self.T + tidx
            if cutlass.const_expr(self.predicated):
                if idx < self.num_vec:
                    cute.copy(vec, cute.local_tile(src, (VEC,), (idx,)), dst[None, v])
            else:
                cute.copy(vec, cute.local_tile(src, (VEC,), (idx,)), dst[None, v])

    @cute.jit
    def _store(self, src: cute.Tensor, dst: cute.Tensor, tidx):
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        for v in cutlass.range_constexpr(self.V):
            idx = v * self.T + tidx
            if cutlass.const_expr(self.predicated):
                if idx < self.num_vec:
                    cute.copy(vec, src[None, v], cute.local_tile(dst, (VEC,), (idx,)))
            else:
                cute.copy(vec, src[None, v], cute.local_tile(dst, (VEC,), (idx,)))

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mWn: cute.Tensor, mWp: cute.Tensor, mMix: cute.Tensor,
               mWo: Optional[cute.Tensor], mOut: Optional[cute.Tensor], eps: Float32, out_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        smem = SmemAllocator()
        s_part = smem.allocate_tensor(Float32, cute.make_layout((self.nred, self.num_warps)), byte_alignment=16)
        s_tot = smem.allocate_tensor(Float32, cute.make_layout((self.nred + 1,)), byte_alignment=16)

        order = PdlOrder(self.cfg.pdl)
        mWn, mWp, mWo = order.weight(mWn), order.weight(mWp), order.weight(mWo)
        mV, mMix, mOut = order.after_wait(mV, mMix, mOut)
        rA = cute.make_rmem_tensor((VEC, self.V), BFloat16)
        rB = cute.make_rmem_tensor((VEC, self.V), BFloat16)
        self._load(mWn, rA, tidx)
        self._load(mWp, rB, tidx)
        w = rA.load().to(Float32) * rB.load().to(Float32)
        if cutlass.const_expr(self.cfg.pdl):
            # weights only before the wait: out_w toward L2 (every CTA reads it in step 5), then wait
            if cutlass.const_expr(self.cfg.has_norm):
                if row == 0 and tidx == 0:
                    prefetch_weights_l2(mWo.iterator.toint(), Int32(self.H * 2))
        order.wait()

        srcs = []
        for s in cutlass.range_constexpr(self.S):
            r = cute.make_rmem_tensor((VEC, self.V), BFloat16)
            self._load(mV[s, row, None], r, tidx)
            vf = r.load().to(Float32)
            dot = (vf * w).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            sq = (vf * vf).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            dot = cute.arch.warp_reduction_sum(dot)
            sq = cute.arch.warp_reduction_sum(sq)
            if lane == 0:
                s_part[2 * s, warp] = dot
                s_part[2 * s + 1, warp] = sq
            if cutlass.const_expr(not self.cfg.reload_sources):
                srcs.append(r)
        cute.arch.sync_threads()
        if warp == 0 and lane < self.nred:
            tot = Float32(0.0)
            for wi in cutlass.range_constexpr(self.num_warps):
                tot = tot + s_part[lane, wi]
            s_tot[lane] = tot
        cute.arch.sync_threads()

        logits = []
        for s in cutlass.range_constexpr(self.S):
            rstd = cute.math.rsqrt(s_tot[2 * s + 1] / Float32(self.H) + eps)
            logits.append(s_tot[2 * s] * rstd)
        mx = logits[0]
        for s in cutlass.range_constexpr(1, self.S):
            mx = cute.arch.fmax(mx, logits[s])
        ps = []
        z = Float32(0.0)
        for s in cutlass.range_constexpr(self.S):
            e = cute.math.exp(logits[s] - mx)
            ps.append(e)
            z = z + e
        inv_z = Float32(1.0) / z

        acc = cute.make_rmem_tensor((VEC, self.V), Float32)
        for s in cutlass.range_constexpr(self.S):
            if cutlass.const_expr(self.cfg.reload_sources):
                self._load(mV[s, row, None], rB, tidx)
                vf = rB.load().to(Float32)
            else:
                vf = srcs[s].load().to(Float32)
            if cutlass.const_expr(s == 0):
                acc.store(vf * (ps[0] * inv_z))
            else:
                acc.store(vf * (ps[s] * inv_z) + acc.load())
        order.launch_dependents()  # every source load is issued
        mix = acc.load().to(BFloat16)
        rA.store(mix)
        self._store(rA, mMix[row, None], tidx)

        if cutlass.const_expr(self.cfg.has_norm):
            mf = mix.to(Float32)
            sq = (mf * mf).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            sq = cute.arch.warp_reduction_sum(sq)
            if lane == 0:
                s_part[0, warp] = sq
            cute.arch.sync_threads()
            tot = Float32(0.0)
            for wi in cutlass.range_constexpr(self.num_warps):
                tot = tot + s_part[0, wi]
            rstd = cute.math.rsqrt(tot / Float32(self.H) + out_eps)
            self._load(mWo, rB, tidx)
            y = (mf * rstd) * rB.load().to(Float32)
            rA.store(y.to(BFloat16))
            self._store(rA, mOut[row, None], tidx)
