"""The fast step's plan: per layer, the reference model's own weight tensors (no copies, so every weight
stays a distinct allocation) in the form the kernels take, typed per layer kind (``KDAWeights``,
``MLAWeights``, ``MoEWeights``, ``DenseMLPWeights``): flattened AttnRes projections, W_UK (FP32) / W_UV
(bf16) split out of ``kv_b_proj``, the beta projection padded to 8 rows, the routed experts of each MoE
layer as an ``ExpertBank`` (``kernels/moe_experts``' ``ExpertWeights``, built once). ``fast_step.run_step``
and ``tp_fast.run_tp_step`` read it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..kernels.mla_decode.api import split_kv_b


# ------------------------------------------------------------------------------------------ experts
class ExpertBank:
    """The routed experts of one LatentMoE layer as ``kernels/moe_experts`` reads them: one
    ``ExpertWeights`` (stacked over experts, in the checkpoint's format, MXFP4 for K3; on a GPU also its
    fragment layout), built once per module and shared by every executor over the same model.

    No BF16 copy of any expert exists: the kernel dequantises MXFP4 in registers and streams only the
    touched experts. Stacking would duplicate the checkpoint's expert tensors, so the module's own
    per-expert tensors are re-pointed at views of the stacked ones (same values; the reference model reads
    them unchanged): the experts live once in the checkpoint layout, plus once in the fragment layout.

    ``single_copy=True`` (MXFP4) keeps them once: the stacks are compacted into the fragment layout
    (``ExpertWeights.compact``) and each module serves its ``weight_packed`` / ``weight_scale`` from it
    (``MXFP4Weight.use_source``: the checkpoint bytes of that expert rebuilt per read, exact). What it
    costs: a reference / prefill / standard-path read of an expert unpacks it first; ``state_dict()`` of the
    model no longer lists the routed experts. What it buys: a full K3 TP16 rank (90 GB of experts) fits an
    H200 with the fast path built (``measure/rank_emulation.py``). Irreversible for the model (every
    executor over it shares the bank)."""

    _weights_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, moe: Any, cfg: Any, single_copy: bool = False) -> None:
        self.module = moe
        self.num_experts = cfg.num_experts
        self.beta = cfg.activation_situ_beta
        self.linear_beta = cfg.activation_situ_linear_beta
        self.fmt = cfg.expert_format
        self.weights = self._build(moe, self.fmt)
        if single_copy and self.fmt == "mxfp4" and not self.weights.compacted:
            self.compact()

    def compact(self) -> None:
        """Keep this layer's experts once, in the fragment layout (see the class docstring)."""
        for e, ex in enumerate(self.module.experts):  # drop the module views of the stacks first
            for n in ("w1", "w3", "w2"):
                getattr(ex, n).use_source(self.weights, n, e)
        self.weights.compact()

    @classmethod
    def _build(cls, moe: Any, fmt: str) -> Any:
        from ..kernels.moe_experts.layout import ExpertWeights

        hit = cls._weights_cache.get(moe)
        if hit is not None:
            return hit
        w = ExpertWeights.from_modules(moe.experts, fmt)
        for e, ex in enumerate(moe.experts):  # the module's tensors become views of the stacked ones
            for n in ("w1", "w3", "w2"):
                mod, stacked = getattr(ex, n), getattr(w, n)
                if fmt == "mxfp4":
                    mod.weight_packed, mod.weight_scale = stacked[0][e], stacked[1][e]
                else:
                    mod.weight = torch.nn.Parameter(stacked[e], requires_grad=mod.weight.requires_grad)
        if fmt == "mxfp4" and w.device.type == "cuda":
            w.fragments()  # the kernel's layout, now rather than inside the first step
        cls._weights_cache[moe] = w
        return w

    def dense(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's (w1, w3, w2) dequantised (tests, debugging; never on the step's path)."""
        return tuple(self.weights.dense(n, e, dtype) for n in ("w1", "w3", "w2"))



# ------------------------------------------------------------------------------------------ plan
def _t(v: Any) -> Any:
    return v.detach() if isinstance(v, torch.Tensor) else v


@dataclass(frozen=True)
class KDAWeights:
    """One KDA layer's tensors as the step reads them (the model's own, detached; ``b`` zero-padded to 8 rows)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    f_a: torch.Tensor
    f_b: torch.Tensor
    b: torch.Tensor
    heads: int
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm: torch.Tensor
    o: torch.Tensor
    lower_bound: float | None
    STREAMED: ClassVar[tuple[str, ...]] = ("q", "k", "v", "g", "f_a", "b", "f_b", "o")  # step order


@dataclass(frozen=True)
class MLAWeights:
    """One gated MLA layer's tensors: W_UK (FP32) / W_UV (bf16) split out of ``kv_b_proj``; ``g`` the output
    gate projection (None without one)."""

    q_a: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: torch.Tensor
    kv_a: torch.Tensor
    kv_norm: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    g: torch.Tensor | None
    o: torch.Tensor
    heads: int
    q_head_dim: int
    softmax_scale: float
    STREAMED: ClassVar[tuple[str, ...]] = ("q_a", "kv_a", "q_b", "g", "o")


@dataclass(frozen=True)
class MoEWeights:
    """One LatentMoE layer: the router, the latent down / norm / up projections, the shared experts, and
    the routed experts as an ``ExpertBank``."""

    router: torch.Tensor
    bias: torch.Tensor
    top_k: int
    renormalize: bool
    scale: float
    latent_down: torch.Tensor
    latent_norm: torch.Tensor | None
    latent_up: torch.Tensor
    shared_gate: torch.Tensor
    shared_up: torch.Tensor
    shared_down: torch.Tensor
    bank: ExpertBank
    STREAMED: ClassVar[tuple[str, ...]] = ("router", "latent_down", "shared_gate", "shared_up", "latent_up",
                                           "shared_down")


@dataclass(frozen=True)
class DenseMLPWeights:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    STREAMED: ClassVar[tuple[str, ...]] = ("gate", "up", "down")


@dataclass
class LayerPlan:
    idx: int
    kind: str  # "kda" | "mla"
    closes_block: bool
    attn_res_norm: torch.Tensor
    attn_res_proj: torch.Tensor  # [H] (the checkpoint's [1, H], flattened)
    input_norm: torch.Tensor
    mlp_res_norm: torch.Tensor
    mlp_res_proj: torch.Tensor
    post_norm: torch.Tensor
    attn: KDAWeights | MLAWeights
    mlp: MoEWeights | DenseMLPWeights
    moe: bool

    def weights(self) -> list[torch.Tensor]:
        """The big weights of this layer in the order the step reads them (what an L2 prefetch targets)."""
        out = [getattr(self.attn, n) for n in self.attn.STREAMED]
        return [w for w in out if w is not None] + [getattr(self.mlp, n) for n in self.mlp.STREAMED]


def _flat(w: torch.Tensor) -> torch.Tensor:
    return w.detach().reshape(-1)


def _rows_to_8(w: torch.Tensor) -> torch.Tensor:
    """The weight itself when its row count is a multiple of 8 (the skinny GEMM's N granule), else a copy
    zero-padded to one: the beta projection has one row per KDA head (6 per GPU at TP16, 4 in k3-tiny)."""
    w = w.detach()
    n = w.shape[0]
    if n % 8 == 0:
        return w
    out = torch.zeros(-(-n // 8) * 8, w.shape[1], dtype=w.dtype, device=w.device)
    out[:n].copy_(w)
    return out


def _attn(a: Any, is_kda: bool) -> KDAWeights | MLAWeights:
    if is_kda:
        return KDAWeights(q=_t(a.q_proj.weight), k=_t(a.k_proj.weight), v=_t(a.v_proj.weight), g=_t(a.g_proj.weight),
                          f_a=_t(a.f_a_proj.weight), f_b=_t(a.f_b_proj.weight), b=_rows_to_8(a.b_proj.weight),
                          heads=a.num_heads, conv_q=_t(a.q_conv1d.weight), conv_k=_t(a.k_conv1d.weight),
                          conv_v=_t(a.v_conv1d.weight), A_log=_t(a.A_log), dt_bias=_t(a.dt_bias),
                          o_norm=_t(a.o_norm.weight), o=_t(a.o_proj.weight), lower_bound=a.lower_bound)
    w_uk, w_uv = split_kv_b(a.kv_b_proj.weight.detach(), a.num_heads, a.nope, a.v_dim)
    return MLAWeights(q_a=_t(a.q_a_proj.weight), q_a_norm=_t(a.q_a_layernorm.weight), q_b=_t(a.q_b_proj.weight),
                      kv_a=_t(a.kv_a_proj_with_mqa.weight), kv_norm=_t(a.kv_a_layernorm.weight), w_uk=w_uk.float(),
                      w_uv=w_uv, g=_t(a.g_proj.weight) if a.g_proj is not None else None, o=_t(a.o_proj.weight),
                      heads=a.num_heads, q_head_dim=a.nope + a.rope, softmax_scale=a.softmax_scale)


def _mlp(layer: Any, cfg: Any, single_expert_copy: bool) -> MoEWeights | DenseMLPWeights:
    moe = getattr(layer, "block_sparse_moe", None)
    if moe is None:
        return DenseMLPWeights(gate=_t(layer.mlp.gate_proj.weight), up=_t(layer.mlp.up_proj.weight),
                               down=_t(layer.mlp.down_proj.weight))
    return MoEWeights(router=_t(moe.gate.weight), bias=_t(moe.gate.e_score_correction_bias), top_k=moe.gate.top_k,
                      renormalize=moe.gate.renormalize, scale=moe.gate.scale,
                      latent_down=_t(moe.routed_expert_down_proj.weight),
                      latent_norm=_t(moe.routed_expert_norm.weight) if moe.routed_expert_norm is not None else None,
                      latent_up=_t(moe.routed_expert_up_proj.weight),
                      shared_gate=_t(moe.shared_experts.gate_proj.weight),
                      shared_up=_t(moe.shared_experts.up_proj.weight),
                      shared_down=_t(moe.shared_experts.down_proj.weight),
                      bank=ExpertBank(moe, cfg, single_copy=single_expert_copy))


@dataclass
class ModelPlan:
    cfg: Any
    eps: float
    embed: torch.Tensor
    layers: list[LayerPlan]
    out_res_norm: torch.Tensor
    out_res_proj: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    num_sources: int  # AttnRes blocks + the running prefix

    @classmethod
    def build(cls, model: Any, single_expert_copy: bool = False) -> ModelPlan:
        """The plan of ``model``'s own weights. ``single_expert_copy``: the routed experts kept once, in the
        kernel's layout (``ExpertBank``)."""
        cfg = model.cfg
        m = model.model
        layers = [LayerPlan(
            idx=i, kind="kda" if layer.is_kda else "mla", closes_block=layer.closes_block,
            attn_res_norm=_t(layer.self_attention_res_norm.weight), attn_res_proj=_flat(layer.self_attention_res_proj.weight),
            input_norm=_t(layer.input_layernorm.weight), mlp_res_norm=_t(layer.mlp_res_norm.weight),
            mlp_res_proj=_flat(layer.mlp_res_proj.weight), post_norm=_t(layer.post_attention_layernorm.weight),
            attn=_attn(layer.self_attn, layer.is_kda), mlp=_mlp(layer, cfg, single_expert_copy),
            moe=hasattr(layer, "block_sparse_moe")) for i, layer in enumerate(m.layers)]
        return cls(cfg=cfg, eps=cfg.rms_norm_eps, embed=m.embed_tokens.weight.detach(), layers=layers,
                   out_res_norm=m.output_attn_res_norm.weight.detach(),
                   out_res_proj=_flat(m.output_attn_res_proj.weight), final_norm=m.norm.weight.detach(),
                   lm_head=model.lm_head.weight.detach(), num_sources=cfg.num_attn_res_blocks + 1)
