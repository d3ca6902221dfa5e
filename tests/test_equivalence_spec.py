"""``equivalence.spec_decode`` on a CPU (the check itself needs an H200): the fast step emulated (every kernel
served by its reference) on k3-tiny, in both modes. Fused verify steps (the default): the clean fast path
passes (every verify step one fused fast step, each row within the logit tolerance of the same rows run as
decode steps, the committed state theirs); a commit that takes the state after the wrong row fails with the
reason. Column-by-column verify steps (``fused=False``): speculative greedy token-identical to plain greedy,
the committed state bitwise plain decoding's, every verify position a fast step; a commit that leaves the
rejected drafts' KDA state behind fails. The status follows from the records by the rule ``bundle verify``
applies, and forged records fail it. Prompts are drawn from the ``seed`` fixture."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from check_tools import cpu_context

from verify.checks.equivalence_spec import spec_decode
from verify.checks.spec_rules import spec_decode_problems
from verify.checks.status_rules import rescore
from verify.result import CheckResult


def _run(seed: int, tmp_path: Path, **kw) -> tuple[CheckResult, list[dict]]:
    ctx, sink = cpu_context("equivalence.spec_decode", seed, tmp_path)
    args = {"batches": [1, 3], "ks": [1, 3], "steps": 12, "prompt_len": 6, "emulate": True, "use_graphs": False, **kw}
    return spec_decode(ctx, **args), sink.rows


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    return _run(0, tmp_path_factory.mktemp("spec"), fused=False)


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory):
    return _run(0, tmp_path_factory.mktemp("spec_fused"))


def test_the_clean_fused_path_passes(fused_run):
    res, recs = fused_run
    assert res.status == "passed", res.reason
    points = [r for r in recs if r["kind"] == "point"]
    assert [(p["batch"], p["k"], p["verify"]) for p in points] == [(1, 1, "fused"), (1, 3, "fused"), (3, 1, "fused"),
                                                                    (3, 3, "fused")]
    assert all(p["fused_steps"] == p["verify_steps"] > 0 and p["fast_positions"] == p["positions"] for p in points)
    steps = [r for r in recs if r["kind"] == "verify_step"]
    assert len(steps) == sum(p["verify_steps"] for p in points) and all(s["rows"] > 0 for s in steps)
    assert max(s["max_rel_err"] for s in steps) < 0.02 and max(s["state_max_abs_diff"] for s in steps) < 0.05
    accepted = sum(sum(p["acceptance"]["accepted"]) for p in points)
    examined = sum(sum(p["acceptance"]["examined"]) for p in points)
    assert 0 < accepted < examined  # drafts were both accepted and rejected
    assert rescore({"equivalence.spec_decode": recs}, res) == []


def test_a_fused_commit_of_the_wrong_row_fails(seed, tmp_path, monkeypatch):
    """The commit takes the state after every fed row (the rejected drafts' included) instead of after the
    kept ones: the committed state is not the decode steps' (KDA state past the tolerance)."""
    from k3_fastpath.runtime import executor
    from k3_fastpath.runtime.verify_step import commit_verify

    def commit_all_rows(pool, cache, keep, tokens):
        commit_verify(pool, cache, keep * 0 + tokens, tokens)
        cache.lengths = cache.lengths - tokens + keep.to(cache.lengths.device)

    monkeypatch.setattr(executor, "commit_verify", commit_all_rows)
    res, recs = _run(seed, tmp_path, batches=[3], ks=[3], p=0.5)
    assert res.status == "failed"
    assert "state_max_abs_diff" in res.reason, res.reason
    assert spec_decode_problems(recs)[0] in res.reason


def test_forged_fused_records_fail_the_rule(fused_run):
    res, recs = fused_run
    steps = [i for i, r in enumerate(recs) if r["kind"] == "verify_step"]
    forged = copy.deepcopy(recs)
    forged[steps[0]]["max_rel_err"] = 0.5
    assert "logit error 0.5 > 0.25" in spec_decode_problems(forged)[0]
    forged = copy.deepcopy(recs)
    forged[steps[0]]["kl_sum"] = 1e3
    assert "mean KL(decode steps || fused)" in spec_decode_problems(forged)[0]
    forged = copy.deepcopy(recs)
    forged[steps[1]]["argmax_mismatches"] = [{"seq": 0, "row": 1, "ref_token": 3, "fused_token": 4,
                                              "ref_token_rank_in_fast": 2, "fast_token_rank_in_ref": 6}]
    assert "beyond a near-tie" in spec_decode_problems(forged)[0]
    forged = copy.deepcopy(recs)
    forged[steps[2]]["state_max_abs_diff"] = forged[steps[2]]["state_scale"]
    assert "state_max_abs_diff" in spec_decode_problems(forged)[0]
    assert "verify_step records for" in spec_decode_problems(recs[: steps[0]] + recs[steps[0] + 1:])[0]
    forged = copy.deepcopy(recs)
    pt = next(i for i, r in enumerate(recs) if r["kind"] == "point")
    forged[pt]["verify_splits"] = {"batch 9 > 8": 1}
    assert "split into decode steps" in spec_decode_problems(forged)[0]


def test_the_clean_fast_path_passes(clean_run):
    res, recs = clean_run
    assert res.status == "passed", res.reason
    points = [r for r in recs if r["kind"] == "point"]
    assert [(p["batch"], p["k"]) for p in points] == [(1, 1), (1, 3), (3, 1), (3, 3)]
    assert all(p["state_max_abs_diff"] == 0.0 and p["latent_max_abs_diff"] == 0.0 for p in points)
    assert all(p["fast_positions"] == p["positions"] > p["verify_steps"] > 0 for p in points)
    accepted = sum(sum(p["acceptance"]["accepted"]) for p in points)
    examined = sum(sum(p["acceptance"]["examined"]) for p in points)
    assert 0 < accepted < examined  # drafts were both accepted and rejected
    assert rescore({"equivalence.spec_decode": recs}, res) == []


def test_a_commit_that_keeps_rejected_drafts_state_fails(seed, tmp_path, monkeypatch):
    from k3_fastpath.runtime import spec_decode as sd

    def leaky_commit(cache, start, states, keep):  # lengths right, the KDA state of every fed draft kept
        lengths = cache.lengths.clone()
        rows = (keep > 0).nonzero().flatten()
        lengths[rows] = (start + keep)[rows]
        cache.lengths = lengths
        cache.length_bound = int(lengths.max())

    monkeypatch.setattr(sd, "commit", leaky_commit)
    res, recs = _run(seed, tmp_path, batches=[3], ks=[3], fused=False)
    assert res.status == "failed"
    assert "speculative tokens differ from plain greedy" in res.reason or "committed state" in res.reason, res.reason
    assert spec_decode_problems(recs)[0] in res.reason


def test_forged_records_fail_the_rule(clean_run):
    res, recs = clean_run
    pts = [i for i, r in enumerate(recs) if r["kind"] == "point"]
    forged = copy.deepcopy(recs)
    forged[pts[1]]["spec_tokens"][0][5] += 1
    assert "request 0: speculative tokens differ from plain greedy at token 5" in spec_decode_problems(forged)[0]
    forged = copy.deepcopy(recs)
    forged[pts[2]]["state_max_abs_diff"] = 1e-3
    assert spec_decode_problems(forged) == ["batch 3 k 1: state_max_abs_diff 0.001 > 0.0 (the committed state is "
                                            "not plain decoding's)"]
    forged = copy.deepcopy(recs)
    forged[pts[0]]["fast_positions"] -= 1
    assert "fast steps and 0 fallbacks for" in spec_decode_problems(forged)[0]
    assert spec_decode_problems(recs[: pts[3]])[0] == "batch 3 k 3: no record of this planned point"
    assert spec_decode_problems([]) == ["0 plan records (expected 1)"]
    flipped = CheckResult(id=res.id, status="failed", reason="x", metrics=res.metrics)
    assert rescore({"equivalence.spec_decode": recs}, flipped)[0].startswith("status 'failed', but its")


def test_bad_parameters_fail_before_anything_runs(tmp_path):
    res, recs = _run(0, tmp_path, ks=[8])
    assert res.status == "failed" and "every k in 1..7" in res.reason and recs == []


@pytest.mark.parametrize("which", ["clean_run", "fused_run"])
def test_a_flipped_status_in_a_written_bundle_fails_verify(which, request, tmp_path):
    """Each clean run's result and records (column-by-column and fused verify steps) in a bundle written by
    ``BundleWriter`` verify; the status flipped to failed in results.jsonl and re-sealed, ``bundle verify``
    re-derives 'passed' from the records and refuses."""
    from test_status_rescore import assert_a_flipped_status_fails_verify

    res, recs = request.getfixturevalue(which)
    assert_a_flipped_status_fails_verify(tmp_path / "b", res, recs)
