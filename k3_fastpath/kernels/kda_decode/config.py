"""Launch knobs of the KDA decode step (one CTA per (sequence, head), ``tokens`` steps of its recurrence)."""

from __future__ import annotations

from dataclasses import dataclass

VEC = 4  # FP32 state elements per 16-byte vector access (one thread owns 4 adjacent V columns)
CONV_W = 4  # short-conv width the kernel implements (K3: 4)
HEAD_DIMS = (32, 64, 128)  # D % 32 == 0 (L2-norm warp reads) and D / VEC <= 32 (a row group fits a warp)
MAX_TOKENS = 8  # tokens per sequence of one launch: a decode step (1) or a verify step (1 + up to 7 drafts)

# Bench that measures the knob below (H200, CUDA-graph medians, cold state pools):
#   python -m k3_fastpath.kernels.kda_decode.bench --heads 12,6 --batch 1,2,8,64
ROWS_PER_THREAD_D128 = 16  # unmeasured: 8 (512 threads) / 16 (256) / 32 (128) at D = 128


@dataclass(frozen=True)
class KDADecodeConfig:
    """The CTA holds its head's whole D x D FP32 state in registers, once: thread t owns V columns
    4*(t % (D/4)) .. +3 (one 16-byte vector per row) of rows ``t // (D/4) + i * G``, i < rows_per_thread,
    where G = D / rows_per_thread row groups; threads = (D / 4) * G. A warp's load instruction reads
    32 * 16 = 512 contiguous bytes (whole rows of the row-major state)."""

    head_dim: int
    rows_per_thread: int
    # Programmatic dependent launch (the decode executor opts in; off = the kernel as it was): launched with
    # the PDL attribute; the parameters (conv weights, dt_bias, A_log, o_norm_w: never written by a step)
    # are loaded before griddepcontrol.wait, slot / inputs / conv and recurrent state after it (the state
    # was written by the previous step's launch: an activation); launch_dependents once every input load is
    # issued. Same arithmetic, same bits.
    pdl: bool = False
    # Tokens per sequence of one launch (a compile-time constant): 1 is the decode step; 2..MAX_TOKENS a
    # speculative verify step, the recurrence run over the sequence's rows in order with the state kept in
    # registers and the state after each token stored to that token's own slot (kernel.py).
    tokens: int = 1
    # vLLM's cache layout (decode steps only): one packed q|k|v conv pool [N, W-1, 3C] and the state stored
    # [N, H, V, K] (kernel.py ``update_vk``); off: the executor's pools (separate conv pools, [N, H, K, V]).
    vllm_layout: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise ValueError(f"tokens per sequence must lie in 1..{MAX_TOKENS}, got {self.tokens}")
        if self.vllm_layout and self.tokens != 1:
            raise ValueError(f"vllm_layout serves decode steps (1 token per sequence), got tokens={self.tokens}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.rows_per_thread < 1 or self.head_dim % self.rows_per_thread:
            raise ValueError(f"rows_per_thread must divide head_dim={self.head_dim}, got {self.rows_per_thread}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"rows_per_thread={self.rows_per_thread} gives {self.threads} threads "
                             "(needs a multiple of 32 in 32..1024)")

    @property
    def threads_per_row(self) -> int:
        return self.head_dim // VEC

    @property
    def row_groups(self) -> int:
        return self.head_dim // self.rows_per_thread

    @property
    def threads(self) -> int:
        return self.threads_per_row * self.row_groups

    @classmethod
    def from_heuristic(cls, head_dim: int, arch: str = "sm_90a", pdl: bool = False, tokens: int = 1,
                       vllm_layout: bool = False) -> KDADecodeConfig:
        """D = 128: 16 rows x 4 columns per thread (64 state registers, 256 threads, 8 row groups);
        smaller D: 8 row groups as well (D = 32: 4 rows per thread, 64 threads). Any ``tokens``."""
        rows = ROWS_PER_THREAD_D128 if head_dim == 128 else head_dim // 8
        return cls(head_dim, rows, pdl, tokens, vllm_layout)
