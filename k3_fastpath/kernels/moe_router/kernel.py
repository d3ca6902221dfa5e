"""Router expert selection for decode rows (CuTe DSL, sm_90a): sigmoid, + correction bias, top-k with the
reference's tie rule, renormalised weights. The FP32 logits come from the skinny GEMM (api.py).

One warp per token row m (``rows_per_cta`` rows per CTA, grid = ceil(M / rows_per_cta)):
1. Lane l loads the 16-byte vectors v = l + 32*i (i < vec_per_lane) of logits[m] and of the bias: experts
   e = 4*v + j. score_e = sigmoid(logit_e) = 1 / (1 + exp(-logit_e)) in FP32; the selection key
   sel_e = score_e + bias_e stays in registers (vectors past E hold -inf).
2. k rounds; each round every lane scans its keys in increasing expert order for its best (strictly
   greater wins, so the lower index wins a tie), then a butterfly over the 32 lanes exchanges (key, index)
   pairs under the total order "greater key, or equal key and lower index" (K3.md failure 5: on exactly
   equal keys the lowest expert index wins, like the reference's stable descending sort). Every lane ends
   with the same winner; lane r keeps round r's index; the owner clears that key to -inf (a compare per
   register, no dynamic register indexing).
3. Lane r < k re-reads logit[m, id_r] (an L1 hit) and recomputes its score with the same instructions as
   step 1 (bitwise the score the key was built from); the k scores are summed with a butterfly, and
   weight_r = score_r / sum * scale (``renormalize``) or score_r * scale. Picks are stored in selection
   order (descending key, as the reference orders them): ids [M, k] int32, weights [M, k] FP32.

With ``config.pdl`` (programmatic dependent launch) the bias vectors are loaded first (a parameter: no step
writes it), then ``griddepcontrol.wait``, then the logits; ``launch_dependents`` follows the step-3 re-read
(the last read of the logits); the stores come after it. A warp whose row is past M (``rows_per_cta`` > 1)
runs on row M - 1 and stores nothing, so the wait and the trigger are reached by every thread.

Constraints: E % 4 == 0, E <= 2048, 1 <= k <= min(32, E); logits [M, E] / bias [E] FP32, 16-byte aligned.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.pdl import PdlOrder
from ..common.primitives import sigmoid
from .config import VEC, MoERouterConfig

_NEG_INF = float("-inf")



def _better(v, i, bv, bi):
    """(v, i) beats (bv, bi): greater key, or equal key and lower expert index."""
    return (v > bv) | ((v == bv) & (i < bi))


class MoERouterKernel:
    def __init__(self, config: MoERouterConfig):
        self.cfg = config
        self.E = config.num_experts
        self.K = config.top_k
        self.VPL = config.vec_per_lane
        self.predicated = config.vec_per_lane * 32 != config.num_vec

    @cute.jit
    def __call__(self, mL: cute.Tensor, mB: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, scale: Float32,
                 stream: cuda.CUstream):
        rpc = self.cfg.rows_per_cta
        grid = (mL.shape[0] + rpc - 1) // rpc
        self.kernel(mL, mB, mIds, mW, scale).launch(grid=[grid, 1, 1], block=[self.cfg.threads, 1, 1],
                                                    stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mB: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        blk, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        order = PdlOrder(self.cfg.pdl)
        mB = order.weight(mB)
        mL, mIds, mW = order.after_wait(mL, mIds, mW)
        row = blk * self.cfg.rows_per_cta + tidx // 32
        M = mL.shape[0]
        rrow = cutlass.min(row, M - 1)  # a warp past M (rows_per_cta > 1) selects row M - 1, stores nothing
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        # 0. the correction bias (a parameter, never written by a step) into registers first
        rb = cute.make_rmem_tensor((VEC, self.VPL), Float32)
        for i in cutlass.range_constexpr(self.VPL):
            v = lane + 32 * i
            if cutlass.const_expr(self.predicated):
                if v < self.cfg.num_vec:
                    cute.copy(vec, cute.local_tile(mB, (VEC,), (v,)), rb[None, i])
            else:
                cute.copy(vec, cute.local_tile(mB, (VEC,), (v,)), rb[None, i])
        order.wait()  # the logits (the predecessor's output) are visible after this

        # 1. keys in registers: sel[j, i] is expert 4 * (lane + 32 i) + j
        sel = cute.make_rmem_tensor((VEC, self.VPL), Float32)
        rl = cute.make_rmem_tensor((VEC,), Float32)
        for i in cutlass.range_constexpr(self.VPL):
            v = lane + 32 * i
            if cutlass.const_expr(self.predicated):
                for j in cutlass.range_constexpr(VEC):
                    sel[j, i] = Float32(_NEG_INF)
                if v < self.cfg.num_vec:
                    cute.copy(vec, cute.local_tile(mL[rrow, None], (VEC,), (v,)), rl)
                    for j in cutlass.range_constexpr(VEC):
                        sel[j, i] = sigmoid(rl[j]) + rb[j, i]
            else:
                cute.copy(vec, cute.local_tile(mL[rrow, None], (VEC,), (v,)), rl)
                for j in cutlass.range_constexpr(VEC):
                    sel[j, i] = sigmoid(rl[j]) + rb[j, i]

        # 2. k rounds of warp arg-max under the tie rule
        my_id = Int32(0)
        for r in cutlass.range(self.K, unroll=1):
            bv = sel[0, 0]
            bi = Int32(4 * lane)
            for i in cutlass.range_constexpr(self.VPL):
                for j in cutlass.range_constexpr(VEC):
                    if cutlass.const_expr(i + j > 0):
                        e = Int32(4 * (lane + 32 * i) + j)
                        take = sel[j, i] > bv
                        bv = Float32(cutlass.select_(take, sel[j, i], bv))
                        bi = Int32(cutlass.select_(take, e, bi))
            for off in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(bv, offset=16 >> off)
                oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> off)
                take = _better(ov, oi, bv, bi)
                bv = Float32(cutlass.select_(take, ov, bv))
                bi = Int32(cutlass.select_(take, oi, bi))
            my_id = Int32(cutlass.select_(lane == r, bi, my_id))
            for i in cutlass.range_constexpr(self.VPL):
                for j in cutlass.range_constexpr(VEC):
                    e = Int32(4 * (lane + 32 * i) + j)
                    sel[j, i] = Float32(cutlass.select_(e == bi, Float32(_NEG_INF), sel[j, i]))

        # 3. scores of the picks, renormalised over the k lanes that hold one
        s = Float32(0.0)
        if lane < self.K:
            s = sigmoid(mL[rrow, my_id])
        order.launch_dependents()  # the last read of the logits is issued
        if cutlass.const_expr(self.cfg.renormalize):
            tot = cute.arch.warp_reduction_sum(s)
            w = s / tot * scale
        else:
            w = s * scale
        if lane < self.K and row < M:
            mIds[row, lane] = my_id
            mW[row, lane] = w
