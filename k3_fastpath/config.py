"""K3Config: the Kimi K3 text model's configuration, parsed from a Hugging Face ``config.json``.

The field names are the published checkpoint's (``text_config`` of ``KimiK3ForConditionalGeneration``,
``linear_attn_config`` with 1-based ``kda_layers`` / ``full_attn_layers``, the MLA ranks, the LatentMoE
fields, the SiTU betas and ``attn_res_block_size``). Every value used anywhere in the package is read from
here; nothing is hard-coded elsewhere.

Presets (``preset(name)``):

* ``k3``           the full model (93 layers, 896 experts, 1M context).
* ``k3-tp8-rank``  the full model seen by one rank of tensor parallelism 8 (``RankShapes`` gives the
                   per-GPU shapes; see ../shared/design/K3.md "One GPU's share").
* ``k3-tp16-rank`` the same at tensor parallelism 16.
* ``k3-mini``      full per-layer shapes, 8 layers and a reduced expert pool (64): fits one H200.
* ``k3-tiny``      the same structure at toy sizes: a whole prefill + decode runs in seconds on a CPU.

A preset spec (``preset_spec``, ``get_config``) is a preset name with overrides, ``NAME[:key=value[,...]]``:
``experts`` (the expert pool, ``num_experts``), ``layers`` (``num_hidden_layers``, K3's KDA/MLA cadence
re-derived) and ``tp`` (the tensor-parallel size the preset stands for), e.g. ``k3-tp8-rank:experts=128``:
the rank emulation of ``runtime/rank_emulation.py`` (a full TP8 rank does not fit one H200). The config's
``name`` is the canonical spec, so a bundle says what ran.

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


# ---------------------------------------------------------------------------------------------- TP shapes
@dataclass(frozen=True)
class RankShapes:
    """One tensor-parallel rank's share of the model (K3.md, "One GPU's share"), as N x K of each GEMM."""

    tp_size: int
    kda_heads: int
    mla_heads: int
    kda_in_proj: tuple[int, int]  # fused q,k,v,g (column-parallel) + f_a (replicated) + beta (padded to 16)
    kda_o_proj: tuple[int, int]
    mla_qa_kva: tuple[int, int]  # fused q_a + kv_a, replicated
    mla_q_b: tuple[int, int]
    mla_kv_b: tuple[int, int]  # per rank: heads * (nope + v) x kv_lora_rank
    mla_gate: tuple[int, int]
    mla_o_proj: tuple[int, int]
    shared_gate_up: tuple[int, int]  # gate and up fused (2 x shared width / tp)
    shared_down: tuple[int, int]
    latent_down: tuple[int, int]
    latent_up: tuple[int, int]
    router: tuple[int, int]
    lm_head: tuple[int, int]
    expert_w13: tuple[int, int]  # one of w1 / w3 per expert: (intermediate / tp) x latent
    expert_w2: tuple[int, int]
    dense_gate_up: tuple[int, int]  # gate and up fused
    dense_down: tuple[int, int]

    def gemm_shapes(self) -> dict[str, tuple[int, int]]:
        """Every decode projection of a rank by name -> (N, K): the skinny-GEMM shape grid."""
        return {
            "kda_in_proj": self.kda_in_proj, "kda_o_proj": self.kda_o_proj, "mla_qa_kva": self.mla_qa_kva,
            "mla_q_b": self.mla_q_b, "mla_kv_b": self.mla_kv_b, "mla_gate": self.mla_gate,
            "mla_o_proj": self.mla_o_proj, "shared_gate_up": self.shared_gate_up, "shared_down": self.shared_down,
            "latent_down": self.latent_down, "latent_up": self.latent_up, "router": self.router,
            "lm_head": self.lm_head, "dense_gate_up": self.dense_gate_up, "dense_down": self.dense_down,
        }


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def rank_shapes(cfg: K3Config, tp_size: int) -> RankShapes:
    """Per-rank GEMM shapes under tensor parallelism ``tp_size`` (heads, vocab and widths split evenly)."""
    lac = cfg.linear_attn_config
    for what, n in (("linear_attn_config.num_heads", lac.num_heads), ("num_attention_heads", cfg.num_attention_heads),
                    ("moe_intermediate_size", cfg.moe_intermediate_size), ("vocab_size", cfg.vocab_size),
                    ("shared intermediate", cfg.shared_intermediate_size), ("intermediate_size", cfg.intermediate_size)):
        if n % tp_size:
            raise ConfigError(f"config field '{what}' = {n} is not divisible by tp_size {tp_size}")
    h = cfg.hidden_size
    kh = lac.num_heads // tp_size
    mh = cfg.num_attention_heads // tp_size
    kw = kh * lac.head_dim
    in_proj_n = 4 * kw + lac.head_dim + _ceil_to(kh, 16)
    return RankShapes(
        tp_size=tp_size,
        kda_heads=kh,
        mla_heads=mh,
        kda_in_proj=(in_proj_n, h),
        kda_o_proj=(h, kw),
        mla_qa_kva=(cfg.q_lora_rank + cfg.mla_latent_dim, h),
        mla_q_b=(mh * cfg.q_head_dim, cfg.q_lora_rank),
        mla_kv_b=(mh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        mla_gate=(mh * cfg.v_head_dim, h),
        mla_o_proj=(h, mh * cfg.v_head_dim),
        shared_gate_up=(2 * cfg.shared_intermediate_size // tp_size, h),
        shared_down=(h, cfg.shared_intermediate_size // tp_size),
        latent_down=(cfg.routed_expert_hidden_size, h),
        latent_up=(h, cfg.routed_expert_hidden_size),
        router=(cfg.num_experts, h),
        lm_head=(cfg.vocab_size // tp_size, h),
        expert_w13=(cfg.moe_intermediate_size // tp_size, cfg.routed_expert_hidden_size),
        expert_w2=(cfg.routed_expert_hidden_size, cfg.moe_intermediate_size // tp_size),
        dense_gate_up=(2 * cfg.intermediate_size // tp_size, h),
        dense_down=(h, cfg.intermediate_size // tp_size),
    )


# ---------------------------------------------------------------------------------------------- presets
def _k3_layers(n: int, mla_every: int = 4) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K3's cadence, 1-based: MLA at every ``mla_every``-th layer and at the last; KDA elsewhere."""
    full = {i for i in range(mla_every, n + 1, mla_every)} | {n}
    kda = tuple(i for i in range(1, n + 1) if i not in full)
    return kda, tuple(sorted(full))


def _k3_full() -> K3Config:
    kda, full = _k3_layers(93)
    return K3Config(
        vocab_size=163840, hidden_size=7168, intermediate_size=33792, num_hidden_layers=93, rms_norm_eps=1e-5,
        max_position_embeddings=1_048_576, tie_word_embeddings=False,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config=LinearAttnConfig(num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                            use_full_rank_gate=True, gate_lower_bound=-5.0,
                                            kda_layers=kda, full_attn_layers=full),
        num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
        moe_renormalize=True, routed_scaling_factor=1.0, first_k_dense_replace=1, moe_layer_freq=1,
        num_expert_group=1, topk_group=1, activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        attn_res_block_size=12, expert_format="mxfp4", name="k3",
    )


@dataclass(frozen=True)
class Preset:
    name: str
    config: K3Config
    tp_size: int
    description: str

    @property
    def shapes(self) -> RankShapes:
        return rank_shapes(self.config, self.tp_size)


def _mini() -> K3Config:
    kda, full = _k3_layers(8)  # MLA at 3 and 7 (0-based), KDA elsewhere; layer 0 dense
    base = _k3_full()
    return dataclasses.replace(
        base, num_hidden_layers=8, num_experts=64, attn_res_block_size=4, max_position_embeddings=262_144,
        linear_attn_config=dataclasses.replace(base.linear_attn_config, kda_layers=kda, full_attn_layers=full),
        name="k3-mini",
    )


def _tiny() -> K3Config:
    # 8 layers: MLA at 3, 6, 7 (0-based; K3 also ends on two MLA layers), KDA elsewhere, layer 0 dense;
    # AttnRes blocks of 3 so snapshots close at layers 0, 3 and 6.
    kda = (1, 2, 3, 5, 6)
    full = (4, 7, 8)
    return K3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config=LinearAttnConfig(num_heads=4, head_dim=32, short_conv_kernel_size=4,
                                            use_full_rank_gate=True, gate_lower_bound=-5.0,
                                            kda_layers=kda, full_attn_layers=full),
        num_experts=16, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=128,
        routed_expert_hidden_size=64, latent_moe_use_norm=True, moe_router_activation_func="sigmoid",
        moe_renormalize=True, routed_scaling_factor=1.0, first_k_dense_replace=1, moe_layer_freq=1,
        num_expert_group=1, topk_group=1, activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        attn_res_block_size=3, expert_format="mxfp4", name="k3-tiny",
    )


PRESET_NAMES = ("k3", "k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-tiny")


def preset(name: str) -> Preset:
    """A named preset; unknown names raise ``ConfigError`` listing the known ones."""
    if name == "k3":
        return Preset(name, _k3_full(), 1, "the full Kimi K3 text model (2.8T parameters)")
    if name == "k3-tp8-rank":
        return Preset(name, dataclasses.replace(_k3_full(), name=name), 8, "one TP8 rank's shapes of the full model")
    if name == "k3-tp16-rank":
        return Preset(name, dataclasses.replace(_k3_full(), name=name), 16, "one TP16 rank's shapes of the full model")
    if name == "k3-mini":
        return Preset(name, _mini(), 1, "full per-layer shapes, 8 layers, 64 experts: fits one H200")
    if name == "k3-tiny":
        return Preset(name, _tiny(), 1, "K3's structure at toy sizes: CPU-fast")
    raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")


# ---------------------------------------------------------------------------------------------- preset specs
SPEC_KEYS = ("experts", "layers", "tp")  # the overrides a preset spec takes, in their canonical order


def is_preset_spec(name_or_path: str) -> bool:
    """True for ``NAME`` or ``NAME:overrides`` with ``NAME`` a preset (the rest of ``get_config``'s inputs are
    paths)."""
    return name_or_path.split(":", 1)[0] in PRESET_NAMES


def _parse_overrides(spec: str, text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in text.split(","):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not key:
            raise ConfigError(f"preset spec {spec!r}: override {item.strip()!r} is not key=value "
                              f"(keys: {', '.join(SPEC_KEYS)})")
        if key not in SPEC_KEYS:
            raise ConfigError(f"preset spec {spec!r}: unknown key {key!r} (keys: {', '.join(SPEC_KEYS)})")
        if key in out:
            raise ConfigError(f"preset spec {spec!r}: key {key!r} is given twice")
        if not value.isdigit():
            raise ConfigError(f"preset spec {spec!r}: {key} must be a positive integer, got {value!r}")
        out[key] = int(value)
    return out


def spec_name(base: str, overrides: dict[str, int | str]) -> str:
    """The canonical spec of preset ``base`` with ``overrides`` (keys in ``SPEC_KEYS`` order; none: ``base``)."""
    items = [f"{k}={overrides[k]}" for k in SPEC_KEYS if k in overrides]
    return f"{base}:{','.join(items)}" if items else base


def preset_spec(spec: str) -> Preset:
    """A preset with overrides: ``NAME[:key=value[,key=value]]`` (see the module docstring), e.g.
    ``k3-tp8-rank:experts=128`` or ``k3-tp16-rank:layers=24``. ``experts`` must be at least
    ``num_experts_per_token``; ``layers`` at least 2 (K3's cadence re-derived with ``_k3_layers``); ``tp``
    must divide the heads, widths and vocabulary. The result's ``name`` (and its config's) is the canonical
    spec. A bad spec raises a one-line ``ConfigError`` naming the key."""
    base, colon, rest = spec.strip().partition(":")
    p = preset(base)
    if not colon:
        return p
    if not rest.strip():
        raise ConfigError(f"preset spec {spec!r}: no overrides after ':' (keys: {', '.join(SPEC_KEYS)})")
    ov = _parse_overrides(spec, rest)
    cfg, tp = p.config, p.tp_size
    changes: dict[str, Any] = {}
    if "experts" in ov:
        k = cfg.num_experts_per_token
        if ov["experts"] < k:
            raise ConfigError(f"preset spec {spec!r}: experts={ov['experts']} is below num_experts_per_token ({k})")
        changes["num_experts"] = ov["experts"]
    if "layers" in ov:
        n = ov["layers"]
        if n < 2:
            raise ConfigError(f"preset spec {spec!r}: layers={n} must be at least 2")
        kda, full = _k3_layers(n)
        changes["num_hidden_layers"] = n
        changes["linear_attn_config"] = dataclasses.replace(cfg.linear_attn_config, kda_layers=kda,
                                                            full_attn_layers=full)
        changes["first_k_dense_replace"] = min(cfg.first_k_dense_replace, n)
    name = spec_name(base, ov)
    try:
        cfg = cfg.replace(name=name, **changes)
    except ConfigError as e:
        raise ConfigError(f"preset spec {spec!r}: {e}") from None
    if "tp" in ov:
        tp = ov["tp"]
        if tp < 1:
            raise ConfigError(f"preset spec {spec!r}: tp={tp} must be at least 1")
        try:
            rank_shapes(cfg, tp)
        except ConfigError as e:
            raise ConfigError(f"preset spec {spec!r}: tp={tp}: {e}") from None
    desc = f"{p.description}; overrides {', '.join(f'{k}={v}' for k, v in ov.items())}"
    return Preset(name, cfg, tp, desc)


def get_config(name_or_path: str) -> K3Config:
    """A preset name or spec (``preset_spec``), or a path to a config.json / checkpoint directory."""
    if name_or_path in PRESET_NAMES:
        return preset(name_or_path).config
    if is_preset_spec(name_or_path) or (":" in name_or_path and not Path(name_or_path).exists()):
        return preset_spec(name_or_path).config  # "k4:experts=8" says "unknown preset", not "no config.json"
    return load_config(name_or_path)
