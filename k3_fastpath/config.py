"""K3Config: the Kimi K3 text model's configuration, parsed from a Hugging Face ``config.json``.

The field names are the published checkpoint's (``text_config`` of ``KimiK3ForConditionalGeneration``,
``linear_attn_config`` with 1-based ``kda_layers`` / ``full_attn_layers``, the MLA ranks, the LatentMoE
fields, the SiTU betas and ``attn_res_block_size``). Every value used anywhere in the package is read from
here; nothing is hard-coded elsewhere. The named presets and preset specs are ``presets.py``, one tensor-
parallel rank's shapes ``rank_shapes.py``.

An invalid config raises ``ConfigError`` whose message names the offending field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json (or preset override) that does not describe a valid K3 model."""


@dataclass(frozen=True)
class LinearAttnConfig:
    """KDA (Kimi Delta Attention) layers: ``text_config.linear_attn_config``."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    use_full_rank_gate: bool
    gate_lower_bound: float
    kda_layers: tuple[int, ...]  # 1-based, as in the checkpoint
    full_attn_layers: tuple[int, ...]  # 1-based, as in the checkpoint

    @property
    def projection_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class K3Config:
    """The text model. Sizes are the full model's; ``RankShapes`` gives one TP rank's share."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP of the first ``first_k_dense_replace`` layers
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    # gated NoPE MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    # KDA
    linear_attn_config: LinearAttnConfig
    # LatentMoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool
    moe_router_activation_func: str
    moe_renormalize: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_expert_group: int
    topk_group: int
    # SiTU-GLU activation and AttnRes
    activation_situ_beta: float
    activation_situ_linear_beta: float
    attn_res_block_size: int
    # multi-token prediction: next-token (MTP) layers after the decoder, checkpoint names model.layers.{L + j}.*
    # (L = num_hidden_layers), each an MLA + MLP block without AttnRes (reference/mtp.py); 0: none
    num_nextn_predict_layers: int = 0
    # routed-expert weight format in the checkpoint: "mxfp4" (compressed-tensors mxfp4-pack-quantized) or "bf16"
    expert_format: str = "mxfp4"
    name: str = "custom"
    _raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ layer structure
    def is_kda_layer(self, layer: int) -> bool:
        """0-based layer index -> True for a KDA layer (the config lists 1-based indices)."""
        return (layer + 1) in self.linear_attn_config.kda_layers

    def is_mla_layer(self, layer: int) -> bool:
        return (layer + 1) in self.linear_attn_config.full_attn_layers

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla_layer(i)]

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Width of one cached MLA token: c_kv (kv_lora_rank) + k_pe (qk_rope_head_dim); 576 for K3."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def num_attn_res_blocks(self) -> int:
        """Snapshots the residual stream can hold (one per block opened): ceil(layers / block)."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` this config round-trips through (multimodal wrapper, text only)."""
        lac = self.linear_attn_config
        text = {
            "model_type": "kimi_linear",
            "architectures": ["KimiK3ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "hidden_act": "situ",
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "mla_use_output_gate": self.mla_use_output_gate,
            "linear_attn_config": {
                "num_heads": lac.num_heads,
                "head_dim": lac.head_dim,
                "short_conv_kernel_size": lac.short_conv_kernel_size,
                "use_full_rank_gate": lac.use_full_rank_gate,
                "gate_lower_bound": lac.gate_lower_bound,
                "kda_layers": list(lac.kda_layers),
                "full_attn_layers": list(lac.full_attn_layers),
            },
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "moe_router_activation_func": self.moe_router_activation_func,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "attn_res_block_size": self.attn_res_block_size,
        }
        if self.num_nextn_predict_layers:
            text["num_nextn_predict_layers"] = self.num_nextn_predict_layers
        out: dict[str, Any] = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
            "k3_verify_preset": self.name,
        }
        if self.expert_format == "mxfp4":
            out["quantization_config"] = mxfp4_quantization_config()
        return out

    def replace(self, **changes: Any) -> K3Config:
        """A copy with some fields changed, re-validated (``ConfigError`` names a bad field)."""
        new = dataclasses.replace(self, **changes)
        validate(new)
        return new


def mxfp4_quantization_config() -> dict[str, Any]:
    """compressed-tensors metadata for routed experts in ``mxfp4-pack-quantized`` (e2m1 + ue8m0 per 32)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "scale_dtype": "ue8m0",
                },
                "input_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*"],
    }


# ---------------------------------------------------------------------------------------------- parsing
_REQUIRED_TEXT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "linear_attn_config", "num_experts", "num_experts_per_token", "moe_intermediate_size",
    "routed_expert_hidden_size", "first_k_dense_replace", "attn_res_block_size",
)
_REQUIRED_LINEAR_FIELDS = ("num_heads", "head_dim", "kda_layers", "full_attn_layers")


def _get(d: dict[str, Any], key: str, where: str, default: Any = dataclasses.MISSING) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if default is dataclasses.MISSING:
        raise ConfigError(f"config field '{where}{key}' is missing")
    return default


def _typed(value: Any, kind: type, name: str) -> Any:
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config field '{name}' must be a boolean, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field '{name}' must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config field '{name}' must be a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"config field '{name}' must be a string, got {value!r}")
        return value
    raise TypeError(kind)


def from_hf_dict(raw: dict[str, Any], name: str = "custom") -> K3Config:
    """Parse a HF ``config.json`` dict (the multimodal wrapper with ``text_config``, or a bare text config)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    if "vision_config" in raw and raw["vision_config"]:
        # The text tower alone would be silently wrong on image prompts; the caller must strip it knowingly.
        pass
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError("config field 'text_config' must be an object")
    p = "text_config." if "text_config" in raw else ""
    for key in _REQUIRED_TEXT_FIELDS:
        _get(text, key, p)
    lac_raw = text["linear_attn_config"]
    if not isinstance(lac_raw, dict):
        raise ConfigError(f"config field '{p}linear_attn_config' must be an object")
    lp = p + "linear_attn_config."
    for key in _REQUIRED_LINEAR_FIELDS:
        _get(lac_raw, key, lp)

    def ints(v: Any, n: str) -> tuple[int, ...]:
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ConfigError(f"config field '{n}' must be a list of integers")
        return tuple(v)

    lac = LinearAttnConfig(
        num_heads=_typed(lac_raw["num_heads"], int, lp + "num_heads"),
        head_dim=_typed(lac_raw["head_dim"], int, lp + "head_dim"),
        short_conv_kernel_size=_typed(_get(lac_raw, "short_conv_kernel_size", lp, 4), int,
                                      lp + "short_conv_kernel_size"),
        use_full_rank_gate=_typed(_get(lac_raw, "use_full_rank_gate", lp, True), bool, lp + "use_full_rank_gate"),
        gate_lower_bound=_typed(_get(lac_raw, "gate_lower_bound", lp, -5.0), float, lp + "gate_lower_bound"),
        kda_layers=ints(lac_raw["kda_layers"], lp + "kda_layers"),
        full_attn_layers=ints(lac_raw["full_attn_layers"], lp + "full_attn_layers"),
    )
    eos = _get(text, "eos_token_id", p, raw.get("eos_token_id", 163586))
    if isinstance(eos, list):
        eos = eos[0]
    group = text.get("num_expert_group", text.get("n_group", 1))
    expert_format = "bf16"
    qc = raw.get("quantization_config") or text.get("quantization_config")
    if qc:
        fmt = str(qc.get("format", ""))
        if "mxfp4" in fmt:
            expert_format = "mxfp4"
        else:
            raise ConfigError(f"config field 'quantization_config.format' is {fmt!r}; only mxfp4-pack-quantized is supported")

    def f(key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
        return _typed(_get(text, key, p, default), kind, p + key)

    cfg = K3Config(
        vocab_size=f("vocab_size", int),
        hidden_size=f("hidden_size", int),
        intermediate_size=f("intermediate_size", int),
        num_hidden_layers=f("num_hidden_layers", int),
        rms_norm_eps=f("rms_norm_eps", float, 1e-5),
        max_position_embeddings=f("max_position_embeddings", int, 1_048_576),
        tie_word_embeddings=f("tie_word_embeddings", bool, False),
        bos_token_id=f("bos_token_id", int, raw.get("bos_token_id", 163584)),
        eos_token_id=_typed(eos, int, p + "eos_token_id"),
        pad_token_id=f("pad_token_id", int, raw.get("pad_token_id", 163839)),
        num_attention_heads=f("num_attention_heads", int),
        q_lora_rank=f("q_lora_rank", int),
        kv_lora_rank=f("kv_lora_rank", int),
        qk_nope_head_dim=f("qk_nope_head_dim", int),
        qk_rope_head_dim=f("qk_rope_head_dim", int),
        v_head_dim=f("v_head_dim", int),
        mla_use_nope=f("mla_use_nope", bool, True),
        mla_use_output_gate=f("mla_use_output_gate", bool, True),
        linear_attn_config=lac,
        num_experts=f("num_experts", int),
        num_experts_per_token=f("num_experts_per_token", int),
        num_shared_experts=f("num_shared_experts", int, 2),
        moe_intermediate_size=f("moe_intermediate_size", int),
        routed_expert_hidden_size=f("routed_expert_hidden_size", int),
        latent_moe_use_norm=f("latent_moe_use_norm", bool, True),
        moe_router_activation_func=f("moe_router_activation_func", str, "sigmoid"),
        moe_renormalize=f("moe_renormalize", bool, True),
        routed_scaling_factor=f("routed_scaling_factor", float, 1.0),
        first_k_dense_replace=f("first_k_dense_replace", int),
        moe_layer_freq=f("moe_layer_freq", int, 1),
        num_expert_group=_typed(group, int, p + "num_expert_group"),
        topk_group=f("topk_group", int, 1),
        activation_situ_beta=f("activation_situ_beta", float, 4.0),
        activation_situ_linear_beta=f("activation_situ_linear_beta", float, 25.0),
        attn_res_block_size=f("attn_res_block_size", int),
        num_nextn_predict_layers=f("num_nextn_predict_layers", int, 0),
        expert_format=expert_format,
        name=str(raw.get("k3_verify_preset", name)),
        _raw=raw,
    )
    validate(cfg)
    return cfg


def load_config(path: str | Path) -> K3Config:
    """Read ``config.json`` from a file or a checkpoint directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {p}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    return from_hf_dict(raw, name=p.parent.name)


def validate(cfg: K3Config) -> None:
    """Structural checks; each failure names the field."""
    lac = cfg.linear_attn_config
    p = "text_config."
    positive = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
        "moe_intermediate_size": cfg.moe_intermediate_size, "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "attn_res_block_size": cfg.attn_res_block_size, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "moe_layer_freq": cfg.moe_layer_freq,
        "linear_attn_config.num_heads": lac.num_heads, "linear_attn_config.head_dim": lac.head_dim,
        "linear_attn_config.short_conv_kernel_size": lac.short_conv_kernel_size,
    }
    for k, v in positive.items():
        if v <= 0:
            raise ConfigError(f"config field '{p}{k}' must be positive, got {v}")
    if cfg.num_nextn_predict_layers < 0:
        raise ConfigError(f"config field '{p}num_nextn_predict_layers' must be >= 0")
    if cfg.qk_rope_head_dim < 0:
        raise ConfigError(f"config field '{p}qk_rope_head_dim' must be >= 0")
    if not cfg.rms_norm_eps > 0:
        raise ConfigError(f"config field '{p}rms_norm_eps' must be positive")
    if not cfg.mla_use_nope:
        raise ConfigError(f"config field '{p}mla_use_nope' is false: K3 MLA has no rotary embedding; RoPE MLA is not K3")
    if not lac.use_full_rank_gate:
        raise ConfigError(f"config field '{p}linear_attn_config.use_full_rank_gate' is false: K3 uses the full-rank output gate")
    if not lac.gate_lower_bound < 0:
        raise ConfigError(f"config field '{p}linear_attn_config.gate_lower_bound' must be negative")
    n = cfg.num_hidden_layers
    seen: dict[int, str] = {}
    for key, layers in (("kda_layers", lac.kda_layers), ("full_attn_layers", lac.full_attn_layers)):
        for i in layers:
            if not 1 <= i <= n:
                raise ConfigError(f"config field '{p}linear_attn_config.{key}' holds {i}, outside 1..{n} (1-based)")
            if i in seen:
                raise ConfigError(f"config field '{p}linear_attn_config.{key}': layer {i} is listed twice")
            seen[i] = key
    missing = [i for i in range(1, n + 1) if i not in seen]
    if missing:
        raise ConfigError(
            f"config field '{p}linear_attn_config.kda_layers': layer {missing[0]} (1-based) is in neither "
            f"kda_layers nor full_attn_layers"
        )
    if not 0 < cfg.num_experts_per_token <= cfg.num_experts:
        raise ConfigError(f"config field '{p}num_experts_per_token' must be in 1..num_experts ({cfg.num_experts})")
    if cfg.moe_router_activation_func != "sigmoid":
        raise ConfigError(f"config field '{p}moe_router_activation_func' is {cfg.moe_router_activation_func!r}; K3 routes with sigmoid")
    if cfg.num_expert_group != 1 or cfg.topk_group != 1:
        raise ConfigError(f"config field '{p}num_expert_group'/'topk_group' must be 1 (K3 routes over one group)")
    if not 0 <= cfg.first_k_dense_replace <= n:
        raise ConfigError(f"config field '{p}first_k_dense_replace' must be in 0..{n}")
    if cfg.expert_format not in ("mxfp4", "bf16"):
        raise ConfigError(f"config field 'quantization_config.format' gives unknown expert format {cfg.expert_format!r}")
    if cfg.expert_format == "mxfp4":
        for k, v in (("routed_expert_hidden_size", cfg.routed_expert_hidden_size),
                     ("moe_intermediate_size", cfg.moe_intermediate_size)):
            if v % 32:
                raise ConfigError(f"config field '{p}{k}' = {v} is not a multiple of 32 (MXFP4 groups of 32)")
    if cfg.tie_word_embeddings:
        raise ConfigError(f"config field '{p}tie_word_embeddings' is true; K3 has an untied lm_head")
