"""Speculative decoding inside the generator and the builtin engine (``+spec=ngram:K``) on k3-tiny (CPU).

Greedy speculative decoding with the prompt-lookup drafter emits exactly plain greedy's tokens, stop tokens
and log-probabilities included, while accepting drafts (prompts with repeats so lookups hit); structured
output validates under speculative decoding and its greedy text is plain decoding's (each verify row gets
the grammar's mask after the draft so far; with one mask for all rows the outputs break, shown below); the
engine spec parses and refuses bad options in one line. Fresh random prompts per run (``seed`` fixture)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.generator import GenerationRequest, Generator
from k3_fastpath.runtime.sampler import SamplingConfig
from k3_fastpath.runtime.spec_decode import NgramDrafter, SpecConfig, Speculation, SyntheticDrafter
from k3_fastpath.synthetic import synthetic_state_dict

CFG = preset("k3-tiny").config


@pytest.fixture(scope="module")
def model64():
    return load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.float64)


def _repeating_prompts(seed: int, n: int = 3) -> list[list[int]]:
    """Prompts made of a short random block repeated, so the drafter's lookups find earlier matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        block = torch.randint(3, CFG.vocab_size, (3 + i,), generator=g).tolist()
        out.append((block * 4)[: 9 + 2 * i])
    return out


def test_ngram_drafter_proposes_what_followed_the_latest_earlier_match():
    d = NgramDrafter(1, 3)
    assert d.propose(0, [5, 6, 7, 8, 5, 6], [], 3) == ([7, 8, 5], None)  # suffix [5, 6] at 0: then 7, 8, 5
    assert d.propose(0, [1, 2, 3, 9, 2, 3, 4, 2, 3], [], 2) == ([4, 2], None)  # the most recent [2, 3] first
    assert d.propose(0, [1, 2], [3, 1], 2) == ([2, 3], None)  # emitted tokens are context too
    assert d.propose(0, [1, 2, 3], [], 3) == ([], None)  # nothing recurs: no draft
    with pytest.raises(ValueError, match="1 \\+ k <= 8 rows"):
        SpecConfig("ngram", 8)
    assert SpecConfig.parse("ngram:5:min=2,max=4") == SpecConfig("ngram", 5, 2, 4)
    with pytest.raises(ValueError, match="METHOD:K\\[:OPTIONS\\]"):
        SpecConfig.parse("ngram")
    with pytest.raises(ValueError, match="no next-token \\(MTP\\) layer"):
        SpecConfig("mtp", 3).drafter(type("M", (), {"cfg": CFG})())
    assert SpecConfig.parse("synthetic:2:p=0.5") == SpecConfig("synthetic", 2, p=0.5)
    with pytest.raises(ValueError, match="option 'p=0.5' is not one of min=N, max=N for ngram"):
        SpecConfig.parse("ngram:2:p=0.5")


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_speculative_generation_is_plain_greedy(model64, seed, k):
    """Stop tokens and log-probabilities included, with drafts kept (the synthetic drafter: plain greedy's
    tokens with probability 0.7) and with the prompt-lookup drafter (acceptance as the model repeats)."""
    prompts = _repeating_prompts(seed)
    reqs = [GenerationRequest(prompt_ids=p, max_tokens=24, logprobs=3, stop_token_ids=(5, 6, 7)) for p in prompts]
    plain = Generator(model64, CFG.vocab_size, 64).generate(reqs)
    oracle = [o.token_ids + ([o.stop_token] if o.stop_token is not None else []) for o in plain]
    for drafter in (SyntheticDrafter(oracle, 0.7, CFG.vocab_size, seed), NgramDrafter(1, 3)):
        gen = Generator(model64, CFG.vocab_size, 64, spec=Speculation(drafter, k))
        spec = gen.generate(reqs)
        for a, b in zip(plain, spec, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, f"seed {seed} {drafter}"
            assert a.stop_token == b.stop_token
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-9 for t in x)
            emitted = len(b.token_ids) + (b.stop_token is not None)  # a stop token from the prefill: no step
            assert (b.acceptance["steps"] >= 1) == (emitted > 1) and len(b.acceptance["accepted"]) <= k
    # the synthetic drafter's drafts were kept: fewer verify steps than tokens after the first
    gen = Generator(model64, CFG.vocab_size, 64, spec=Speculation(SyntheticDrafter(oracle, 0.7, CFG.vocab_size,
                                                                                   seed), k))
    spec = gen.generate(reqs)
    assert sum(gen.acceptance.accepted) > 0, f"seed {seed}: no draft accepted"
    assert gen.acceptance.steps == sum(o.acceptance["steps"] for o in spec)  # per request, summed
    assert gen.acceptance.steps < sum(len(o.token_ids) + (o.stop_token is not None) - 1 for o in spec)


def test_the_draft_model_drafters_greedy_acceptance_is_its_p(model64, seed):
    """On the reference target the synthetic drafter drafts the target's own tokens: every kept draft is
    accepted (p 1: all of them), corrupted ones are rejected, so the per-position rate is about p; its
    corruptions depend on (seed, prompt, position) only: the same drafts in any batch."""
    from k3_fastpath.runtime.spec_decode import DraftModelDrafter

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, CFG.vocab_size, (5,), generator=g).tolist() for _ in range(4)]
    reqs = [GenerationRequest(prompt_ids=p, max_tokens=30, ignore_stop_tokens=True) for p in prompts]
    plain = Generator(model64, CFG.vocab_size, 64).generate(reqs)
    full = Generator(model64, CFG.vocab_size, 64, spec=Speculation(DraftModelDrafter(model64, 1.0, seed), 3))
    assert [o.token_ids for o in full.generate(reqs)] == [o.token_ids for o in plain]
    assert full.acceptance.accepted == full.acceptance.examined  # every examined draft accepted
    half = Generator(model64, CFG.vocab_size, 64, spec=Speculation(DraftModelDrafter(model64, 0.5, seed), 3))
    outs = half.generate(reqs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert 0.2 < half.acceptance.rates()[0] < 0.8, half.acceptance.record()
    alone = Generator(model64, CFG.vocab_size, 64, spec=Speculation(DraftModelDrafter(model64, 0.5, seed), 3))
    assert alone.generate(reqs[2:3])[0].acceptance == outs[2].acceptance  # batch-independent drafts


def test_sampled_speculative_generation_is_reproducible_and_stays_in_the_filters(model64, seed):
    from k3_fastpath.runtime.spec_decode import DraftModelDrafter

    prompts = _repeating_prompts(seed)
    cfg = SamplingConfig(temperature=0.8, top_k=5)
    reqs = [GenerationRequest(prompt_ids=p, max_tokens=16, sampling=cfg, seed=seed + i) for i, p in enumerate(prompts)]
    gen = Generator(model64, CFG.vocab_size, 64, spec=Speculation(DraftModelDrafter(model64, 0.8, seed), 3))
    a, b = gen.generate(reqs), gen.generate(reqs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(gen.acceptance.accepted) > 0 and sum(gen.acceptance.examined) > sum(gen.acceptance.accepted)
    # every emitted token is among the top 5 of its context (prefix recomputed by a plain forward)
    for p, o in zip(prompts, a, strict=True):
        ctx = list(p)
        for t in o.token_ids:
            top = model64(torch.tensor([ctx]))[0, -1].topk(5).indices.tolist()
            assert t in top, f"seed {seed}: token {t} outside top-5 {top}"
            ctx.append(t)


# ---------------------------------------------------------------------------------------------- the engine
pytest.importorskip("transformers", reason="needs_eval_extra: scripts/bootstrap --eval")

from verify.engines import EngineError, build_engine, parse_spec, with_speculation  # noqa: E402
from verify.engines.base import Constraint, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["aa", "bb", "cc"]}}, "required": ["n", "tag"],
          "additionalProperties": False}
CASES = [(Constraint("json_schema", SCHEMA), lambda t: _json_ok(t)),
         (Constraint("regex", r"([a-c]{2}-){2,4}[0-9]{2}"), lambda t: re.fullmatch(r"([a-c]{2}-){2,4}[0-9]{2}", t)),
         (Constraint("choice", ["ab ab ab", "ab ab", "ba"]), lambda t: t in ("ab ab ab", "ab ab", "ba"))]


def _json_ok(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except Exception:  # noqa: BLE001 - any failure: invalid
        return False
    return True


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("xgrammar", reason="needs_eval_extra")
    pytest.importorskip("jsonschema", reason="needs_eval_extra")
    plain = build_engine("builtin:reference", preset="k3-tiny", device="cpu", seed=0, max_model_len=128)
    spec = build_engine("builtin:reference+spec=ngram:4", preset="k3-tiny", device="cpu", seed=0, max_model_len=128)
    yield plain, spec
    plain.close()
    spec.close()


def _run_cases(engine, temperature: float, seed: int):
    out = []
    for constraint, valid in CASES:
        params = SamplingParams(max_tokens=60, temperature=temperature, seed=seed)
        for c in engine.generate(["ab ab ab ab:", "x: aa-bb-aa-"], params, constraint):
            out.append((constraint.kind, c, bool(valid(c.text)) and c.finish_reason == "stop"))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_validates_under_speculative_decoding(engines, seed, temperature):
    plain, spec = engines
    got = _run_cases(spec, temperature, seed)
    assert all(ok for _, _, ok in got), [(k, c.text, c.finish_reason) for k, c, ok in got if not ok]
    drafted = sum(sum(c.extra["acceptance"]["examined"]) for _, c, _ in got)
    assert drafted > 0, "no draft was examined: the verify steps did not run"
    if temperature == 0.0:  # greedy: plain decoding's text exactly
        want = _run_cases(plain, 0.0, seed)
        assert [c.text for _, c, _ in got] == [c.text for _, c, _ in want]


def test_without_per_row_masks_speculated_tokens_escape_the_grammar(engines, seed, monkeypatch):
    """The test above can fail: give every verify row the mask of row 0 (the bug of a grammar applied once
    per step, not per speculated token) and greedy outputs stop matching plain decoding or validating."""
    from k3_fastpath.runtime import spec_decode

    real = spec_decode._draft_bitmasks

    def first_row_only(constraint, draft, words):
        masks = real(constraint, draft, words)
        return masks[:1].expand_as(masks).clone()

    monkeypatch.setattr(spec_decode, "_draft_bitmasks", first_row_only)
    plain, spec = engines
    with pytest.raises(Exception) as info:  # noqa: PT011 - either symptom: a differing or invalid output
        got = _run_cases(spec, 0.0, seed)
        want = _run_cases(plain, 0.0, seed)
        assert all(ok for _, _, ok in got) and [c.text for _, c, _ in got] == [c.text for _, c, _ in want]
    assert isinstance(info.value, (AssertionError, RuntimeError)), info.value


def test_engine_spec_options_parse_and_refuse_in_one_line():
    assert parse_spec("builtin:reference+spec=ngram:3") == ("builtin", "reference+spec=ngram:3")
    assert with_speculation("builtin:fast+defect=kda_state_bf16", "ngram:2") == \
        "builtin:fast+defect=kda_state_bf16+spec=ngram:2"
    assert with_speculation("builtin:reference", "ngram:2") == "builtin:reference+spec=ngram:2"
    for bad, why in [("builtin:reference+spec=ngram:9", "1 \\+ k <= 8 rows"),
                     ("builtin:reference+spec=beam:3", "speculative method 'beam'"),
                     ("builtin:reference+spec=ngram:3+spec=ngram:2", "each at most once"),
                     ("builtin:reference+defect=x", "goes into the fast path"),
                     ("builtin:slow", "unknown engine builtin:slow")]:
        with pytest.raises(EngineError, match=why) as e:
            parse_spec(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(EngineError, match="already decodes with \\+spec=ngram:3"):
        with_speculation("builtin:reference+spec=ngram:3", "ngram:2")
    with pytest.raises(EngineError, match="--speculative-config"):
        with_speculation("vllm", "ngram:3")
