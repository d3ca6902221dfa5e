"""Launch knobs of the routed-expert kernels (plan, grouped expert GEMMs, weighted combine).

Constants marked unmeasured are choices nobody has timed yet; this times them:

    python -m k3_fastpath.kernels.moe_experts.bench --batch 1,8,64 --routing router,uniform --sweep
"""

from __future__ import annotations

from dataclasses import dataclass

GP = 64  # K per pipeline step: two MX groups of 32 (one 16-byte load of repacked MXFP4 per lane and matrix)
MX_GROUP = 32
MAX_TOKENS = 64  # decode batch the kernels serve
MAX_PAIRS = 1024  # tokens x top-k (64 x 16)
NUM_SMS_H200 = 132
CTAS_PER_SM = 4  # persistent grid: SMs x this many CTAs loop over (expert, row block) work items. Unmeasured
COMBINE_THREADS = 256


@dataclass(frozen=True)
class ExpertGemmConfig:
    """One work item = (touched expert, block of ``warps_n`` 16-row tiles); ``warps_k`` warps split K
    (partials summed through shared memory in warp order); tokens of the expert in passes of
    ``tiles_per_pass`` n8 tiles (one pass for <= 8 * tiles_per_pass tokens: the weights stream once)."""

    fmt: str  # "mxfp4" | "bf16"
    glu: bool  # True: w1/w3 -> SiTU-GLU -> h; False: w2 -> y
    warps_n: int
    warps_k: int
    tiles_per_pass: int = 1
    k_unroll: int = 2
    # Programmatic dependent launch (the decode executor opts in; off = the kernel as it was): launched with
    # the PDL attribute, the CTA builds its dequantisation table (shared memory only), then waits; which
    # expert weights it reads depends on the router (an activation), so none is touched before the wait.
    pdl: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in ("mxfp4", "bf16"):
            raise ValueError(f"fmt must be 'mxfp4' or 'bf16', got {self.fmt!r}")
        if self.warps_n < 1 or self.warps_k < 1 or self.threads > 1024:
            raise ValueError(f"warps_n={self.warps_n}, warps_k={self.warps_k}: 1..32 warps per CTA")
        if self.tiles_per_pass not in (1, 2, 4):
            raise ValueError(f"tiles_per_pass must be 1, 2 or 4, got {self.tiles_per_pass}")

    @property
    def threads(self) -> int:
        return 32 * self.warps_n * self.warps_k

    @property
    def rows_per_item(self) -> int:
        return 16 * self.warps_n

    @classmethod
    def from_heuristic(cls, fmt: str, glu: bool, rows: int, K: int, pdl: bool = False) -> ExpertGemmConfig:
        """gate/up (K = latent 3584, rows = intermediate 384 at TP8): one row tile per item, K over 4 warps
        (batch 1 touches 16 experts x 24 row tiles = 384 items: every SM busy). down (K = 384, rows =
        3584): four row tiles per item, K in one warp. Unmeasured."""
        gps = K // GP
        if glu:
            wk = 4 if gps >= 16 else (2 if gps >= 4 else 1)
            return cls(fmt, True, 1, wk, 2, 2, pdl)
        wn = 4 if rows % 64 == 0 else (2 if rows % 32 == 0 else 1)
        return cls(fmt, False, wn, 1, 2, 2, pdl)
