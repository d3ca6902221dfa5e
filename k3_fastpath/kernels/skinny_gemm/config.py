"""Launch knobs of the weight-streaming skinny GEMM and the heuristic that picks them.

Each threshold cites the H200 measurement behind it (STYLE.md rule 2): FMA_MAX_M the session-1 bench
(fma_alt_us rows), the rest the one-factor-at-a-time sweep (``k3-verify run --tier scripts/gpu/gemm-sweep.yaml``:
CUDA-graph medians, cold L2, each constant varied alone around the heuristic's pick). Where the sweep found a
config faster by more than 5% for a specific (N, K, M), ``tuned.py`` keeps it in ``tuned_h200.json`` and the
heuristic returns it; the rules below serve every other shape.
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
PDL_PREFETCH_BYTES = 16 << 20  # per GEMM, before griddepcontrol.wait (L2 is 60 MB). Unmeasured

# wgmma variant (kernel_wgmma.py): TMA + wgmma, swap-AB. select() sends M >= WGMMA_MIN_M to it by default
# (its wgmma_min_m moves the threshold or turns it off); from_heuristic (the fma / mma table) never picks it.
WGMMA_BUCKETS = (16, 32, 64)  # m_max = the wgmma N extent
WGMMA_BLOCK_K = 64  # bf16 per 128-byte swizzle row: one pipeline stage holds k_unroll of these along K
WGMMA_SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90
SMEM_PER_SM_H200 = 228 * 1024  # of which 1 KB per resident CTA is reserved by the driver
# Default range 4..64 (the 16-, 32- and 64-row buckets; M 4..16 share the 16-row bucket and cost what M = 16
# does). Measured on the H200: at M = 16 / 32 / 64 wgmma beats the mma variant at all 22 rank / k3-mini GEMM
# shapes (bundles/runs/2026-12-01-h200-session5/wgmma_bench.txt, `python -m k3_fastpath.kernels.skinny_gemm.bench
# --preset k3-tp16-rank --preset k3-mini --m 16,32,64 --wgmma`, cold L2, CUDA-graph medians; e.g. k3-mini lm_head
# 533 / 536 / 552 us vs 595 / 911 / 1304 us, cuBLAS 533 / 538 / 566 us). Below M = 9, whole k3-mini decode
# steps (bundles/runs/2026-12-01-h200-session6, scripts/gpu/decode-sweep-s6.yaml, step time of the variant
# vs the fma / mma default then, 1K / 128K context): wgmma for M 5..8 is 8.5 / 5.8% faster at batch 8; for
# M = 4 (wgmma from M = 1 at batch 4) 6.7 / 5.3% faster; at batch 2 a tie (+1.4 / +0.5%, within
# run-to-run spread); at batch 1 2.6 / 2.1% slower. So fma keeps M 1..3 (M = 3 unmeasured) and wgmma takes 4..64.
WGMMA_MIN_M = 4


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """y[M, N] = x[M, K] @ W[N, K]^T (+ residual[M, N]); W is streamed once, x is re-read from L1/L2.

    variant "fma": M <= m_max <= 8 rows; each warp owns ``rows_per_warp`` weight rows, lanes stride
      over K in 16-byte vectors, FP32 FMAs, butterfly-shuffle reduction.
    variant "mma": m_max in (8, 16, 32, 64); each warp owns ``rows_per_warp`` 16-row tiles and runs
      mma.sync m16n8k16 (BF16 in, FP32 accumulate) with the weights as the A operand (swap-AB),
      ``m_max / 8`` n-tiles of the batch.
    variant "wgmma" (kernel_wgmma.py): m_max in (16, 32, 64) is the wgmma N extent; ``warps_n`` / 4
      warpgroups each own ``rows_per_warp`` 64-row wgmma tiles (rows_per_cta = 16 * warps_n *
      rows_per_warp); W and x tiles arrive by TMA through a ``stages``-deep mbarrier pipeline, each stage
      ``k_unroll`` x 64 wide in K. ``split_k`` works as for mma. Never picked by ``from_heuristic``:
      ``wgmma_for`` builds one, ``select`` returns it for M >= its ``wgmma_min_m`` (default WGMMA_MIN_M).
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
    # spilling to raise occupancy. > 1 reads a device attribute at compile time (needs a GPU). Sweep: 2 won
    # nowhere by more than 1% (kda_o_proj M = 8: 11.0 -> 10.9 us): 1 kept.
    min_ctas_per_sm: int = 1
    # Programmatic dependent launch (the decode executor opts in; off = the kernel as it was): launched
    # with the PDL attribute, each CTA first pulls its share of up to PDL_PREFETCH_BYTES of W toward L2,
    # then waits (griddepcontrol.wait) for its predecessor before it reads x / residual, then lets its
    # successor launch. Weights are never written by a step, so reading them early cannot race.
    pdl: bool = False
    # wgmma only: TMA pipeline depth (K stages of W and x in flight per CTA); the other variants keep 4.
    stages: int = 4

    def __post_init__(self) -> None:
        if self.variant == "fma":
            if not 1 <= self.m_max <= 8:
                raise ValueError(f"fma variant needs 1 <= m_max <= 8, got {self.m_max}")
            if self.split_k != 1:
                raise ValueError("fma variant has no cross-CTA split-K")
        elif self.variant == "mma":
            if self.m_max not in MMA_BUCKETS:
                raise ValueError(f"mma variant needs m_max in {MMA_BUCKETS}, got {self.m_max}")
        elif self.variant == "wgmma":
            self._check_wgmma()
        else:
            raise ValueError(f"unknown variant {self.variant!r}")
        if self.variant != "wgmma" and self.stages != 4:
            raise ValueError(f"stages is a wgmma knob; {self.variant} keeps the default 4")
        if self.rows_per_warp < 1 or self.warps_n < 1 or self.warps_k < 1 or self.split_k < 1:
            raise ValueError("rows_per_warp, warps_n, warps_k, split_k must be >= 1")
        if self.threads > 1024:
            raise ValueError(f"{self.threads} threads per CTA > 1024")
        limit = WGMMA_SMEM_LIMIT if self.variant == "wgmma" else SMEM_LIMIT
        if self.smem_bytes > limit:
            raise ValueError(f"needs {self.smem_bytes} B of shared memory > {limit}")

    def _check_wgmma(self) -> None:
        if self.m_max not in WGMMA_BUCKETS:
            raise ValueError(f"wgmma variant needs m_max in {WGMMA_BUCKETS}, got {self.m_max}")
        if self.warps_n not in (4, 8) or self.warps_k != 1:
            raise ValueError("wgmma variant needs warps_n in (4, 8) (one or two warpgroups) and warps_k == 1")
        if self.rows_per_warp not in (1, 2):
            raise ValueError("wgmma variant needs rows_per_warp in (1, 2) (64-row wgmma tiles per warpgroup)")
        if self.k_unroll not in (1, 2, 4):
            raise ValueError("wgmma variant needs k_unroll in (1, 2, 4) (64-wide K blocks per stage)")
        if not 2 <= self.stages <= 12:
            raise ValueError(f"wgmma variant needs 2 <= stages <= 12, got {self.stages}")
        if self.m_max * (self.rows_per_cta + 4) * 4 > self.stages * self.stage_bytes:
            raise ValueError("wgmma epilogue tile does not fit the pipeline slots it reuses")

    # ---------------------------------------------------------------- derived
    @property
    def threads(self) -> int:
        return 32 * self.warps_n * self.warps_k

    @property
    def rows_per_cta(self) -> int:
        return self.warps_n * self.rows_per_warp * (1 if self.variant == "fma" else 16)

    @property
    def k_granule(self) -> int:
        """K must be a multiple of this (wgmma: 16-byte TMA row stride; the K tail is zero-filled)."""
        return MMA_K if self.variant == "mma" else VEC

    @property
    def block_k(self) -> int:
        """wgmma: K extent of one pipeline stage."""
        return WGMMA_BLOCK_K * self.k_unroll

    @property
    def acc_per_thread(self) -> int:
        """FP32 accumulators per thread (mma: tiles x n-tiles x 4; wgmma: the CTA tile over its threads;
        fma: rows x m_max)."""
        if self.variant == "mma":
            return self.rows_per_warp * (self.m_max // 8) * 4
        if self.variant == "wgmma":
            return self.rows_per_cta * self.m_max // self.threads
        return self.rows_per_warp * self.m_max

    @property
    def stage_bytes(self) -> int:
        """wgmma: bytes one pipeline stage brings in (the W tile and the x tile)."""
        return (self.rows_per_cta + self.m_max) * self.block_k * 2

    @property
    def smem_bytes(self) -> int:
        if self.variant == "wgmma":  # pipeline slots (1 KB aligned; the epilogue tile reuses them), mbarriers
            return self.stages * self.stage_bytes + 1024 + 256
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

    def ctas_per_sm(self) -> int:
        """wgmma: CTAs that fit one SM by shared memory (the register file never limits it first)."""
        return max(1, SMEM_PER_SM_H200 // (self.smem_bytes + 1024))

    # ---------------------------------------------------------------- wgmma (opt-in)
    @classmethod
    def wgmma_for(cls, M: int, N: int, K: int, *, out_fp32: bool = False, residual: bool = False,
                  num_sms: int = NUM_SMS_H200) -> SkinnyGemmConfig:
        """A wgmma config for one (M, N, K) (measured against mma and cuBLAS: ``bench --wgmma``; the constants
        below are the first guesses, not yet swept one at a time):
        - 64 weight rows per CTA (one warpgroup); 128 (two warpgroups, x read half as often from L2) once
          64-row CTAs would not fit one wave at 2 CTAs per SM (N > 64 * 2 * num_sms, e.g. lm_head);
        - 64-wide K stages, as many as fit 2 CTAs per SM (at most 8): 6 stages at m_max = 64, i.e.
          ~48 KB of W in flight per CTA, ~96 KB per SM (Little's law at ~4.4 TB/s over 132 SMs and
          ~1.5 us loaded latency asks for >= 50 KB);
        - split-K as the mma heuristic does: double it until the grid covers the SMs, keeping >= 4 K
          stages per split."""
        if not 1 <= M <= MAX_M:
            raise ValueError(f"M = {M} outside 1..{MAX_M}")
        if K % VEC or N % VEC:
            raise ValueError(f"wgmma needs K and N multiples of {VEC}, got N={N}, K={K}")
        m_max = next(b for b in WGMMA_BUCKETS if b >= M)
        warps_n = 8 if -(-N // 64) > 2 * num_sms else 4
        stage = (16 * warps_n + m_max) * WGMMA_BLOCK_K * 2
        stages = max(3, min(8, (SMEM_PER_SM_H200 // 2 - 1024 - 1280) // stage))
        blocks = -(-N // (16 * warps_n))
        k_stages = -(-K // WGMMA_BLOCK_K)
        split = 1
        while blocks * split < num_sms and split < 16 and k_stages // (2 * split) >= 4:
            split *= 2
        return cls("wgmma", m_max=m_max, rows_per_warp=1, warps_n=warps_n, warps_k=1, split_k=split,
                   k_unroll=1, stages=stages, out_fp32=out_fp32, residual=residual)

    @classmethod
    def select(cls, M: int, N: int, K: int, *, out_fp32: bool = False, residual: bool = False,
               num_sms: int = NUM_SMS_H200, wgmma_min_m: int = WGMMA_MIN_M) -> SkinnyGemmConfig:
        """The config ``api.skinny_gemm`` launches: the wgmma variant for M in ``wgmma_min_m``..64 (0: never;
        ``DecodeOptions.gemm_wgmma_min_m`` in a decode step), ``from_heuristic`` below it."""
        lo = wgmma_threshold(wgmma_min_m)
        if lo is not None and lo <= M <= MAX_M and K % VEC == 0:
            return cls.wgmma_for(M, N, K, out_fp32=out_fp32, residual=residual, num_sms=num_sms)
        return cls.from_heuristic(M, N, K, out_fp32=out_fp32, residual=residual, num_sms=num_sms)

    # ---------------------------------------------------------------- heuristic
    @classmethod
    def from_heuristic(cls, M: int, N: int, K: int, arch: str = "sm_90a", *, out_fp32: bool = False,
                       residual: bool = False, num_sms: int = NUM_SMS_H200) -> SkinnyGemmConfig:
        """Pick a config for one (M, N, K): the measured winner from ``tuned.py``'s H200 table where the
        sweep covered this (N, K, M bucket), else the rules below. Each rule's constant cites the sweep
        bundle bundles/runs/2026-11-30-h200-session2/20261130T171914Z-h200-gemm-sweep (one factor at a time around this
        heuristic on kda_in_proj, kda_o_proj, mla_q_b, mla_kv_b, latent_down at M = 1..64)."""
        if not 1 <= M <= MAX_M:
            raise ValueError(f"M = {M} outside 1..{MAX_M}")
        from .tuned import lookup

        bucket = M if M <= FMA_MAX_M else next((b for b in MMA_BUCKETS if b >= M), M)
        tuned = lookup(N, K, bucket)
        if tuned is not None and tuned["variant"] == ("fma" if M <= FMA_MAX_M else "mma") and not K % (
                VEC if tuned["variant"] == "fma" else MMA_K):
            return cls(**tuned, out_fp32=out_fp32, residual=residual)
        if M <= FMA_MAX_M or K % MMA_K:
            if M > 8 or K % VEC:
                raise ValueError(f"no variant for M={M}, K={K} (fma needs M <= 8, K % 8 == 0)")
            # 2 rows per warp x 4 warps; 1 row per warp when that leaves SMs idle. Sweep: 1 row per warp won
            # by ~5% only on mla_q_b 2304x1536 (M = 1..3; in the table), lost or tied elsewhere: kept.
            rows = 2 if -(-N // 8) >= num_sms else 1
            return cls("fma", m_max=M, rows_per_warp=rows, warps_n=4, warps_k=1, k_unroll=4,
                       out_fp32=out_fp32, residual=residual)
        m_max = next(b for b in MMA_BUCKETS if b >= M)
        # One 16-row tile per warp at every M. Sweep: the former 2 tiles at M > 16 lost at M = 32 on 3 of 4
        # shapes (mla_q_b 18.3 -> 11.1 us, mla_kv_b 9.1 -> 7.0, kda_in_proj 45.2 -> 43.1 with 1 tile) and at
        # M = 64 on kda_in_proj (73.0 -> 69.7) and mla_kv_b (14.9 -> 13.6): more CTAs beat x reuse.
        mt = 1
        # 4 warps (64 rows) per CTA share x through L1. Sweep: 8 warps won by < 5% (mla_q_b and
        # latent_down at M = 16), 2 warps never: kept.
        warps_n = 4
        blocks = -(-N // (16 * mt * warps_n))
        chunks = K // MMA_K
        split = 1
        # Split K across CTAs until the grid covers the SMs, keeping >= 4 chunks per split. Sweep: a
        # different split won on kda_o_proj at M = 32/64 (2: 6-8%) and mla_q_b at M = 64 (4: 37%); those
        # points are in the table; no single rule change won on every shape: kept.
        while blocks * split < num_sms and split < 16 and chunks // (2 * split) >= 4:
            split *= 2
        return cls("mma", m_max=m_max, rows_per_warp=mt, warps_n=warps_n, warps_k=1, split_k=split,
                   k_unroll=4 if m_max <= 32 else 2, out_fp32=out_fp32, residual=residual)


def wgmma_threshold(min_m: int) -> int | None:
    """The smallest M ``select`` sends to the wgmma variant for the option value ``min_m`` (0: never, None;
    1: every M, the rows of M <= 16 past M being TMA zero-fill; 2..64: M >= it); anything else raises."""
    if isinstance(min_m, bool) or not isinstance(min_m, int) or not 0 <= min_m <= MAX_M:
        raise ValueError(f"wgmma_min_m={min_m!r}: expected 0 (never) or an M threshold in 1..{MAX_M}")
    return min_m or None


def m_buckets(wgmma_min_m: int = WGMMA_MIN_M) -> tuple[int, ...]:
    """Representative M per compiled variant: every config ``select(..., wgmma_min_m=)`` can return for M in
    1..64 (the wgmma buckets replace the mma buckets they cover)."""
    base = tuple(range(1, FMA_MAX_M + 1)) + MMA_BUCKETS
    lo = wgmma_threshold(wgmma_min_m)
    if lo is None:
        return base
    keep = {m for m in base if m < lo} | {lo} | {b for b in WGMMA_BUCKETS if b >= lo}
    for prev, b in zip((FMA_MAX_M,) + MMA_BUCKETS[:-1], MMA_BUCKETS, strict=True):
        if prev + 1 < lo <= b:  # the mma bucket cut by lo still serves M in (prev, lo)
            keep.add(lo - 1)
    return tuple(sorted(keep))
