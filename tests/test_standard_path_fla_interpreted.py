"""The standard path's KDA step as a GPU runs it (fla's ``fused_recurrent_kda_fwd`` + ``rms_norm_gated``; a verify
step through fla's speculative layout, 2-D ``ssm_state_indices``) equals its PyTorch path, on the CPU through
Triton's interpreter (``fla_standard_interpreted.py``, in a process of its own): outputs and every pool the step
leaves, decode and verify, a padded row among real ones. States handed to fla transposed fail (the control)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).with_name("fla_standard_interpreted.py")
TOL = 1e-5  # FP32 both ways, different orders of operations (measured ~3e-7)

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs fla)"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core (the dev extra)"),
]


def _run(*args: str) -> dict:
    r = subprocess.run([sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fla_and_pytorch_standard_kda_steps_agree():
    got = _run()
    for step in ("decode", "verify"):
        assert max(got[step].values()) < TOL, (step, got[step])


def test_a_transposed_state_layout_fails():
    got = _run("--wrong-layout")
    for step in ("decode", "verify"):
        assert got[step]["y"] > 0.1 and got[step]["state"] > 0.1, (step, got[step])
