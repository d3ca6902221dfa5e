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
    # the scale the docstring promises: lm_head rows ~ N(0, logit_std^2 / hidden) (channel 0: the suppression)
    std = float(w["lm_head.weight"][:, 1:].float().std()) * spec.hidden_size ** 0.5
    assert abs(std - spec.logit_std) < 0.1


def test_partial_byte_tokens_are_never_sampled(tmp_path, seed):
    """Tokens that decode alone to an incomplete UTF-8 byte get far below the others at every position (a
    server would hold the stream behind them); without the suppression they hold real probability."""
    import torch
    from transformers import AutoModelForCausalLM

    from verify.engines.tiny_model import partial_byte_ids

    bad = partial_byte_ids(512, 0)
    assert len(bad) == 128
    ids = torch.randint(3, 512, (4, 24), generator=torch.Generator().manual_seed(seed))
    for spec, most in [(TinyLlamaSpec(), 1e-9), (TinyLlamaSpec(partial_byte_logit=0.0), None)]:
        model = AutoModelForCausalLM.from_pretrained(str(make_tiny_llama(tmp_path / str(most), spec)),
                                                     torch_dtype=torch.float32)
        with torch.no_grad():
            p = torch.softmax(model(ids).logits.float(), -1)[..., bad].sum(-1)
        if most is None:
            assert float(p.mean()) > 0.05  # the control: a quarter of the vocabulary, real mass
        else:
            assert float(p.max()) < most, f"seed {seed}: partial-byte mass {float(p.max())}"
