"""The feature checks pass on the real builtin engine (k3-tiny, CPU) and FAIL on deliberately broken engines:
one that ignores the schema, one that applies the temperature twice, one that silently truncates the context.
Plus their statistics against independent implementations."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs_eval_extra: scripts/bootstrap --eval")
pytest.importorskip("xgrammar", reason="needs_eval_extra: scripts/bootstrap --eval")
pytest.importorskip("jsonschema", reason="needs_eval_extra: scripts/bootstrap --eval")

from check_harness import check_context  # noqa: E402

from verify.checks import feature_rules, features  # noqa: E402
from verify.engines.base import SamplingParams  # noqa: E402
from verify.engines.builtin import BuiltinEngine  # noqa: E402

MAX_LEN = 128


@pytest.fixture(scope="module")
def engine():
    e = BuiltinEngine(preset="k3-tiny", path="reference", device="cpu", seed=0, max_model_len=MAX_LEN)
    yield e
    e.close()


class _Engines:
    def __init__(self, eut, base) -> None:
        self.roles = {"engine_under_test": eut, "baseline": base}

    def get(self, role, model_source=None, speculative=None):
        assert model_source is None  # these tests score the run's model
        return self.roles[role]


def _run(check: str, eut, base, seed: int, **params):
    ctx, w = check_context(f"features.{check}", seed, _Engines(eut, base))
    return getattr(features, check)(ctx, **params), w.records


class _Wrapper:
    """Delegates everything to the real engine; subclasses break one thing."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"broken:{type(self).__name__}"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def generate(self, prompts, params, constraint=None):
        return self.inner.generate(prompts, params, constraint)

    def chat(self, messages, params, constraint=None):
        return self.inner.chat(messages, params, constraint)


class SchemaIgnored(_Wrapper):
    def generate(self, prompts, params, constraint=None):
        return self.inner.generate(prompts, params, None)

    def chat(self, messages, params, constraint=None):
        return self.inner.chat(messages, params, None)


class TemperatureTwice(_Wrapper):
    """logits / T / T: the temperature applied once by the server and once more by the sampler."""

    def generate(self, prompts, params, constraint=None):
        t = params.temperature
        return self.inner.generate(prompts, dataclasses.replace(params, temperature=t * t), constraint)


class Truncating(_Wrapper):
    """Keeps the last tokens that fit instead of rejecting an over-long request."""

    def generate(self, prompts, params, constraint=None):
        room = self.inner.max_model_len - params.max_tokens
        return self.inner.generate([list(p)[-room:] for p in prompts], params, constraint)


# ---------------------------------------------------------------------------------------------- structured output
SO = {"cases": ["compact", "date", "prefixes"], "temperatures": [0.0, 1.0], "samples": 1, "max_tokens": 80}


@pytest.mark.slow  # ~50 s on a busy 2-core machine: JSON spelled token by token
def test_structured_output_passes_on_the_builtin_engine(engine, seed):
    res, recs = _run("structured_output", engine, engine, seed, **SO)
    assert res.status == "passed", res.reason
    samples = [r for r in recs if r["kind"] == "sample"]
    assert len(samples) == 6 and all(r["valid"] for r in samples)
    assert res.metrics["engine_under_test_valid_fraction"] == 1.0 and res.metrics["same_engine"]


def test_structured_output_fails_when_the_schema_is_ignored(engine, seed):
    res, recs = _run("structured_output", SchemaIgnored(engine), engine, seed, cases=["date"], temperatures=[0.0],
                     samples=1, max_tokens=24)
    assert res.status == "failed", res.reason
    assert "broken:SchemaIgnored" in res.reason
    assert res.metrics["engine_under_test_valid_fraction"] < 1.0 and res.metrics["baseline_valid_fraction"] == 1.0


def test_validators_reject_what_they_should():
    person = feature_rules.CASES[0]["spec"]
    assert feature_rules.validate_output("json_schema", person, '{"name":"ab"}').startswith("schema violation")
    assert feature_rules.validate_output("json_schema", person, '{"name":"ab"').startswith("not JSON")
    assert feature_rules.validate_output("regex", r"[0-9]{2}", "123") is not None
    assert feature_rules.validate_output("choice", ["yes"], "yes ") is not None
    assert feature_rules.validate_output("choice", ["yes"], "yes") is None


# ---------------------------------------------------------------------------------------------- sampling
TS = {"temperatures": [0.5, 1.0], "filters": [{"top_k": 0, "top_p": 1.0}, {"top_k": 20, "top_p": 0.9}],
      "samples": 400, "alpha": 1e-4, "seq_tokens": 4, "other_seeds": 2}


def test_temperature_sampling_passes_on_the_builtin_engine(engine, seed, tmp_path):
    from test_status_rescore import assert_a_flipped_status_fails_verify

    res, recs = _run("temperature_sampling", engine, engine, seed, **TS)
    assert res.status == "passed", f"seed {seed}: {res.reason}"
    cells = [r for r in recs if r["kind"] == "frequency"]
    assert len(cells) == 4 and all(r["samples"] == 400 for r in cells)
    assert res.metrics["alpha_per_test"] == pytest.approx(1e-4 / 4)
    assert res.metrics["same_seed_same_tokens"] and res.metrics["other_seeds_differ"]
    # bundle verify's rule, on the records: the same verdict; counts moved to the top token (the recorded
    # p-value left as it was) fail the recomputed G-test
    assert feature_rules.temperature_sampling_problems(recs) == []
    forged = copy.deepcopy(recs)
    cell = next(r for r in forged if r["kind"] == "frequency")
    top = max(cell["counts"], key=lambda t: cell["counts"][t])
    cell["counts"] = {top: cell["samples"]}
    problems = feature_rules.temperature_sampling_problems(forged)
    assert any("its counts and the reference logits give 400, p=" in p for p in problems), problems
    assert any("token frequencies differ from softmax(logits/T)" in p for p in problems), problems
    assert next(r for r in recs if r["kind"] == "reference_logits")["top_p_rule"] == feature_rules.TOP_P_RULE
    assert_a_flipped_status_fails_verify(tmp_path / "b", res, recs)  # the status, flipped and re-sealed: refused


def test_temperature_sampling_fails_when_temperature_is_applied_twice(engine, seed):
    res, recs = _run("temperature_sampling", TemperatureTwice(engine), engine, seed, **TS)
    assert res.status == "failed"
    bad = {(r["temperature"], r["top_k"]) for r in recs if r["kind"] == "frequency" and not r["ok"]}
    assert (0.5, 0) in bad, f"seed {seed}: T=0.5 not caught: {res.reason}"
    assert all(t == 0.5 for t, _ in bad)  # at T=1 applying it twice changes nothing


def test_reference_distribution_agrees_with_the_sampler(seed):
    from k3_fastpath.runtime.sampler import SamplingConfig, filtered_logits

    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(512) * 1.5).astype(np.float32)
    for t, k, p in [(0.5, 0, 1.0), (1.5, 30, 1.0), (1.0, 0, 0.7), (0.8, 60, 0.9)]:
        want, amb = feature_rules.reference_distribution(logits.astype(np.float64), t, k, p)
        got = torch.softmax(filtered_logits(torch.from_numpy(logits), SamplingConfig(t, k, p)), -1).numpy()
        assert not amb.any()
        assert np.abs(got - want).max() < 1e-5, f"seed {seed} T={t} k={k} p={p}"


def test_top_p_ambiguity_is_the_logit_tolerance_carried_to_the_mass(seed):
    """A nucleus boundary another engine may place differently: with every logit within ``logit_tol``, the mass
    ahead of a token ``b`` can reach ``b / (b + (1 - b) e^(+-2 eps))``. A flat top-20 at T 0.7 (k3-tiny's
    synthetic distributions) built so that token 18 has 0.906 of mass ahead of it, 0.006 past top_p 0.9, like the
    four tokens the H100 run of features.spec_sampling sampled there (bundles/runs/2026-12-06-h100-session19): at
    logit_tol 0.05 it is ambiguous, under the old fixed rule (``rule="mass"``, mass_tol 0.005) it was
    forbidden; token 19 (0.953 ahead) stays forbidden; the new rule only adds ambiguous tokens, and at
    logit_tol 0 the two agree. The tail below the top 20 is fresh noise per run."""
    rng = np.random.default_rng(seed)
    t, k, tp = 0.7, 20, 0.9
    logits = np.concatenate([np.full(18, -5.0 + t * np.log(0.906 * 2 / (18 * 0.094))), [-5.0, -5.0],
                             -9.0 + np.clip(rng.standard_normal(492), -3, 3)])  # tail <= -6: never in the top 20
    p, amb = feature_rules.reference_distribution(logits, t, k, tp, 0.05, 0.005, rule="logit_bound")
    p_old, amb_old = feature_rules.reference_distribution(logits, t, k, tp, 0.05, 0.005, rule="mass")
    assert amb[18] and not amb_old[18] and p[18] == 0 == p_old[18]
    assert not amb[19] and p[19] == 0
    # tokens 18 and 19 tie: the rule of new records lets 19 be ordered first, so it is ambiguous too
    assert feature_rules.reference_distribution(logits, t, k, tp, 0.05, 0.005)[1][18:20].all()
    assert not (amb_old & ~amb).any() and np.array_equal(p, p_old)
    same = [feature_rules.reference_distribution(logits, t, k, tp, 0.0, 0.005, rule=r)[1]
            for r in ("logit_bound", "mass")]
    assert np.array_equal(*same)


def test_a_tie_or_near_tie_at_the_nucleus_boundary_is_ambiguous(seed):
    """The H100 case (bundles/runs/2026-12-06-h100-session20, token 420): the BF16 baseline gives two tokens the
    same log-probability and the nucleus boundary falls between them; ordered by id one is kept and the other
    dropped, a sampler's sort may order them the other way. Under "logit_bound_reorder" both are ambiguous even
    at logit_tol 0 (a tie), and still when one lies within 2 x logit_tol behind the other; "logit_bound" (the
    tokens ahead fixed) called the dropped one forbidden. Tokens far past the boundary stay forbidden. Built in
    probability space at T 0.7: 15 head tokens holding 0.88 (each above 0.035), the tied pair 0.03 each (mass
    ahead 0.88 and 0.91), a tail of 0.025 / 0.02 / 0.015, the rest ~0."""
    rng = np.random.default_rng(seed)
    t, k, tp = 0.7, 20, 0.9
    head = 0.035 + 0.355 * rng.dirichlet(np.ones(15))
    mass = np.concatenate([np.sort(head)[::-1], [0.03, 0.03, 0.025, 0.02, 0.015]])
    logits = np.concatenate([t * np.log(mass), -40.0 + rng.standard_normal(492)])
    p, amb = feature_rules.reference_distribution(logits, t, k, tp, 0.0, 0.0)
    assert p[15] > 0 and p[16] == 0, f"seed {seed}: the boundary falls between the tied tokens"
    assert amb[15] and amb[16], f"seed {seed}: a tie at the boundary is ambiguous"
    _, amb_fixed = feature_rules.reference_distribution(logits, t, k, tp, 0.0, 0.0, rule="logit_bound")
    assert not amb_fixed[16], "the rule without reordering calls it forbidden"
    assert p[17] == p[19] == 0 and not amb[17:20].any(), f"seed {seed}: far past the boundary stays forbidden"
    near = logits.copy()
    near[16] -= 0.09  # 0.09 behind its former tie: within 2 x logit_tol (0.1) of token 15
    p, amb = feature_rules.reference_distribution(near, t, k, tp, 0.05, 0.0)
    assert amb[16] and amb[15] and not amb[19], f"seed {seed}"
    far = logits.copy()
    far[16] -= 0.3  # past 2 x logit_tol: 16 now surely behind 15 and past the boundary
    p, amb = feature_rules.reference_distribution(far, t, k, tp, 0.05, 0.0)
    assert p[16] == 0 and not amb[16], f"seed {seed}"


def test_the_rule_rederives_under_the_top_p_rule_its_records_name(seed):
    """``temperature_sampling_problems`` judges a token 0.006 of mass past top_p as the records' own rule does:
    sampled under the logit-bound rule (records name ``top_p_rule``) it is ambiguous, left out; the same records
    without the name (written before it) are judged under the fixed mass rule, where it is a sample the
    filters remove."""
    t, k, tp = 0.7, 20, 0.9
    rng = np.random.default_rng(seed)
    logits = np.concatenate([np.full(18, -5.0 + t * np.log(0.906 * 2 / (18 * 0.094))), [-5.0, -5.0],
                             -9.0 + np.clip(rng.standard_normal(492), -3, 3)])  # tail <= -6: never in the top 20
    ref = {"kind": "reference_logits", "logits": logits.tolist(), "alpha": 1e-3, "logit_tol": 0.05,
           "mass_tol": 0.005, "min_expected": 5.0, "top_p_rule": feature_rules.TOP_P_RULE}
    counts = {str(i): 20 for i in range(18)} | {"18": 3}
    cell = {"kind": "frequency", "temperature": t, "top_k": k, "top_p": tp, "samples": 363, "p_value": 1.0,
            "alpha_per_test": 1e-3, "counts": counts}
    now = feature_rules.temperature_sampling_problems([ref, cell])
    assert not any("the filters remove" in p for p in now), now
    older = feature_rules.temperature_sampling_problems([{kk: v for kk, v in ref.items() if kk != "top_p_rule"}, cell])
    assert any("3 samples of tokens the filters remove" in p for p in older), older


def test_pooling_and_g_test(seed):
    rng = np.random.default_rng(seed)
    expected = rng.dirichlet(np.full(200, 0.3)) * 1000
    bins = feature_rules.pooled_bins(expected, 5.0)
    flat = sorted(i for b in bins for i in b)
    assert flat == sorted(int(i) for i in np.nonzero(expected > 0)[0])
    assert all(expected[b].sum() >= 5.0 for b in bins)
    obs = np.array([7.0, 13.0, 30.0])
    exp = np.array([10.0, 10.0, 30.0])
    g, df, p = feature_rules.g_test(obs, exp)
    assert g == pytest.approx(2 * (7 * np.log(0.7) + 13 * np.log(1.3))) and df == 2
    assert p == pytest.approx(np.exp(-g / 2), rel=1e-9)  # chi-square with 2 df: sf(x) = exp(-x/2)


# ---------------------------------------------------------------------------------------------- full context
def test_full_context_passes_on_the_builtin_engine(engine, seed):
    res, recs = _run("full_context", engine, engine, seed)
    assert res.status == "passed", res.reason
    full = [r for r in recs if r["kind"] == "full_context"]
    assert full[0]["prompt_tokens"] + len(full[0]["token_ids"]) == MAX_LEN
    assert all(r["rejected_clearly"] for r in recs if r["kind"] == "over_limit")


def test_full_context_fails_when_the_context_is_silently_truncated(engine, seed):
    res, recs = _run("full_context", Truncating(engine), engine, seed)
    assert res.status == "failed"
    assert "silently truncated" in res.reason
    assert not any(r["rejected_clearly"] for r in recs if r["kind"] == "over_limit")


def test_truncating_engine_really_truncates(engine, seed):
    """The broken engine is broken the way its name says: it answers an over-long request."""
    ids = torch.randint(3, 512, (MAX_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
    c = Truncating(engine).generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert c.prompt_tokens == MAX_LEN - 2


# ---------------------------------------------------------------------------------------------- the run plumbing
def _cli(*args: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "250"}
    env.pop("K3_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow  # a subprocess run: ~50 s on a busy 2-core machine
def test_run_builds_engines_once_records_them_and_verifies(tmp_path):
    """``k3-verify run --engine ...``: the manifest names both engines; each check records what it ran on;
    two checks share one engine (one build in the log); the bundle verifies."""
    import json

    tier = tmp_path / "t.yaml"
    tier.write_text("name: t\ndescription: d\ntarget_s: 1800\nchecks:\n"
                    "  - id: features.structured_output\n    budget_s: 900\n"
                    "    params: {cases: [prefixes], temperatures: [0.0], samples: 1, max_tokens: 8}\n"
                    "  - id: features.temperature_sampling\n    budget_s: 900\n"
                    "    params: {temperatures: [1.0], filters: [{top_k: 0, top_p: 1.0}], samples: 50, seq_tokens: 2,"
                    " other_seeds: 2}\n")
    out = tmp_path / "b"
    r = _cli("run", "--tier", str(tier), "--output", str(out), "--engine", "builtin:reference",
             "--baseline-engine", "builtin:reference", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] == "pass"
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(e["role"], e["spec"]) for e in manifest["engines"]] == [("engine_under_test", "builtin:reference"),
                                                                    ("baseline", "builtin:reference")]
    recs = [json.loads(line) for line in (out / "records" / "features.structured_output.jsonl").open()]
    assert recs[0]["kind"] == "engines" and recs[0]["engine_under_test"]["path"] == "reference"
    log = (out / "logs" / "run.log").read_text()
    assert log.count("building engine builtin:reference") == 1
    assert _cli("bundle", "verify", str(out)).returncode == 0


def test_bad_engine_spec_is_one_line_exit_2(tmp_path):
    r = _cli("run", "--tier", "smoke", "--engine", "tgi:foo", "--output", str(tmp_path / "x"))
    assert r.returncode == 2 and "unknown engine 'tgi:foo'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------- fast path (GPU)
@pytest.mark.gpu
def test_feature_checks_pass_on_the_fast_path_against_the_reference(seed):
    """On an H100/H200: builtin:fast (the executor, bf16) under test, builtin:reference (bf16) as baseline;
    all three checks pass and the executor's trace shows fast decode steps with no decode fallback."""
    fast = BuiltinEngine(preset="k3-tiny", path="fast", device="cuda", seed=0, max_model_len=MAX_LEN)
    ref = BuiltinEngine(preset="k3-tiny", path="reference", device="cuda", seed=0, max_model_len=MAX_LEN)
    try:
        for check, params in (("structured_output", SO), ("temperature_sampling", TS), ("full_context", {})):
            res, _ = _run(check, fast, ref, seed, **params)
            assert res.status == "passed", f"{check}: {res.reason}"
            assert not res.metrics["same_engine"]
        trace = fast.describe()["fast_path_trace"]
        assert trace["fast_steps"] > 0, trace
        assert all("prefill" in reason for reason in trace["fallbacks"]), trace["fallbacks"]  # decode: all fast
    finally:
        fast.close()
        ref.close()
