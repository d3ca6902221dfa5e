"""Launch knobs of the weight-streaming skinny GEMM and the heuristic that picks them.

Every threshold below is a placeholder until measured on an H200. The bench that measures them
(CUDA-graph medians, cold L2, every rank_shapes() GEMM of TP8/TP16, M = 1..64, each candidate config
against cuBLAS) is:

    python -m k3_fastpath.kernels.skinny_gemm.bench --preset k3-tp8-rank --preset k3-tp16-rank --sweep

Replace each "TO BE MEASURED" with the measurement that justifies it (STYLE.md rule 2).
"""

from __future__ import annotations

from dataclasses import dataclass

VEC = 8  # bf16 per 16-byte load
MMA_K = 32  # K consumed per mma step: two m16n8k16 halves fed from one 16-byte load per row
MMA_BUCKETS = (8, 16, 32, 64)  # compile-time M bounds of the mma variant (one n8 tile per 8 rows)
MAX_M = 64
SMEM_LIMIT = 48 * 1024  # static shared memory per CTA without opt-in

# M at which the mma variant overtakes the FMA variant. H200, cold L2, CUDA-graph medians over the 21 distinct
# TP8/TP16 rank shapes (bundles/runs/2026-11-30-h200-kernels, bench.kernels rows "fma_alt_us"): at M=4 the FMA
# variant beat the mma pick on 17 of 21 shapes (median mma/fma time 1.12; dense_gate_up 8448x7168: 37.4 vs
# 49.3 us), at M=8 on 5 of 21 (median 0.81). So FMA up to M=4, mma above.
FMA_MAX_M = 4
NUM_SMS_H200 = 132


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """y[M, N] = x[M, K] @ W[N, K]^T (+ residual[M, N]); W is streamed once, x is re-read from L1/L2.

    variant "fma": M <= m_max <= 8 rows; each warp owns ``rows_per_warp`` weight rows, lanes stride
      over K in 16-byte vectors, FP32 FMAs, butterfly-shuffle reduction.
    variant "mma": m_max in (8, 16, 32, 64); each warp owns ``rows_per_warp`` 16-row tiles and runs
      mma.sync m16n8k16 (BF16 in, FP32 accumulate) with the weights as the A operand (swap-AB),
      ``m_max / 8`` n-tiles of the batch.
    A CTA has ``warps_n`` x ``warps_k`` warps: warps_n split the CTA's rows, warps_k split K (reduced
    through shared memory). ``split_k`` CTAs split K further (mma only); each writes FP32 partials to a
    workspace and the last CTA to arrive sums them in split order (deterministic) and runs the epilogue.
    """

    variant: str
    m_max: int
    rows_per_warp: int
    warps_n: int
    warps_k: int = 1
    split_k: int = 1
    k_unroll: int = 4
    out_fp32: bool = False
    residual: bool = False
    # PTX .minnctapersm: 1 lets ptxas use the registers it needs (more loads in flight) instead of
    # spilling to raise occupancy. > 1 reads a device attribute at compile time (needs a GPU). TO BE MEASURED
    min_ctas_per_sm: int = 1

    def __post_init__(self) -> None:
        if self.variant == "fma":
            if not 1 <= self.m_max <= 8:
                raise ValueError(f"fma variant needs 1 <= m_max <= 8, got {self.m_max}")
            if self.split_k != 1:
                raise ValueError("fma variant has no cross-CTA split-K")
        elif self.variant == "mma":
            if self.m_max not in MMA_BUCKETS:
                raise ValueError(f"mma variant needs m_max in {MMA_BUCKETS}, got {self.m_max}")
        else:
            raise ValueError(f"unknown variant {self.variant!r}")
        if self.rows_per_warp < 1 or self.warps_n < 1 or self.warps_k < 1 or self.split_k < 1:
            raise ValueError("rows_per_warp, warps_n, warps_k, split_k must be >= 1")
        if self.threads > 1024:
            raise ValueError(f"{self.threads} threads per CTA > 1024")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"needs {self.smem_bytes} B of shared memory > {SMEM_LIMIT}")

    # ---------------------------------------------------------------- derived
    @property
    def threads(self) -> int:
        return 32 * self.warps_n * self.warps_k

    @property
    def rows_per_cta(self) -> int:
        return self.warps_n * self.rows_per_warp * (16 if self.variant == "mma" else 1)

    @property
    def k_granule(self) -> int:
        """K must be a multiple of this."""
        return MMA_K if self.variant == "mma" else VEC

    @property
    def acc_per_thread(self) -> int:
        """FP32 accumulators per thread (mma: tiles x n-tiles x 4; fma: rows x m_max)."""
        if self.variant == "mma":
            return self.rows_per_warp * (self.m_max // 8) * 4
        return self.rows_per_warp * self.m_max

    @property
    def smem_bytes(self) -> int:
        if self.variant == "mma":
            red = self.acc_per_thread * 32 * self.warps_n * self.warps_k * 4 if self.warps_k > 1 else 0
            staging = self.m_max * (self.rows_per_cta + 4) * 4  # epilogue tile, padded rows
            return red + staging + 32
        return self.acc_per_thread * self.warps_n * self.warps_k * 4 + 16

    def num_blocks(self, N: int) -> int:
        return -(-N // self.rows_per_cta)

    def workspace_floats(self, N: int) -> int:
        """FP32 workspace for split-K partials ([split_k, blocks, 32 * warps_n, acc_per_thread])."""
        if self.split_k == 1:
            return 0
        return self.split_k * self.num_blocks(N) * self.acc_per_thread * 32 * self.warps_n

    # ---------------------------------------------------------------- heuristic
    @classmethod
    def from_heuristic(cls, M: int, N: int, K: int, arch: str = "sm_90a", *, out_fp32: bool = False,
                       residual: bool = False, num_sms: int = NUM_SMS_H200) -> SkinnyGemmConfig:
        """Pick a config for one (M, N, K). Every constant here is TO BE MEASURED (see module doc)."""
        if not 1 <= M <= MAX_M:
            raise ValueError(f"M = {M} outside 1..{MAX_M}")
        if M <= FMA_MAX_M or K % MMA_K:
            if M > 8 or K % VEC:
                raise ValueError(f"no variant for M={M}, K={K} (fma needs M <= 8, K % 8 == 0)")
            # 2 rows per warp x 4 warps; 1 row per warp when that leaves SMs idle. TO BE MEASURED
            rows = 2 if -(-N // 8) >= num_sms else 1
            return cls("fma", m_max=M, rows_per_warp=rows, warps_n=4, warps_k=1, k_unroll=4,
                       out_fp32=out_fp32, residual=residual)
        m_max = next(b for b in MMA_BUCKETS if b >= M)
        mt = 1 if m_max <= 16 else 2  # 16-row tiles per warp: x reuse vs registers. TO BE MEASURED
        warps_n = 4  # 64 or 128 rows per CTA: 4 warps share x through L1. TO BE MEASURED
        blocks = -(-N // (16 * mt * warps_n))
        chunks = K // MMA_K
        split = 1
        # Split K across CTAs until the grid covers the SMs, keeping >= 4 chunks per split. TO BE MEASURED
        while blocks * split < num_sms and split < 16 and chunks // (2 * split) >= 4:
            split *= 2
        return cls("mma", m_max=m_max, rows_per_warp=mt, warps_n=warps_n, warps_k=1, split_k=split,
                   k_unroll=4 if m_max <= 32 else 2, out_fp32=out_fp32, residual=residual)


def m_buckets() -> tuple[int, ...]:
    """Representative M per compiled variant: every config from_heuristic can return for M in 1..64."""
    return tuple(range(1, FMA_MAX_M + 1)) + MMA_BUCKETS
