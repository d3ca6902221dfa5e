"""The eval checks for real, on a CPU: lm-eval runs GSM8K / AIME25 / MRCR tasks from ``evals/`` against the
builtin engine serving k3-tiny (random weights: the answers are garbage, which is the point: the gates must
say so), into a real bundle that ``bundle verify`` accepts, re-scores, and rejects once a sample's score
is edited. A deliberately broken "fast path" (answers cut to nothing) must fail the paired gates."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="needs_eval_extra: scripts/bootstrap --eval")
pytest.importorskip("transformers", reason="needs_eval_extra: scripts/bootstrap --eval")

from eval_tools import PERMISSIVE, QuietOut  # noqa: E402

from evals.data.make_synthetic import make_all  # noqa: E402
from verify.bundle import schema  # noqa: E402
from verify.bundle import verify as verify_module  # noqa: E402
from verify.bundle.schema import SumEntry, format_sums, sha256_file, walk_bundle  # noqa: E402
from verify.bundle.verify import verify_bundle  # noqa: E402
from verify.bundle.writer import BundleWriter  # noqa: E402
from verify.checks import evals as eval_checks  # noqa: E402
from verify.checks.registry import REGISTRY  # noqa: E402
from verify.context import CheckContext  # noqa: E402
from verify.engines.base import Completion  # noqa: E402
from verify.engines.builtin import BuiltinEngine  # noqa: E402
from verify.evals import rescore  # noqa: E402
from verify.tiers import load_tier  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)  # k3-tiny's ops are tiny: thread hand-off costs more than it saves
    e = BuiltinEngine(preset="k3-tiny", path="reference", device="cpu", seed=0, max_model_len=1024)
    yield e
    e.close()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("evaldata")
    make_all(d, seed=3, gsm8k=3, aime=2, mrcr=2, mrcr_chars=160, needles=(2,))
    return d


class _Engines:
    def __init__(self, under_test, baseline) -> None:
        self.roles = {"engine_under_test": under_test, "baseline": baseline}

    def get(self, role, model_source=None, speculative=None):
        assert model_source is None  # these tests score the run's model
        return self.roles[role]


class _Mute:
    """A broken fast path: the same model, but every answer comes back empty (as if EOS came first)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, "builtin:muted"
        self.max_model_len, self.vocab_size = inner.max_model_len, inner.vocab_size

    def _mute(self, c: Completion) -> Completion:
        return Completion(text="", token_ids=[], finish_reason="stop", prompt_tokens=c.prompt_tokens)

    def generate(self, prompts, params, constraint=None):
        return [self._mute(c) for c in self.inner.generate(prompts, params, constraint)]

    def chat(self, messages, params, constraint=None):
        return self._mute(self.inner.chat(messages, params, constraint))

    def describe(self):
        return {"name": self.name}


class _Traced:
    """A fast engine's description over the reference engine's answers: each call counts one step per output
    token as fast (``fast=True``) or as fallen back for ``reason``, as a builtin fast engine's trace does."""

    def __init__(self, inner, fast: bool, reason: str = "prefill") -> None:
        self.inner, self.name, self.fast, self.reason = inner, "builtin:traced", fast, reason
        self.max_model_len, self.vocab_size = inner.max_model_len, inner.vocab_size
        self.steps = 0

    def _count(self, out):
        self.steps += sum(len(c.token_ids) for c in (out if isinstance(out, list) else [out]))
        return out

    def generate(self, prompts, params, constraint=None):
        return self._count(self.inner.generate(prompts, params, constraint))

    def chat(self, messages, params, constraint=None):
        return self._count(self.inner.chat(messages, params, constraint))

    def describe(self):
        n, fast = self.steps, self.steps if self.fast else 0
        return {"name": self.name, "fast_path_trace": {"steps": n, "fast_steps": fast, "fallback_steps": n - fast,
                                                       "fallbacks": {} if self.fast else {self.reason: n}}}


def _reseal(root: Path) -> None:
    files, _ = walk_bundle(root)
    entries = [SumEntry(f, sha256_file(root / f)[0]) for f in files if f != schema.SUMS]
    (root / schema.SUMS).write_bytes(format_sums(entries, sealed=False))


def _run_bundle(root: Path, plan: list[tuple[str, str, dict]], engines: _Engines, tmp: Path):
    """Run ``plan`` [(check id, function, params)] into a real bundle; returns the results by id."""
    writer = BundleWriter(root, tool_version="0.1.0", argv=["pytest"], tier="evals-test",
                          planned_checks=[p[0] for p in plan], engines=["builtin:reference"],
                          config={"preset": "k3-tiny"}, seeds={"global": 0}, env={})
    results = {}
    for cid, fn, params in plan:
        ctx = CheckContext(check_id=cid, preset="k3-tiny", device="cpu", seed=0, writer=writer, out=QuietOut(),
                           tmp_dir=tmp, budget_s=600, engines=engines)
        r = getattr(eval_checks, fn)(ctx, **params)
        writer.add_result(r)
        results[cid] = r
    writer.finalize(state="finished")
    return results


@pytest.mark.slow  # ~25 s on an idle 2-core CPU: 16 k3-tiny generations through lm-eval
def test_evals_on_builtin_engine_bundle_verifies_and_tamper_fails(engine, data_dir, tmp_path) -> None:
    loose = tmp_path / "loose.yaml"
    loose.write_text(PERMISSIVE)
    common = {"data_dir": str(data_dir), "max_tokens": 4}
    plan = [("evals.gsm8k", "gsm8k", {**common, "limit": 2}),
            ("evals.aime25", "aime25", {**common, "limit": 1, "repeats": 2, "thresholds": str(loose)}),
            ("evals.mrcr", "mrcr", {**common, "limit": 1, "needles": [2], "thresholds": str(loose)})]
    root = tmp_path / "bundle"
    res = _run_bundle(root, plan, _Engines(engine, engine), tmp_path)

    # k3-tiny with random weights runs into max_tokens every time: the default thresholds fail the eval
    g = res["evals.gsm8k"]
    assert g.status == "failed", g
    assert "truncation (hit max_tokens) rate 100.0% on the baseline side" in g.reason
    # with truncation allowed, identical engines pass every paired gate
    for cid in ("evals.aime25", "evals.mrcr"):
        assert res[cid].status == "passed", (cid, res[cid].reason, res[cid].metrics.get("problems"))
    m = res["evals.aime25"].metrics["tasks"]["k3_aime25"]
    assert m["items"] == 1 and m["baseline"]["responses"] == 2 and m["under_test"]["truncation_rate"] == 1.0
    assert res["evals.mrcr"].metrics["data"][0]["kind"] == "mrcr2"

    records = [json.loads(x) for x in (root / "records" / "evals.aime25.jsonl").read_text().splitlines()]
    samples = [r for r in records if r["type"] == "sample"]
    assert {s["side"] for s in samples} == {"baseline", "under_test"}
    for s in samples:  # what lm-eval logged plus what the adapter saw, per repeat
        assert len(s["doc_hash"]) == len(s["prompt_hash"]) == 64
        assert s["repeats"] == 2 and s["output_tokens"] == [4, 4] and s["truncated"] == [True, True]
        assert s["finish_reasons"] == ["length", "length"] and len(set(s["seeds"])) == 2  # each repeat its own seed
    data = [r for r in records if r["type"] == "data"]
    assert data[0]["files"][0]["sha256"] == json.loads((data_dir / "MANIFEST.json").read_text())["files"]["aime25/test.jsonl"]["sha256"]

    report = verify_bundle(root)  # the evals.* rescorer is registered by importing verify.evals.rescore
    assert ("evals.", rescore.rescore_eval) in verify_module._RESCORERS
    assert report.ok, report.problems
    assert report.verdict == "fail"

    # a forger edits one sample's score (and re-seals the hashes): the rescorer re-scores the response
    p = root / "records" / "evals.mrcr.jsonl"
    lines = p.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if json.loads(line)["type"] == "sample")
    s = json.loads(lines[i])
    s["scores"] = [1.0]
    lines[i] = json.dumps(s, separators=(",", ":"))
    p.write_text("\n".join(lines) + "\n")
    _reseal(root)
    bad = verify_bundle(root)
    assert bad.exit_code == 1
    assert any("evals.mrcr: rescore:" in x and "re-score" in x for x in bad.problems), bad.problems


def test_broken_fast_path_fails_the_paired_gates(engine, data_dir, tmp_path) -> None:
    loose = tmp_path / "loose.yaml"
    loose.write_text(PERMISSIVE)
    res = _run_bundle(tmp_path / "b", [("evals.gsm8k", "gsm8k", {"data_dir": str(data_dir), "max_tokens": 4, "limit": 2,
                                                                  "thresholds": str(loose)})],
                      _Engines(_Mute(engine), engine), tmp_path)
    r = res["evals.gsm8k"]
    assert r.status == "failed"
    problems = r.metrics["problems"]
    assert any("mean output 0.0 tokens vs baseline 4.0" in p for p in problems), problems
    assert r.metrics["tasks"]["k3_gsm8k"]["under_test"]["extraction_failure_rate"] == 1.0  # nothing to extract
    assert verify_bundle(tmp_path / "b").ok  # a failing run is still a valid, re-derivable bundle


def test_an_engine_under_test_that_ran_no_fast_step_fails_and_the_rescorer_rederives_it(engine, data_dir,
                                                                                      tmp_path) -> None:
    """The served gate: a fast engine (its description counts fast-path steps) must run some on the fast path
    during the check. The same answers with every step fallen back fail with the reasons; both verdicts and
    the ``served`` metrics are re-derived from the ``engine_steps`` records, and a forged count is found."""
    from test_status_rescore import forge

    loose = tmp_path / "loose.yaml"
    loose.write_text(PERMISSIVE)
    params = {"data_dir": str(data_dir), "max_tokens": 3, "limit": 2, "thresholds": str(loose)}
    ok = _run_bundle(tmp_path / "ok", [("evals.gsm8k", "gsm8k", params)],
                     _Engines(_Traced(engine, fast=True), engine), tmp_path)["evals.gsm8k"]
    assert ok.status == "passed", (ok.reason, ok.metrics.get("problems"))
    assert ok.metrics["served"]["baseline"] is None  # the reference engine counts no fast-path steps
    assert ok.metrics["served"]["under_test"] == {"steps": 6, "fast_steps": 6, "fallback_steps": 0, "fallbacks": {}}
    assert verify_bundle(tmp_path / "ok").ok
    bad = _run_bundle(tmp_path / "bad", [("evals.gsm8k", "gsm8k", params)],
                      _Engines(_Traced(engine, fast=False, reason="no CUDA graph for batch 3"), engine),
                      tmp_path)["evals.gsm8k"]
    assert bad.status == "failed"
    assert "under_test (builtin:traced): no step ran on the fast path during this check (6 fell back: no CUDA " \
           "graph for batch 3 x6)" in bad.metrics["problems"]
    assert verify_bundle(tmp_path / "bad").ok  # the failure is re-derived from the records
    forge(tmp_path / "bad", "evals.gsm8k", result={"status": "passed", "reason": ""})  # re-sealed as a forger would
    assert any("records fail a gate" in p and "no step ran on the fast path" in p
               for p in verify_bundle(tmp_path / "bad").problems), verify_bundle(tmp_path / "bad").problems
    forge(tmp_path / "ok", "evals.gsm8k", result={"metrics": {**ok.metrics, "served": {
        "baseline": None, "under_test": {**ok.metrics["served"]["under_test"], "fast_steps": 60}}}})
    assert any("the engine_steps records give" in p for p in verify_bundle(tmp_path / "ok").problems)


def test_missing_data_is_an_error_not_a_skip(engine, tmp_path) -> None:
    res = _run_bundle(tmp_path / "c", [("evals.gsm8k", "gsm8k", {"data_dir": str(tmp_path / "nowhere")})],
                      _Engines(engine, engine), tmp_path)
    r = res["evals.gsm8k"]
    assert r.status == "error" and "does not exist" in r.reason


def test_tiers_and_registry_match_the_check_functions() -> None:
    """Every tier's params for evals.* (GPU and CPU) bind to the check function; the checks run on a CPU (no
    requires); the builtin tiers score the sentinel on items its training keeps out (train.EVAL_EXCLUDE)."""
    from k3_fastpath.sentinel.train import EVAL_EXCLUDE

    for cid in ("evals.gsm8k", "evals.aime25", "evals.mrcr"):
        decl = REGISTRY[cid]
        assert decl.requires == ()
        fn = getattr(eval_checks, decl.function)
        for tier in ("standard", "full"):
            spec = {c.id: c for c in load_tier(tier).checks}[cid]
            for device in ("cuda", "cpu"):
                params = spec.params_for(device)
                inspect.signature(fn).bind(None, **{**decl.params, **params})
                assert params["model"] == "sentinel" and params["data_dir"] == "synthetic"
                assert params["limit"] <= EVAL_EXCLUDE[cid.removeprefix("evals.")], (tier, cid)


def test_mrcr_at_two_lengths_is_two_gated_task_sets_that_rescore(engine, tmp_path) -> None:
    """``lengths``: one synthetic MRCR data set per conversation length, tasks named by length, prompts
    measured in tokens, re-derived by ``bundle verify``; lengths need synthetic data."""
    loose = tmp_path / "loose.yaml"
    loose.write_text(PERMISSIVE)
    params = {"data_dir": "synthetic", "max_tokens": 3, "limit": 1, "needles": [2], "thresholds": str(loose),
              "lengths": [160, 480]}
    root = tmp_path / "lengths"
    r = _run_bundle(root, [("evals.mrcr", "mrcr", params)], _Engines(engine, engine), tmp_path)["evals.mrcr"]
    assert r.status == "passed", (r.reason, r.metrics.get("problems"))
    assert set(r.metrics["tasks"]) == {"k3_mrcr_2needle@160c", "k3_mrcr_2needle@480c"}
    short, long_ = (r.metrics["prompt_tokens"][f"k3_mrcr_2needle@{n}c"]["median"] for n in (160, 480))
    assert 0 < short < long_  # the longer conversation is the longer prompt
    assert [d["mrcr_chars"] for d in r.metrics["data"]] == [160, 480]
    assert verify_bundle(root).ok
    from test_status_rescore import forge

    forge(root, "evals.mrcr", result={"status": "failed", "reason": "forged"})  # re-sealed as a forger would
    assert any("records pass every gate" in p for p in verify_bundle(root).problems), verify_bundle(root).problems
    bad = _run_bundle(tmp_path / "nosynth", [("evals.mrcr", "mrcr", {**params, "data_dir": str(tmp_path)})],
                      _Engines(engine, engine), tmp_path)["evals.mrcr"]
    assert bad.status == "error" and "needs data_dir: synthetic" in bad.reason
    bad = _run_bundle(tmp_path / "dup", [("evals.mrcr", "mrcr", {**params, "lengths": [160, 160]})],
                      _Engines(engine, engine), tmp_path)["evals.mrcr"]
    assert bad.status == "error" and "distinct positive integers" in bad.reason


def test_chats_go_to_the_engine_in_batches_and_answer_as_one_at_a_time(engine) -> None:
    """``EngineLM`` sends greedy chats through the engine's ``chat_batch`` up to its batch size (one decode
    batch, as a server serves concurrent requests), sampled ones too, each with its own seed; every answer is
    the one it gets alone (k3-tiny's reference path on this CPU: token for token)."""
    from lm_eval.api.instance import Instance

    from verify.evals.lm_adapter import ChatPrompt, EngineLM

    calls = []

    class Counting:
        name, max_model_len, vocab_size = engine.name, engine.max_model_len, engine.vocab_size

        def chat_batch(self, conversations, params, constraint=None, seeds=None):
            calls.append((len(conversations), params.temperature))
            return engine.chat_batch(conversations, params, constraint, seeds)

    convs = [[{"role": "user", "content": f"item {i}: " + "seven " * i}] for i in range(5)]
    greedy = {"until": [], "max_gen_toks": 5, "do_sample": False}
    sampled = {"until": [], "max_gen_toks": 5, "do_sample": True, "temperature": 1.0}
    reqs = [Instance("generate_until", None, (ChatPrompt(json.dumps(c)), kw), i, task_name="t", doc_id=i)
            for i, (c, kw) in enumerate([(c, greedy) for c in convs] + [(convs[0], sampled), (convs[1], sampled)])]
    lm = EngineLM(Counting(), seed=0, batch_size=3)
    texts = lm.generate_until(reqs)
    assert sorted(calls) == [(2, 0.0), (2, 1.0), (3, 0.0)]  # 5 greedy as 3 + 2, the 2 sampled as one batch
    from verify.engines.base import SamplingParams

    assert texts[:5] == [engine.chat(c, SamplingParams(max_tokens=5)).text for c in convs]
    calls.clear()
    alone = EngineLM(Counting(), seed=0, batch_size=1).generate_until(reqs)
    assert len(calls) == 7 and alone == texts  # the sampled answers too: each its own seed, batch or not
    assert EngineLM(Counting(), seed=1, batch_size=3).generate_until(reqs)[5:] != texts[5:]  # the seed counts


def test_a_batch_holds_at_most_its_size_and_its_characters():
    """Long prompts go a few at a time (one over the cap alone), short ones up to the batch size, in order."""
    from verify.evals.batching import BATCH_CHARS, batched

    jobs = [(i, None, "x" * n) for i, n in enumerate([10] * 5 + [BATCH_CHARS // 2] * 3 + [BATCH_CHARS + 1, 10])]
    got = [[j[0] for j in b] for b in batched(jobs, lambda job: len(job[2]), 4)]
    assert got == [[0, 1, 2, 3], [4, 5], [6, 7], [8], [9]]
