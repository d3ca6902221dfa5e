"""LatentMoE (K3's MoE block) and the dense SiTU MLP: PyTorch reference.

Per token x [H] (K3.md, "LatentMoE"):

1. router (``gate``): ``logits = x @ gate.weight^T`` in FP32 (FP64 when the model runs in FP64 for oracle
   runs); ``scores = sigmoid(logits)``; experts are SELECTED by ``scores + e_score_correction_bias``,
   top-``num_experts_per_token`` with a defined tie rule: on exactly equal selection scores the lower
   expert index wins (a stable descending sort; ``torch.topk`` gives no such guarantee, K3.md failure 5).
   Weights are the chosen experts' UNBIASED sigmoid scores, renormalised to sum 1 (``moe_renormalize``),
   times ``routed_scaling_factor``;
2. routed path: ``z = routed_expert_down_proj(x)`` (hidden -> latent); per chosen expert
   ``y_e = w2_e SiTU-GLU(w1_e z, w3_e z)``; ``sum_e weight_e * y_e`` in FP32; ``routed_expert_norm``
   (RMSNorm over the latent, if ``latent_moe_use_norm``); ``routed_expert_up_proj`` (latent -> hidden);
3. shared path: ``shared_experts`` is one SiTU GLU of width ``moe_intermediate_size * num_shared_experts``
   on x, added to the routed output.

Routed experts are stored as the checkpoint stores them: MXFP4 (``experts.{e}.w1.weight_packed`` /
``weight_scale`` uint8 buffers) or BF16 (``experts.{e}.w1.weight``). MXFP4 experts are dequantized on the
fly, each expert only when some token routes to it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import mxfp4
from ..config import K3Config
from .common import RMSNorm, compute_dtype, situ_glu


# ---------------------------------------------------------------------------------------------- router
def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, H]`` -> (``expert_ids [N, k] int64``, ``weights [N, k]``).

    Logits are FP32 (FP64 if ``x`` is FP64). Experts are ordered by descending selection score
    ``sigmoid(logit) + bias``, ties broken by the lower expert index. ``weights`` (FP32, or FP64 for FP64
    input) are the unbiased sigmoid scores of the chosen experts, renormalised if asked, times ``scale``.
    """
    cdt = compute_dtype(x.dtype)
    logits = x.to(cdt) @ gate_weight.to(cdt).T
    scores = torch.sigmoid(logits)
    sel = scores + bias.to(cdt)
    # stable descending sort: equal keys keep their index order, so the lower expert index comes first
    order = torch.sort(sel, dim=-1, descending=True, stable=True).indices
    ids = order[..., :top_k]
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w * scale


class MoEGate(nn.Module):
    """The router: ``weight [E, H]`` (BF16 in the checkpoint) and ``e_score_correction_bias [E]`` (FP32)."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=cfg.hidden_size ** -0.5)
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.num_experts, dtype=torch.float32, device=device))
        self.top_k = cfg.num_experts_per_token
        self.renormalize = cfg.moe_renormalize
        self.scale = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.e_score_correction_bias, self.top_k, self.renormalize, self.scale)


# ---------------------------------------------------------------------------------------------- experts
class MXFP4Weight(nn.Module):
    """One routed-expert matrix in compressed-tensors MXFP4: ``weight_packed [N, K/2]``, ``weight_scale [N, K/32]``."""

    def __init__(self, out_features: int, in_features: int, device=None) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                          device=device))
        self.register_buffer("weight_scale", torch.full((out_features, in_features // mxfp4.GROUP), 127,
                                                        dtype=torch.uint8, device=device))

    def use_source(self, source: Any, name: str, e: int) -> None:
        """Serve this matrix from ``source.checkpoint(name, e)`` (a compacted ``ExpertWeights``: the experts
        kept once, in the kernel's fragment layout) instead of own buffers, which are dropped. Reads of
        ``weight_packed`` / ``weight_scale`` then rebuild the checkpoint bytes (exact, a copy per read)."""
        self._buffers.pop("weight_packed", None)
        self._buffers.pop("weight_scale", None)
        self.__dict__["_source"] = (source, name, e)
        self.drop_dense()

    def __getattr__(self, name: str) -> Any:
        src = self.__dict__.get("_source")
        if src is not None and name in ("weight_packed", "weight_scale"):
            p, s = src[0].checkpoint(src[1], src[2])
            return p if name == "weight_packed" else s
        return super().__getattr__(name)

    def _packed_and_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.__dict__.get("_source")
        return src[0].checkpoint(src[1], src[2]) if src is not None else (self.weight_packed, self.weight_scale)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        c = self.__dict__.get("_dense")
        if c is not None and c[0] == self._key(dtype):
            return c[1]
        return mxfp4.dequantize(*self._packed_and_scale(), dtype)

    def _key(self, dtype: torch.dtype) -> tuple:
        src = self.__dict__.get("_source")
        if src is not None:  # the source's bytes never change once compacted
            return (dtype, "source", id(src[0]), src[1], src[2])
        p, s = self.weight_packed, self.weight_scale
        return (dtype, p.data_ptr(), p._version, s.data_ptr(), s._version)

    def keep_dense(self, dtype: torch.dtype) -> int:
        """Keep this matrix dequantised to ``dtype`` for later ``dense`` calls (the same values: the
        dequantisation is exact and deterministic; re-pointed or modified packed / scale tensors invalidate
        it). Returns the bytes kept. ``cache_dense_experts`` does it for a whole model."""
        self.__dict__["_dense"] = (self._key(dtype), mxfp4.dequantize(*self._packed_and_scale(), dtype))
        return self.__dict__["_dense"][1].numel() * self.__dict__["_dense"][1].element_size()

    def drop_dense(self) -> None:
        self.__dict__.pop("_dense", None)


def cache_dense_experts(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Dequantise every MXFP4 routed expert of ``model`` once and keep it: the reference then runs its routed
    experts without dequantising per call, with bitwise the same results (a long reference run, e.g.
    ``equivalence.decode`` over 256 steps, is otherwise dominated by dequantisation). Returns the bytes kept
    (4x the MXFP4 bytes for BF16); ``drop_dense`` on each weight (or a new model) gives them back."""
    return sum(m.keep_dense(dtype) for m in model.modules() if isinstance(m, MXFP4Weight))


def keep_dense_experts_if_room(model: nn.Module, share: float = 0.4) -> int:
    """``cache_dense_experts`` on a CUDA model when the dense copies take under ``share`` of the device's free
    memory (a long reference run is then not dominated by dequantisation; the results are bitwise the
    same); returns the bytes kept (0: not kept, or not on CUDA)."""
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return 0
    if mxfp4_expert_dense_bytes(model) >= share * torch.cuda.mem_get_info(dev)[0]:
        return 0
    return cache_dense_experts(model)


def mxfp4_expert_dense_bytes(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """What ``cache_dense_experts`` would keep."""
    bits = torch.finfo(dtype).bits
    return sum(m.out_features * m.in_features * bits // 8 for m in model.modules() if isinstance(m, MXFP4Weight))


class DenseWeight(nn.Module):
    """One routed-expert matrix in BF16: ``weight [N, K]``."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)


class RoutedExpert(nn.Module):
    """``w1, w3 [inter, latent]``, ``w2 [latent, inter]`` (registered in the checkpoint's order w1, w3, w2)."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        lat, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        if cfg.expert_format == "mxfp4":
            self.w1 = MXFP4Weight(inter, lat, device)
            self.w3 = MXFP4Weight(inter, lat, device)
            self.w2 = MXFP4Weight(lat, inter, device)
        else:
            self.w1 = DenseWeight(inter, lat, dtype, device)
            self.w3 = DenseWeight(inter, lat, dtype, device)
            self.w2 = DenseWeight(lat, inter, dtype, device)
        self.beta = cfg.activation_situ_beta
        self.linear_beta = cfg.activation_situ_linear_beta

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``z [N, latent]`` (model dtype) -> ``[N, latent]``; weights dequantized to ``z``'s dtype here."""
        dt = z.dtype
        g = F.linear(z, self.w1.dense(dt))
        u = F.linear(z, self.w3.dense(dt))
        h = situ_glu(g, u, self.beta, self.linear_beta).to(dt)
        return F.linear(h, self.w2.dense(dt))


class GLUMLP(nn.Module):
    """SiTU GLU ``down_proj(SiTU-GLU(gate_proj x, up_proj x))``: the dense MLP and the shared experts."""

    def __init__(self, cfg: K3Config, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden, inter, **kw)
        self.up_proj = nn.Linear(hidden, inter, **kw)
        self.down_proj = nn.Linear(inter, hidden, **kw)
        self.beta = cfg.activation_situ_beta
        self.linear_beta = cfg.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta).to(x.dtype)
        return self.down_proj(h)


def dense_mlp(cfg: K3Config, dtype: torch.dtype = torch.bfloat16, device=None) -> GLUMLP:
    """The dense MLP of layers ``< first_k_dense_replace`` (``mlp.{gate,up,down}_proj``)."""
    return GLUMLP(cfg, cfg.hidden_size, cfg.intermediate_size, dtype, device)


# ---------------------------------------------------------------------------------------------- LatentMoE
class LatentMoE(nn.Module):
    """K3's MoE block (``block_sparse_moe``); submodule names and order are the checkpoint's."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        h, lat = cfg.hidden_size, cfg.routed_expert_hidden_size
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate = MoEGate(cfg, dtype, device)
        self.routed_expert_down_proj = nn.Linear(h, lat, **kw)
        self.routed_expert_norm = RMSNorm(lat, cfg.rms_norm_eps, dtype, device) if cfg.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(lat, h, **kw)
        self.experts = nn.ModuleList(RoutedExpert(cfg, dtype, device) for _ in range(cfg.num_experts))
        self.shared_experts = GLUMLP(cfg, h, cfg.shared_intermediate_size, dtype, device)

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed path for tokens ``x [N, H]`` with a given routing -> ``[N, H]`` (model dtype)."""
        dt = x.dtype
        cdt = compute_dtype(dt)
        z = self.routed_expert_down_proj(x)
        acc = torch.zeros(z.shape, dtype=cdt, device=z.device)
        for e in torch.unique(ids).tolist():  # only the touched experts run (and get dequantized)
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](z[rows])
            acc.index_add_(0, rows, y.to(cdt) * weights[rows, slot].to(cdt).unsqueeze(-1))
        if self.routed_expert_norm is not None:
            zr = self.routed_expert_norm.forward(acc).to(dt)  # RMSNorm straight from the FP32 sum
        else:
            zr = acc.to(dt)
        return self.routed_expert_up_proj(zr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``: routed (latent) path plus shared experts."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        ids, weights = self.gate(xf)
        out = self.routed(xf, ids, weights) + self.shared_experts(xf)
        return out.reshape(shape)
