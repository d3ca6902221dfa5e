"""Inline-PTX building blocks of the tensor-core kernels (mla_decode, moe_experts): cp.async with zero
fill, ldmatrix (plain and transposed), mma.sync m16n8k16 BF16 -> FP32, raw shared-memory vector access
and the e4m3 -> scaled BF16 conversion. Shared-memory operands are 32-bit shared-window addresses
(``ptr.toint()`` of a shared pointer), global ones 64-bit generic addresses, so every offset is computed
by the caller in the width it needs (64-bit for anything that can pass 2^31 bytes)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

_MMA_BF16 = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
             "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};")


@cute.jit
def cp_async_16(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32):
    """16-byte global -> shared copy (L2 only, .cg); bytes past ``src_bytes`` (0 or 16) are zero-filled."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
                         read_only_args=[smem_addr, gmem_addr, src_bytes])


@cute.jit
def ldmatrix_x4(smem_addr: Int32):
    """Four 8x8 b16 matrices; lanes 8j..8j+7 give the row addresses of matrix j. Returns 4 x b32."""
    return cute.arch.inline_ptx("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Uint32] * 4, read_only_args=[smem_addr])


@cute.jit
def ldmatrix_x4_trans(smem_addr: Int32):
    """ldmatrix_x4 with each 8x8 matrix transposed (a thread gets a column pair instead of a row pair)."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4, read_only_args=[smem_addr])


@cute.jit
def ldmatrix_x2(smem_addr: Int32):
    """Two 8x8 b16 matrices (lanes 0..15 give the row addresses). Returns 2 x b32."""
    return cute.arch.inline_ptx("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {{$w0}, {$w1}}, [{$r0}];",
                                write_only_types=[Uint32] * 2, read_only_args=[smem_addr])


@cute.jit
def mma_bf16(acc: cute.Tensor, a0, a1, a2, a3, b0, b1):
    """acc[0..3] += A (16x16, row) * B (16x8, col) with the m16n8k16 fragment layouts, in place."""
    d = cute.arch.inline_ptx(_MMA_BF16, write_only_types=[Float32] * 4,
                             read_only_args=[a0, a1, a2, a3, b0, b1, acc[0], acc[1], acc[2], acc[3]])
    for e in cutlass.range_constexpr(4):
        acc[e] = d[e]


@cute.jit
def lds_128(smem_addr: Int32):
    return cute.arch.inline_ptx("ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Uint32] * 4, read_only_args=[smem_addr])


@cute.jit
def sts_128(smem_addr: Int32, v0, v1, v2, v3):
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[smem_addr, v0, v1, v2, v3])


_E4M3X4_TO_BF16 = """{
.reg .b16 lo, hi, f0, f1, f2, f3;
.reg .b32 h01, h23;
.reg .f32 x0, x1, x2, x3;
mov.b32 {lo, hi}, {$r0};
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 x0, f0;
cvt.f32.f16 x1, f1;
cvt.f32.f16 x2, f2;
cvt.f32.f16 x3, f3;
mul.rn.f32 x0, x0, {$r1};
mul.rn.f32 x1, x1, {$r1};
mul.rn.f32 x2, x2, {$r1};
mul.rn.f32 x3, x3, {$r1};
cvt.rn.bf16x2.f32 {$w0}, x1, x0;
cvt.rn.bf16x2.f32 {$w1}, x3, x2;
}"""


@cute.jit
def e4m3x4_to_bf16(packed: Uint32, scale: Float32):
    """Four e4m3 bytes (byte 0 = element 0) -> bf16(e4m3 * scale), two b32 of bf16 pairs (element 0 in the
    low half). Exactly ``(fp8.float() * scale).to(bfloat16)``: e4m3 -> f16 is exact, one FP32 multiply,
    one round to nearest even."""
    return cute.arch.inline_ptx(_E4M3X4_TO_BF16, write_only_types=[Uint32, Uint32], read_only_args=[packed, scale])
