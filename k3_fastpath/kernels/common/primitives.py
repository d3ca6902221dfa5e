"""Scalar device math and the PDL prologue's weight prefetch, shared by the kernels (``kernels/common``)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32


def sigmoid(x):
    """1 / (1 + exp(-x)) in FP32 (the kernels' gates, routers and SiTU); traced inline into the caller."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


def prefetch_weights_l2(gmem_addr, nbytes):
    """``cp.async.bulk.prefetch.L2`` of ``nbytes`` of a weight from the 64-bit global address ``gmem_addr``.

    The only global access a PDL build issues before ``griddepcontrol.wait``: a weight is never written by
    a step, so reading it while the predecessor still runs is safe; an activation or cache read there would
    not be (``tests/test_pdl_compile.py`` fails on one). ``nbytes`` a multiple of 16, the address 16-byte
    aligned; traced inline into the caller. ``gmem_addr``: Int64, ``nbytes``: Int32."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};", read_only_args=[gmem_addr, nbytes])
