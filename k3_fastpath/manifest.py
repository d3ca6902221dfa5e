"""The checkpoint manifest: every tensor of a K3 checkpoint by its published name, shape, dtype and TP rule.

Names are those of the released K3 checkpoint (``KimiK3ForConditionalGeneration``; see the public
loaders in vLLM, mlx-lm and colibri): text-model tensors live under ``language_model.``, e.g.

    language_model.model.embed_tokens.weight
    language_model.model.layers.{i}.self_attention_res_norm.weight / self_attention_res_proj.weight [1, H]
    language_model.model.layers.{i}.input_layernorm.weight
    language_model.model.layers.{i}.self_attn.{q,k,v,g,o}_proj.weight             (KDA)
    language_model.model.layers.{i}.self_attn.{q,k,v}_conv1d.weight [C, 1, W]  F32 (KDA)
    language_model.model.layers.{i}.self_attn.{f_a,f_b,b}_proj.weight, A_log, dt_bias, o_norm.weight
    language_model.model.layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,
                                               kv_a_layernorm,kv_b_proj,g_proj,o_proj}   (MLA)
    language_model.model.layers.{i}.mlp_res_norm.weight / mlp_res_proj.weight, post_attention_layernorm.weight
    language_model.model.layers.0.mlp.{gate,up,down}_proj.weight                    (dense layer)
    language_model.model.layers.{i}.block_sparse_moe.gate.weight / gate.e_score_correction_bias (F32)
    language_model.model.layers.{i}.block_sparse_moe.routed_expert_{down_proj,norm,up_proj}.weight
    language_model.model.layers.{i}.block_sparse_moe.experts.{e}.w{1,2,3}.weight_packed / weight_scale  (MXFP4)
    language_model.model.layers.{i}.block_sparse_moe.shared_experts.{gate,up,down}_proj.weight
    language_model.model.output_attn_res_norm.weight / output_attn_res_proj.weight, model.norm.weight
    language_model.lm_head.weight
    language_model.model.layers.{L+j}.{embed_tokens,enorm,hnorm,eh_proj,shared_head.norm,shared_head.head}.weight
        and the block's input_layernorm / self_attn (MLA) / post_attention_layernorm / MLP tensors, no AttnRes
        (next-token layers j < num_nextn_predict_layers, L = num_hidden_layers; ``mtp_layer_specs``)

``A_log`` ships zero-padded to ``head_dim`` entries for ``num_heads`` real heads (only the first
``num_heads`` are used). FP32 parameters (A_log, dt_bias, conv weights, o_norm, the correction bias)
stay FP32: a blanket BF16 cast changes the model (K3.md, failure mode 6).

The reference model's ``state_dict()`` keys are these names without the ``language_model.`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import K3Config

CHECKPOINT_PREFIX = "language_model."

# TP rules: how one rank's share is cut from the full tensor.
COL = "col"  # split dim 0 (output features / heads) evenly across ranks
ROW = "row"  # split dim 1 (input features) evenly across ranks
REP = "rep"  # replicated on every rank
HEAD_VEC = "head_vec"  # a per-head vector (A_log), padded: rank r takes heads [r*h/tp, (r+1)*h/tp)
EXPERT_COL = "expert_col"  # per-expert w1/w3: split the intermediate (dim 0) across ranks
EXPERT_ROW = "expert_row"  # per-expert w2: split the intermediate (dim 1; packed: bytes) across ranks


@dataclass(frozen=True)
class TensorSpec:
    name: str  # without CHECKPOINT_PREFIX
    shape: tuple[int, ...]
    dtype: str  # "BF16", "F32", "U8"
    tp: str
    kind: str  # "linear", "norm", "conv", "vector", "embedding", "packed", "scale"

    @property
    def checkpoint_name(self) -> str:
        return CHECKPOINT_PREFIX + self.name

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * {"BF16": 2, "F32": 4, "U8": 1}[self.dtype]


def mtp_layer_specs(cfg: K3Config, i: int) -> list[TensorSpec]:
    """Next-token (MTP) layer ``i`` (``num_hidden_layers`` <= i): vLLM's ``KimiK3MTP`` names (its
    ``_rewrite_spec_layer_name``): the input norms and projection, the shared head, the embedding copy, then
    a decoder block of layer i's kind without AttnRes tensors (MLA: ``i + 1`` is in no ``kda_layers``)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    p = f"model.layers.{i}."
    head = [TensorSpec(p + "embed_tokens.weight", (v, h), "BF16", COL, "embedding"),
            TensorSpec(p + "enorm.weight", (h,), "BF16", REP, "norm"),
            TensorSpec(p + "hnorm.weight", (h,), "BF16", REP, "norm"),
            TensorSpec(p + "eh_proj.weight", (h, 2 * h), "BF16", REP, "linear"),
            TensorSpec(p + "shared_head.norm.weight", (h,), "BF16", REP, "norm"),
            TensorSpec(p + "shared_head.head.weight", (v, h), "BF16", COL, "linear")]
    return head + layer_specs(cfg, i, attn_res=False)


def layer_specs(cfg: K3Config, i: int, attn_res: bool = True) -> list[TensorSpec]:
    h = cfg.hidden_size
    lac = cfg.linear_attn_config
    p = f"model.layers.{i}."
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], dtype: str, tp: str, kind: str) -> None:
        if attn_res or not name.startswith(("self_attention_res_", "mlp_res_")):
            out.append(TensorSpec(p + name, tuple(shape), dtype, tp, kind))

    add("self_attention_res_norm.weight", (h,), "BF16", REP, "norm")
    add("self_attention_res_proj.weight", (1, h), "BF16", REP, "linear")
    add("input_layernorm.weight", (h,), "BF16", REP, "norm")
    if cfg.is_kda_layer(i):
        c = lac.projection_dim
        w = lac.short_conv_kernel_size
        a = "self_attn."
        for x in ("q", "k", "v"):
            add(f"{a}{x}_proj.weight", (c, h), "BF16", COL, "linear")
            add(f"{a}{x}_conv1d.weight", (c, 1, w), "F32", COL, "conv")
        add(f"{a}f_a_proj.weight", (lac.head_dim, h), "BF16", REP, "linear")
        add(f"{a}f_b_proj.weight", (c, lac.head_dim), "BF16", COL, "linear")
        add(f"{a}A_log", (max(lac.head_dim, lac.num_heads),), "F32", HEAD_VEC, "vector")
        add(f"{a}dt_bias", (c,), "F32", COL, "vector")
        add(f"{a}b_proj.weight", (lac.num_heads, h), "BF16", COL, "linear")
        add(f"{a}g_proj.weight", (c, h), "BF16", COL, "linear")
        add(f"{a}o_norm.weight", (lac.head_dim,), "F32", REP, "norm")
        add(f"{a}o_proj.weight", (h, c), "BF16", ROW, "linear")
    else:
        a = "self_attn."
        nh = cfg.num_attention_heads
        add(f"{a}q_a_proj.weight", (cfg.q_lora_rank, h), "BF16", REP, "linear")
        add(f"{a}q_a_layernorm.weight", (cfg.q_lora_rank,), "BF16", REP, "norm")
        add(f"{a}q_b_proj.weight", (nh * cfg.q_head_dim, cfg.q_lora_rank), "BF16", COL, "linear")
        add(f"{a}kv_a_proj_with_mqa.weight", (cfg.mla_latent_dim, h), "BF16", REP, "linear")
        add(f"{a}kv_a_layernorm.weight", (cfg.kv_lora_rank,), "BF16", REP, "norm")
        add(f"{a}kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "BF16", COL, "linear")
        if cfg.mla_use_output_gate:
            add(f"{a}g_proj.weight", (nh * cfg.v_head_dim, h), "BF16", COL, "linear")
        add(f"{a}o_proj.weight", (h, nh * cfg.v_head_dim), "BF16", ROW, "linear")
    add("mlp_res_norm.weight", (h,), "BF16", REP, "norm")
    add("mlp_res_proj.weight", (1, h), "BF16", REP, "linear")
    add("post_attention_layernorm.weight", (h,), "BF16", REP, "norm")
    if cfg.is_moe_layer(i):
        m = "block_sparse_moe."
        lat = cfg.routed_expert_hidden_size
        inter = cfg.moe_intermediate_size
        add(f"{m}gate.weight", (cfg.num_experts, h), "BF16", REP, "linear")
        add(f"{m}gate.e_score_correction_bias", (cfg.num_experts,), "F32", REP, "vector")
        add(f"{m}routed_expert_down_proj.weight", (lat, h), "BF16", REP, "linear")
        if cfg.latent_moe_use_norm:
            add(f"{m}routed_expert_norm.weight", (lat,), "BF16", REP, "norm")
        add(f"{m}routed_expert_up_proj.weight", (h, lat), "BF16", REP, "linear")
        for e in range(cfg.num_experts):
            for wname, (n, k), rule in (("w1", (inter, lat), EXPERT_COL), ("w3", (inter, lat), EXPERT_COL),
                                        ("w2", (lat, inter), EXPERT_ROW)):
                base = f"{m}experts.{e}.{wname}."
                if cfg.expert_format == "mxfp4":
                    add(base + "weight_packed", (n, k // 2), "U8", rule, "packed")
                    add(base + "weight_scale", (n, k // 32), "U8", rule, "scale")
                else:
                    add(base + "weight", (n, k), "BF16", rule, "linear")
        s = cfg.shared_intermediate_size
        add(f"{m}shared_experts.gate_proj.weight", (s, h), "BF16", COL, "linear")
        add(f"{m}shared_experts.up_proj.weight", (s, h), "BF16", COL, "linear")
        add(f"{m}shared_experts.down_proj.weight", (h, s), "BF16", ROW, "linear")
    else:
        d = cfg.intermediate_size
        add("mlp.gate_proj.weight", (d, h), "BF16", COL, "linear")
        add("mlp.up_proj.weight", (d, h), "BF16", COL, "linear")
        add("mlp.down_proj.weight", (h, d), "BF16", ROW, "linear")
    return out


def tensor_specs(cfg: K3Config) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in a stable order (embedding, layers 0.., final, lm_head, MTP layers)."""
    h = cfg.hidden_size
    out = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h), "BF16", COL, "embedding")]
    for i in range(cfg.num_hidden_layers):
        out.extend(layer_specs(cfg, i))
    out.append(TensorSpec("model.output_attn_res_norm.weight", (h,), "BF16", REP, "norm"))
    out.append(TensorSpec("model.output_attn_res_proj.weight", (1, h), "BF16", REP, "linear"))
    out.append(TensorSpec("model.norm.weight", (h,), "BF16", REP, "norm"))
    out.append(TensorSpec("lm_head.weight", (cfg.vocab_size, h), "BF16", COL, "linear"))
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        out.extend(mtp_layer_specs(cfg, i))
    return out
