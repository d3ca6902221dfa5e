"""KDA (Kimi Delta Attention) decode / verify step for a batch of sequences (CuTe DSL, sm_90a).

One launch per KDA layer per step; grid = (B, H): one CTA per (sequence b, head h), with
``threads = (D/4) * G`` threads (config.py; D = 128: 256 threads, G = 8 row groups of 16 rows). Each
sequence has ``T = config.tokens`` rows (row ``b*T + t`` of q, k, v, g, a, beta_logits and y): T = 1 is
the decode step, T > 1 a speculative verify step. Sequence b's caches are read at pool index
``slot[b]``; the state and conv window after its token t are stored at ``slot_out[b*T + t]`` (0: not
stored; the decode step passes ``slot_out = slot``, an in-place update). Slot 0 is the empty slot.

Algorithm of one CTA (b, h), slot s = slot[b]:
0. s <= 0: write y = 0 for the T rows of head h, touch no cache, return (the whole CTA takes this branch;
   vLLM pads with -1).
1. Issue the loads of the CTA's D x D FP32 state S = state[s, h] first (row-major [K, V]): thread t owns
   columns 4*(t % (D/4)) .. +3 of rows ``t // (D/4) + i*G`` (i < D/G), one 16-byte load per row, so the
   whole 64 KB are in flight while step 2 runs. Offsets into the pools are 64-bit (large slot indices).
   Each channel task (step 2) loads its conv windows (conv_state[s, 0..2, c]) into registers.
Then per token t (rows in order, S and the conv windows staying in registers; o = slot_out[b*T + t]):
2. Per-channel work, 2*D tasks spread over the threads: task j < D does channel c = h*D + j of q and of
   k: short conv over (window, x[row, c]) with the FP32 weights, SiLU, result (not yet normalised) to
   shared memory, and shifts the window (w0 <- w1, w1 <- w2, w2 <- x: BF16 values copied, so bit-exact),
   stored to conv_state[o, 0..2, c] when o != 0. Task D + j does channel c of v (conv + SiLU + window)
   and the decay alpha_j = exp(lower_bound * sigmoid(exp(A_log[h]) * (a[row, c] + dt_bias[c]))). Every
   conv channel of (s, h) is read and written by exactly one thread of one CTA, reads before writes:
   race-free as long as the non-zero slots (and slot_out entries) of a launch are distinct across
   sequences.
3. __syncthreads. Every warp reads q and k from shared memory and butterfly-reduces sum q^2, sum k^2
   and q.k (no second barrier): rq = rsqrt(sum q^2 + 1e-6) * D^-0.5, rk = rsqrt(sum k^2 + 1e-6);
   (q.k) of the normalised vectors = q.k * rq * rk. beta = sigmoid(beta_logits[b, h]).
4. Each thread, per owned row r: S_r <- alpha_r * S_r (kept in registers) and accumulates
   pk += k_r S_r, pq += q_r S_r for its 4 columns. Because S_new = alpha S + k v'^T,
   o = S_new^T q = (alpha S)^T q + v' (k.q): both products need only the decayed S, one reduction pass.
5. Partial sums of the G row groups through shared memory (one barrier); each thread adds the G
   partials of its 4 columns in a fixed order (deterministic): Sk, Sq.
   v' = beta (v - Sk); o = Sq + v' (k.q); S_r += k_r v' and, when o != 0, 16-byte stores to state[o, h].
6. RMSNorm over the head: the D/4 threads of a row group hold all D values of o; butterfly sum of o^2
   within that group (D = 128: the whole warp); y = o * rsqrt(mean(o^2) + eps) * o_norm_w * sigmoid(g)
   rounded to BF16; row group 0 stores y[row, h*D + cols] (8-byte stores). A barrier closes the token
   (the next token's step 2 overwrites the shared vectors step 5 reads). A T-token launch is T decode
   steps' arithmetic: the state stays FP32 and the windows hold the BF16 inputs, as the pools would; the
   two builds contract the state update differently, so states agree to FP32 rounding (GPU test).

Parameters first: before step 0 every thread loads the parameters it will need (the FP32 conv weights of
its channel tasks, dt_bias of its decay channel, A_log[h], and for row group 0 its o_norm_w vector) into
registers. A step never writes them, so with ``config.pdl`` (programmatic dependent launch) these loads are
issued before ``griddepcontrol.wait``; ``slot``, the projections, the conv and recurrent state (written by
the previous step's launch of this kernel) and the output gate are read only after it, and every global
write comes after it. ``launch_dependents`` follows once the first token's input loads (step 2) are issued,
or at once for an empty slot (a dependent's ``griddepcontrol.wait`` still waits for this whole grid).

vLLM's layout (``config.vllm_layout``, decode steps): the caches are vLLM's own KDA cache tensors, read and
written in place: one packed conv pool [N, W-1, 3C] (q | k | v channels; the kernel takes it as all three
conv operands and offsets the k and v channels by C and 2C) and the state [N, H, V, K] (row-major [V, K]:
the owned rows are V rows, ``update_vk`` replaces steps 4-5 with per-row butterflies over the row group's
lanes, and o reaches step 6 through shared memory). Same loads and stores (16-byte state vectors, whole
rows per warp), same barriers.

Constraints: D in (32, 64, 128); W = 4; q, k, v, g, a [B, C] BF16, beta_logits [B, H] BF16, conv weights
[C, 4] / A_log [H] / dt_bias [C] / o_norm_w [D] FP32; conv pools [N, 3, C] BF16; state pool [N, H, D, D]
FP32; slot [B], slot_out [B*T] int32 in [0, N); every tensor contiguous, 16-byte aligned.
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
        self.tokens = config.tokens
        self.T = config.threads
        self.TPR = config.threads_per_row  # threads sharing one row (a 4-column vector each)
        self.G = config.row_groups
        self.RPT = config.rows_per_thread
        self.task_iters = -(-2 * D // self.T)
        self.task_pred = self.task_iters * self.T != 2 * D
        self.L2_PER_LANE = D // 32
        self.vk = config.vllm_layout  # state [V, K] per head; conv one packed [N, W-1, 3C] tensor (q|k|v)
        self.off_k, self.off_v = (self.C, 2 * self.C) if self.vk else (0, 0)  # channel offsets in the conv pools

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mA: cute.Tensor,
                 mBeta: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWv: cute.Tensor, mAlog: cute.Tensor,
                 mDt: cute.Tensor, mNw: cute.Tensor, mSlot: cute.Tensor, mSlotOut: cute.Tensor, mCq: cute.Tensor,
                 mCk: cute.Tensor, mCv: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, eps: Float32,
                 lower_bound: Float32, conv_stride: Int64, state_stride: Int64, stream: cuda.CUstream):
        self.kernel(mQ, mK, mV, mG, mA, mBeta, mWq, mWk, mWv, mAlog, mDt, mNw, mSlot, mSlotOut, mCq, mCk, mCv,
                    mS, mO, eps, lower_bound, conv_stride, state_stride).launch(grid=[mSlot.shape[0], self.H, 1], block=[self.T, 1, 1],
                                                     stream=stream, min_blocks_per_mp=1, use_pdl=self.cfg.pdl)

    @cute.jit
    def rows(self, m: cute.Tensor, stride: Int64, divby: int) -> cute.Tensor:
        """``m`` (compact, passed for its base pointer) re-laid with ``stride`` elements between slot indices
        (a multiple of ``divby``: the 16-byte state vectors stay aligned), the inner modes compact."""
        inner = m.shape[1:]
        inner_stride = []
        acc = 1
        for n in reversed(inner):
            inner_stride.insert(0, acc)
            acc = acc * n
        return cute.make_tensor(m.iterator, cute.make_layout((m.shape[0], *inner),
                                                             stride=(cute.assume(stride, divby=divby), *inner_stride)))

    @cute.jit
    def load_window(self, mConv: cute.Tensor, slot, c, win: cute.Tensor):
        """The channel's conv window conv[slot, 0..2, c] (oldest first) into registers ``win``."""
        for j in cutlass.range_constexpr(CONV_W - 1):
            win[j] = mConv[slot, j, c]

    @cute.jit
    def conv_channel(self, mX: cute.Tensor, rw: cute.Tensor, win: cute.Tensor, mConv: cute.Tensor, row, out, c,
                     cc):
        """silu(sum_j w[c, j] * in_j) over in = (window, x[row, c]) with the channel's weights ``rw``
        (registers, loaded up front); shifts the window and stores it at conv[out, 0..2, cc] (out != 0; ``cc``
        the channel's column in its conv pool: c, or c offset into the packed q|k|v pool)."""
        x = mX[row, c]
        acc = rw[0] * win[0].to(Float32)
        acc = acc + rw[1] * win[1].to(Float32)
        acc = acc + rw[2] * win[2].to(Float32)
        acc = acc + rw[3] * x.to(Float32)
        win[0] = win[1]
        win[1] = win[2]
        win[2] = x
        if out != 0:
            for j in cutlass.range_constexpr(CONV_W - 1):
                mConv[out, j, cc] = win[j]
        return acc * sigmoid(acc)

    @cute.jit
    def update_vk(self, rS: cute.Tensor, s_k: cute.Tensor, s_q: cute.Tensor, s_v: cute.Tensor, s_al: cute.Tensor,
                  s_o: cute.Tensor, o: cute.Tensor, rk, rq, kq, beta, cg, rg, mS: cute.Tensor, out64, h):
        """Steps 4-5 on a [V, K] state (vLLM's layout): the owned rows are V rows, the 4 columns K columns.
        Per row v: decay by alpha of the 4 columns, (S^T k)[v] and (S^T q)[v] summed over the row group's
        threads (a butterfly over TPR lanes, no shared memory), v'[v], the rank-1 update; o[v] goes to
        shared memory by V row, and after one barrier each thread reads o of its 4 columns for step 6."""
        G, RPT, TPR = self.G, self.RPT, self.TPR
        vec32 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        kc = cute.make_rmem_tensor((VEC,), Float32)
        qc = cute.make_rmem_tensor((VEC,), Float32)
        ac = cute.make_rmem_tensor((VEC,), Float32)
        for j in cutlass.range_constexpr(VEC):
            kc[j] = s_k[cg * VEC + j] * rk
            qc[j] = s_q[cg * VEC + j] * rq
            ac[j] = s_al[cg * VEC + j]
        for i in cutlass.range_constexpr(RPT):
            pk = Float32(0.0)
            pq = Float32(0.0)
            for j in cutlass.range_constexpr(VEC):
                sv = rS[j, i] * ac[j]
                rS[j, i] = sv
                pk = pk + kc[j] * sv
                pq = pq + qc[j] * sv
            pk = cute.arch.warp_reduction_sum(pk, threads_in_group=TPR)
            pq = cute.arch.warp_reduction_sum(pq, threads_in_group=TPR)
            r = rg + G * i
            vr = beta * (s_v[r] - pk)
            for j in cutlass.range_constexpr(VEC):
                rS[j, i] = rS[j, i] + kc[j] * vr
            if cg == 0:
                s_o[r] = pq + vr * kq
        if out64 != 0:
            for i in cutlass.range_constexpr(RPT):
                cute.copy(vec32, rS[None, i], cute.local_tile(mS[out64, h, rg + G * i, None], (VEC,), (cg,)))
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(VEC):
            o[j] = s_o[cg * VEC + j]

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mA: cute.Tensor,
               mBeta: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWv: cute.Tensor, mAlog: cute.Tensor,
               mDt: cute.Tensor, mNw: cute.Tensor, mSlot: cute.Tensor, mSlotOut: cute.Tensor, mCq: cute.Tensor,
               mCk: cute.Tensor, mCv: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, eps: Float32,
               lower_bound: Float32, conv_stride: Int64, state_stride: Int64):
        D, G, RPT, TPR, NT = self.D, self.G, self.RPT, self.TPR, self.tokens
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
        s_o = smem.allocate_tensor(Float32, cute.make_layout((D,)), byte_alignment=16)  # o by V row (VK layout)

        vec32 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        vec16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=64)
        hD = h * D
        rY = cute.make_rmem_tensor((VEC,), BFloat16)
        order = PdlOrder(self.cfg.pdl)
        mWq, mWk, mWv, mAlog, mDt, mNw = (order.weight(t) for t in (mWq, mWk, mWv, mAlog, mDt, mNw))
        # the pools as indexed: slot index -> ``*_stride`` elements (vLLM's pages may be padded), the rest compact (address
        # arithmetic: nothing read before the wait)
        mCq, mCk, mCv = (self.rows(m, conv_stride, 1) for m in (mCq, mCk, mCv))
        mS = self.rows(mS, state_stride, VEC)
        mQ, mK, mV, mG, mA, mBeta, mSlot, mSlotOut, mCq, mCk, mCv, mS, mO = order.after_wait(
            mQ, mK, mV, mG, mA, mBeta, mSlot, mSlotOut, mCq, mCk, mCv, mS, mO)

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

        slot = mSlot[b]
        if slot <= 0:
            # 0. empty slot: output zeros, no cache touched
            order.launch_dependents()
            if rg == 0:
                rY.fill(0.0)
                for t in cutlass.range_constexpr(NT):
                    cute.copy(vec16, rY, cute.local_tile(mO[b * NT + t, None], (VEC,), (h * TPR + cg,)))
        else:
            slot64 = Int64(slot)
            # 1. state loads first: (4 columns, RPT rows) per thread; then the conv windows of the tasks
            rS = cute.make_rmem_tensor((VEC, RPT), Float32)
            for i in cutlass.range_constexpr(RPT):
                cute.copy(vec32, cute.local_tile(mS[slot64, h, rg + G * i, None], (VEC,), (cg,)), rS[None, i])
            wina = []  # q (task < D) or v (task >= D) windows
            winb = []  # k windows
            for it in cutlass.range_constexpr(self.task_iters):
                task = tidx + it * self.T
                win_a = cute.make_rmem_tensor((CONV_W - 1,), BFloat16)
                win_b = cute.make_rmem_tensor((CONV_W - 1,), BFloat16)
                if task < 2 * D:
                    if task < D:
                        self.load_window(mCq, slot64, hD + task, win_a)
                        self.load_window(mCk, slot64, self.off_k + hD + task, win_b)
                    else:
                        self.load_window(mCv, slot64, self.off_v + hD + task - D, win_a)
                wina.append(win_a)
                winb.append(win_b)

            for t in cutlass.range_constexpr(NT):
                row = b * NT + t
                out64 = Int64(mSlotOut[row])
                rG = cute.make_rmem_tensor((VEC,), BFloat16)  # the output gate, for step 6
                if rg == 0:
                    cute.copy(vec16, cute.local_tile(mG[row, None], (VEC,), (h * TPR + cg,)), rG)

                # 2. per-channel conv / gate tasks
                for it in cutlass.range_constexpr(self.task_iters):
                    task = tidx + it * self.T
                    if task < 2 * D:
                        if task < D:
                            c = hD + task
                            s_q[task] = self.conv_channel(mQ, rwa[it], wina[it], mCq, row, out64, c, c)
                            s_k[task] = self.conv_channel(mK, rwb[it], winb[it], mCk, row, out64, c,
                                                          self.off_k + c)
                        else:
                            j = task - D
                            c = hD + j
                            s_v[j] = self.conv_channel(mV, rwa[it], wina[it], mCv, row, out64, c,
                                                       self.off_v + c)
                            rate = cute.math.exp(a_log)
                            glog = lower_bound * sigmoid(rate * (mA[row, c].to(Float32) + rdt[it]))
                            s_al[j] = cute.math.exp(glog)
                beta = sigmoid(mBeta[row, h].to(Float32))
                if t == 0:
                    order.launch_dependents()  # the first token's input loads are issued
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

                o = cute.make_rmem_tensor((VEC,), Float32)  # o of the 4 columns of step 6
                if cutlass.const_expr(self.vk):
                    self.update_vk(rS, s_k, s_q, s_v, s_al, s_o, o, rk, rq, kq, beta, cg, rg, mS, out64, h)
                else:
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
                    if out64 != 0:
                        for i in cutlass.range_constexpr(RPT):
                            cute.copy(vec32, rS[None, i],
                                      cute.local_tile(mS[out64, h, rg + G * i, None], (VEC,), (cg,)))

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
                    cute.copy(vec16, rY, cute.local_tile(mO[row, None], (VEC,), (h * TPR + cg,)))
                if t + 1 < NT:
                    cute.arch.sync_threads()  # step 5 read s_k / s_v / s_red: the next token rewrites them
