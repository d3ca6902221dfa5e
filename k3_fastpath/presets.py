"""Named K3 configs (``preset(name)``) and preset specs (``preset_spec``, ``get_config``).

* ``k3``           the full model (93 layers, 896 experts, 1M context).
* ``k3-tp8-rank``  the full model seen by one rank of tensor parallelism 8 (``Preset.shapes()`` gives the
                   per-GPU shapes; see ../shared/design/K3.md "One GPU's share").
* ``k3-tp16-rank`` the same at tensor parallelism 16.
* ``k3-mini``      full per-layer shapes, 8 layers and a reduced expert pool (64): fits one H200.
* ``k3-sentinel``  K3's structure and per-head shapes with a TP16 rank's 6 heads at width 1024: the model
                   ``k3_fastpath.sentinel`` trains so evals have signal.
* ``k3-tiny``      the same structure at toy sizes: a whole prefill + decode runs in seconds on a CPU.

A preset spec is a preset name with overrides, ``NAME[:key=value[,...]]``: ``experts`` (the expert pool,
``num_experts``), ``layers`` (``num_hidden_layers``, K3's KDA/MLA cadence re-derived) and ``tp`` (the
tensor-parallel size the preset stands for) and ``mtp`` (``num_nextn_predict_layers``: next-token layers after the
decoder, the ``mtp`` drafter's), e.g. ``k3-tp8-rank:experts=128``: the rank emulation of
``measure/rank_emulation.py`` (a full TP8 rank does not fit one H200). The config's ``name`` is the
canonical spec, so a bundle says what ran. A bad name or spec raises a one-line ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, K3Config, LinearAttnConfig, load_config
from .rank_shapes import RankShapes, rank_shapes


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


def _sentinel() -> K3Config:
    """K3's structure with K3's per-head dimensions (KDA head 128; MLA q/k 128 + 64, v 128, the 576-wide
    latent, q LoRA 1536) and a TP16 rank's 6 heads, at a small width (1024), 16 experts (top 4) and a
    1024-token vocabulary: 158M parameters, 75M of them routed experts (40 MB in MXFP4; 205 MB with the
    other 82M in BF16), trainable in minutes (``k3_fastpath.sentinel``). 9 layers: layer 0 dense, MLA at 4, 8 and 9 (1-based: K3 also ends on
    two MLA layers), KDA elsewhere; AttnRes blocks of 3."""
    kda, full = _k3_layers(9)
    base = _k3_full()
    return dataclasses.replace(
        base, vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=9,
        max_position_embeddings=65_536, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        num_attention_heads=6,
        linear_attn_config=dataclasses.replace(base.linear_attn_config, num_heads=6, kda_layers=kda,
                                               full_attn_layers=full),
        num_experts=16, num_experts_per_token=4, moe_intermediate_size=384, routed_expert_hidden_size=512,
        attn_res_block_size=3, name="k3-sentinel",
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


PRESET_NAMES = ("k3", "k3-tp8-rank", "k3-tp16-rank", "k3-mini", "k3-sentinel", "k3-tiny")


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
    if name == "k3-sentinel":
        return Preset(name, _sentinel(), 1, "K3's structure and per-head shapes, 6 heads, width 1024: the trained sentinel")
    if name == "k3-tiny":
        return Preset(name, _tiny(), 1, "K3's structure at toy sizes: CPU-fast")
    raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")


# ---------------------------------------------------------------------------------------------- preset specs
SPEC_KEYS = ("experts", "layers", "tp", "mtp")  # the overrides a preset spec takes, in their canonical order


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
    if "mtp" in ov:
        changes["num_nextn_predict_layers"] = ov["mtp"]
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
