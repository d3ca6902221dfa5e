"""Device code of the L2 weight prefetch (``prefetch.py`` is the torch-facing side; this module is imported
only when the kernel is compiled, so the package imports without cutlass-dsl).

Thread ``t`` of CTA ``b`` owns chunk ``b * threads + t`` of ``chunk_bytes`` bytes and issues one
``cp.async.bulk.prefetch.L2.global [addr + off], size;`` for it (``size`` rounded down to 16 bytes, the
instruction's granule). A prefetch has no destination and nothing waits for it.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64


class L2PrefetchKernel:
    def __init__(self, config) -> None:
        self.cfg = config

    @cute.jit
    def __call__(self, addr: Int64, nbytes: Int64, stream: cuda.CUstream):
        per_cta = Int64(self.cfg.chunk_bytes * self.cfg.threads)
        grid = Int32((nbytes + per_cta - 1) // per_cta)
        self.kernel(addr, nbytes).launch(grid=[grid, 1, 1], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, addr: Int64, nbytes: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        chunk = Int64(self.cfg.chunk_bytes)
        off = (Int64(bidx) * Int64(self.cfg.threads) + Int64(tidx)) * chunk
        if off < nbytes:
            size = cutlass.min(chunk, nbytes - off)
            size = size - size % Int64(16)
            if size > Int64(0):
                cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                                     read_only_args=[addr + off, Int32(size)])
