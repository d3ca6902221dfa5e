"""SiTU-GLU activation of the shared experts and the dense MLP, one kernel (CuTe DSL, sm_90a).

    h[m, i] = bf16( beta * tanh(g / beta) * sigmoid(g) * (linear_beta * tanh(u / linear_beta)) )

with g = gate[m, i], u = up[m, i] (bf16, taken to FP32). In PyTorch this is ~12 elementwise kernels (two
FP32 casts, two tanh, a sigmoid, seven multiplies, the bf16 cast) per MLP per step; here one launch.

Algorithm, grid (M, chunks), ``config.threads`` threads per CTA:
1. thread t of CTA (m, c) owns the 16-byte vectors c * threads * vpt + v * threads + t (v < vpt) of row m,
   predicated past I / 8;
2. with ``config.pdl``: ``griddepcontrol.wait`` first (g and u are the previous kernels' outputs; there
   is no weight to fetch early), then the loads, then ``griddepcontrol.launch_dependents``;
3. FP32 per element, left to right as ``reference.common.situ_glu``: sigmoid as 1 / (1 + exp(-g)), tanh by
   ``cute.math.tanh`` (the routed experts' GLU in ``moe_experts`` computes the same way);
4. one bf16 rounding, 16-byte stores.

Constraints: bf16 [M, I] tensors, rows contiguous and 16-byte aligned, I % 8 == 0; ``out`` may alias g or u
(every element is read and written by the same thread, reads first).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from ..common.pdl import PdlOrder
from ..common.primitives import sigmoid
from .config import VEC, SituGluConfig


class SituGluKernel:
    def __init__(self, I: int, config: SituGluConfig):  # noqa: E741
        if I % VEC:
            raise ValueError(f"I = {I} must be a multiple of {VEC}")
        self.I = I
        self.cfg = config
        self.num_vec = I // VEC
        self.threads = config.threads
        self.vpt = config.vec_per_thread
        self.chunks = config.chunks(I)
        self.predicated = self.chunks * config.vectors_per_cta != self.num_vec

    @cute.jit
    def __call__(self, mG: cute.Tensor, mU: cute.Tensor, mH: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mG, mU, mH).launch(grid=[mG.shape[0], self.chunks, 1], block=[self.threads, 1, 1],
                                       stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mU: cute.Tensor, mH: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, chunk, _ = cute.arch.block_idx()
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        rG = cute.make_rmem_tensor((VEC, self.vpt), BFloat16)
        rU = cute.make_rmem_tensor((VEC, self.vpt), BFloat16)
        rG.fill(0.0)
        rU.fill(0.0)
        order = PdlOrder(self.cfg.pdl)  # no weights: nothing global before the wait
        mG, mU, mH = order.after_wait(mG, mU, mH)
        base = chunk * self.cfg.vectors_per_cta + tidx
        order.wait()
        gG, gU, gH = mG[row, None], mU[row, None], mH[row, None]
        for v in cutlass.range_constexpr(self.vpt):
            idx = base + v * self.threads
            if cutlass.const_expr(self.predicated):
                if idx < self.num_vec:
                    cute.copy(vec, cute.local_tile(gG, (VEC,), (idx,)), rG[None, v])
                    cute.copy(vec, cute.local_tile(gU, (VEC,), (idx,)), rU[None, v])
            else:
                cute.copy(vec, cute.local_tile(gG, (VEC,), (idx,)), rG[None, v])
                cute.copy(vec, cute.local_tile(gU, (VEC,), (idx,)), rU[None, v])
        order.launch_dependents()

        b, lb = Float32(self.cfg.beta), Float32(self.cfg.linear_beta)
        for v in cutlass.range_constexpr(self.vpt):
            for e in cutlass.range_constexpr(VEC):
                gv = rG[e, v].to(Float32)
                uv = rU[e, v].to(Float32)
                h = b * cute.math.tanh(gv / b) * sigmoid(gv) * (lb * cute.math.tanh(uv / lb))
                rG[e, v] = h.to(BFloat16)  # rG now holds the output

        for v in cutlass.range_constexpr(self.vpt):
            idx = base + v * self.threads
            if cutlass.const_expr(self.predicated):
                if idx < self.num_vec:
                    cute.copy(vec, rG[None, v], cute.local_tile(gH, (VEC,), (idx,)))
            else:
                cute.copy(vec, rG[None, v], cute.local_tile(gH, (VEC,), (idx,)))
