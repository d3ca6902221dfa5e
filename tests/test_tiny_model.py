"""The tiny Llama directory made for the vLLM tests: complete, deterministic, and a valid HF Llama."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers", reason="needs tokenizers/transformers (scripts/bootstrap --eval)")

from verify.engines.tiny_model import TinyLlamaSpec, make_tiny_llama, tiny_llama_weights  # noqa: E402


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_directory_is_byte_identical_per_seed(tmp_path):
    spec = TinyLlamaSpec(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1)
    a = _files(make_tiny_llama(tmp_path / "a", spec, seed=4))
    b = _files(make_tiny_llama(tmp_path / "b", spec, seed=4))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(a)
    assert a == b
    c = _files(make_tiny_llama(tmp_path / "c", spec, seed=5))
    assert c["model.safetensors"] != a["model.safetensors"] and c["tokenizer.json"] != a["tokenizer.json"]


def test_hf_config_and_weights_agree(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    spec = TinyLlamaSpec()
    d = make_tiny_llama(tmp_path / "m", spec)
    cfg = AutoConfig.from_pretrained(str(d))
    assert cfg.model_type == "llama" and cfg.vocab_size == spec.vocab_size == len(AutoTokenizer.from_pretrained(str(d)))
    raw = json.loads((d / "config.json").read_text())
    assert raw["eos_token_id"] == 2 and raw["architectures"] == ["LlamaForCausalLM"]
    w = load_file(str(d / "model.safetensors"))
    ref = tiny_llama_weights(spec)
    assert w.keys() == ref.keys() and len(w) == 3 + 9 * spec.num_hidden_layers
    for k in w:
        assert w[k].dtype == ref[k].dtype and w[k].equal(ref[k]), k
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (spec.num_key_value_heads * spec.head_dim,
                                                                 spec.hidden_size)
    # the scale the docstring promises: lm_head rows ~ N(0, logit_std^2 / hidden)
    std = float(w["lm_head.weight"].float().std()) * spec.hidden_size ** 0.5
    assert abs(std - spec.logit_std) < 0.1
