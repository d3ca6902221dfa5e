"""Launch knobs of the router's selection kernel (sigmoid, + correction bias, top-k, renormalise)."""

from __future__ import annotations

from dataclasses import dataclass

VEC = 4  # FP32 logits per 16-byte vector access
MAX_TOP_K = 32  # one pick per lane of the warp that owns a row
MAX_VEC_PER_LANE = 16  # 32 lanes x 16 vectors x 4 = 2048 experts in registers (K3: 896 -> 7 vectors per lane)

# Bench that measures the knob below (H200, CUDA-graph medians, batch 1..64):
#   python -m k3_fastpath.kernels.moe_router.bench --batch 1,8,64
ROWS_PER_CTA = 1  # unmeasured: 1 (grid = M CTAs of one warp) vs 4 (M/4 CTAs of four warps)


@dataclass(frozen=True)
class MoERouterConfig:
    """One warp selects the experts of one token row: lane l holds the logits of experts
    4*(l + 32*i) + j (i < vec_per_lane, j < 4) in registers; ``rows_per_cta`` warps share a CTA."""

    num_experts: int
    top_k: int
    renormalize: bool = True
    rows_per_cta: int = ROWS_PER_CTA
    # Programmatic dependent launch (the decode executor opts in; off = the kernel as it was): the selection
    # kernel is launched with the PDL attribute and loads the bias (a parameter) before griddepcontrol.wait,
    # the logits after it; ``moe_router`` then also launches its logits GEMM with ``SkinnyGemmConfig.pdl``.
    # Same arithmetic, same bits.
    pdl: bool = False

    def __post_init__(self) -> None:
        if self.num_experts % VEC or self.num_experts < VEC:
            raise ValueError(f"num_experts must be a positive multiple of {VEC}, got {self.num_experts}")
        if self.vec_per_lane > MAX_VEC_PER_LANE:
            raise ValueError(f"num_experts={self.num_experts} > {32 * VEC * MAX_VEC_PER_LANE} (registers)")
        if not 1 <= self.top_k <= min(MAX_TOP_K, self.num_experts):
            raise ValueError(f"top_k must be in 1..{min(MAX_TOP_K, self.num_experts)}, got {self.top_k}")
        if self.rows_per_cta not in (1, 2, 4, 8):
            raise ValueError(f"rows_per_cta must be 1, 2, 4 or 8, got {self.rows_per_cta}")

    @property
    def num_vec(self) -> int:
        return self.num_experts // VEC

    @property
    def vec_per_lane(self) -> int:
        return -(-self.num_vec // 32)

    @property
    def threads(self) -> int:
        return 32 * self.rows_per_cta

    @classmethod
    def from_heuristic(cls, num_experts: int, top_k: int, renormalize: bool = True,
                       arch: str = "sm_90a", pdl: bool = False) -> MoERouterConfig:
        return cls(num_experts, top_k, renormalize, ROWS_PER_CTA, pdl)
