"""Tensor parallelism of the K3 model: one process per GPU (or CPU rank), sharded by the manifest's TP rules.

A rank holds its share of every tensor (``shard_state_dict``: ``weights.slice_tensor`` per manifest spec)
and runs the reference modules built for the **rank config** (``rank_config``: the full config with
heads, intermediate widths and vocabulary divided by ``tp``), so each module's shapes are exactly the
rank's share: column-parallel projections (q/k/v/g/b/f_b of KDA, q_b/kv_b/g of MLA, gate/up of the MLPs,
every expert's w1/w3 rows) produce the rank's heads or channels, row-parallel ones (the o_projs, the MLP
down projections, every expert's w2 columns) produce partial sums, replicated ones (MLA q_a/kv_a, the
router, the LatentMoE latent projections and norms, every AttnRes/RMSNorm weight) run whole on every rank.
The MLA latent cache is replicated (every rank computes the same latent), or with ``dcp`` split by token
across the ranks (``tp_dcp.py``: each rank attends over its share, partials merged by LSE); KDA state holds
the rank's heads.

Where partial sums meet (``TPModel._run``):

* the vocab-parallel embedding (a rank looks up the tokens of its vocabulary range, zeros elsewhere) and
  every row-parallel output go through ``comm.reduce_add_mix_norm``: all-reduce + residual add + the next
  sublayer's AttnRes mix + its RMSNorm, the fused op (``tp_comm.Communicator``; the GPU implementations in
  ``tp_allreduce.py``). K3 has no plain "residual + RMSNorm": the norm's input is the AttnRes mix of the
  block snapshots and the updated prefix, so the fused op carries the mix too;
* the LatentMoE's routed experts: each rank sums its slice of the touched experts (intermediate split),
  the FP32 latent sums are all-reduced before the latent RMSNorm, the up projection then runs whole; the
  routed output is added to the all-reduced shared-expert output inside the fused op (``addend``), in the
  reference's order (``routed + shared``). The router and the latent projections run whole on every rank
  (``moe_front="replicated"``, the manifest's rule) or each rank reads its rows of them and the shares are
  all-gathered (``moe_front="split"``, ``tp_moe_front.py``);
* the logits: ``lm_head`` is vocab-parallel; ranks all-gather their slices.

Every rank sees bitwise the same all-reduced values, so every replicated computation (routing included)
agrees across ranks. ``LocalComm`` runs the same code at TP1. On CPU (gloo) and in FP64 a TP2 run equals the
TP1 reference to ~1e-12 (tests/test_tp_cpu.py); on GPUs in BF16 it matches to BF16 rounding
(scripts/gpu/tp2_check.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import K3Config
from ..manifest import HEAD_VEC, tensor_specs
from ..reference.common import compute_dtype
from .tp_comm import Communicator, TorchComm
from .tp_dcp import dcp_mla_forward
from .tp_moe_front import MOE_FRONTS, FrontShard


# ---------------------------------------------------------------------------------------------- sharding
def rank_config(cfg: K3Config, tp: int) -> K3Config:
    """The config whose reference modules have exactly one rank's shapes under tensor parallelism ``tp``."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if tp == 1:
        return cfg
    lac = cfg.linear_attn_config
    for what, n in (("linear_attn_config.num_heads", lac.num_heads), ("num_attention_heads", cfg.num_attention_heads),
                    ("moe_intermediate_size", cfg.moe_intermediate_size), ("intermediate_size", cfg.intermediate_size),
                    ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"config {cfg.name!r}: {what} = {n} is not divisible by tp {tp}")
    return cfg.replace(
        linear_attn_config=dataclasses.replace(lac, num_heads=lac.num_heads // tp),
        num_attention_heads=cfg.num_attention_heads // tp,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=cfg.vocab_size // tp,
        name=f"{cfg.name}@tp{tp}",
    )


def shard_state_dict(cfg: K3Config, state_dict: dict[str, torch.Tensor], tp: int, rank: int
                     ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share of a full state dict (manifest names, with or without ``language_model.``),
    shaped for ``rank_config(cfg, tp)``: the manifest's cut of every tensor, with the KDA ``A_log`` re-padded
    to the rank config's ``max(head_dim, heads)`` entries."""
    from ..manifest import CHECKPOINT_PREFIX
    from ..weights import slice_tensor

    sd = {(k[len(CHECKPOINT_PREFIX):] if k.startswith(CHECKPOINT_PREFIX) else k): v for k, v in state_dict.items()}
    rcfg = rank_config(cfg, tp)
    out: dict[str, torch.Tensor] = {}
    for spec in tensor_specs(cfg):
        if spec.name not in sd:
            raise KeyError(f"state dict is missing tensor {spec.name}")
        t = slice_tensor(spec, sd[spec.name], tp, rank, cfg=cfg)
        if spec.tp == HEAD_VEC and tp > 1:
            lac = rcfg.linear_attn_config
            padded = torch.zeros(max(lac.head_dim, lac.num_heads), dtype=t.dtype, device=t.device)
            padded[: t.shape[0]] = t
            t = padded
        out[spec.name] = t
    return out


def rank_model(cfg: K3Config, state_dict: dict[str, torch.Tensor], tp: int, rank: int,
               dtype: torch.dtype = torch.bfloat16, device: Any = None):
    """A reference ``K3ForCausalLM`` of ``rank_config(cfg, tp)`` holding rank ``rank``'s share."""
    from ..reference.model import load_reference

    return load_reference(rank_config(cfg, tp), shard_state_dict(cfg, state_dict, tp, rank), dtype=dtype,
                          device=device)


# ---------------------------------------------------------------------------------------------- the model
class TPModel:
    """One rank of a tensor-parallel K3: the reference modules of ``rank_config`` plus a ``Communicator``.

    The same interface as ``K3ForCausalLM`` (``new_cache``, ``prefill``, ``decode``) and the same
    semantics: right-padded prompts with ``lengths``, ``active`` masks, FP32 (FP64) logits of the whole
    vocabulary on every rank, padded / inactive rows exactly 0.
    """

    def __init__(self, cfg: K3Config, model: Any, comm: Communicator, dcp: bool = False,
                 moe_front: str = "replicated") -> None:
        if model.cfg != rank_config(cfg, comm.world):
            raise ValueError(f"model config {model.cfg.name!r} is not rank_config({cfg.name!r}, {comm.world})")
        if moe_front not in MOE_FRONTS:
            raise ValueError(f"moe_front must be one of {', '.join(MOE_FRONTS)}, got {moe_front!r}")
        self.cfg = cfg
        self.model = model
        self.comm = comm
        self.dcp = bool(dcp)  # decode context parallelism over the TP ranks (tp_dcp.py)
        self.moe_front = moe_front
        # the rank's rows of each LatentMoE's router / latent down / latent up (tp_moe_front.py), by layer
        self.fronts: dict[int, FrontShard] = {} if moe_front == "replicated" else {
            i: FrontShard.of(layer.block_sparse_moe, comm.world, comm.rank)
            for i, layer in enumerate(model.model.layers) if hasattr(layer, "block_sparse_moe")}
        self.vocab_per_rank = cfg.vocab_size // comm.world

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, batch: int, max_len: int, kv_dtype: torch.dtype | None = None, device=None,
                  kv_scale: float | None = None):
        """The rank's caches: KDA state of its heads, the MLA latents (replicated; with ``dcp`` the rank's
        token share, ``tp_dcp.local_rows`` rows)."""
        cache = self.model.new_cache(batch, max_len, kv_dtype=kv_dtype, device=device, kv_scale=kv_scale)
        if self.dcp:
            from ..reference.mla import MLACache
            from .tp_dcp import local_rows

            rows = local_rows(max_len, self.comm.world)
            cache.layers = [MLACache.empty(self.model.cfg, batch, rows, layer.latent.dtype, layer.latent.device,
                                           scale=float(layer.scale)) if isinstance(layer, MLACache) else layer
                            for layer in cache.layers]
        return cache

    # ------------------------------------------------------------------ pieces
    def _embed_partial(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the vocab-parallel embedding (0 for tokens of other ranks and padding)."""
        local = ids - self.comm.rank * self.vocab_per_rank
        mine = (local >= 0) & (local < self.vocab_per_rank) & valid
        e = self.model.model.embed_tokens(local.clamp(0, self.vocab_per_rank - 1))
        return torch.where(mine[..., None], e, torch.zeros((), dtype=e.dtype, device=e.device))

    def _moe(self, moe: Any, x: torch.Tensor, front: FrontShard | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(shared-expert partial, routed output) of the LatentMoE for tokens ``x [N, H]``; ``front``: the
        rank's rows of the router and latent projections (split front), None when they are replicated."""
        dt = x.dtype
        if front is None:
            ids, weights = moe.gate(x)
            z = moe.routed_expert_down_proj(x)
        else:
            ids, weights, z = front.route_and_down(moe, x, self.comm)
        acc = torch.zeros(z.shape, dtype=compute_dtype(dt), device=z.device)
        for e in torch.unique(ids).tolist():  # the rank's slice of every touched expert: a partial sum
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = moe.experts[e](z[rows])
            acc.index_add_(0, rows, y.to(acc.dtype) * weights[rows, slot].to(acc.dtype).unsqueeze(-1))
        acc = self.comm.all_reduce(acc)  # the latent sums before the latent RMSNorm
        zr = moe.routed_expert_norm(acc).to(dt) if moe.routed_expert_norm is not None else acc.to(dt)
        routed = moe.routed_expert_up_proj(zr) if front is None else front.up_proj(zr, self.comm)
        return moe.shared_experts(x), routed

    def _mlp(self, layer: Any, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(partial, addend) of the layer's MLP on the valid tokens, scattered back to ``[B, T, H]``."""
        xv = x[valid]
        if hasattr(layer, "block_sparse_moe"):
            part, routed = self._moe(layer.block_sparse_moe, xv, self.fronts.get(layer.layer_idx))
        else:
            part, routed = layer.mlp(xv), None
        partial = torch.zeros_like(x)
        partial[valid] = part
        if routed is None:
            return partial, None
        addend = torch.zeros_like(x)
        addend[valid] = routed
        return partial, addend

    # ------------------------------------------------------------------ running
    def _run(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: Any, mla_mode: str) -> torch.Tensor:
        from ..reference.model import prepare_step

        b, t = input_ids.shape
        dev = self.device
        ids, lengths, start_pos, valid = prepare_step(input_ids, lengths, cache, dev)
        m = self.model.model
        eps = self.cfg.rms_norm_eps
        layers = list(m.layers)
        comm = self.comm

        def pre_attention(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if i < len(layers):
                nxt = layers[i]
                return nxt.self_attention_res_proj.weight, nxt.self_attention_res_norm.weight, nxt.input_layernorm.weight
            return m.output_attn_res_proj.weight, m.output_attn_res_norm.weight, m.norm.weight

        # the closed AttnRes snapshots, stacked: blocks = block_buf[:nb] (what a fused kernel reads in place)
        block_buf = torch.empty(self.cfg.num_attn_res_blocks, b, t, self.cfg.hidden_size, dtype=self.dtype, device=dev)
        nb = 0
        # the embedding's all-reduce, fused with layer 0's input norm (no block yet: no mix)
        prefix, x_in = comm.reduce_add_mix_norm(self._embed_partial(ids, valid), None, block_buf[:0],
                                                *pre_attention(0), eps)
        for i, layer in enumerate(layers):
            stream: torch.Tensor | None = prefix
            if layer.closes_block:
                block_buf[nb].copy_(prefix)
                nb += 1
                stream = None
            blocks = block_buf[:nb]
            if layer.is_kda:
                a = layer.self_attn(x_in, cache=cache.layers[i], lengths=lengths)
            elif self.dcp:
                a = dcp_mla_forward(layer.self_attn, x_in, cache.layers[i], start_pos, lengths, comm)
            else:
                a = layer.self_attn(x_in, cache.layers[i], start_pos, lengths, mode=mla_mode)
            prefix, h = comm.reduce_add_mix_norm(a, stream, blocks, layer.mlp_res_proj.weight,
                                                 layer.mlp_res_norm.weight, layer.post_attention_layernorm.weight, eps)
            f, addend = self._mlp(layer, h, valid)
            prefix, x_in = comm.reduce_add_mix_norm(f, prefix, blocks, *pre_attention(i + 1), eps, addend=addend)
        logits = comm.all_gather_last(self.model.lm_head(x_in))
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        cache.lengths = start_pos + lengths
        return torch.where(valid[..., None], logits, torch.zeros((), dtype=logits.dtype, device=dev))

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """``K3ForCausalLM.prefill`` semantics: right-padded ``[B, T]`` with ``lengths`` -> ``[B, T, V]``."""
        if lengths is None:
            lengths = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long)
        return self._run(input_ids, lengths, cache, "plain")

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: Any, active: torch.Tensor | None = None) -> torch.Tensor:
        """``K3ForCausalLM.decode`` semantics: one token per active sequence -> ``[B, V]``."""
        b = tokens.shape[0]
        if active is None:
            active = torch.ones(b, dtype=torch.bool)
        return self._run(tokens.reshape(b, 1), active.to(torch.long).reshape(b), cache, "absorbed")[:, 0]


def build_tp_model(cfg: K3Config, state_dict: dict[str, torch.Tensor], comm: Communicator,
                   dtype: torch.dtype = torch.bfloat16, device: Any = None, dcp: bool = False,
                   moe_front: str = "replicated") -> TPModel:
    """A ``TPModel`` for ``comm``'s rank from the FULL state dict (each rank cuts its own share); ``dcp``:
    the MLA caches split by token across the ranks (``tp_dcp``); ``moe_front="split"``: each rank reads its
    rows of the LatentMoE router and latent projections (``tp_moe_front``)."""
    return TPModel(cfg, rank_model(cfg, state_dict, comm.world, comm.rank, dtype, device), comm, dcp, moe_front)


# ---------------------------------------------------------------------------------------------- test worker
def equivalence_worker(rank: int, world: int, preset_name: str, seed: int, batch: int, prompt_len: int,
                       steps: int, dtype_name: str = "float64", comm_kind: str = "unfused", dcp: bool = False,
                       moe_front: str = "replicated") -> dict[str, Any]:
    """One rank of a TP run on the seeded synthetic weights: a ragged prefill then ``steps`` greedy decode
    steps driven by the TP logits. Returns the prompt, the tokens fed and every logit (on the CPU), so the
    caller can replay the same inputs through the TP1 reference. CPU ranks (gloo) use ``TorchComm``; CUDA
    ranks (nccl) use ``comm_kind`` ("unfused": NCCL + PyTorch ops, "fused": tp_allreduce.SymmMemComm).
    (For ``tp_launch.launch``.)"""
    import torch.distributed as dist

    from ..presets import preset
    from ..synthetic import synthetic_state_dict

    cfg = preset(preset_name).config
    dtype = getattr(torch, dtype_name)
    if dist.get_backend() == "nccl":
        from .tp_allreduce import make_comm

        comm: Communicator = make_comm(comm_kind)
        device: Any = torch.device("cuda", torch.cuda.current_device())
    else:
        comm, device = TorchComm(), None
    model = build_tp_model(cfg, synthetic_state_dict(cfg, seed), comm, dtype=dtype, device=device, dcp=dcp,
                           moe_front=moe_front)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), generator=g)
    lengths = torch.randint(1, prompt_len + 1, (batch,), generator=g)
    lengths[0] = prompt_len
    cache = model.new_cache(batch, prompt_len + steps + 1)
    prefill = model.prefill(ids, lengths, cache).cpu()
    tok = prefill[torch.arange(batch), lengths - 1].argmax(-1)
    fed, decoded = [], []
    for _ in range(steps):
        fed.append(tok.clone())
        logits = model.decode(tok, cache).cpu()
        decoded.append(logits)
        tok = logits.argmax(-1)
    mla = [layer.latent for layer in cache.layers if hasattr(layer, "latent")]
    return {"rank": rank, "comm": comm.name, "ids": ids, "lengths": lengths, "prefill": prefill,
            "fed": torch.stack(fed), "decode": torch.stack(decoded), "cache_lengths": cache.lengths.cpu(),
            "mla_latents": [lat.cpu() for lat in mla]}
