"""The builtin engine on k3-tiny (CPU): greedy = argmax of the reference logits, logprobs, context limit,
structured output through xgrammar, chat, stop strings, seeds, and the engine plumbing."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers", reason="needs_eval_extra: scripts/bootstrap --eval")

from verify.engines import EnginePool, build_engine, describe_spec, parse_spec  # noqa: E402
from verify.engines.base import Constraint, ContextLimitError, EngineError, SamplingParams  # noqa: E402
from verify.engines.builtin import BuiltinEngine  # noqa: E402

MAX_LEN = 96


@pytest.fixture(scope="module")
def engine():
    e = BuiltinEngine(preset="k3-tiny", path="reference", device="cpu", seed=0, max_model_len=MAX_LEN)
    yield e
    e.close()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _recompute_argmax(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_equals_argmax_of_reference_logits(engine, seed):
    prompts = [_ids(seed, 7), _ids(seed + 1, 3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2))
    for p, c in zip(prompts, outs, strict=True):
        assert c.token_ids == _recompute_argmax(engine.model, p, 5), f"seed {seed}"
        assert c.prompt_tokens == len(p) and c.finish_reason == "length"
        assert all(max(lp, key=lp.get) == t for lp, t in zip(c.logprobs, c.token_ids, strict=True))


def test_next_token_logprobs_are_log_softmax_of_every_token(engine, seed):
    p = _ids(seed, 6)
    lp = engine.next_token_logprobs(p)
    assert sorted(lp) == list(range(512))
    want = torch.log_softmax(engine.model(torch.tensor([p]))[0, -1].double(), -1)
    got = torch.tensor([lp[i] for i in range(512)], dtype=torch.float64)
    assert float((got - want).abs().max()) < 1e-4
    assert abs(float(got.exp().sum()) - 1.0) < 1e-5


def test_context_limit_is_a_clear_rejection(engine, seed):
    fits = engine.generate([_ids(seed, MAX_LEN - 2)], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert fits.prompt_tokens == MAX_LEN - 2 and len(fits.token_ids) == 2
    with pytest.raises(ContextLimitError, match=rf"prompt {MAX_LEN - 2} tokens \+ max_tokens 3 = {MAX_LEN + 1} "
                                                rf"> max_model_len {MAX_LEN}"):
        engine.generate([_ids(seed, MAX_LEN - 2)], SamplingParams(max_tokens=3))
    with pytest.raises(ContextLimitError):
        engine.next_token_logprobs(_ids(seed, MAX_LEN))


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "kind": {"enum": ["a", "b", "c"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        # bounded strings by pattern: xgrammar 0.2.8 lets maxLength-only strings hold raw control characters
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "minItems": 1,
                 "maxItems": 2},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False},
    },
    "required": ["id", "kind", "score", "tags", "inner"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_outputs_validate(engine, seed, temperature):
    jsonschema = pytest.importorskip("jsonschema", reason="needs_eval_extra")
    pytest.importorskip("xgrammar", reason="needs_eval_extra")
    params = SamplingParams(max_tokens=80, temperature=temperature, seed=seed)
    cases = [(Constraint("json_schema", SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             (Constraint("regex", r"[a-z]{2,5}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
             (Constraint("choice", ["yes", "yes please", "no"]), lambda t: t in ("yes", "yes please", "no"))]
    for constraint, valid in cases:
        outs = engine.generate(["json:"], params, constraint)
        for c in outs:
            assert c.finish_reason == "stop" and c.extra["grammar_terminated"], (constraint, c)
            assert valid(c.text), f"seed {seed}: {constraint.kind} output {c.text!r} does not validate"


def test_grammar_allows_eos_only_when_complete(engine):
    pytest.importorskip("xgrammar", reason="needs_eval_extra")
    from k3_fastpath.runtime.sampler import bitmask_words, unpack_bitmask

    m = engine._grammar_compiler().matcher(Constraint("choice", ["ab", "abc"]))
    eos = engine.eos_token_ids[0]

    def allowed() -> torch.Tensor:
        bm = torch.zeros(bitmask_words(512), dtype=torch.int32)
        m.fill_bitmask(bm)
        return unpack_bitmask(bm, 512)

    assert not allowed()[eos]
    for t in engine.tokenize("ab"):
        assert m.accept_token(t)
    assert allowed()[eos]  # "ab" is complete, "abc" still possible
    assert m.accept_token(eos) and m.is_terminated()


def test_chat_stop_strings_and_seeds(engine, seed):
    msgs = [{"role": "user", "content": "hello there"}]
    c = engine.chat(msgs, SamplingParams(max_tokens=4, ignore_eos=True))
    templ = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert c.prompt_tokens == len(engine.tokenizer(templ, add_special_tokens=False)["input_ids"])
    full = engine.generate(["abc"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = full.text[3:5] if len(full.text) >= 5 else None
    if stop:
        cut = engine.generate(["abc"], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))[0]
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
    a, b = engine.generate(["abc", "abc"], p)
    assert a.token_ids == b.token_ids, "same seed, same tokens"
    others = [engine.generate(["abc"], SamplingParams(max_tokens=6, temperature=1.0, seed=seed + k,
                                                      ignore_eos=True))[0].token_ids for k in (1, 2)]
    assert any(o != a.token_ids for o in others)
    unseeded = engine.generate(["abc", "abc"], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    assert unseeded[0].extra["seed"] != unseeded[1].extra["seed"]


def test_fast_path_refuses_clearly_without_sm90():
    with pytest.raises(EngineError, match="sm_90"):
        BuiltinEngine(path="fast", device="cpu")
    with pytest.raises(EngineError, match="unknown engine"):
        parse_spec("builtin:turbo")
    with pytest.raises(EngineError, match="base URL"):
        parse_spec("openai:localhost")
    assert parse_spec("vllm+latency_specialized") == ("vllm", "latency_specialized")
    assert describe_spec("builtin:reference", "baseline", seed=3)["options"] == {"seed": 3}


def test_pool_builds_lazily_shares_and_remembers_failures():
    log: list[str] = []
    pool = EnginePool({"engine_under_test": "builtin:reference", "baseline": "builtin:reference"},
                      {"preset": "k3-tiny", "device": "cpu", "seed": 1, "max_model_len": 32, "unused": 1}, log.append)
    assert log == []
    a = pool.get("engine_under_test")
    assert pool.get("baseline") is a and set(pool.built) == {"engine_under_test", "baseline"}
    assert pool.built["baseline"]["max_model_len"] == 32
    pool.close()
    assert a.closed and a.describe()["name"] == "builtin:reference"
    bad = EnginePool({"engine_under_test": "builtin:fast"}, {"device": "cpu"})
    with pytest.raises(EngineError, match="sm_90") as e1:
        bad.get("engine_under_test")
    with pytest.raises(EngineError) as e2:
        bad.get("engine_under_test")
    assert e1.value is e2.value
    assert isinstance(build_engine("builtin:reference", preset="k3-tiny", max_model_len=16, other=2), BuiltinEngine)


def test_weights_from_a_preset_spec():
    """A preset spec with overrides (presets.preset_spec) loads synthetic weights of the overridden model."""
    from verify.engines.builtin import _load_weights

    cfg, sd, source, path = _load_weights("k3-tiny:experts=8,layers=4", 3)
    assert (cfg.num_experts, cfg.num_hidden_layers, path) == (8, 4, None) and source.startswith("synthetic")
    assert sd["model.layers.1.block_sparse_moe.gate.weight"].shape[0] == 8
