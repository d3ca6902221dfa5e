"""Launch knobs of the AttnRes source-mixing kernel."""

from __future__ import annotations

from dataclasses import dataclass

from ..._lib.dispatch import validate_row_launch

VEC = 8  # bf16 per 16-byte access
MAX_SOURCES = 9  # at most 8 block snapshots + the running prefix (K3.md, AttnRes)

# Bench that measures the knob below (H200, CUDA-graph medians, S = 1..9, M = 1..64):
#   python -m k3_fastpath.kernels.attn_res_mix.bench --preset k3-tp8-rank
MAX_VEC_PER_THREAD = 2  # unmeasured: each thread holds S x this many vectors in registers
# Register budget, from compile-time SASS (tests/test_kernels_compile.py prints it): S x 2 vectors at 448
# threads spilled at S = 9 (128 registers, 46 LDL/STL); S x 1 vector at 896 threads (72-register cap)
# spilled from S = 7 (6 / 28 / 58 LDL+STL at S = 7 / 8 / 9). So: S <= 4 keeps 2 vectors per thread in
# registers, S <= 6 keeps 1 with twice the threads, and S >= 7 re-reads the sources (L1/L2) for the mix.
MAX_VECS_IN_REGS = 8
MAX_S_IN_REGS = 6


@dataclass(frozen=True)
class AttnResConfig:
    """One CTA per row; ``threads`` threads each own ``vec_per_thread`` 16-byte vectors of every source
    (thread t owns vectors t, t + threads, ...). ``has_norm``: also emit RMSNorm(mix) * out_weight."""

    threads: int
    vec_per_thread: int
    has_norm: bool = True
    reload_sources: bool = False  # True: the mix pass re-reads the sources instead of keeping them
    # Programmatic dependent launch (the decode executor opts in; off = the kernel as it was): launched with
    # the PDL attribute; norm_w and proj_w (never written by a step) are loaded and out_w is prefetched
    # toward L2 before griddepcontrol.wait; the sources are read only after it; launch_dependents once the
    # last source load is issued. Same arithmetic, same bits.
    pdl: bool = False

    def __post_init__(self) -> None:
        validate_row_launch(self.threads, self.vec_per_thread)

    @classmethod
    def from_heuristic(cls, S: int, H: int, arch: str = "sm_90a", has_norm: bool = True,
                       pdl: bool = False) -> AttnResConfig:
        if H % VEC:
            raise ValueError(f"H = {H} is not a multiple of {VEC}")
        if not 1 <= S <= MAX_SOURCES:
            raise ValueError(f"S = {S} sources outside 1..{MAX_SOURCES}")
        nv = H // VEC
        reload = S > MAX_S_IN_REGS
        per = MAX_VEC_PER_THREAD if reload else max(1, min(MAX_VEC_PER_THREAD, MAX_VECS_IN_REGS // S))
        want = -(-nv // per)
        threads = min(1024, max(32, -(-want // 32) * 32))
        return cls(threads=threads, vec_per_thread=-(-nv // threads), has_norm=has_norm, reload_sources=reload,
                   pdl=pdl)
