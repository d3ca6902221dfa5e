"""``perf.serving``'s records, metrics and rule (verify/checks/serving_rules.py, verify/aiperf.py) without a
server: AIPerf's export rows read into request records, metrics recomputed by hand, a bundle written the
way the check writes it that verifies, and its forgeries -- a metric edited, a request dropped or added, a
status flipped, a speedup gate missed -- failing ``bundle verify``."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from test_status_rescore import _only_rescore_problems, assert_passed_record_forgery_fails, forge

from verify import aiperf
from verify.bundle.compare import compare_bundles
from verify.bundle.verify import verify_bundle
from verify.bundle.writer import BundleWriter
from verify.checks.serving_rules import ROLES, compare_points, point_metrics, request_itl_ms, serving_problems
from verify.checks.status_rules import verdict_reason
from verify.result import CheckResult

SAMPLE = Path(__file__).parent / "data" / "aiperf" / f"profile_export_chat_{aiperf.AIPERF_VERSION}.jsonl"
CHECK = "perf.serving"


def test_aiperf_rows_become_request_records():
    rows = [json.loads(x) for x in SAMPLE.read_text().splitlines()]
    recs = [aiperf.request_record(r) for r in rows]
    ok = recs[0]
    m = rows[0]["metrics"]
    assert ok["output_tokens"] == m["usage_completion_tokens"]["value"] and ok["error"] is None
    assert ok["ttft_ms"] == m["time_to_first_token"]["value"] and ok["gaps_ms"] == m["inter_chunk_latency"]["value"]
    assert ok["start_ns"] == rows[0]["metadata"]["request_start_ns"] and ok["session"].startswith("sess-")
    # our ITL is AIPerf's definition with the server's token count
    assert request_itl_ms(ok) == pytest.approx((ok["latency_ms"] - ok["ttft_ms"]) / (ok["output_tokens"] - 1))
    bad = recs[-1]
    assert bad["error"].startswith("400") and "maximum context length" in bad["error"] and request_itl_ms(bad) is None
    wrong_unit = json.loads(json.dumps(rows[0]))
    wrong_unit["metrics"]["time_to_first_token"]["unit"] = "ns"
    with pytest.raises(aiperf.AIPerfError, match="expected 'ms'"):
        aiperf.request_record(wrong_unit)


def _requests(rng: random.Random, n: int, itl_ms: float, errors: int = 0) -> list[dict]:
    out, t = [], 1_000_000_000
    for i in range(n):
        ttft, toks = rng.uniform(20, 60), 16
        lat = ttft + itl_ms * rng.uniform(0.8, 1.2) * (toks - 1)
        out.append({"kind": "request", "start_ns": t, "end_ns": t + int(lat * 1e6), "latency_ms": lat, "ttft_ms": ttft,
                    "gaps_ms": [itl_ms] * (toks - 1), "output_tokens": toks, "prompt_tokens": 64,
                    "cached_tokens": None, "error": "500 boom" if i < errors else None, "session": f"s{i}",
                    "turn": 0, "aiperf_itl_ms": None})
        t += int(lat * 1e6 / 2)
    return out


def test_point_metrics_by_hand():
    reqs = [{"kind": "request", "start_ns": 0, "end_ns": 2_000_000_000, "latency_ms": 1000.0, "ttft_ms": 100.0,
             "output_tokens": 10, "prompt_tokens": 5, "cached_tokens": 2, "error": None},
            {"kind": "request", "start_ns": 500_000_000, "end_ns": 1_000_000_000, "latency_ms": 500.0,
             "ttft_ms": 50.0, "output_tokens": 10, "prompt_tokens": 5, "cached_tokens": 0, "error": None},
            {"kind": "request", "start_ns": 0, "end_ns": 10, "error": "timeout"}]
    m = point_metrics(reqs, gpus=2)
    assert (m["requests"], m["succeeded"], m["errors"]) == (3, 2, 1)
    assert m["window_s"] == 2.0 and m["output_tokens_per_s"] == 10.0 and m["output_tokens_per_s_per_gpu"] == 5.0
    assert m["itl_ms_p50"] == pytest.approx((100 + 50) / 2) and m["itl_ms_p90"] == pytest.approx(50 + 0.9 * 50)
    assert m["interactivity_p90"] == pytest.approx(1e3 / 95) and m["cached_tokens"] == 2
    assert m["ttft_ms_p50"] == pytest.approx(75.0)


def test_the_comparison_and_its_noise_rule():
    fast = [{"interactivity_p90": 200.0, "ttft_ms_p50": 10.0}, {"interactivity_p90": 210.0, "ttft_ms_p50": 11.0}]
    slow = [{"interactivity_p90": 100.0, "ttft_ms_p50": 20.0}, {"interactivity_p90": 101.0, "ttft_ms_p50": 20.0}]
    c = compare_points(fast, slow, 0.05, min_speedup=1.5)
    assert c["outcome"] == "faster" and c["interactivity_p90_ratio"] == pytest.approx(205 / 100.5)
    assert c["noise"] == pytest.approx(10 / 205) or c["noise"] == 0.05
    assert c["meets_min_speedup"] is True
    assert compare_points(fast, fast, 0.05, None)["outcome"] == "within noise"
    assert compare_points(slow, fast, 0.05, 1.0)["meets_min_speedup"] is False


def write_serving_bundle(root: Path, seed: int = 0, itl_eut: float = 5.0, min_speedup: float | None = None,
                         repeats: int = 2) -> Path:
    """A bundle holding perf.serving as the check writes it (records, then the rule's verdict)."""
    rng = random.Random(seed)
    w = BundleWriter(root, tool_version="0.0.0", argv=["k3-verify", "run"], tier="t", planned_checks=[CHECK],
                     engines=["openai:a", "openai:b"], config={}, seeds={"global": seed}, env={"gpu": None})
    recorded: list[dict] = []

    def rec(obj):
        recorded.append(obj)
        w.record(CHECK, obj)

    plan = {"kind": "plan", "roles": list(ROLES), "workloads": ["agentic"], "concurrency": [1, 4],
            "repeats": repeats, "min_requests": 20, "max_error_rate": 0.0, "min_speedup": min_speedup,
            "noise_floor": 0.05, "gpus": None}
    rec(plan)
    pts = {}
    for c in (1, 4):
        for i in range(repeats):
            for role in ROLES:
                key = {"role": role, "workload": "agentic", "concurrency": c, "repeat": i}
                reqs = [{**r, **key} for r in _requests(rng, 24, itl_eut if role == "engine_under_test" else 5.0)]
                for r in reqs:
                    rec(r)
                pts[(role, c, i)] = point_metrics(reqs, None)
                rec({"kind": "point", **key, "metrics": pts[(role, c, i)]})
    for c in (1, 4):
        sides = {role: [pts[(role, c, i)] for i in range(repeats)] for role in ROLES}
        rec({"kind": "comparison", "workload": "agentic", "concurrency": c,
             **compare_points(sides["engine_under_test"], sides["baseline"], 0.05, min_speedup)})
    problems = serving_problems(recorded)
    w.add_result(CheckResult(CHECK, "failed" if problems else "passed", verdict_reason(problems) if problems else ""))
    w.finalize()
    return root


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    root = write_serving_bundle(tmp_path / "serving")
    report = verify_bundle(root)
    assert report.ok and report.verdict == "pass", report.problems
    return root


def _first_point(rows, role="engine_under_test"):
    return next(r for r in rows if r.get("kind") == "point" and r["role"] == role)


def _edit_p90(rows):
    _first_point(rows)["metrics"]["interactivity_p90"] *= 1.5


def _drop_request(rows):
    rows.remove(next(r for r in rows if r.get("kind") == "request"))


def _add_request(rows):
    i = rows.index(next(r for r in rows if r.get("kind") == "request"))
    rows.insert(i, dict(rows[i], latency_ms=rows[i]["latency_ms"] * 3))


def _error_under_passed(rows):
    next(r for r in rows if r.get("kind") == "request")["error"] = "500 Internal Server Error"


def _drop_a_point(rows):
    rows.remove(_first_point(rows, "baseline"))


def _timing_edited_with_its_point(rows):
    """Every request of the engine under test 2x slower, its point metrics recomputed: the comparison record
    no longer follows."""
    keyed = {}
    for r in rows:
        if r.get("kind") == "request" and r["role"] == "engine_under_test":
            r["latency_ms"] = r["ttft_ms"] + 2 * (r["latency_ms"] - r["ttft_ms"])
            keyed.setdefault((r["concurrency"], r["repeat"]), []).append(r)
    for r in rows:
        if r.get("kind") == "point" and r["role"] == "engine_under_test":
            r["metrics"] = point_metrics(keyed[(r["concurrency"], r["repeat"])], None)


FORGERIES = {
    "a point metric edited": (_edit_p90, "interactivity_p90"),
    "a request dropped": (_drop_request, "does not follow from its requests"),
    "a request added": (_add_request, "does not follow from its requests"),
    "a failed request under a passed status": (_error_under_passed, "does not follow from its requests"),
    "a planned point dropped": (_drop_a_point, "no record of this planned point"),
    "timings edited with their point": (_timing_edited_with_its_point, "comparison agentic c=1"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgeries_of_the_records_fail_verify(bundle, name):
    assert_passed_record_forgery_fails(bundle, CHECK, *FORGERIES[name])


def test_a_status_flip_fails_verify(bundle):
    forge(bundle, CHECK, result={"status": "failed", "reason": "forged"})
    assert "records give 'passed'" in _only_rescore_problems(bundle, CHECK)[0]


def test_a_missed_speedup_gate_fails_and_cannot_be_flipped(tmp_path):
    root = write_serving_bundle(tmp_path / "slow", itl_eut=5.0, min_speedup=1.5)
    assert verify_bundle(root).ok and verify_bundle(root).verdict == "fail"
    forge(root, CHECK, result={"status": "passed", "reason": ""})
    problems = _only_rescore_problems(root, CHECK)
    assert "the baseline's < 1.5x" in problems[0], problems
    fast = write_serving_bundle(tmp_path / "fast", itl_eut=2.5, min_speedup=1.5)
    assert verify_bundle(fast).verdict == "pass"


def test_too_few_requests_fail(tmp_path):
    recs = [{"kind": "plan", "roles": ["engine_under_test"], "workloads": ["w"], "concurrency": [1], "repeats": 1,
             "min_requests": 20, "max_error_rate": 0.0, "min_speedup": None, "noise_floor": 0.05, "gpus": None}]
    reqs = [{**r, "role": "engine_under_test", "workload": "w", "concurrency": 1, "repeat": 0}
            for r in _requests(random.Random(1), 5, 5.0)]
    recs += reqs + [{"kind": "point", "role": "engine_under_test", "workload": "w", "concurrency": 1, "repeat": 0,
                     "metrics": point_metrics(reqs, None)}]
    assert serving_problems(recs) == ["engine_under_test w c=1 repeat 0: 5 successful requests < 20"]
    assert serving_problems([]) == ["no plan record"]


def test_responses_that_arrive_in_one_chunk_fail_where_the_plan_asks(tmp_path):
    """A point whose requests came in one burst (TTFT == latency: the stream was coalesced) measured no
    inter-token latency: with ``max_burst_share`` in the plan (what the check writes) it is a problem; a
    plan written before the rule existed is not judged on it (the committed bundles keep verifying)."""
    def records(burst: int, share):
        plan = {"kind": "plan", "roles": ["engine_under_test"], "workloads": ["w"], "concurrency": [1],
                "repeats": 1, "min_requests": 20, "max_error_rate": 0.0, "min_speedup": None, "noise_floor": 0.05,
                "gpus": None, **({} if share is None else {"max_burst_share": share})}
        reqs = [{**r, "role": "engine_under_test", "workload": "w", "concurrency": 1, "repeat": 0}
                for r in _requests(random.Random(2), 24, 5.0)]
        for r in reqs[:burst]:
            r["latency_ms"] = r["ttft_ms"]
            r["gaps_ms"] = [0.0] * len(r["gaps_ms"])
        return [plan, *reqs, {"kind": "point", "role": "engine_under_test", "workload": "w", "concurrency": 1,
                              "repeat": 0, "metrics": point_metrics(reqs, None)}]

    assert serving_problems(records(2, 0.1)) == []
    assert serving_problems(records(6, 0.1)) == ["engine_under_test w c=1 repeat 0: 6 of 24 requests arrived in one "
                                                 "chunk (> 10%): the stream was not measured token by token "
                                                 "(client or server coalescing)"]
    assert serving_problems(records(24, None)) == []


def test_compare_two_runs_within_noise_and_a_regression(tmp_path):
    a = write_serving_bundle(tmp_path / "a", seed=1)
    b = write_serving_bundle(tmp_path / "b", seed=2)
    rep = compare_bundles(a, b)
    rows = [p for p in rep.perf if p.source == CHECK]
    assert len(rows) == 4 and all(p.outcome == "within noise" for p in rows), rows
    slow = write_serving_bundle(tmp_path / "slow", seed=3, itl_eut=10.0)
    rep = compare_bundles(a, slow)
    itl = [p for p in rep.perf if p.source == CHECK and "P90 ITL" in p.label]
    assert itl and all(p.outcome == "regressed" for p in itl) and rep.verdict == "regressed"


def test_render_draws_the_pareto_and_cdf(bundle, tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (the render plots)")
    from PIL import Image

    from verify.bundle.render import render_bundle

    res = render_bundle(bundle, tmp_path / "r")
    names = {p.name for p in res.plots}
    assert {"serving_pareto.png", "serving_cdf.png"} <= names
    for n in ("serving_pareto.png", "serving_cdf.png"):
        with Image.open(tmp_path / "r" / n) as im:
            assert im.size[0] > 400 and im.size[1] > 300


def test_a_copy_of_the_bundle_is_unchanged_by_verification(bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    verify_bundle(copy)
    assert sorted(p.name for p in copy.rglob("*")) == sorted(p.name for p in bundle.rglob("*"))


def test_without_aiperf_the_check_is_a_preflight_error(tmp_path, monkeypatch):
    from verify.output import Output
    from verify.runner import run_tier

    monkeypatch.setenv("K3_AIPERF", str(tmp_path / "no-aiperf"))
    assert "needs AIPerf 0.13.0" in aiperf.tool_problem()
    tier = tmp_path / "t.yaml"
    tier.write_text("name: t\ndescription: d\ntarget_s: 600\nchecks:\n  - id: perf.serving\n    budget_s: 600\n")
    verdict, root = run_tier(str(tier), tmp_path / "b", "auto", "cpu", 0, Output("json"), argv=["test"])
    res = json.loads((root / "results.jsonl").read_text().splitlines()[0])
    assert verdict == "fail" and res["status"] == "error" and "needs AIPerf 0.13.0" in res["reason"], res
    assert verify_bundle(root).ok
