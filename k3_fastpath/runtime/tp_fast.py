"""The fast decode step of one TP rank: the executor's kernels on the rank's shards, partial sums reduced by a
``Communicator``, one CUDA graph per batch bucket.

``fast_step.run_step`` fuses each sublayer's residual add into its output projection; under tensor
parallelism those projections produce partial sums, so ``run_tp_step`` keeps the executor's per-op
implementations (``ops``: skinny GEMM, KDA decode, MLA attention, router, experts; the same ``ModelPlan`` of
the rank model's own weights, the same slot-pool caches) and changes only where sums meet:

* the KDA / MLA blocks write their o_proj partial into a buffer (``residual=None``) and
  ``comm.reduce_add_mix_norm`` does all-reduce + residual add + the MLP's AttnRes mix + its RMSNorm;
* the MLP: dense down projection and shared-expert down projection are partials; the routed experts of the
  rank (each expert's intermediate slice) give a partial FP32 latent sum, all-reduced before the latent
  RMSNorm; the routed output joins the shared sum inside the next fused op (``addend``), which also mixes
  and norms the next layer's input (or the final norm);
* the vocab-parallel embedding and lm_head: a rank embeds the tokens of its vocabulary range (its partial
  is reduced by the first fused op) and its logits slice is all-gathered;
* with ``moe_front="split"`` the rank reads only its rows of each LatentMoE's router and latent projections
  (``tp_moe_front.py``): its FP32 router logits, latent channels and routed output channels are all-gathered
  (three all-gathers per MoE layer) and the selection runs on the gathered logits.

With ``tp_allreduce.SymmMemComm`` each of those is one symmetric-memory one-shot all-reduce plus one Triton
kernel; everything is capturable (no host synchronisation, static shapes). ``TPFastDecoder`` wraps it with
the executor's pieces (``CachePool``, ``StepIO``, ``BucketGraphs``) for ``decode``. On a CPU (gloo) the
kernels run their references (counted fallbacks), which is how tests/test_tp_cpu.py checks the structure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .._lib import counters
from ..reference.common import rms_norm
from .graphs import counter_delta, step_in_place
from .options import DecodeOptions
from .options import resolve as resolve_options
from .tp import rank_config
from .tp_comm import Communicator
from .tp_moe_front import MOE_FRONTS, FrontShard
from .trace import ExecutionTrace, StepRecord, trace_dir_from_env


def _attention_fns() -> tuple[Any, Any]:
    """The executor's KDA and MLA blocks (``fast_step._kda`` / ``_mla``): one place defines their op calls."""
    from . import fast_step

    return fast_step._kda, fast_step._mla


def _tp_mlp(ops: Any, m: Any, x: torch.Tensor, eps: float, cfg: Any, comm: Communicator,
            front: FrontShard | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(partial, addend) of one MLP on this rank: partial = the row-parallel down projection's output,
    addend = the (replicated) routed output of a LatentMoE. ``front``: the rank's rows of the router and the
    latent projections (``tp_moe_front``: logits, latent and routed output all-gathered; the selection is
    ``route_from_logits`` on the gathered FP32 logits), None when the rank holds them whole."""
    from .fast_ops import route_from_logits
    from .fast_step import mlp_activation
    from .step_plan import DenseMLPWeights

    if isinstance(m, DenseMLPWeights):
        h = mlp_activation(ops, ops("linear", x, m.gate), ops("linear", x, m.up), cfg)
        return ops("linear", h, m.down), None
    if front is None:
        ids, weights = ops("moe_router", x, m.router, m.bias, m.top_k, m.renormalize, m.scale)
        z = ops("linear", x, m.latent_down)
    else:
        logits = comm.all_gather_last(ops("linear", x, front.router, out_dtype=torch.float32))
        ids, weights = route_from_logits(logits, m.bias, m.top_k, m.renormalize, m.scale)
        z = comm.all_gather_last(ops("linear", x, front.down))
    acc = comm.all_reduce(ops("moe_experts", z, ids, weights, m.bank))  # the ranks' expert slices summed
    zr = (rms_norm(acc, m.latent_norm, eps) if m.latent_norm is not None else acc).to(x.dtype)
    routed = ops("linear", zr, m.latent_up) if front is None else comm.all_gather_last(ops("linear", zr, front.up))
    h = mlp_activation(ops, ops("linear", x, m.shared_gate), ops("linear", x, m.shared_up), cfg)
    return ops("linear", h, m.shared_down), routed


def run_tp_step(plan: Any, ops: Any, io: Any, pool: Any, comm: Communicator, vocab_per_rank: int,
                fronts: dict[int, FrontShard] | None = None) -> None:
    """One decode step of this rank for the bucket of ``io`` (reads tokens / slot / pos / active, updates the
    rank's caches, writes the full-vocabulary ``io.logits``, or where ``io.hidden`` is given the hidden states
    the final norm reads, the same on every rank). Every rank must run it at the same time.
    ``fronts``: per MoE layer index, the rank's rows of its router and latent projections (split front)."""
    kda, mla = _attention_fns()
    bk = io.tokens.shape[0]
    embed = plan.embed
    h_dim = embed.shape[1]
    eps = plan.eps
    local = io.tokens - comm.rank * vocab_per_rank
    mine = (local >= 0) & (local < vocab_per_rank) & io.active
    emb = torch.index_select(embed, 0, local.clamp(0, vocab_per_rank - 1)) * mine.to(embed.dtype)[:, None]
    blocks = torch.empty(plan.num_sources - 1, bk, h_dim, dtype=embed.dtype, device=embed.device)
    nb = 0
    layers = plan.layers

    def pre_attention(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if n < len(layers):
            return layers[n].attn_res_proj, layers[n].attn_res_norm, layers[n].input_norm
        return plan.out_res_proj, plan.out_res_norm, plan.final_norm

    prefix, x = comm.reduce_add_mix_norm(emb, None, blocks[:0], *pre_attention(0), eps)
    for n, L in enumerate(layers):
        stream: torch.Tensor | None = prefix
        if L.closes_block:
            blocks[nb].copy_(prefix)
            nb += 1
            stream = None
        partial = torch.empty(bk, h_dim, dtype=embed.dtype, device=embed.device)
        (kda if L.kind == "kda" else mla)(ops, L.attn, x, io, pool.layers[L.idx], eps, None, partial)
        prefix, h = comm.reduce_add_mix_norm(partial, stream, blocks[:nb], L.mlp_res_proj, L.mlp_res_norm,
                                             L.post_norm, eps)
        f, addend = _tp_mlp(ops, L.mlp, h, eps, plan.cfg, comm, (fronts or {}).get(L.idx))
        prefix, x = comm.reduce_add_mix_norm(f, prefix, blocks[:nb], *pre_attention(n + 1), eps, addend=addend)
    if io.hidden is not None:  # the final AttnRes mix before the norm (the engine applies norm and lm_head)
        src = torch.cat([blocks[:nb], prefix[None]])
        from .fast_step import _mix

        io.hidden.copy_(_mix(ops, src, nb, plan.out_res_norm, plan.out_res_proj, None, eps))
        io.hidden.masked_fill_(~io.active[:, None], 0.0)
        return
    logits = comm.all_gather_last(ops("linear", x, plan.lm_head, out_dtype=torch.float32))
    io.logits.copy_(logits)
    io.logits.masked_fill_(~io.active[:, None], 0.0)


class TPFastDecoder:
    """``DecodeExecutor.decode`` for one TP rank (see the module docstring). All ranks call ``decode`` with the
    same batch at the same time; ``graphs`` holds one captured step per bucket once ``decode`` saw it.

    ``backend="standard_graph"`` is the strong standard path at TP > 1: the same step and graphs with
    ``standard_ops``' library op table (cuBLAS, fla, ``torch._grouped_mm`` over the rank's BF16 expert slices)
    and, given ``TorchComm``, NCCL all-reduces followed by separate PyTorch ops (captured too). ``pool_from``
    shares another decoder's slot pool, so both backends time the same cache. ``options``: the
    ``DecodeOptions`` it honours (``options.HONOURED["tp:<backend>"]``: PDL and the SiTU-GLU kernel, or the
    standard path's compiled glue); given none, ``options.defaults`` (PDL off here until measured at TP2:
    ``perf.decode_sweep`` ``tp_fast_pdl`` times a ``fast_pdl`` row beside ``fast``)."""

    def __init__(self, cfg: Any, model: Any, comm: Communicator, *, max_batch: int = 64, max_len: int,
                 buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), use_graphs: bool = True,
                 kv_dtype: torch.dtype | None = None,
                 backend: str = "latency_specialized", pool_from: TPFastDecoder | None = None,
                 options: DecodeOptions | None = None, moe_front: str = "replicated", readout: str = "logits",
                 in_place: bool = False) -> None:
        from .cache_pool import CachePool
        from .executor import READOUTS, STEP_BACKENDS, _buckets
        from .fast_ops import op_table
        from .graphs import BucketGraphs
        from .standard_ops import standard_op_table
        from .step_plan import ModelPlan

        if backend not in STEP_BACKENDS:
            raise ValueError(f"backend must be one of {STEP_BACKENDS}, got {backend!r}")
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        self.readout = readout  # what decode returns (DecodeExecutor's readout)

        if model.cfg != rank_config(cfg, comm.world):
            raise ValueError(f"model config {model.cfg.name!r} is not rank_config({cfg.name!r}, {comm.world})")
        self.cfg, self.model, self.comm = cfg, model, comm
        self.device = model.device
        self.max_len = max_len
        self.buckets = _buckets(buckets, max_batch)
        self.plan = ModelPlan.build(model)
        self.backend = backend
        self.options = opts = resolve_options(options, f"tp:{backend}")
        self.ops = (standard_op_table(compiled_glue=opts.standard_compiled_glue, device=self.device,
                                      mxfp4_experts=opts.standard_mxfp4_experts)
                    if backend == "standard_graph" else op_table(opts))
        self.pdl = opts.pdl
        self.kv_dtype = kv_dtype or model.dtype
        if pool_from is not None:  # e.g. the standard path timed on the fast decoder's caches
            if (pool_from.model is not model or pool_from.max_len != max_len or pool_from.kv_dtype != self.kv_dtype
                    or pool_from.pool.slots < max_batch + 1):
                raise ValueError("pool_from must be a decoder over the same rank model with the same max_len and "
                                 "kv_dtype and at least as many slots")
            self.pool = pool_from.pool
        elif in_place:  # steps only on caches the engine owns (decode_in_place): no pool, no graphs of its own
            self.pool = None
            use_graphs = False
        else:
            self.pool = CachePool(model.cfg, max_batch + 1, max_len, model.dtype, self.device,
                                  kv_dtype=self.kv_dtype)
        self.graphs = BucketGraphs(self.device) if use_graphs and self.device.type == "cuda" else None
        self._io: dict[int, Any] = {}
        self.vocab_per_rank = cfg.vocab_size // comm.world
        if moe_front not in MOE_FRONTS:
            raise ValueError(f"moe_front must be one of {', '.join(MOE_FRONTS)}, got {moe_front!r}")
        self.moe_front = moe_front
        self.fronts = {} if moe_front == "replicated" else {
            i: FrontShard.of(layer.block_sparse_moe, comm.world, comm.rank)
            for i, layer in enumerate(model.model.layers) if hasattr(layer, "block_sparse_moe")}
        self.last_calls: Any = None
        # every step recorded, streamed where the executor's trace goes ($K3_FASTPATH_TRACE: the vLLM route's
        # steps counted by equivalence.vllm_route)
        self.trace = ExecutionTrace(trace_dir_from_env(), {"tp": comm.world, "rank": comm.rank, "comm": comm.name})

    fast = True  # its step is always the fast step's structure (on a CPU the kernels serve their references)
    model_reason = None
    kv_scale = None  # the TP decoder keeps its MLA latents in the model dtype

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @torch.no_grad()
    def decode_in_place(self, io: Any, caches: Any) -> torch.Tensor:
        """``DecodeExecutor.decode_in_place`` for this rank: one step over the engine's caches of this rank
        (each layer carrying its indices), every rank at the same time; capturable by the engine's graph
        (the collectives included, over NCCL). Returns ``io.readout``."""
        step_in_place(self.ops, caches, lambda calls: run_tp_step(
            self.plan, calls, io, caches, self.comm, self.vocab_per_rank, self.fronts), self.trace, self.backend,
            self.device, int(io.tokens.shape[0]))
        return io.readout

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def step_reason(self, batch: int, cache: Any) -> str | None:
        """Why this decoder cannot run a decode step of ``batch`` sequences on ``cache`` (None: it can); it has
        no other path, so a caller with a reason runs its own (``DecodeExecutor.step_reason``'s contract)."""
        if self.pool is None or not self.pool.owns(cache):
            return "cache not allocated by this decoder (use TPFastDecoder.new_cache; in_place: decode_in_place)"
        if batch > self.max_batch:
            return f"batch {batch} > the decoder's largest bucket {self.max_batch}"
        if cache.length_bound + 1 > self.max_len:
            cache.length_bound = int(cache.lengths.max())  # the host bound is loose: read the exact one once
            if cache.length_bound + 1 > self.max_len:
                return f"context {cache.length_bound + 1} > the decoder's max_len {self.max_len}"
        return None

    def new_cache(self, batch: int, max_len: int | None = None) -> Any:
        if self.pool is None:
            raise ValueError("an in_place TPFastDecoder holds no cache pool: it steps on the engine's caches "
                             "(decode_in_place)")
        return self.pool.allocate(batch, self.max_len if max_len is None else max_len)

    def warmup_and_capture(self) -> None:
        """Every bucket's step warmed up and captured now (on a GPU; a collective on every rank, so every
        rank calls it at the same point), not inside the first steps that use it."""
        for bucket in self.buckets:
            self._ensure_bucket(bucket)

    def _io_for(self, bucket: int) -> Any:
        from .fast_step import StepIO

        if bucket not in self._io:
            hidden = (self.cfg.hidden_size, self.model.dtype) if self.readout == "hidden" else None
            self._io[bucket] = StepIO.zeros(bucket, self.cfg.vocab_size, self.device, hidden)
        return self._io[bucket]

    def _run(self, bucket: int) -> Any:
        from .fast_step import OpCalls

        calls = OpCalls(self.ops)
        run_tp_step(self.plan, calls, self._io_for(bucket), self.pool, self.comm, self.vocab_per_rank, self.fronts)
        self.last_calls = calls
        return calls

    @torch.no_grad()
    def _ensure_bucket(self, bucket: int) -> None:
        if self.graphs is None or bucket in self.graphs:
            return
        io = self._io_for(bucket)
        for t in (io.tokens, io.slot, io.pos, io.active):
            t.zero_()
        self._run(bucket)  # warm-up: compiles every kernel and the Triton epilogue before capture
        torch.cuda.synchronize(self.device)
        self.comm.barrier()
        holder: dict[str, Any] = {}

        def step() -> None:
            holder["calls"] = self._run(bucket)

        self.graphs.capture(bucket, step, lambda: {"standard_ops": holder["calls"].standard_ops()})

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: Any, active: torch.Tensor | None = None) -> torch.Tensor:
        """One token per active sequence of ``cache`` (from ``new_cache``) -> full-vocabulary logits [B, V]
        (``readout="hidden"``: the hidden states [B, H] the final norm reads)."""
        from .graphs import bucket_for

        b = int(tokens.shape[0])
        bucket = bucket_for(b, self.buckets)
        if bucket is None or self.pool is None or not self.pool.owns(cache):
            raise ValueError(f"batch {b} outside the buckets {self.buckets}, or a cache not from new_cache()")
        self._ensure_bucket(bucket)
        io = self._io_for(bucket)
        io.load(tokens, active, cache.slots, cache.lengths)
        rec = StepRecord(0, self.backend, b, bucket)
        if self.graphs is not None:
            cap = self.graphs.replay(bucket)
            rec = dataclasses.replace(rec, kernels=dict(cap.kernels), standard_ops=list(cap.standard_ops),
                                      kernel_fallbacks=dict(cap.kernel_fallbacks), graph=True)
        else:
            before = counters.snapshot()
            calls = self._run(bucket)
            kernels, fallbacks = counter_delta(before, counters.snapshot())
            rec = dataclasses.replace(rec, kernels=kernels, standard_ops=calls.standard_ops(),
                                      kernel_fallbacks=fallbacks)
        self.trace.record(rec)
        cache.lengths.add_(io.active[:b])
        cache.length_bound += 1
        return io.readout[:b].clone()


def fast_equivalence_worker(rank: int, world: int, preset_name: str, seed: int, batch: int, steps: int,
                            backend: str = "latency_specialized", moe_front: str = "replicated") -> dict[str, Any]:
    """One rank of ``TPFastDecoder`` on CPU (gloo, kernels served by their references) over the stable
    synthetic weights: ``steps`` decode steps from an empty cache on seeded tokens (the last sequence inactive
    on the last step). Returns the tokens, the active masks and the logits. (For ``tp_launch.launch``.)"""
    from ..presets import preset
    from ..synthetic import synthetic_state_dict
    from .tp import rank_model
    from .tp_comm import TorchComm

    cfg = preset(preset_name).config
    comm = TorchComm()
    model = rank_model(cfg, synthetic_state_dict(cfg, seed, conditioning="stable"), world, rank)
    dec = TPFastDecoder(cfg, model, comm, max_batch=batch, max_len=steps + 2, use_graphs=False, backend=backend,
                        moe_front=moe_front)
    cache = dec.new_cache(batch)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, cfg.vocab_size, (steps, batch), generator=g)
    active = torch.ones(steps, batch, dtype=torch.bool)
    active[-1, -1] = False
    logits = torch.stack([dec.decode(tokens[k], cache, active[k]) for k in range(steps)])
    return {"rank": rank, "tokens": tokens, "active": active, "logits": logits,
            "standard_ops": dec.last_calls.standard_ops()}
