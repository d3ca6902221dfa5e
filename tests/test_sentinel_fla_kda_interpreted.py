"""fla's ``chunk_kda``, the sentinel's training recurrence, held to the reference on the CPU: fla's own Triton
kernels (forward and backward) run through Triton's interpreter with the configs training pins on a Hopper GPU,
through ``fla_kda.fla_kda_chunked``, against ``reference.kda.kda_chunked`` in FP64 (``tests/fla_interpreted.py``
runs them in a process of its own). A 2% larger beta on the reference's side must fail the same tolerance.
What only a GPU shows (TF32 dots, the compiled kernels on the hardware) stays with ``test_sentinel_fla_kda_gpu.py``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).with_name("fla_interpreted.py")
REPO = Path(__file__).resolve().parents[1]
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


GPU_RECORD = REPO / "bundles/runs/2026-12-06-h100-session25/sentinel-training-aeb3233.json"  # an H100 training


def _blocks(config: str) -> dict[str, str]:
    """A config as Triton prints it, without what does not change the arithmetic (warps, CTAs, registers)."""
    kv = dict(part.split(": ") for part in config.split(", "))
    return {k: v for k, v in kv.items() if k not in ("num_warps", "num_ctas", "maxnreg", "ir_override")}


def test_every_kernel_ran_the_block_sizes_training_runs_on_a_gpu(interpreted):
    """No autotuning: each kernel chunk_kda launched, forward and backward, took the one config the rule picks
    from fla's Hopper lists, with the block sizes and stages an H100 training run recorded (training.json's
    ``fla_configs``; there one kernel dropped to 2 warps where 4 did not fit, which changes no arithmetic)."""
    used = interpreted["configs"]
    assert interpreted["pinned"] > 10
    gpu = json.loads(GPU_RECORD.read_text())["fla_configs"]["used"]
    assert set(used) == set(gpu)
    assert {k: _blocks(v) for k, v in used.items()} == {k: _blocks(v) for k, v in gpu.items()}
