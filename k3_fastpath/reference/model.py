"""The Kimi K3 text model: PyTorch reference ("standard path"), dtype-generic (BF16 / FP32 / FP64).

Structure (K3.md): ``embed_tokens`` -> 93 decoder layers -> AttnRes mix -> ``norm`` -> ``lm_head`` (untied).
Decoder layer ``i`` (attribute names are the checkpoint's):

    prefix_sum = x                                        # the running sum of the current AttnRes block
    h = AttnRes(prefix_sum, blocks; self_attention_res_*)  if blocks else prefix_sum
    if i % attn_res_block_size == 0:                      # a block closes: stash the PRE-mix stream, reset
        blocks = blocks + [prefix_sum]; prefix_sum = None
    a = self_attn(input_layernorm(h))                     # KDA or gated MLA (cfg.is_kda_layer)
    prefix_sum = a if prefix_sum is None else prefix_sum + a
    h = AttnRes(prefix_sum, blocks; mlp_res_*)
    f = mlp / block_sparse_moe(post_attention_layernorm(h))
    return prefix_sum + f, blocks

With ``num_nextn_predict_layers`` > 0 the next-token (MTP) layers (reference/mtp.py) follow the decoder
layers in ``model.layers`` under their checkpoint names; ``prefill_hidden`` gives an MTP drafter the hidden
states the final norm reads.

Residual adds happen in the model dtype (in serving BF16: "the prefix accumulates each sublayer's output
rounded to BF16"). Padded tokens (``t >= lengths[b]``) get a zero embedding, attention outputs 0 for them
and the MLP is not run on them, so their stream stays exactly 0 and their logits are returned as exactly 0.

``K3ForCausalLM(cfg).state_dict()`` holds exactly the manifest's tensors (names without ``language_model.``)
with its shapes and dtypes: BF16 tensors in the model dtype, FP32 ones (KDA ``A_log``/``dt_bias``/conv/
``o_norm``, the router's correction bias) in FP32, MXFP4 experts as uint8 buffers. ``set_compute_dtype``
changes the BF16 tensors only; ``.to(torch.float64)`` makes an all-FP64 oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import K3Config
from ..manifest import CHECKPOINT_PREFIX, tensor_specs
from ..synthetic import torch_dtype
from .attn_res import apply_attn_res
from .common import RMSNorm
from .kda import KDACache, KimiDeltaAttention
from .mla import GatedMLA, MLACache
from .moe import LatentMoE, dense_mlp
from .mtp import K3MTPLayer


@dataclass
class K3Cache:
    """Per-layer caches (``KDACache`` for KDA layers, ``MLACache`` for MLA layers) and ``lengths [B]``,
    the number of tokens each sequence has seen (its next token's position)."""

    layers: list
    lengths: torch.Tensor
    max_len: int

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.eps = eps
        self.self_attention_res_norm = RMSNorm(h, eps, dtype)
        self.self_attention_res_proj = nn.Linear(h, 1, bias=False, dtype=dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = KimiDeltaAttention(cfg, layer_idx, dtype=dtype) if self.is_kda else GatedMLA(cfg, layer_idx, dtype)
        self.mlp_res_norm = RMSNorm(h, eps, dtype)
        self.mlp_res_proj = nn.Linear(h, 1, bias=False, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        if cfg.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(cfg, dtype)
        else:
            self.mlp = dense_mlp(cfg, dtype)

    @property
    def closes_block(self) -> bool:
        """True where this layer stashes the incoming stream as a new AttnRes block."""
        return self.layer_idx % self.cfg.attn_res_block_size == 0

    def forward(self, x: torch.Tensor, blocks: list[torch.Tensor], cache, start_pos: torch.Tensor,
                lengths: torch.Tensor, valid: torch.Tensor, mla_mode: str = "auto"
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``x [B, T, H]`` (the prefix sum) and the closed blocks -> (new prefix sum, blocks)."""
        prefix_sum: torch.Tensor | None = x
        if blocks:
            h = apply_attn_res(x, blocks, self.self_attention_res_proj.weight, self.self_attention_res_norm.weight,
                               self.eps)
        else:
            h = x
        if self.closes_block:
            blocks = blocks + [x]
            prefix_sum = None
        a_in = self.input_layernorm(h)
        if self.is_kda:
            a = self.self_attn(a_in, cache=cache, lengths=lengths)
        else:
            a = self.self_attn(a_in, cache, start_pos, lengths, mode=mla_mode)
        prefix_sum = a if prefix_sum is None else prefix_sum + a
        h = apply_attn_res(prefix_sum, blocks, self.mlp_res_proj.weight, self.mlp_res_norm.weight, self.eps)
        mlp = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        f = torch.zeros_like(prefix_sum)
        f[valid] = mlp(self.post_attention_layernorm(h[valid]))  # padded tokens touch no expert
        return prefix_sum + f, blocks


class DecoderLayers(nn.ModuleList):
    """``model.layers``: iterating it, ``len()`` and indexing give the decoder layers ``0 .. L-1``; the
    next-token (MTP) layers are held after them at keys ``L ..`` (so their ``state_dict`` names are the
    checkpoint's ``model.layers.{L+j}.*``) and reached through ``K3ForCausalLM.mtp_layers``, never as
    decoder layers."""

    def __init__(self, layers: list[nn.Module], mtp: list[nn.Module]) -> None:
        super().__init__()
        self._num_decoder = len(layers)
        for j, m in enumerate(layers + mtp):
            self.add_module(str(j), m)

    def __len__(self) -> int:
        return self._num_decoder

    def __iter__(self):
        return iter(list(self._modules.values())[: self._num_decoder])

    @property
    def mtp(self) -> list[nn.Module]:
        return list(self._modules.values())[self._num_decoder:]


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, dtype=dtype)
        n = cfg.num_hidden_layers
        self.layers = DecoderLayers([K3DecoderLayer(cfg, i, dtype) for i in range(n)],
                                    [K3MTPLayer(cfg, n + j, dtype) for j in range(cfg.num_nextn_predict_layers)])
        self.output_attn_res_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.output_attn_res_proj = nn.Linear(h, 1, bias=False, dtype=dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)


def prepare_step(input_ids: torch.Tensor, lengths: torch.Tensor, cache, device) -> tuple[torch.Tensor, ...]:
    """Validate one prefill/decode call against its cache -> (ids with padding set to 0, lengths [B],
    start positions [B] (a copy of ``cache.lengths``), valid mask [B, T]). Shared by every runner of the
    model (this reference, the TP decoder) so they refuse the same inputs with the same messages."""
    b, t = input_ids.shape
    input_ids = input_ids.to(device)
    lengths = lengths.to(device=device, dtype=torch.long).reshape(b)
    if cache.batch != b:
        raise ValueError(f"cache holds {cache.batch} sequences, input has {b}")
    if bool((lengths < 0).any()) or bool((lengths > t).any()):
        raise ValueError(f"lengths must lie in 0..{t}, got {lengths.tolist()}")
    start_pos = cache.lengths.to(device).clone()
    if bool((start_pos + lengths > cache.max_len).any()):
        raise ValueError(f"cache max_len {cache.max_len} exceeded: positions {(start_pos + lengths).tolist()}")
    valid = torch.arange(t, device=device)[None, :] < lengths[:, None]
    return input_ids.masked_fill(~valid, 0), lengths, start_pos, valid


class K3ForCausalLM(nn.Module):
    """The reference model. ``prefill`` / ``decode`` run against a ``K3Cache``; ``forward`` is a fresh prefill."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype = torch.bfloat16, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = K3Model(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if device is not None:
            self.to(device)

    # ------------------------------------------------------------------ dtypes
    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the (BF16-in-the-checkpoint) embedding."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def set_compute_dtype(self, dtype: torch.dtype) -> K3ForCausalLM:
        """Cast the tensors the manifest lists as BF16 to ``dtype``; F32 ones back to FP32; U8 untouched."""
        want = {s.name: s.dtype for s in tensor_specs(self.cfg)}
        for mod_name, mod in self.named_modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in list(store.items()):
                    kind = want.get(f"{mod_name}.{name}" if mod_name else name)
                    if t is None or kind not in ("BF16", "F32"):
                        continue
                    target = dtype if kind == "BF16" else torch.float32
                    if isinstance(t, nn.Parameter):
                        t.data = t.data.to(target)
                    else:
                        store[name] = t.to(target)
        return self

    # ------------------------------------------------------------------ caches
    def new_cache(self, batch: int, max_len: int, kv_dtype: torch.dtype | None = None, device=None,
                  kv_scale: float | None = None) -> K3Cache:
        """Empty caches for ``batch`` sequences of up to ``max_len`` tokens.

        MLA latents in ``kv_dtype`` (default: the model dtype, i.e. BF16 in serving; FP8 e4m3 with the
        per-tensor ``kv_scale``, default 1.0). KDA conv state in the model dtype (BF16 in serving), KDA
        recurrent state in FP32 (FP64 for an FP64 model).
        """
        device = self.device if device is None else device
        dt = self.dtype
        kv_dtype = dt if kv_dtype is None else kv_dtype
        state_dtype = torch.float64 if dt == torch.float64 else torch.float32
        layers = []
        for i in range(self.cfg.num_hidden_layers):
            if self.cfg.is_kda_layer(i):
                layers.append(KDACache.empty(self.cfg, batch, device=device, conv_dtype=dt, state_dtype=state_dtype))
            else:
                layers.append(MLACache.empty(self.cfg, batch, max_len, kv_dtype, device, scale=kv_scale))
        return K3Cache(layers=layers, lengths=torch.zeros(batch, dtype=torch.long, device=device), max_len=max_len)

    # ------------------------------------------------------------------ running
    @property
    def mtp_layers(self) -> list[K3MTPLayer]:
        """The next-token layers (``cfg.num_nextn_predict_layers``; reference/mtp.py)."""
        return self.model.layers.mtp

    def _run(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: K3Cache, mla_mode: str,
             hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        ids, lengths, start_pos, valid = prepare_step(input_ids, lengths, cache, dev)
        x = self.model.embed_tokens(ids)
        x = torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype, device=dev))
        blocks: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            x, blocks = layer(x, blocks, cache.layers[i], start_pos, lengths, valid, mla_mode)
        if blocks:
            x = apply_attn_res(x, blocks, self.model.output_attn_res_proj.weight,
                               self.model.output_attn_res_norm.weight, self.cfg.rms_norm_eps)
        logits = self.compute_logits(x)
        cache.lengths = start_pos + lengths
        zero = torch.zeros((), dtype=logits.dtype, device=dev)
        logits = torch.where(valid[..., None], logits, zero)
        return (logits, torch.where(valid[..., None], x, zero.to(x.dtype))) if hidden else logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and lm_head of hidden states (what ``prefill_hidden`` / ``decode_hidden`` return) ->
        logits in FP32 (FP64 for an FP64 model): vLLM's K3 ``compute_logits``. Not under ``no_grad``: the
        forward's own last step."""
        logits = self.lm_head(self.model.norm(hidden))
        return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)

    @torch.no_grad()
    def prefill_hidden(self, input_ids: torch.Tensor, lengths: torch.Tensor | None, cache: K3Cache
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``prefill`` that also returns the hidden states the final norm reads (after the AttnRes output
        mix), ``[B, T, H]`` in the model dtype: what vLLM hands an MTP drafter as the target's hidden states
        (padded rows 0)."""
        if lengths is None:
            lengths = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long)
        return self._run(input_ids, lengths, cache, "plain", hidden=True)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None, cache: K3Cache) -> torch.Tensor:
        """Right-padded ``input_ids [B, T]`` with ``lengths [B]`` -> logits ``[B, T, V]``.

        Continues each sequence from ``cache.lengths`` (so a prompt can be prefilled in pieces) and advances
        it by ``lengths``. Logits are FP32 (FP64 for an FP64 model); padded rows are exactly 0.
        """
        if lengths is None:
            lengths = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long)
        return self._run(input_ids, lengths, cache, "plain")

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: K3Cache, active: torch.Tensor | None = None) -> torch.Tensor:
        """One token per active sequence, each at its own position ``cache.lengths[b]`` -> logits ``[B, V]``.

        Inactive sequences (``active[b] == False``) are left untouched and get logits 0. MLA runs absorbed.
        """
        return self._decode(tokens, cache, active, hidden=False)

    @torch.no_grad()
    def decode_hidden(self, tokens: torch.Tensor, cache: K3Cache, active: torch.Tensor | None = None) -> torch.Tensor:
        """``decode`` -> the hidden states the final norm reads ``[B, H]`` (model dtype, inactive rows 0): what
        vLLM's K3 ``forward`` returns, its ``compute_logits`` applying the final norm and lm_head."""
        return self._decode(tokens, cache, active, hidden=True)

    def _decode(self, tokens: torch.Tensor, cache: K3Cache, active: torch.Tensor | None, hidden: bool) -> torch.Tensor:
        b = tokens.shape[0]
        if active is None:
            active = torch.ones(b, dtype=torch.bool)
        lengths = active.to(torch.long).reshape(b)
        out = self._run(tokens.reshape(b, 1), lengths, cache, "absorbed", hidden=hidden)
        return (out[1] if hidden else out)[:, 0]

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """A full prefill on a fresh cache (MLA latents in the model dtype)."""
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        return self.prefill(input_ids, lengths, cache)


def load_reference(cfg: K3Config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                   device=None) -> K3ForCausalLM:
    """A ``K3ForCausalLM`` holding ``state_dict`` (names with or without ``language_model.``), loaded strictly.

    Every manifest tensor must be present with its manifest shape and dtype and nothing else may be; a
    violation raises ``ValueError``/``TypeError`` naming the tensor. BF16 tensors become ``dtype``; FP32 ones
    stay FP32 unless ``dtype`` is FP64 (an oracle run), which makes every float tensor FP64.
    """
    specs = {s.name: s for s in tensor_specs(cfg)}
    sd: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        name = k[len(CHECKPOINT_PREFIX):] if k.startswith(CHECKPOINT_PREFIX) else k
        if name in sd:
            raise ValueError(f"tensor {name} is given twice (with and without '{CHECKPOINT_PREFIX}')")
        sd[name] = v
    missing = [n for n in specs if n not in sd]
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [n for n in sd if n not in specs]
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]}"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, spec in specs.items():
        t = sd[name]
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"tensor {name}: shape {tuple(t.shape)}, manifest says {spec.shape}")
        if t.dtype != torch_dtype(spec.dtype):
            raise TypeError(f"tensor {name}: dtype {t.dtype}, manifest says {spec.dtype}")
    compute = torch.float32 if dtype == torch.float64 else dtype
    model = K3ForCausalLM(cfg, dtype=compute)
    own = model.state_dict()
    if list(sorted(own)) != list(sorted(specs)):
        extra = sorted(set(own) - set(specs)) + sorted(set(specs) - set(own))
        raise ValueError(f"reference module tree does not match the manifest at tensor {extra[0]}")
    for name, t in own.items():
        if t.dtype not in (compute, torch.float32, torch.uint8) or tuple(t.shape) != specs[name].shape:
            raise ValueError(f"reference tensor {name} is {t.dtype} {tuple(t.shape)}, manifest says "
                             f"{specs[name].dtype} {specs[name].shape}")
    model.load_state_dict(sd, strict=True)
    if dtype == torch.float64:
        model.to(torch.float64)
    if device is not None:
        model.to(device)
    return model
