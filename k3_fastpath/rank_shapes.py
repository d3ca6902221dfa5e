"""One tensor-parallel rank's shapes of a K3 config (``rank_shapes(cfg, tp)``: what each GPU holds and
computes; ../shared/design/K3.md "One GPU's share"). A config a TP size cannot split raises ``ConfigError``
naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError, K3Config


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
