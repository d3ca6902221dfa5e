"""Launch knobs of the SiTU-GLU activation kernel."""

from __future__ import annotations

from dataclasses import dataclass

from ..._lib.dispatch import validate_row_launch

VEC = 8  # bf16 elements per 16-byte vector access
MAX_THREADS = 256  # per CTA; wider rows take more CTAs along grid y. Unmeasured (one CTA of 64 vs 256)


@dataclass(frozen=True)
class SituGluConfig:
    """Grid (M, chunks): CTA (m, c) computes vectors c * threads * vec_per_thread + t, + threads, ... of row m
    (thread t owns ``vec_per_thread`` 16-byte vectors strided by ``threads``, so a warp touches contiguous
    512-byte runs). ``beta`` / ``linear_beta``: the activation's constants (K3: 4 and 25), compiled in."""

    threads: int
    vec_per_thread: int
    beta: float
    linear_beta: float
    # Programmatic dependent launch: launched with the PDL attribute; every load comes after
    # griddepcontrol.wait (the kernel reads only activations: there is no weight to fetch early), and
    # launch_dependents follows the loads. Same instructions on the data, so the same bits.
    pdl: bool = False

    def __post_init__(self) -> None:
        validate_row_launch(self.threads, self.vec_per_thread)
        if not (self.beta > 0 and self.linear_beta > 0):
            raise ValueError(f"beta and linear_beta must be positive, got {self.beta}, {self.linear_beta}")

    @property
    def vectors_per_cta(self) -> int:
        return self.threads * self.vec_per_thread

    def chunks(self, I: int) -> int:  # noqa: E741 (I: the intermediate width, as in the model's docs)
        return -(-(I // VEC) // self.vectors_per_cta)

    @classmethod
    def from_heuristic(cls, I: int, beta: float, linear_beta: float, pdl: bool = False) -> SituGluConfig:  # noqa: E741
        """One vector per thread, whole warps, at most MAX_THREADS per CTA: I = 384 (a TP16 rank's shared
        experts) is one CTA of 64 threads per row (48 vectors, predicated); I = 2112 two CTAs of 256."""
        if I % VEC:
            raise ValueError(f"I = {I} is not a multiple of {VEC}")
        nv = I // VEC
        threads = min(MAX_THREADS, max(32, -(-nv // 32) * 32))
        return cls(threads=threads, vec_per_thread=1, beta=float(beta), linear_beta=float(linear_beta), pdl=pdl)
