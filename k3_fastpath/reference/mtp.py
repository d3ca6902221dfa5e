"""K3's next-token (MTP) layer: PyTorch reference of vLLM's ``KimiK3MultiTokenPredictorLayer``
(``vllm/models/kimi_k3/nvidia/mtp.py``, ``common/mtp.py``), dtype-generic like the rest of ``reference``.

Layer ``N`` (``num_hidden_layers`` <= N; checkpoint names ``model.layers.{N}.*``, ``manifest.mtp_layer_specs``)
drafts the token after next. For the pair at position ``p`` (the token ``t_{p+1}`` and the target's hidden
state ``h_p``, taken before the target's final norm):

    x = eh_proj([enorm(e) | hnorm(h_p)])      e = embed(t_{p+1}), zeroed at p == 0 (vLLM's mask)
    r = x + self_attn(input_layernorm(x))      gated NoPE MLA (layer N is in no ``kda_layers``) over the
                                               layer's own latent cache, the token at position p
    s = r + mlp(post_attention_layernorm(r))   LatentMoE where ``cfg.is_moe_layer(N)``, else the dense MLP
    -> (shared_head.norm(s), s)                the first feeds the logits, the second is the next step's h

No AttnRes (vLLM builds the block with ``attn_res_block_size = None``). The logits are the TARGET's
``lm_head`` of the first output and the embedding the target's ``embed_tokens``: vLLM replaces the layer's
own ``shared_head.head`` / ``embed_tokens`` by the target's at load time, so the checkpoint's copies here are
held (and written, and loaded) but not read. The residual sums are formed in FP32 and the norms read the
unrounded sum, as vLLM's fused add-RMSNorm does; every other rounding follows this package's reference.
``K3ForCausalLM`` holds these layers (``mtp_layers``); ``runtime.spec_decode.MTPDrafter`` runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from .common import RMSNorm, compute_dtype, rms_norm
from .mla import GatedMLA, MLACache
from .moe import LatentMoE, dense_mlp


class SharedHead(nn.Module):
    """``shared_head.norm`` (read) and ``shared_head.head`` (the checkpoint's copy of the head; vLLM reads the
    target's ``lm_head`` instead, and so does this reference)."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)


class K3MTPLayer(nn.Module):
    """One next-token layer; attribute names are the checkpoint's (after ``model.layers.{N}.``)."""

    def __init__(self, cfg: K3Config, layer_idx: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if cfg.is_kda_layer(layer_idx):
            raise ValueError(f"next-token layer {layer_idx} is listed as a KDA layer; vLLM builds it as MLA only "
                             "when layer_idx + 1 is in no kda_layers")
        self.cfg, self.layer_idx, self.eps = cfg, layer_idx, cfg.rms_norm_eps
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, dtype=dtype)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.shared_head = SharedHead(cfg, dtype)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.self_attn = GatedMLA(cfg, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        if cfg.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(cfg, dtype)
        else:
            self.mlp = dense_mlp(cfg, dtype)

    def new_cache(self, batch: int, max_len: int, device=None) -> MLACache:
        """The layer's own latent cache (model dtype), ``max_len`` positions per sequence."""
        return MLACache.empty(self.cfg, batch, max_len, self.eh_proj.weight.dtype,
                              self.eh_proj.weight.device if device is None else device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: MLACache, start_pos: torch.Tensor,
                lengths: torch.Tensor, mode: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``embeds [B, T, H]`` (the target's embedding of ``t_{p+1}``) and ``hidden [B, T, H]`` (``h_p``),
        token ``t`` of row ``b`` at position ``start_pos[b] + t``, valid for ``t < lengths[b]`` ->
        (``shared_head.norm(s)``, ``s``), both ``[B, T, H]`` in the model dtype; padded tokens give 0 and
        write nothing to ``cache``."""
        b, t, _ = embeds.shape
        dev, dt = embeds.device, embeds.dtype
        cdt = compute_dtype(dt)
        start_pos = start_pos.to(device=dev, dtype=torch.long).reshape(b)
        lengths = lengths.to(device=dev, dtype=torch.long).reshape(b)
        pos = start_pos[:, None] + torch.arange(t, device=dev)[None, :]
        valid = torch.arange(t, device=dev)[None, :] < lengths[:, None]
        zero = torch.zeros((), dtype=dt, device=dev)
        e = torch.where((pos == 0)[..., None], zero, embeds)
        x = self.eh_proj(torch.cat([rms_norm(e, self.enorm.weight, self.eps),
                                    rms_norm(hidden.to(dt), self.hnorm.weight, self.eps)], dim=-1))
        x = torch.where(valid[..., None], x, zero)
        a = self.self_attn(self.input_layernorm(x), cache, start_pos, lengths, mode=mode)
        r_sum = x.to(cdt) + a.to(cdt)
        r = r_sum.to(dt)
        mlp = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        f = torch.zeros_like(r)
        f[valid] = mlp(rms_norm(r_sum, self.post_attention_layernorm.weight, self.eps).to(dt)[valid])
        s = f.to(cdt) + r.to(cdt)
        out = rms_norm(s, self.shared_head.norm.weight, self.eps).to(dt)
        return torch.where(valid[..., None], out, zero), torch.where(valid[..., None], s.to(dt), zero)
