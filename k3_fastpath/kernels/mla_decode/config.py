"""Launch knobs of the absorbed MLA decode kernels (split-KV attention + LSE combine) and the split
heuristic.

Constants marked unmeasured are choices nobody has timed yet; this times them:

    python -m k3_fastpath.kernels.mla_decode.bench --ctx 1024,32768,131072 --batch 1,8,64 --sweep
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TILE = 64  # cache positions per pipeline stage (one cp.async group); page sizes are multiples of it
THREADS = 256  # 8 warps per attention CTA
MAX_SPLITS = 256  # split-KV partials (or context-parallel ranks) one combine merges
NUM_SMS_H200 = 132
SMEM_LIMIT = 227 * 1024  # sm_90 opt-in dynamic shared memory per CTA
COMBINE_ROWS = 8  # batch rows per combine CTA: W_UV[h] is read once per 8 rows (from L2 after the first)
# The attention split count minimises waves * tiles-per-split + SPLIT_COST * splits (the combine reads one
# 2 KB partial per split and head). Unmeasured (bench --sweep prints the best split count per row).
SPLIT_COST_TILES = 0.25


@dataclass(frozen=True)
class MLADecodeConfig:
    """One attention CTA handles ``heads_per_cta`` heads (8 or 16: one or two n8 tiles of mma.sync) of one
    sequence over one split of its positions, TILE positions per stage, ``stages`` stages of cp.async in
    flight. FP8 caches stage raw bytes and convert each tile into one BF16 tile buffer."""

    heads_per_cta: int
    stages: int
    fp8: bool = False
    gate: bool = True  # the combine multiplies by sigmoid(gate) (K3: mla_use_output_gate)
    combine_rows: int = COMBINE_ROWS
    # Programmatic dependent launch (the decode executor opts in; off = the kernels as they were): both
    # launches carry the PDL attribute. The attention kernel reads nothing before griddepcontrol.wait (its
    # inputs are activations and the latent cache, written by this step's glue and earlier steps); the
    # combine prefetches its head's W_UV toward L2 first. Each triggers launch_dependents at the start of
    # its epilogue. Same arithmetic, same bits.
    pdl: bool = False

    def __post_init__(self) -> None:
        if self.heads_per_cta not in (8, 16):
            raise ValueError(f"heads_per_cta must be 8 or 16, got {self.heads_per_cta}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"stages must be in 2..4, got {self.stages}")
        if self.combine_rows not in (1, 2, 4, 8):
            raise ValueError(f"combine_rows must be 1, 2, 4 or 8, got {self.combine_rows}")

    @property
    def n_tiles(self) -> int:
        """n8 mma tiles of heads."""
        return self.heads_per_cta // 8

    def smem_bytes(self, D: int) -> int:
        """Dynamic shared memory of the attention CTA for latent width D (R + rope)."""
        row = D * 2 + 16  # padded BF16 row: 16 bytes of padding keep ldmatrix rows on distinct banks
        tile = TILE * row
        stage_bytes = TILE * D if self.fp8 else tile
        k_split = ksplit(self.heads_per_cta, D)
        return (self.stages * stage_bytes + (tile if self.fp8 else 0) + self.heads_per_cta * row
                + k_split * self.heads_per_cta * (TILE + 4) * 4 + self.heads_per_cta * (TILE + 8) * 2
                + 4 * self.heads_per_cta * 4 + 128)

    @classmethod
    def from_heuristic(cls, H: int, D: int, fp8: bool, gate: bool = True, arch: str = "sm_90a",
                       pdl: bool = False) -> MLADecodeConfig:
        """16 heads per CTA when more than 8 heads (TP8: 12 -> one CTA, 25% of the mma padding), else 8
        (TP16: 6 heads). Stages: as many as fit 227 KB (BF16 at D = 576: 2 x 73 KB; FP8: 3 x 36 KB)."""
        hg = 16 if H > 8 else 8
        for stages in (4, 3, 2):
            cfg = cls(hg, stages, fp8, gate, pdl=pdl)
            if cfg.smem_bytes(D) <= SMEM_LIMIT:
                return cfg
        raise ValueError(f"latent width D={D} does not fit two stages in shared memory")


def ksplit(heads_per_cta: int, D: int) -> int:
    """The QK product runs on 8 warps: (TILE/16 position tiles) x (head tiles) units; with one head tile
    the 36 k-steps (D = 576) split in two halves so all 8 warps work (partials summed in the softmax)."""
    units = (TILE // 16) * (heads_per_cta // 8)
    k = max(1, (THREADS // 32) // units)
    return k if (D // 16) % k == 0 else 1


def choose_splits(batch: int, head_groups: int, max_ctx: int, num_sms: int = NUM_SMS_H200,
                  max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(splits, tiles per split) for a batch whose longest context is ``max_ctx``: one CTA per SM and
    split, cost = waves x tiles per split + SPLIT_COST_TILES x splits, fewest splits on ties."""
    tiles = max(1, math.ceil(max_ctx / TILE))
    base = batch * head_groups
    best = None
    for s in range(1, min(tiles, max_splits) + 1):
        per = math.ceil(tiles / s)
        s_eff = math.ceil(tiles / per)
        cost = math.ceil(base * s_eff / num_sms) * per + SPLIT_COST_TILES * s_eff
        if best is None or cost < best[0] - 1e-9:
            best = (cost, s_eff, per)
    return best[1], best[2]
