"""Weight prefetch into L2 for the next layer, on a side stream, while the current layer attends.

Decode GEMMs stream each weight once; the attention of a layer (the KDA recurrence, MLA over the latent
cache) reads little weight. Issuing ``cp.async.bulk.prefetch.L2.global`` for the first bytes of the next
layer's weights while the current layer attends lets the next GEMMs start from L2. Only a budget of bytes
per layer is prefetched (default 24 MB of the H200's 60 MB L2): a full-size layer (k3-mini is TP1: ~1 GB
per layer) cannot fit, a TP16 rank's layer mostly does.

The kernel (``L2PrefetchKernel``): one thread per ``chunk_bytes`` chunk issues one bulk prefetch (a
multiple of 16 bytes from a 16-byte aligned address; the prefetch is a hint: no destination, no
completion to wait for, so it can never race with the kernels that read the weights). Addresses are
passed as Int64 scalars, so one compiled kernel serves every tensor.

``L2Prefetcher.issue(tensors)`` forks the side stream from the current one, launches the prefetches
there and returns; ``join()`` (end of the step) makes the current stream wait for the side stream, as a
CUDA graph capture requires. With ``enabled=False`` both are no-ops (the "off" arm of the measurement).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NAME = "l2_prefetch"
DEFAULT_BUDGET_BYTES = 24 << 20
_SOURCE_HASH = hashlib.sha256(Path(__file__).with_name("prefetch_kernel.py").read_bytes()).hexdigest()[:16]


@dataclass(frozen=True)
class L2PrefetchConfig:
    chunk_bytes: int = 64 << 10  # bytes per bulk prefetch instruction (a multiple of 16)
    threads: int = 32
    source: str = _SOURCE_HASH  # prefetch_kernel.py is outside the compile cache's hashed folders

    def __post_init__(self) -> None:
        if self.chunk_bytes % 16 or self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {self.chunk_bytes}")


def compile_l2_prefetch(config: L2PrefetchConfig) -> Any:
    from .._lib import compile_cache

    key = compile_cache.CompileKey.make(NAME, "u8", (), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from .._lib.tensor import fake_stream
        from .prefetch_kernel import L2PrefetchKernel

        return cute.compile(L2PrefetchKernel(config), cutlass.Int64(0), cutlass.Int64(0), fake_stream(),
                            options=options)

    return compile_cache.get_or_compile(key, build)


def prefetch_plan(tensors: list[torch.Tensor], budget: int) -> list[tuple[int, int]]:
    """(address, bytes) of the leading bytes of ``tensors`` in order, up to ``budget`` bytes in all; byte
    counts are multiples of 16 (the bulk-prefetch granule)."""
    out, left = [], budget
    for t in tensors:
        if left < 16:
            break
        n = min(t.numel() * t.element_size(), left)
        n -= n % 16
        if n and t.data_ptr() % 16 == 0:
            out.append((t.data_ptr(), n))
            left -= n
    return out


class L2Prefetcher:
    """Side-stream L2 prefetch of upcoming weights (see the module docstring)."""

    def __init__(self, device: torch.device, budget_bytes: int = DEFAULT_BUDGET_BYTES, enabled: bool = True,
                 config: L2PrefetchConfig | None = None) -> None:
        self.device = torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self.budget = budget_bytes
        self.config = config or L2PrefetchConfig()
        self.stream = torch.cuda.Stream(self.device) if self.enabled else None
        self._fn = None
        self._forked = False
        self.launches = 0  # host-side count of prefetch launches (per capture: once)

    def precompile(self) -> None:
        if self.enabled:
            self._fn = compile_l2_prefetch(self.config)

    def issue(self, tensors: list[torch.Tensor]) -> None:
        if not self.enabled:
            return
        from .._lib import counters
        from .._lib.tensor import current_stream

        if self._fn is None:
            self.precompile()
        plan = prefetch_plan(tensors, self.budget)
        if not plan:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            s = current_stream(self.device)
            for addr, n in plan:
                self._fn(addr, n, s)
                self.launches += 1
                counters.count_launch(NAME)
        self._forked = True

    def join(self) -> None:
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._forked = False


def capability() -> dict[str, Any]:
    """What this module can do here, for the trace metadata."""
    from .._lib import arch

    why = arch.unavailable_reason()
    return {"l2_prefetch": "cp.async.bulk.prefetch.L2.global via cute.arch.inline_ptx (nvidia-cutlass-dsl "
                           f"{arch.cutlass_version()})" if not why else f"unavailable: {why}"}
