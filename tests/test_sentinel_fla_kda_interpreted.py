"""fla's ``chunk_kda``, the sentinel's training recurrence, held to the reference on the CPU: fla's own Triton
kernels (forward and backward) run through Triton's interpreter with the configs pinned as training pins them,
through ``fla_kda.fla_kda_chunked``, against ``reference.kda.kda_chunked`` in FP64 (``tests/fla_interpreted.py``
runs them in a process of its own). A 2% larger beta on the reference's side must fail the same tolerance.
What only a GPU shows (fla's Hopper configs, TF32 dots) stays with ``test_sentinel_fla_kda_gpu.py``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).with_name("fla_interpreted.py")
TOL = 1e-4  # max |fla - ref| / max |ref| per tensor: FP32 through the interpreter (no TF32) against FP64
CASES = [[64, 0, 1.0], [200, 37, 1.0], [200, 37, 1.02]]  # (T, padded tail, beta scale of the reference)

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs fla)"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core (the dev extra)"),
]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    r = subprocess.run([sys.executable, str(HELPER), json.dumps(CASES)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fla_matches_the_reference_recurrence_and_its_gradients(interpreted):
    for (t, pad, _), errs in zip(CASES[:2], interpreted["errors"][:2], strict=True):
        assert set(errs) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dstate"}, (t, pad, errs)
        assert max(errs.values()) < TOL, (t, pad, errs)


def test_the_comparison_fails_on_a_two_percent_larger_beta(interpreted):
    errs = interpreted["errors"][2]
    assert min(errs[n] for n in ("o", "final_state", "dq", "dk")) > 100 * TOL, errs


def test_every_kernel_ran_pinned_to_one_config(interpreted):
    """No autotuning: each kernel chunk_kda launched, forward and backward, took the one config the rule
    picked (recorded as training.json records them)."""
    used = interpreted["configs"]
    assert interpreted["pinned"] > 10
    assert any("fwd" in name for name in used) and any("bwd" in name for name in used), used
