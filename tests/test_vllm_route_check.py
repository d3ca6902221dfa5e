"""``equivalence.vllm_route`` (verify/checks/vllm_route.py) where it can run here: skipped with its reason without
vLLM's GPU build; its rule re-derives pass and fail from records (routed and stock outputs equal or within
top-n, at least one routed decode step, the routed fraction) and counts routed steps from a real trace written
by the executor's trace writer (the plugin's format)."""

from __future__ import annotations

import copy

from verify.checks.vllm_route import trace_counts
from verify.checks.vllm_route_rules import vllm_route_problems
from verify.requirements import unmet


def _records(routed=10, decode=12, diverge=False):
    lp = [{"5": -0.1, "6": -2.0}, {"7": -0.2, "8": -1.5}]
    pair = {"kind": "pair", "prompt": 0, "engine_under_test": {"token_ids": [5, 7], "logprobs": lp},
            "baseline": {"token_ids": [5, 7], "logprobs": lp}}
    if diverge:
        pair["baseline"] = {"token_ids": [5, 9], "logprobs": [lp[0], {"9": -0.1, "10": -3.0}]}
    return [{"kind": "plan", "prompts": 1, "top_logprobs": 2, "min_routed_fraction": 0.5}, pair,
            {"kind": "trace", "decode_steps": decode, "routed_steps": routed, "fallbacks": {"x": decode - routed}}]


def test_skipped_here_without_vllms_gpu_build():
    why = unmet("vllm_k3_gpu")
    assert why and why.startswith("needs vLLM's GPU build with Kimi K3 (vllm >= 0.33)"), why


def test_the_rule_passes_equal_outputs_with_routed_steps_and_fails_each_defect():
    assert vllm_route_problems(_records()) == []
    assert "no decode step was routed" in vllm_route_problems(_records(routed=0))[0]
    assert "3 of 12 traced decode steps routed" in vllm_route_problems(_records(routed=3))[0]
    assert "diverge at position 1 beyond each other's top-2" in vllm_route_problems(_records(diverge=True))[0]
    recs = _records()
    del recs[1]
    assert "0 generation pairs recorded of 1 planned" in vllm_route_problems(recs)[0]
    within = copy.deepcopy(_records(diverge=True))  # a divergence inside each other's top-n passes
    within[1]["baseline"]["logprobs"][1] = {"9": -0.1, "7": -0.3}
    within[1]["engine_under_test"]["logprobs"][1] = {"7": -0.2, "9": -0.25}
    assert vllm_route_problems(within) == []


def test_trace_counts_routed_decode_steps_from_an_executor_trace(tmp_path):
    from k3_fastpath.runtime.trace import ExecutionTrace, StepRecord

    tr = ExecutionTrace(tmp_path, {"source": "vllm_plugin"})
    for _ in range(3):
        tr.record(StepRecord(0, "latency_specialized", 2, None, kind="decode"))
    tr.record(StepRecord(0, "latency_specialized", 2, None, fallback="vllm standard path: prefill tokens in the step",
                         kind="prefill"))
    tr.record(StepRecord(0, "latency_specialized", 80, None, fallback="vllm standard path: batch 80 > 64",
                         kind="decode"))
    # under vLLM's FULL graphs (the in-place router): a capture runs nothing, replays are counted on the device
    tr.record(StepRecord(0, "latency_specialized", 4, None, kind="decode", graph=True, count=0))
    tr.record(StepRecord(0, "latency_specialized", 0, None, kind="decode", graph=True, count=7))
    got = trace_counts(str(tmp_path))
    assert (got["decode_steps"], got["routed_steps"], got["steps"]) == (11, 10, 12)
    assert got["fallbacks"] == {"vllm standard path: prefill tokens in the step": 1, "vllm standard path: batch 80 > 64": 1}


def test_a_flipped_status_in_a_written_bundle_fails_verify(tmp_path):
    from test_status_rescore import assert_a_flipped_status_fails_verify

    from verify.result import CheckResult

    res = CheckResult(id="equivalence.vllm_route", status="passed", metrics={"pairs": 1}, duration_s=1.0)
    assert_a_flipped_status_fails_verify(tmp_path / "b", res, _records())
