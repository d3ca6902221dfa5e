"""Launch knobs of the fused residual-add + RMSNorm kernel."""

from __future__ import annotations

from dataclasses import dataclass

from ..._lib.dispatch import validate_row_launch

VEC = 8  # bf16 elements per 16-byte vector access

# Bench that measures the knobs below (H200, CUDA-graph medians over M = 1..64):
#   python -m k3_fastpath.kernels.rmsnorm_residual.bench --preset k3-tp8-rank
MAX_VEC_PER_THREAD = 4  # unmeasured: 2 / 4 / 8 vectors per thread at H = 7168


@dataclass(frozen=True)
class RMSNormConfig:
    """One CTA normalises one row. ``threads`` threads each own ``vec_per_thread`` 16-byte vectors,
    strided by ``threads`` vectors (thread t owns vectors t, t + threads, ...), so a warp's loads
    are contiguous 512-byte runs."""

    threads: int
    vec_per_thread: int
    has_residual: bool = True
    # Programmatic dependent launch (the decode executor opts in; off = the kernel as it was): launched with
    # the PDL attribute, each thread loads its norm-weight vectors (never written by a step) before
    # griddepcontrol.wait, reads x / residual only after it, and triggers launch_dependents once those loads
    # are issued. Same instructions on the data, so the same bits.
    pdl: bool = False

    def __post_init__(self) -> None:
        validate_row_launch(self.threads, self.vec_per_thread)

    @classmethod
    def from_heuristic(cls, H: int, arch: str = "sm_90a", has_residual: bool = True,
                       pdl: bool = False) -> RMSNormConfig:
        """Fewest whole warps such that no thread owns more than MAX_VEC_PER_THREAD vectors
        (H = 7168: 224 threads x 4 vectors, no predication)."""
        if H % VEC:
            raise ValueError(f"H = {H} is not a multiple of {VEC}")
        nv = H // VEC
        want = -(-nv // MAX_VEC_PER_THREAD)  # threads needed at MAX_VEC_PER_THREAD each
        threads = min(1024, max(32, -(-want // 32) * 32))
        return cls(threads=threads, vec_per_thread=-(-nv // threads), has_residual=has_residual, pdl=pdl)
