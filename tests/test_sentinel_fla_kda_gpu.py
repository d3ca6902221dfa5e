"""fla's chunk_kda as the sentinel's training recurrence: outputs, final state and every input's gradient
held to ``reference.kda.kda_chunked`` (FP32) on fresh random inputs at the sentinel's head shape (6 heads
of 128), with a sequence that is not a multiple of the chunk and a padded tail; a 2% change of beta must
break the same tolerance (the comparison can fail). fla runs the pinned configs training runs
(``fla_kda.pin_fla_configs``)."""

from __future__ import annotations

import pytest
import torch
from kda_chunk_tools import chunk_inputs, rel_err, run_with_grads

from k3_fastpath.reference.kda import kda_chunked

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]
TOL = 5e-3  # max |fla - ref| / max |ref| per tensor (fla's FP32 path runs its dots in TF32)


@pytest.mark.parametrize("t,pad", [(64, 0), (200, 0), (200, 37)])
def test_fla_matches_the_reference_recurrence_and_its_gradients(t, pad):
    from k3_fastpath.sentinel.fla_kda import fla_unavailable_reason

    if fla_unavailable_reason("cuda"):
        pytest.skip(fla_unavailable_reason("cuda"))
    import fla.ops.kda  # noqa: F401

    from k3_fastpath.sentinel.fla_kda import PINNED, pin_fla_configs
    assert pin_fla_configs() > 10  # the configs training runs (no autotuning: the test compiles in seconds)
    try:
        _compare(t, pad)
    finally:  # later tests in this process (the standard path's fla kernels) autotune as they do in a run
        PINNED.unpin_all()


def _compare(t: int, pad: int) -> None:
    from k3_fastpath.sentinel.fla_kda import fla_kda_chunked

    b, h, d = 3, 6, 128
    inputs = chunk_inputs(b, t, h, d, seed=t + pad, pad=pad, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    weights = (torch.randn(b, t, h, d, generator=gen, device="cuda"), torch.randn(b, h, d, d, generator=gen, device="cuda"))
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dstate"]
    ref = run_with_grads(kda_chunked, inputs, weights)
    fla = run_with_grads(fla_kda_chunked, inputs, weights)
    errs = {n: rel_err(f, r) for n, f, r in zip(names, fla, ref, strict=True)}
    assert all(torch.isfinite(x).all() for x in fla)
    assert max(errs.values()) < TOL, errs
    # the control: the reference on a 2% larger beta is farther from itself than fla is
    bumped = [x.detach().clone().requires_grad_(True) for x in inputs]
    with torch.no_grad():
        bumped[4].mul_(1.02)
    off = run_with_grads(kda_chunked, bumped, weights)
    assert rel_err(off[0], ref[0]) > TOL and rel_err(off[1], ref[1]) > TOL
