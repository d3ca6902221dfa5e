"""The HBM floor of one decode step: the bytes one GPU must move, divided by its measured read bandwidth.

A decode step at (config, tp, batch, context, routing) cannot be faster than the time it takes to stream
what it must touch from HBM once. What one rank must touch (K3.md, "Bytes a decode step must read"):

1. **every weight it uses, once**, in its stored dtype (BF16 / FP32 as the manifest says), cut to the
   rank's share by the manifest's TP rule (``weights.rank_shape``): column/row-parallel projections and
   heads split, REP tensors whole. Routed experts count only when touched: MXFP4 packed bytes + ue8m0
   scales of the rank's slice of each *distinct* expert the batch's top-k choices select in that MoE
   layer (``touched``: per MoE layer, from a routing model or a recorded routing, ``routing.py``);
   ``moe_latent_sharded=True`` models the router and latent down/up projections split across ranks too
   (K3.md's "fully sharded" 47.5 MB per layer instead of the manifest's replicated 148.6 MB);
2. **the embedding rows** of the batch's tokens (vocab-parallel: a rank holds ``1/tp`` of them) and the
   whole rank's share of ``lm_head``;
3. **the caches, per sequence**: the MLA latent cache read over the context, ``context x (kv_lora_rank +
   rope) x kv bytes`` per MLA layer (replicated on every rank: MLA TP splits heads, not the latent), plus
   the new token's latent written; the KDA recurrent state read and written, FP32 ``heads/tp x K x V``;
   the KDA conv state (the last ``W-1`` inputs of q, k and v, BF16) read and written.

Activations (a few hundred KB per step, L2-resident) are not counted. ``floor_us = bytes / read
bandwidth``, the bandwidth measured on the same machine in the same run (``perf.bandwidth_probe``, or
``_lib.timing.read_bandwidth_gbs``); writes are charged at the read rate.

Everything is derived from the config and the manifest; ``tests/test_floor.py`` pins the result to
K3.md's per-layer numbers (KDA 112.6 MB, MLA 84.5 MB, MoE non-expert 47.5 / 148.6 MB, expert slice
2.19 MB, 16 / 120 / 613 experts touched, KDA state 0.79 MB, 576 B per cached token).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import K3Config
from ..manifest import REP, TensorSpec, layer_specs, tensor_specs

L2_BYTES = 60 * 2**20  # H200 L2: a step that reads much more than this cannot be served from it

# Byte parts of a step, and the layer type each belongs to (the sweep's per-layer-type breakdown).
PART_LAYER_TYPE = {
    "kda": "kda", "kda_state": "kda", "kda_conv_state": "kda",
    "mla": "mla", "mla_cache": "mla",
    "moe_nonexpert": "moe", "moe_experts": "moe",
    "dense_mlp": "dense_mlp",
    "norms": "norms",
    "embed": "head", "lm_head": "head",
}
LAYER_TYPES = ("kda", "mla", "moe", "dense_mlp", "norms", "head")

_DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1}
# the small per-layer tensors in front of each sublayer (AttnRes mix weights, the sublayer's RMSNorm)
_NORM_PREFIXES = ("self_attention_res_", "input_layernorm", "mlp_res_", "post_attention_layernorm")


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Experts touched by ``batch`` tokens that each pick ``top_k`` distinct experts uniformly at random.

    An expert escapes one token with probability ``1 - k/E`` (the token's k picks are a uniform k-subset),
    so it is touched with probability ``1 - (1 - k/E)^B``; by linearity the expected count is
    ``E * (1 - (1 - k/E)^B)``: 16 / 120.3 / 613.2 for K3 (E=896, k=16) at batch 1 / 8 / 64.
    """
    if batch < 0 or not 0 < top_k <= num_experts:
        raise ValueError(f"need batch >= 0 and 0 < top_k <= num_experts, got {batch}, {top_k}, {num_experts}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def _rank_numel(spec: TensorSpec, tp: int, cfg: K3Config, moe_latent_sharded: bool) -> int:
    """Elements of rank 0's share of ``spec`` (all ranks hold the same amount)."""
    from ..weights import rank_shape

    if spec.tp == REP and moe_latent_sharded and spec.kind == "linear" and ".block_sparse_moe." in f".{spec.name}":
        # router and latent down/up projections split like a column/row-parallel GEMM
        n = spec.numel
        if n % tp:
            raise ValueError(f"{spec.name}: {n} elements cannot be sharded over tp {tp}")
        return n // tp
    n = 1
    for d in rank_shape(spec, tp, cfg):
        n *= d
    return n


def _spec_bytes(spec: TensorSpec, tp: int, cfg: K3Config, moe_latent_sharded: bool) -> int:
    return _rank_numel(spec, tp, cfg, moe_latent_sharded) * _DTYPE_BYTES[spec.dtype]


def _part_of(spec: TensorSpec, cfg: K3Config, layer: int) -> str | None:
    """Which part a per-layer tensor's bytes belong to; None for routed experts (counted per touch)."""
    local = spec.name.split(".", 3)[3]  # strip "model.layers.{i}."
    if local.startswith(_NORM_PREFIXES):
        return "norms"
    if local.startswith("self_attn."):
        return "kda" if cfg.is_kda_layer(layer) else "mla"
    if local.startswith("mlp."):
        return "dense_mlp"
    if local.startswith("block_sparse_moe.experts."):
        return None
    if local.startswith("block_sparse_moe."):
        return "moe_nonexpert"
    raise ValueError(f"tensor {spec.name} belongs to no known part of a decode step")


@dataclass(frozen=True)
class LayerWeightBytes:
    """One rank's weight bytes of one layer, by part (routed experts: one expert's slice, kept apart)."""

    layer: int
    parts: dict[str, int]
    expert_slice: int  # bytes of ONE routed expert's rank slice (w1 + w3 + w2, packed + scales); 0 if dense


def layer_weight_bytes(cfg: K3Config, layer: int, tp: int = 1, *, moe_latent_sharded: bool = False
                       ) -> LayerWeightBytes:
    """Bytes rank 0 reads for layer ``layer``'s weights, split into parts (``PART_LAYER_TYPE``)."""
    parts: dict[str, int] = {}
    expert_slice = 0
    first_expert = f"model.layers.{layer}.block_sparse_moe.experts.0."
    for spec in layer_specs(cfg, layer):
        part = _part_of(spec, cfg, layer)
        if part is None:
            if spec.name.startswith(first_expert):  # every expert has the same shapes
                expert_slice += _spec_bytes(spec, tp, cfg, moe_latent_sharded)
            continue
        parts[part] = parts.get(part, 0) + _spec_bytes(spec, tp, cfg, moe_latent_sharded)
    return LayerWeightBytes(layer, parts, expert_slice)


@functools.lru_cache(maxsize=64)
def _model_weight_bytes(cfg: K3Config, tp: int, moe_latent_sharded: bool
                        ) -> tuple[tuple[LayerWeightBytes, ...], tuple[TensorSpec, ...]]:
    """Every layer's ``LayerWeightBytes`` (layers of one kind computed once) and the non-layer specs."""
    by_kind: dict[tuple[bool, bool], LayerWeightBytes] = {}
    layers = []
    for i in range(cfg.num_hidden_layers):
        kind = (cfg.is_kda_layer(i), cfg.is_moe_layer(i))
        if kind not in by_kind:
            by_kind[kind] = layer_weight_bytes(cfg, i, tp, moe_latent_sharded=moe_latent_sharded)
        lw = by_kind[kind]
        layers.append(LayerWeightBytes(i, lw.parts, lw.expert_slice))
    # the embedding, final AttnRes/norm and lm_head do not depend on the experts: skip building 896 x 93 specs
    light = dataclasses.replace(cfg, num_experts=0)
    top = tuple(s for s in tensor_specs(light) if not s.name.startswith("model.layers."))
    return tuple(layers), top


def moe_layer_ids(cfg: K3Config) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def kda_state_bytes_per_seq(cfg: K3Config, tp: int = 1) -> int:
    """FP32 recurrent state of one sequence in one KDA layer on one rank: ``heads/tp x K x V x 4``."""
    lac = cfg.linear_attn_config
    return (lac.num_heads // tp) * lac.head_dim * lac.head_dim * 4


def kda_conv_state_bytes_per_seq(cfg: K3Config, tp: int = 1, conv_bytes: int = 2) -> int:
    """The q, k, v conv windows of one sequence in one KDA layer on one rank: ``3 x (W-1) x C/tp``."""
    lac = cfg.linear_attn_config
    return 3 * (lac.short_conv_kernel_size - 1) * (lac.projection_dim // tp) * conv_bytes


def mla_cache_bytes_per_token(cfg: K3Config, kv_bytes: int) -> int:
    """One cached token of one MLA layer: ``(kv_lora_rank + rope) x kv bytes`` (576 B in FP8 for K3)."""
    return cfg.mla_latent_dim * kv_bytes


@dataclass(frozen=True)
class StepBytes:
    """The bytes one rank moves in one decode step, by part; ``floor_us(bw)`` turns them into time."""

    config: str
    tp: int
    batch: int
    context: int
    kv_bytes: int
    touched: tuple[float, ...]  # distinct routed experts per MoE layer, in layer order
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def weight_bytes(self) -> int:
        """Weights only (no caches): what must stay out of L2 for a cold-L2 measurement."""
        return sum(v for k, v in self.parts.items() if k not in ("kda_state", "kda_conv_state", "mla_cache"))

    def by_layer_type(self) -> dict[str, int]:
        out = dict.fromkeys(LAYER_TYPES, 0)
        for part, b in self.parts.items():
            out[PART_LAYER_TYPE[part]] += b
        return out

    def floor_us(self, read_bytes_per_s: float) -> float:
        """The step's floor in microseconds at a read bandwidth in bytes per second."""
        if not read_bytes_per_s > 0:
            raise ValueError(f"read bandwidth must be positive, got {read_bytes_per_s}")
        return self.total / read_bytes_per_s * 1e6

    def floor_us_by_layer_type(self, read_bytes_per_s: float) -> dict[str, float]:
        return {k: v / read_bytes_per_s * 1e6 for k, v in self.by_layer_type().items()}

    def to_dict(self) -> dict:
        return {"config": self.config, "tp": self.tp, "batch": self.batch, "context": self.context,
                "kv_bytes": self.kv_bytes, "touched_experts": list(self.touched), "parts": dict(self.parts),
                "total_bytes": self.total}


def _touched_per_layer(cfg: K3Config, batch: int, touched: float | Sequence[float] | None) -> tuple[float, ...]:
    n_moe = len(moe_layer_ids(cfg))
    if touched is None:
        t = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, batch) if batch else 0.0
        return (t,) * n_moe
    if isinstance(touched, (int, float)):
        values = (float(touched),) * n_moe
    else:
        values = tuple(float(x) for x in touched)
        if len(values) != n_moe:
            raise ValueError(f"touched gives {len(values)} MoE layers, config {cfg.name!r} has {n_moe}")
    limit = min(cfg.num_experts, batch * cfg.num_experts_per_token)
    for i, v in enumerate(values):
        if not 0 <= v <= limit:
            raise ValueError(f"touched experts {v} in MoE layer {i} outside 0..{limit} "
                             f"(batch {batch} x top-{cfg.num_experts_per_token}, {cfg.num_experts} experts)")
    return values


def step_bytes(cfg: K3Config, *, tp: int = 1, batch: int, context: int, kv_bytes: int = 2,
               touched: float | Sequence[float] | None = None, moe_latent_sharded: bool = False,
               conv_bytes: int = 2, expert_pad: int = 1) -> StepBytes:
    """The bytes rank 0 of ``tp`` moves in one decode step of ``batch`` sequences at ``context`` tokens each.

    ``touched``: distinct routed experts per MoE layer (a number for all layers, or one per MoE layer);
    ``None`` = the uniform-routing expectation (``expected_distinct_experts``). ``kv_bytes``: bytes per
    cached latent element (2 BF16, 1 FP8). ``conv_bytes``: bytes per conv-state element (BF16).
    ``expert_pad``: a kernel that pads each rank's expert intermediate up to a multiple of this reads the
    padding too (K3.md: TP16's 192-wide slices "often padded to 256"); 1 = no padding.
    """
    if batch < 1 or context < 0 or tp < 1 or expert_pad < 1:
        raise ValueError(f"need batch >= 1, context >= 0, tp >= 1, expert_pad >= 1; got {batch}, {context}, "
                         f"{tp}, {expert_pad}")
    inter = cfg.moe_intermediate_size // tp
    pad_factor = (-(-inter // expert_pad) * expert_pad) / inter if inter else 1.0
    touched_t = _touched_per_layer(cfg, batch, touched)
    parts: dict[str, int] = {}

    def add(part: str, b: float) -> None:
        parts[part] = parts.get(part, 0) + int(round(b))

    moe_ids = moe_layer_ids(cfg)
    layers, top = _model_weight_bytes(cfg, tp, moe_latent_sharded)
    for i, lw in enumerate(layers):
        for part, b in lw.parts.items():
            add(part, b)
        if i in moe_ids:
            add("moe_experts", touched_t[moe_ids.index(i)] * lw.expert_slice * pad_factor)
        if cfg.is_kda_layer(i):
            add("kda_state", 2 * batch * kda_state_bytes_per_seq(cfg, tp))
            add("kda_conv_state", 2 * batch * kda_conv_state_bytes_per_seq(cfg, tp, conv_bytes))
        else:
            add("mla_cache", batch * (context + 1) * mla_cache_bytes_per_token(cfg, kv_bytes))
    for spec in top:
        b = _spec_bytes(spec, tp, cfg, moe_latent_sharded)
        if spec.kind == "embedding":
            add("embed", batch * cfg.hidden_size * _DTYPE_BYTES[spec.dtype] / tp)  # only the batch's rows
        elif spec.name == "lm_head.weight":
            add("lm_head", b)
        else:
            add("norms", b)
    return StepBytes(cfg.name, tp, batch, context, kv_bytes, touched_t, parts)


def floor_us(cfg: K3Config, read_bytes_per_s: float, **kwargs) -> float:
    """Shorthand: ``step_bytes(cfg, **kwargs).floor_us(read_bytes_per_s)``."""
    return step_bytes(cfg, **kwargs).floor_us(read_bytes_per_s)
