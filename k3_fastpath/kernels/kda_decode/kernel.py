"""KDA (Kimi Delta Attention) decode step, T = 1, for a batch of sequences (CuTe DSL, sm_90a).

One launch per KDA layer per decode step; grid = (B, H): one CTA per (sequence b, head h), with
``threads = (D/4) * G`` threads (config.py; D = 128: 256 threads, G = 8 row groups of 16 rows).
Sequence b's caches live at pool index ``slot[b]``; slot 0 is the empty slot.

Algorithm of one CTA (b, h), slot s = slot[b]:
0. s == 0: write y[b, head h] = 0, touch no cache, return (the whole CTA takes the same branch).
1. Issue the loads of the CTA's D x D FP32 state S = state[s, h] first (row-major [K, V]): thread t owns
   columns 4*(t % (D/4)) .. +3 of rows ``t // (D/4) + i*G`` (i < D/G), one 16-byte load per row, so the
   whole 64 KB are in flight while step 2 runs. Offsets into the pools are 64-bit (large slot indices).
2. Per-channel work, 2*D tasks spread over the threads: task j < D does channel c = h*D + j of q and of
   k: short conv over (conv_state[s, 0..2, c], x[b, c]) with the FP32 weights, SiLU, result (not yet
   normalised) to shared memory, and shifts the conv state in place (state[0] <- state[1], state[1] <-
   state[2], state[2] <- x: BF16 values copied, so bit-exact). Task D + j does channel c of v (conv +
   SiLU + state shift) and the decay alpha_j = exp(lower_bound * sigmoid(exp(A_log[h]) * (a[b, c] +
   dt_bias[c]))). Every conv channel of (s, h) is read and written by exactly one thread of one CTA,
   reads before writes: race-free as long as the non-zero slots of a batch are distinct.
3. __syncthreads. Every warp reads q and k from shared memory and butterfly-reduces sum q^2, sum k^2
   and q.k (no second barrier): rq = rsqrt(sum q^2 + 1e-6) * D^-0.5, rk = rsqrt(sum k^2 + 1e-6);
   (q.k) of the normalised vectors = q.k * rq * rk. beta = sigmoid(beta_logits[b, h]).
4. Each thread, per owned row r: S_r <- alpha_r * S_r (kept in registers) and accumulates
   pk += k_r S_r, pq += q_r S_r for its 4 columns. Because S_new = alpha S + k v'^T,
   o = S_new^T q = (alpha S)^T q + v' (k.q): both products need only the decayed S, one reduction pass.
5. Partial sums of the G row groups through shared memory (one barrier); each thread adds the G
   partials of its 4 columns in a fixed order (deterministic): Sk, Sq.
   v' = beta (v - Sk); o = Sq + v' (k.q); S_r += k_r v' and 16-byte stores back to state[s, h] in place.
6. RMSNorm over the head: the D/4 threads of a row group hold all D values of o; butterfly sum of o^2
   within that group (D = 128: the whole warp); y = o * rsqrt(mean(o^2) + eps) * o_norm_w * sigmoid(g)
   rounded to BF16; row group 0 stores y[b, h*D + cols] (8-byte stores).

Parameters first: before step 0 every thread loads the parameters it will need (the FP32 conv weights of
its channel tasks, dt_bias of its decay channel, A_log[h], and for row group 0 its o_norm_w vector) into
registers. A step never writes them, so with ``config.pdl`` (programmatic dependent launch) these loads are
issued before ``griddepcontrol.wait``; ``slot``, the projections, the conv and recurrent state (written by
the previous step's launch of this kernel) and the output gate are read only after it, and every global
write comes after it. ``launch_dependents`` follows once the last input load (step 2) is issued, or at
once for an empty slot.

Constraints: D in (32, 64, 128); W = 4; q, k, v, g, a [B, C] BF16, beta_logits [B, H] BF16, conv weights
[C, 4] / A_log [H] / dt_bias [C] / o_norm_w [D] FP32; conv pools [N, 3, C] BF16; state pool [N, H, D, D]
FP32; slot [B] int32 in [0, N); every tensor contiguous, 16-byte aligned. Non-zero slots distinct.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64
from cutlass.memory import SmemAllocator

from ..common.pdl import PdlOrder
from ..common.primitives import sigmoid
from .config import CONV_W, VEC, KDADecodeConfig

L2_EPS = 1e-6



class KDADecodeKernel:
    def __init__(self, H: int, D: int, config: KDADecodeConfig):
        if config.head_dim != D:
            raise ValueError(f"config.head_dim={config.head_dim} != D={D}")
        self.H = H
        self.D = D
        self.C = H * D
        self.cfg = config
        self.T = config.threads
        self.TPR = config.threads_per_row  # threads sharing one row (a 4-column vector each)
        self.G = config.row_groups
        self.RPT = config.rows_per_thread
        self.task_iters = -(-2 * D // self.T)
        self.task_pred = self.task_iters * self.T != 2 * D
        self.L2_PER_LANE = D // 32

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mA: cute.Tensor,
                 mBeta: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWv: cute.Tensor, mAlog: cute.Tensor,
                 mDt: cute.Tensor, mNw: cute.Tensor, mSlot: cute.Tensor, mCq: cute.Tensor, mCk: cute.Tensor,
                 mCv: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, eps: Float32, lower_bound: Float32,
                 stream: cuda.CUstream):
        self.kernel(mQ, mK, mV, mG, mA, mBeta, mWq, mWk, mWv, mAlog, mDt, mNw, mSlot, mCq, mCk, mCv, mS, mO,
                    eps, lower_bound).launch(grid=[mQ.shape[0], self.H, 1], block=[self.T, 1, 1],
                                             stream=stream, min_blocks_per_mp=1, use_pdl=self.cfg.pdl)

    @cute.jit
    def conv_channel(self, mX: cute.Tensor, rw: cute.Tensor, mConv: cute.Tensor, b, slot, c):
        """silu(sum_j w[c, j] * in_j) over in = (conv[slot, 0..2, c], x[b, c]) with the channel's weights
        ``rw`` (registers, loaded up front); shifts the conv state."""
        x = mX[b, c]
        s0 = mConv[slot, 0, c]
        s1 = mConv[slot, 1, c]
        s2 = mConv[slot, 2, c]
        acc = rw[0] * s0.to(Float32)
        acc = acc + rw[1] * s1.to(Float32)
        acc = acc + rw[2] * s2.to(Float32)
        acc = acc + rw[3] * x.to(Float32)
        mConv[slot, 0, c] = s1
        mConv[slot, 1, c] = s2
        mConv[slot, 2, c] = x
        return acc * sigmoid(acc)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mA: cute.Tensor,
               mBeta: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWv: cute.Tensor, mAlog: cute.Tensor,
               mDt: cute.Tensor, mNw: cute.Tensor, mSlot: cute.Tensor, mCq: cute.Tensor, mCk: cute.Tensor,
               mCv: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, eps: Float32, lower_bound: Float32):
        D, G, RPT, TPR = self.D, self.G, self.RPT, self.TPR
        tidx, _, _ = cute.arch.thread_idx()
        b, h, _ = cute.arch.block_idx()
        lane = tidx % 32
        cg = tidx % TPR  # column group: columns 4*cg .. 4*cg+3
        rg = tidx // TPR  # row group: rows rg + G*i

        smem = SmemAllocator()
        s_q = smem.allocate_tensor(Float32, cute.make_layout((D,)), byte_alignment=16)
        s_k = smem.allocate_tensor(Float32, cute.make_layout((D,)), byte_alignment=16)
        s_v = smem.allocate_tensor(Float32, cute.make_layout((D,)), byte_alignment=16)
        s_al = smem.allocate_tensor(Float32, cute.make_layout((D,)), byte_alignment=16)
        # partial sums: (4 columns, column group, k|q, row group); a thread's 4 columns are one 16-byte vector
        s_red = smem.allocate_tensor(Float32, cute.make_layout((VEC, TPR, 2, G)), byte_alignment=16)

        vec32 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        vec16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=64)
        hD = h * D
        rY = cute.make_rmem_tensor((VEC,), BFloat16)
        order = PdlOrder(self.cfg.pdl)
        mWq, mWk, mWv, mAlog, mDt, mNw = (order.weight(t) for t in (mWq, mWk, mWv, mAlog, mDt, mNw))
        mQ, mK, mV, mG, mA, mBeta, mSlot, mCq, mCk, mCv, mS, mO = order.after_wait(
            mQ, mK, mV, mG, mA, mBeta, mSlot, mCq, mCk, mCv, mS, mO)

        # parameters (never written by a step): conv weights of this thread's tasks (a: q or v, b: k),
        # dt_bias of its decay channel, A_log[h], row group 0's o_norm_w vector
        rwa = []
        rwb = []
        rdt = cute.make_rmem_tensor((self.task_iters,), Float32)
        for it in cutlass.range_constexpr(self.task_iters):
            task = tidx + it * self.T
            wa = cute.make_rmem_tensor((CONV_W,), Float32)
            wb = cute.make_rmem_tensor((CONV_W,), Float32)
            if task < 2 * D:
                if task < D:
                    cute.copy(vec32, mWq[hD + task, None], wa)
                    cute.copy(vec32, mWk[hD + task, None], wb)
                else:
                    cute.copy(vec32, mWv[hD + task - D, None], wa)
                    rdt[it] = mDt[hD + task - D]
            rwa.append(wa)
            rwb.append(wb)
        a_log = mAlog[h]
        rW = cute.make_rmem_tensor((VEC,), Float32)
        if rg == 0:
            cute.copy(vec32, cute.local_tile(mNw, (VEC,), (cg,)), rW)
        order.wait()  # the predecessor's writes (inputs, caches) are visible after this

        gO = cute.local_tile(mO[b, None], (VEC,), (h * TPR + cg,))
        slot = mSlot[b]
        if slot == 0:
            # 0. empty slot: output zeros, no cache touched
            order.launch_dependents()
            if rg == 0:
                rY.fill(0.0)
                cute.copy(vec16, rY, gO)
        else:
            slot64 = Int64(slot)
            # 1. state loads first: (4 columns, RPT rows) per thread
            gS = mS[slot64, h, None, None]
            rS = cute.make_rmem_tensor((VEC, RPT), Float32)
            for i in cutlass.range_constexpr(RPT):
                cute.copy(vec32, cute.local_tile(gS[rg + G * i, None], (VEC,), (cg,)), rS[None, i])
            rG = cute.make_rmem_tensor((VEC,), BFloat16)  # the output gate, for step 6
            if rg == 0:
                cute.copy(vec16, cute.local_tile(mG[b, None], (VEC,), (h * TPR + cg,)), rG)

            # 2. per-channel conv / gate tasks
            for it in cutlass.range_constexpr(self.task_iters):
                task = tidx + it * self.T
                if task < 2 * D:
                    if task < D:
                        c = hD + task
                        s_q[task] = self.conv_channel(mQ, rwa[it], mCq, b, slot64, c)
                        s_k[task] = self.conv_channel(mK, rwb[it], mCk, b, slot64, c)
                    else:
                        j = task - D
                        c = hD + j
                        s_v[j] = self.conv_channel(mV, rwa[it], mCv, b, slot64, c)
                        rate = cute.math.exp(a_log)
                        glog = lower_bound * sigmoid(rate * (mA[b, c].to(Float32) + rdt[it]))
                        s_al[j] = cute.math.exp(glog)
            beta = sigmoid(mBeta[b, h].to(Float32))
            order.launch_dependents()  # every input load is issued
            cute.arch.sync_threads()

            # 3. L2 norms and q.k, reduced redundantly by every warp
            sqq = Float32(0.0)
            skk = Float32(0.0)
            sqk = Float32(0.0)
            for i in cutlass.range_constexpr(self.L2_PER_LANE):
                qv = s_q[lane + 32 * i]
                kv = s_k[lane + 32 * i]
                sqq = sqq + qv * qv
                skk = skk + kv * kv
                sqk = sqk + qv * kv
            sqq = cute.arch.warp_reduction_sum(sqq)
            skk = cute.arch.warp_reduction_sum(skk)
            sqk = cute.arch.warp_reduction_sum(sqk)
            rq = cute.math.rsqrt(sqq + Float32(L2_EPS)) * Float32(D ** -0.5)
            rk = cute.math.rsqrt(skk + Float32(L2_EPS))
            kq = sqk * rq * rk

            # 4. decay the owned rows; partial S^T k and S^T q of the 4 columns
            pk = cute.make_rmem_tensor((VEC,), Float32)
            pq = cute.make_rmem_tensor((VEC,), Float32)
            pk.fill(0.0)
            pq.fill(0.0)
            for i in cutlass.range_constexpr(RPT):
                r = rg + G * i
                al = s_al[r]
                kr = s_k[r] * rk
                qr = s_q[r] * rq
                for j in cutlass.range_constexpr(VEC):
                    sv = rS[j, i] * al
                    rS[j, i] = sv
                    pk[j] = pk[j] + kr * sv
                    pq[j] = pq[j] + qr * sv
            cute.copy(vec32, pk, s_red[None, cg, 0, rg])
            cute.copy(vec32, pq, s_red[None, cg, 1, rg])
            cute.arch.sync_threads()

            # 5. totals (fixed order), v', o, state update and store
            vn = cute.make_rmem_tensor((VEC,), Float32)
            o = cute.make_rmem_tensor((VEC,), Float32)
            tk = cute.make_rmem_tensor((VEC,), Float32)
            tq = cute.make_rmem_tensor((VEC,), Float32)
            tk.fill(0.0)
            tq.fill(0.0)
            for gi in cutlass.range_constexpr(G):
                cute.copy(vec32, s_red[None, cg, 0, gi], pk)
                cute.copy(vec32, s_red[None, cg, 1, gi], pq)
                for j in cutlass.range_constexpr(VEC):
                    tk[j] = tk[j] + pk[j]
                    tq[j] = tq[j] + pq[j]
            for j in cutlass.range_constexpr(VEC):
                vj = beta * (s_v[cg * VEC + j] - tk[j])
                vn[j] = vj
                o[j] = tq[j] + vj * kq
            for i in cutlass.range_constexpr(RPT):
                kr = s_k[rg + G * i] * rk
                for j in cutlass.range_constexpr(VEC):
                    rS[j, i] = rS[j, i] + kr * vn[j]
                cute.copy(vec32, rS[None, i], cute.local_tile(gS[rg + G * i, None], (VEC,), (cg,)))

            # 6. gated RMSNorm over the head (the TPR threads of a row group hold all D columns)
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(VEC):
                ss = ss + o[j] * o[j]
            ss = cute.arch.warp_reduction_sum(ss, threads_in_group=TPR)
            rstd = cute.math.rsqrt(ss / Float32(D) + eps)
            if rg == 0:
                for j in cutlass.range_constexpr(VEC):
                    y = o[j] * rstd * rW[j] * sigmoid(rG[j].to(Float32))
                    rY[j] = y.to(BFloat16)
                cute.copy(vec16, rY, gO)
