"""``likelihood.gold_answers`` on a CPU: teacher forcing through decode steps gives the log-probabilities of a
whole-sequence forward (and its greedy flags), the paired gate fails a shift of the answers' likelihood above
its margin and passes one below it, the check runs into a bundle that ``bundle verify`` re-derives, and an
edited log-probability or a flipped status is found. The synthetic rows carry the answer the sentinel learns."""

from __future__ import annotations

import inspect
import math
import random
from pathlib import Path

import pytest
import torch
from eval_tools import QuietOut

from k3_fastpath.runtime.generator import ForcedTokens
from k3_fastpath.sentinel import tasks
from verify.bundle.verify import verify_bundle
from verify.bundle.writer import BundleWriter
from verify.checks import likelihood as check_module
from verify.checks.registry import REGISTRY
from verify.context import CheckContext
from verify.evals import likelihood, rejudge
from verify.evals.likelihood import LikelihoodThresholds, compare
from verify.tiers import load_tier

pytest.importorskip("transformers", reason="needs_eval_extra: scripts/bootstrap --eval")

TH = LikelihoodThresholds(confidence=0.95, bootstrap_iters=1000, max_nll_increase=0.002,
                          max_relative_nll_increase=0.02)


@pytest.fixture(scope="module")
def engine():
    from verify.engines.builtin import BuiltinEngine

    torch.set_num_threads(1)
    e = BuiltinEngine(preset="k3-tiny", path="reference", device="cpu", seed=0, max_model_len=1024)
    yield e
    e.close()


def test_forced_tokens_allow_one_token_at_a_time_and_roll_back():
    f = ForcedTokens([5, 31, 63])
    mask = torch.full((3,), -1, dtype=torch.int32)
    f.fill_bitmask(mask)
    assert mask.tolist() == [1 << 5, 0, 0]
    assert not f.accept_token(6) and f.accept_token(5)
    f.fill_bitmask(mask)
    assert mask.tolist() == [-(1 << 31), 0, 0]  # bit 31 of an int32 word: the sign bit
    assert f.accept_token(31) and f.accept_token(63) and f.is_terminated()
    f.rollback(2)
    assert not f.is_terminated() and f.accept_token(31)
    with pytest.raises(ValueError, match="at least one token"):
        ForcedTokens([])


def test_scores_through_decode_steps_equal_a_whole_sequence_forward(engine, seed):
    rng = random.Random(seed)
    words = [rng.choice(tasks.WORDS[:60]) for _ in range(40)]
    chats = [[{"role": "user", "content": " ".join(words[:9])}], [{"role": "user", "content": " ".join(words[9:13])}]]
    answers = [" ".join(words[13:30]), " ".join(words[30:33])]
    scored = engine.score_chats(chats, answers)
    seqs = [engine._chat_ids(c) + s.token_ids for c, s in zip(chats, scored, strict=True)]
    full = engine.sequence_logprobs(seqs)
    for s, lp, ans in zip(scored, full, answers, strict=True):
        assert s.token_ids[-1] == engine.tokenizer.eos_token_id and engine.detokenize(s.token_ids) == ans
        rows = lp[s.prompt_tokens - 1: s.prompt_tokens - 1 + len(s.token_ids)]
        want = rows.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4), (s.logprobs, want)
        assert s.greedy == (rows.argmax(-1) == torch.tensor(s.token_ids)).tolist()


def _records(rng: random.Random, n: int, shift: float = 0.0, base_nll: float = 0.05):
    """Sample records of ``n`` items for both sides: the under-test side's log-probabilities ``shift`` lower."""
    base, test = [], []
    for i in range(n):
        k = rng.randint(5, 40)
        lps = [-rng.expovariate(1 / base_nll) for _ in range(k)]
        common = {"task": "t", "doc_id": i, "doc_hash": f"d{i}", "prompt_hash": f"p{i}", "answer_hash": f"a{i}",
                  "greedy": [int(x > -0.5) for x in lps]}
        base.append({**common, "side": "baseline", "logprobs": lps})
        noise = [x - shift + rng.gauss(0, 1e-4) for x in lps]
        test.append({**common, "side": "under_test", "logprobs": [min(0.0, x) for x in noise]})
    return base, test


def test_the_gate_fails_a_shift_above_its_margin_and_passes_one_below(seed):
    rng = random.Random(seed)
    same, found = compare("t", *_records(random.Random(seed), 200), TH, seed)
    assert found == [] and abs(same["nll_diff"]) < 1e-4 and same["margin"] == 0.002
    worse, found = compare("t", *_records(random.Random(seed), 200, shift=0.01), TH, seed)
    assert worse["ci"]["lo"] > 0.002 and worse["items_worse"] == 200
    assert len(found) == 1 and "above the margin 0.002" in found[0]
    small, found = compare("t", *_records(random.Random(seed), 200, shift=0.001), TH, seed)
    assert found == [] and small["nll_diff"] > 0  # real but below the margin: not a failure
    # a high-entropy task's margin is relative: 2% of 2.3 nats
    high, found = compare("t", *_records(random.Random(seed), 100, shift=0.02, base_nll=2.3), TH, seed)
    assert found == [] and math.isclose(high["margin"], 0.02 * high["baseline"]["nll"])
    assert high["detectable_increase"] > high["margin"]
    # not paired, or not a log-probability: problems, whatever the numbers
    base, test = _records(rng, 5)
    test[2] = {**test[2], "answer_hash": "other"}
    assert "not a paired comparison" in compare("t", base, test, TH, seed)[1][0]
    base, test = _records(rng, 5)
    test[1] = {**test[1], "logprobs": [float("nan")] * len(test[1]["logprobs"])}
    assert "without one finite log-probability <= 0 and one greedy flag per answer token (first 1 (under_test))" in \
        compare("t", base, test, TH, seed)[1][0]


def _run(root: Path, engines, params: dict, tmp: Path):
    writer = BundleWriter(root, tool_version="0.1.0", argv=["pytest"], tier="likelihood-test",
                          planned_checks=["likelihood.gold_answers"], engines=["builtin:reference"],
                          config={"preset": "k3-tiny"}, seeds={"global": 0}, env={})
    ctx = CheckContext(check_id="likelihood.gold_answers", preset="k3-tiny", device="cpu", seed=0, writer=writer,
                       out=QuietOut(), tmp_dir=tmp, budget_s=600, engines=engines)
    r = check_module.gold_answers(ctx, **params)
    writer.add_result(r)
    writer.finalize(state="finished")
    return r


class _Engines:
    def __init__(self, under_test, baseline) -> None:
        self.roles = {"engine_under_test": under_test, "baseline": baseline}

    def get(self, role, model_source=None, speculative=None):
        return self.roles[role]


class _Lowered:
    """The same engine, every answer token's log-probability 0.5 lower (k3-tiny's random weights give ~6.6 nats a
    token, so the relative margin is ~0.13)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, "builtin:lowered"

    def score_chats(self, chats, answers):
        out = self.inner.score_chats(chats, answers)
        for s in out:
            s.logprobs = [x - 0.5 for x in s.logprobs]
        return out

    def describe(self):
        return {"name": self.name}


@pytest.mark.slow  # ~15 s on the 2-core CPU: 3 short answers, twice each side
def test_the_check_writes_a_bundle_that_verifies_and_an_edit_is_found(engine, tmp_path):
    from test_status_rescore import forge

    params = {"datasets": ["gsm8k", "mrcr"], "limits": {"gsm8k": 2, "mrcr": 1}, "data_dir": "synthetic",
              "mrcr_lengths": [300]}
    ok = _run(tmp_path / "ok", _Engines(engine, engine), params, tmp_path)
    assert ok.status == "passed", (ok.reason, ok.metrics.get("problems"))
    assert set(ok.metrics["tasks"]) == {"likelihood_gsm8k", "likelihood_mrcr_2needle@300c"}
    assert ok.metrics["likelihood_gsm8k:items"] == 2 and ok.metrics["likelihood_gsm8k:nll_diff"] == 0.0
    assert verify_bundle(tmp_path / "ok").ok
    bad = _run(tmp_path / "bad", _Engines(_Lowered(engine), engine), params, tmp_path)
    assert bad.status == "failed" and "likelihood_gsm8k: the answers' negative log-likelihood" in bad.reason
    assert verify_bundle(tmp_path / "bad").ok  # a failure re-derived from the records
    forge(tmp_path / "bad", "likelihood.gold_answers", result={"status": "passed", "reason": ""})
    assert any("records fail a gate" in p for p in verify_bundle(tmp_path / "bad").problems)
    forge(tmp_path / "ok", "likelihood.gold_answers", result={"metrics": {**ok.metrics, "likelihood_gsm8k:nll_diff": -0.5}})
    assert any("likelihood_gsm8k:nll_diff" in p for p in verify_bundle(tmp_path / "ok").problems)
    forge(tmp_path / "ok", "likelihood.gold_answers", result={"status": "failed", "reason": "forged"})
    assert any("but the records pass every gate" in p for p in verify_bundle(tmp_path / "ok").problems)


def test_bad_params_are_one_line_errors_and_a_server_is_skipped(engine, tmp_path):
    for params, msg in (({"datasets": ["gsm8k", "nope"]}, "param datasets must be"),
                        ({"limits": {"gsm8k": 0}}, "param limits must map"),
                        ({"mrcr_lengths": [300]}, "needs data_dir: synthetic"),
                        ({"mrcr_needles": 3, "data_dir": "synthetic"}, "param mrcr_needles must be 2, 4 or 8")):
        r = _run(tmp_path / msg.split()[1], _Engines(engine, engine), params, tmp_path)
        assert r.status == "error" and msg in r.reason and "\n" not in r.reason

    class Server:
        name = "openai:vllm"

        def describe(self):
            return {"name": self.name}

    r = _run(tmp_path / "server", _Engines(Server(), engine), {"datasets": ["gsm8k"], "data_dir": "synthetic",
                                                                "limits": {"gsm8k": 1}}, tmp_path)
    assert r.status == "skipped" and "engine openai:vllm cannot teacher-force" in r.reason


def test_synthetic_rows_hold_the_answer_the_sentinel_learns():
    from evals import utils

    for task in ("gsm8k", "aime25"):
        for item in tasks.items(task, "eval", 0, 5):
            assert utils.gold_answer(task, item.record) == item.messages[-1]["content"]
    mrcr = tasks.items("mrcr", "eval", 0, 2, n_needles=2)[0]
    assert utils.gold_answer("mrcr", mrcr.record) == mrcr.messages[-1]["content"]
    assert utils.gold_answer("aime25", {"problem": "p", "answer": "7"}) is None  # math-ai/aime25: no solution


def test_the_tiers_params_bind_and_score_the_sentinel_on_kept_out_items():
    from k3_fastpath.sentinel.train import EVAL_EXCLUDE

    decl = REGISTRY["likelihood.gold_answers"]
    assert decl.requires == ()
    for tier in ("standard", "full"):
        spec = {c.id: c for c in load_tier(tier).checks}["likelihood.gold_answers"]
        for device in ("cuda", "cpu"):
            params = spec.params_for(device)
            inspect.signature(check_module.gold_answers).bind(None, **{**decl.params, **params})
            assert params["model"] == "sentinel" and params["data_dir"] == "synthetic"
            assert all(n <= EVAL_EXCLUDE[d] for d, n in params["limits"].items()), (tier, params)
    assert likelihood.load_thresholds() == LikelihoodThresholds(0.95, 5000, 0.0005, 0.002)


def test_recorded_likelihoods_rejudged_under_other_margins(capsys):
    """The committed H100 run (session 31): the clean fast path passes under the current margins, the
    correction bias planted into the combine weights fails both MRCR lengths; looser margins pass it."""
    runs = Path(__file__).resolve().parents[1] / "bundles" / "runs" / "2026-12-07-h100-session31"
    clean, bias = runs / "standard-984fcf0", runs / "defect-router_bias_in_weights-984fcf0"
    assert rejudge.main([str(clean)]) == 0
    assert rejudge.main([str(bias)]) == 1
    out = capsys.readouterr().out
    assert "likelihood_mrcr_2needle@41000c: FAIL  nll 5.963 -> 6.085" in out and "16 of 16 less likely" in out
    loose = LikelihoodThresholds(0.95, 5000, 0.002, 0.02)
    assert all(not problems for _, _, problems in rejudge.rejudge(bias, loose))
    assert rejudge.main(["/nowhere"]) == 2 and "rejudge: /nowhere" in capsys.readouterr().err
