"""The decode executor behind ``decode_backend: latency_specialized``.

    ex = DecodeExecutor(model, max_len=4096)            # backend="latency_specialized" (or "standard")
    ex.warmup_and_capture()                              # compile every kernel, one CUDA graph per bucket
    cache = ex.new_cache(batch)                          # slot-pool caches (K3Cache views)
    logits = ex.prefill(ids, lengths, cache)             # always the standard path (recorded as a fallback)
    logits = ex.decode(tokens, cache)                    # [B, V] FP32, same semantics as K3ForCausalLM.decode
    logits = ex.mixed(tokens, cache, row, prompt)        # the others decode while `row` prefills (mixed_step.py)
    logits = ex.verify(feed, cache, active)              # [B, T, V]: a speculative verify step (verify_step.py)
    ex.commit_verify(cache, keep)                        # keep [B] accepted rows per sequence
    ex.trace.summary()                                   # per step: kernels, standard ops, fallbacks

``readout="hidden"`` (the vLLM route, whose engine applies the final norm and lm_head in its own
``compute_logits``): ``decode`` and ``verify`` return the hidden states the final norm reads (``[B, H]`` /
``[B, T, H]`` in the model dtype, inactive rows 0; ``K3ForCausalLM.decode_hidden`` on the standard path)
instead of logits, and the step skips lm_head. ``prefill`` returns logits either way; ``mixed`` is refused.

Every decode step is checked against the ``Envelope`` on the host (no GPU read): inside it the step pads
the batch to its bucket (padded rows use the empty slot 0), copies tokens / slots / positions into static
buffers and replays the bucket's CUDA graph (or runs ``fast_step.run_step`` eagerly with
``use_graphs=False``); outside it the step runs the reference model (the standard path) on the same
cache and the trace records ``fallback`` with the reason. ``backend="standard"`` runs every step on the
reference model (bitwise the reference: it is the reference). ``backend="standard_graph"`` is the strong
standard path the fast one is measured against: the same step, pools and CUDA graphs with every op served by
cuBLAS / fla / torch's grouped GEMM / PyTorch instead of our kernels (``standard_ops.py``).

A fast step allocates nothing and never synchronises with the host once its bucket is captured; to keep
it that way pass device tensors (tokens, ``active``) and ``out=`` for the logits. Every op of the step is a
kernel (``fast_ops``: MLA attention is ``mla_decode``, the routed experts ``moe_experts`` over the MXFP4
weights built once here, ``ExpertBank``); the shared experts overlap the routed experts on a second stream.
A bucket whose eager warm-up saw a kernel refuse a call (a counted kernel fallback, served by the
kernel's reference, which synchronises) is not captured: its steps run eagerly, each listing the fallback.

The MLA latent pools hold ``max_len`` rounded up to a multiple of 64 positions (``CachePool``): the slot
pool is then a paged cache of 64-position pages, the layout ``mla_decode`` takes; ``max_len`` itself stays
the context limit of the envelope and of ``new_cache``. Launch-level switches are one ``DecodeOptions``
(``options.py``: PDL, L2 prefetch and its budget, the shared-experts stream, the SiTU-GLU kernel, a single
expert copy, the standard path's compiled glue, the skinny GEMM's wgmma threshold), resolved for the backend (``options.resolve``: an option
the backend cannot honour is refused) and recorded whole in the trace metadata (``options``);
``pdl_support()`` says exactly what PDL covers (bitwise the same logits:
tests/test_executor_gpu.py::test_pdl_changes_no_bit). ``ops`` replaces entries of this executor's op
table (``fast_ops.op_table``'s ``overrides``: a kernel under test, a planted error); other executors keep theirs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._lib import counters
from .cache_pool import CachePool, PooledCache, copy_cache
from .envelope import PREFILL_REASON, Envelope
from .fast_ops import GLUE_OPS, OpImpl, op_table
from .fast_step import OpCalls, SideStream, StepIO, run_step
from .graphs import BucketGraphs, bucket_for, counter_delta, step_in_place
from .mixed_step import MixedCapture, MixedStepRunner
from .options import DecodeOptions
from .options import resolve as resolve_options
from .prefetch import L2Prefetcher
from .standard_ops import standard_op_table
from .standard_prefill import prefill_op_table
from .step_plan import ModelPlan
from .trace import ExecutionTrace, StepRecord, trace_dir_from_env
from .verify_step import MAX_VERIFY_ROWS, commit_verify, load_verify, verify_io, verify_launches, verify_rows

BACKENDS = ("latency_specialized", "standard", "standard_graph")
STEP_BACKENDS = ("latency_specialized", "standard_graph")  # backends that run fast_step.run_step
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
READOUTS = ("logits", "hidden")  # what a decode / verify step returns (DecodeExecutor(readout=...))


def pdl_support() -> str:
    """What ``pdl=True`` does in this build (recorded in the trace metadata)."""
    return ("every kernel of the latency_specialized step launches with programmatic dependent launch "
            "(nvidia-cutlass-dsl 4.8.1: launch(use_pdl=True), cute.arch.griddepcontrol_*); before "
            "griddepcontrol.wait each reads only weights, nothing a step writes, then triggers "
            "launch_dependents once its input loads are issued: skinny_gemm (every projection, the router "
            "logits) prefetches its CTA's share of up to 16 MB of W into L2; rmsnorm_residual loads its norm "
            "weight; attn_res_mix loads norm_w and proj_w and prefetches out_w into L2; kda_decode loads the "
            "conv weights, dt_bias, A_log and o_norm_w (slot, conv and recurrent state only after the wait); "
            "moe_router's selection loads the correction bias; mla_decode's attention reads nothing (q, block "
            "table, ctx_len and the latent cache after the wait) and its combine prefetches W_UV into L2; "
            "moe_experts' plan reads nothing (ids after the wait), its two grouped GEMMs only build their "
            "shared-memory MXFP4 table (which experts they read depends on the router), its combine loads the "
            "latent norm weight; situ_glu (opt-in) reads g and u only after the wait (it reads no weight). "
            "The PyTorch glue between kernels launches normally; the standard_graph "
            "backend does not use PDL, tp_fast.TPFastDecoder only when asked (options.BACKEND_DEFAULTS)")


class DecodeExecutor:
    """Fast decode steps for one ``K3ForCausalLM`` on one device (see the module docstring)."""

    def __init__(self, model: Any, *, backend: str = "latency_specialized", max_batch: int = 64, max_len: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, use_graphs: bool = True, trace_dir: str | None = None,
                 kv_dtype: torch.dtype | None = None, kv_scale: float | None = None,
                 envelope: Envelope | None = None, options: DecodeOptions | None = None,
                 pool_from: DecodeExecutor | None = None, ops: Mapping[str, OpImpl] | None = None,
                 spec_tokens: int = 0, spec_all_rows: bool = False, readout: str = "logits") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        if max_batch < 1 or max_len < 1:
            raise ValueError(f"max_batch and max_len must be >= 1, got {max_batch}, {max_len}")
        self.model = model
        self.cfg = model.cfg
        self.backend = backend
        self.readout = readout  # what decode / verify return: "logits", or "hidden" (the final norm's input)
        self.device = model.device
        self.dtype = model.dtype
        self.max_batch = max_batch
        self.max_len = max_len
        self.kv_dtype = kv_dtype or self.dtype
        self.kv_scale = kv_scale
        self.buckets = _buckets(buckets, max_batch)
        if not 0 <= spec_tokens <= 8:
            raise ValueError(f"spec_tokens {spec_tokens}: a verify step holds 1..8 tokens per sequence (0: none)")
        self.spec_tokens = spec_tokens  # the most tokens per sequence of a fused verify step (0: none)
        self.spec_all_rows = spec_all_rows  # scratch for every row of the largest bucket's verify step
        self.verify_splits: dict[str, int] = {}  # why verify steps ran as decode steps, counted
        self._pending_verify: tuple[torch.Tensor, int] | None = None  # (the verified cache's slots, T)
        base = envelope or Envelope()
        self.envelope = dataclasses.replace(base, max_batch=min(base.max_batch, max_batch),
                                            max_context=min(base.max_context, max_len))
        self.model_reason = self.envelope.check_model(self.cfg, device=self.device, dtype=self.dtype,
                                                      kv_dtype=self.kv_dtype)
        self.fast = backend in STEP_BACKENDS and self.model_reason is None
        self.use_graphs = bool(use_graphs and self.fast and self.device.type == "cuda")
        self.options = opts = resolve_options(options, backend)
        self.single_expert_copy = opts.single_expert_copy  # ExpertBank(single_copy=...): the experts kept once
        self.pdl = opts.pdl
        self.situ_glu_kernel = opts.situ_glu_kernel
        self.ops = (standard_op_table(compiled_glue=opts.standard_compiled_glue, device=self.device,
                                      mxfp4_experts=opts.standard_mxfp4_experts)
                    if backend == "standard_graph" else op_table(opts, overrides=ops))
        self.side = SideStream(self.device, enabled=opts.shared_stream and self.fast)
        self.prefetcher = L2Prefetcher(self.device, opts.prefetch_budget, enabled=opts.prefetch and self.fast)
        self.pool: CachePool | None = None
        if pool_from is not None:  # e.g. the standard_graph backend timed on the fast backend's caches
            if (pool_from.max_len, pool_from.max_batch, pool_from.kv_dtype, pool_from.kv_scale, pool_from.dtype,
                    verify_rows(pool_from.spec_tokens, pool_from.buckets, pool_from.spec_all_rows)) != (
                    max_len, self.max_batch, self.kv_dtype, kv_scale, self.dtype,
                    verify_rows(spec_tokens, self.buckets, spec_all_rows)) or pool_from.model is not model:
                raise ValueError("pool_from must be an executor over the same model with the same max_len, "
                                 "max_batch, dtype, kv_dtype, kv_scale and verify scratch (spec_tokens x buckets)")
            self.pool = pool_from._ensure_pool()
        self._plan: ModelPlan | None = None
        self._io: dict[Any, StepIO] = {}  # decode bucket or ("verify", bucket, T) -> its static buffers
        self._calls: dict[int, OpCalls] = {}
        self.eager_buckets: dict[int, dict[str, dict[str, int]]] = {}  # bucket -> kernel fallbacks at warm-up
        self.graphs = BucketGraphs(self.device) if self.use_graphs else None
        self._mixed: MixedStepRunner | None = None  # mixed steps (mixed_step.py), built on first use
        meta = {"backend": backend, "model": self.cfg.name, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "kv_dtype": str(self.kv_dtype).replace("torch.", ""),
                "envelope": self.envelope.as_dict(), "model_reason": self.model_reason, "buckets": list(self.buckets),
                "max_len": max_len, "use_graphs": self.use_graphs,
                "ops": {n: (o.kernel if o.kernel else f"standard: {o.standard_reason}") for n, o in self.ops.items()},
                "glue_ops": list(GLUE_OPS), "options": opts.as_dict(),
                "pdl": {"requested": self.pdl, "effect": pdl_support() if self.pdl else "off"},
                "l2_prefetch": {"enabled": self.prefetcher.enabled, "budget_bytes": opts.prefetch_budget},
                "mla_pool_len": CachePool.latent_length(max_len),
                "shared_experts_stream": self.side.stream is not None,
                "standard_compiled_glue": opts.standard_compiled_glue,
                "single_expert_copy": opts.single_expert_copy, "spec_tokens": spec_tokens, "readout": readout}
        self.trace = ExecutionTrace(trace_dir if trace_dir is not None else trace_dir_from_env(), meta)
        if self.fast:  # the routed experts' kernel weights (and W_UK / W_UV) once, here, never per step
            self._plan = ModelPlan.build(model, single_expert_copy=opts.single_expert_copy)
            self.trace.set_meta(expert_weights=self.cfg.expert_format)

    # ------------------------------------------------------------------ caches
    def _ensure_pool(self) -> CachePool:
        if self.pool is None:
            self.pool = CachePool(self.cfg, self.max_batch + 1, self.max_len, self.dtype, self.device,
                                  kv_dtype=self.kv_dtype, kv_scale=self.kv_scale,
                                  scratch=verify_rows(self.spec_tokens, self.buckets, self.spec_all_rows)
                                  if self.fast else 0)
        return self.pool

    def new_cache(self, batch: int, max_len: int | None = None, *, kv_dtype: torch.dtype | None = None,
                  kv_scale: float | None = None) -> Any:
        """Empty caches for ``batch`` sequences. The fast backend hands out views of its slot pool; a request
        the pool cannot serve (more than ``max_batch`` sequences, a longer ``max_len``, another KV dtype or
        scale) gets a plain reference cache, and its steps run the standard path with the reason."""
        max_len = self.max_len if max_len is None else max_len
        kv_dtype = self.kv_dtype if kv_dtype is None else kv_dtype
        kv_scale = self.kv_scale if kv_scale is None else kv_scale
        if (self.backend == "standard" or batch > self.max_batch or max_len > self.max_len
                or kv_dtype != self.kv_dtype or kv_scale != self.kv_scale):
            return self.model.new_cache(batch, max_len, kv_dtype=kv_dtype, kv_scale=kv_scale)
        return self._ensure_pool().allocate(batch, max_len)

    def copy_cache(self, dst: Any, src: Any) -> Any:
        """Overwrite ``dst`` with ``src``'s state (e.g. one prefilled reference cache into an executor cache)."""
        return copy_cache(dst, src)

    # ------------------------------------------------------------------ setup
    def _plan_or_build(self) -> ModelPlan:
        if self._plan is None:
            self._plan = ModelPlan.build(self.model, single_expert_copy=self.single_expert_copy)
        return self._plan

    def _io_for(self, bucket: Any) -> StepIO:
        """A decode bucket's buffers, or (key ``("verify", Bk, T)``) a verify step's."""
        if bucket not in self._io:
            hidden = (self.cfg.hidden_size, self.dtype) if self.readout == "hidden" else None
            self._io[bucket] = (verify_io(bucket[1], bucket[2], self.cfg.vocab_size, self.device, hidden)
                                if isinstance(bucket, tuple) else
                                StepIO.zeros(bucket, self.cfg.vocab_size, self.device, hidden))
        return self._io[bucket]

    def _run(self, bucket: int) -> OpCalls:
        calls = OpCalls(self.ops)
        run_step(self._plan_or_build(), calls, self._io_for(bucket), self._ensure_pool(),
                 self.prefetcher if self.prefetcher.enabled else None, self.side)
        return calls

    def _empty_rows(self, io: StepIO) -> None:
        for t in (io.tokens, io.slot, io.pos, io.active, io.kda_slot, io.kda_out):
            if t is not None:
                t.zero_()

    @torch.no_grad()
    def _warm_up(self, bucket: int) -> None:
        """One eager step of empty rows: compiles every kernel the bucket launches, touches only slot 0."""
        io = self._io_for(bucket)
        self._empty_rows(io)
        self._calls[bucket] = self._run(bucket)

    @torch.no_grad()
    def _ensure_bucket(self, bucket: int) -> None:
        """With graphs: warm the bucket up and capture its graph (once). A warm-up in which a kernel refused
        a call (served by its reference, which synchronises with the host) leaves the bucket eager."""
        if self.graphs is None or bucket in self.graphs or bucket in self.eager_buckets:
            return
        before = counters.snapshot()
        self._warm_up(bucket)
        torch.cuda.synchronize(self.device)
        _, refused = counter_delta(before, counters.snapshot())
        if refused:
            self.eager_buckets[bucket] = refused
            self.trace.set_meta(eager_buckets={str(b): f for b, f in self.eager_buckets.items()})
            return
        holder: dict[str, OpCalls] = {}

        def step() -> None:
            holder["calls"] = self._run(bucket)

        self.graphs.capture(bucket, step, lambda: {"standard_ops": holder["calls"].standard_ops()})

    def warmup_and_capture(self) -> None:
        """Compile every kernel each bucket launches and capture one CUDA graph per bucket (largest first, so
        the shared graph memory pool is sized by the largest step), and with ``spec_tokens`` one per verify
        step the pool can take (each T in 1..spec_tokens at each bucket whose rows fit the scratch): a request
        never compiles or captures. No-op for steps that fall back."""
        if not self.fast:
            return
        pool = self._ensure_pool()
        keys: list[Any] = [("verify", b, t) for t in range(self.spec_tokens, 0, -1) for b in
                           sorted(self.buckets, reverse=True) if b * t <= min(pool.scratch, MAX_VERIFY_ROWS)]
        for key in sorted(keys, key=lambda k: -k[1] * k[2]) + sorted(self.buckets, reverse=True):
            if self.graphs is not None:
                self._ensure_bucket(key)
            elif self.device.type == "cuda" and key not in self._calls:
                self._warm_up(key)

    # ------------------------------------------------------------------ steps
    def step_reason(self, batch: int, cache: Any) -> str | None:
        """Why a decode step of ``batch`` sequences on ``cache`` would run the standard path (None: fast)."""
        if self.backend == "standard":
            return None
        if self.model_reason:
            return self.model_reason
        if self.pool is None or not self.pool.owns(cache):
            if batch > self.max_batch:
                return self.envelope.check_step(batch=batch)
            return "cache not allocated by this executor (use DecodeExecutor.new_cache)"
        reason = self.envelope.check_step(batch=batch, context=cache.length_bound + 1)
        if reason and reason.startswith("context"):  # the host bound is loose: read the exact one once
            cache.length_bound = int(cache.lengths.max())
            reason = self.envelope.check_step(batch=batch, context=cache.length_bound + 1)
        return reason

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """The standard path (``K3ForCausalLM.prefill``) on ``cache``; recorded as a step with prefill tokens."""
        logits = self.model.prefill(input_ids, lengths, cache)
        if isinstance(cache, PooledCache):
            cache.length_bound = int(cache.lengths.max()) if cache.batch else 0
        reason = None if self.backend == "standard" else PREFILL_REASON
        self.trace.record(StepRecord(0, self.backend, int(input_ids.shape[0]), None, fallback=reason, kind="prefill"))
        return logits

    @torch.no_grad()
    def mixed(self, tokens: torch.Tensor, cache: Any, row: int, prompt: torch.Tensor, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """One mixed step: every sequence of ``cache`` but ``row`` decodes its token of ``tokens [B]`` while
        sequence ``row`` prefills ``prompt [P]`` from its current length -> logits ``[B, V]`` FP32 (row
        ``row``: its last prompt token's). On this executor's pool the step is ``mixed_step.py``'s, served by
        the standard op table plus the prefill ops (a CUDA graph per (bucket, P, start) when graphs are on);
        the ``latency_specialized`` backend records it as a fallback (``PREFILL_REASON``). Otherwise (the
        ``standard`` backend, a cache from elsewhere, a model outside the envelope) the reference model's
        ``prefill`` runs the same step. One host read: the prompt's start position."""
        if self.readout != "logits":
            raise ValueError(f"mixed step: an executor with readout={self.readout!r} runs decode and verify steps only")
        b = int(tokens.shape[0])
        prompt = prompt.reshape(-1)
        p = int(prompt.shape[0])
        if cache.batch != b or not 0 <= row < b or p < 1:
            raise ValueError(f"mixed step: tokens for {b} sequences, cache of {cache.batch}, row {row}, "
                             f"prompt of {p} tokens (need the cache's batch, 0 <= row < batch, a prompt)")
        start = int(cache.lengths[row])
        if start + p > cache.max_len:
            raise ValueError(f"mixed step: prompt positions {start}..{start + p - 1} past the cache's max_len "
                             f"{cache.max_len}")
        bucket = bucket_for(b, self.buckets)
        if self.backend == "standard" or not self.fast or bucket is None or self.pool is None \
                or not self.pool.owns(cache):
            logits = self._mixed_reference(tokens, cache, row, prompt)
            reason = None if self.backend == "standard" else self.model_reason or (
                self.envelope.check_step(batch=b) if bucket is None else
                "cache not allocated by this executor (use DecodeExecutor.new_cache)")
            self.trace.record(StepRecord(0, self.backend, b, None, fallback=reason, kind="mixed"))
        else:
            cap, replayed = self._mixed_runner().step((bucket, p, start), tokens, cache.slots, cache.lengths,
                                                      row, prompt)
            cache.lengths.add_(1)
            cache.lengths[row] = start + p
            cache.length_bound = max(cache.length_bound + 1, start + p)
            self.trace.record(StepRecord(0, self.backend, b, bucket, standard_ops=list(cap.standard_ops),
                                         fallback=PREFILL_REASON if self.backend == "latency_specialized" else None,
                                         graph=replayed, kind="mixed"))
            logits = cap.io.logits[:b]
        if out is not None:
            return out[:b].copy_(logits)
        return logits.clone()

    def _mixed_reference(self, tokens: torch.Tensor, cache: Any, row: int, prompt: torch.Tensor) -> torch.Tensor:
        """``mixed`` through the reference model's right-padded ``prefill``."""
        b, p = int(tokens.shape[0]), int(prompt.shape[0])
        ids = torch.zeros(b, p, dtype=torch.long, device=self.device)
        ids[:, 0] = tokens.to(self.device)
        ids[row] = prompt.to(self.device)
        lengths = torch.ones(b, dtype=torch.long, device=self.device)
        lengths[row] = p
        logits = self.model.prefill(ids, lengths, cache)
        if isinstance(cache, PooledCache):
            cache.length_bound = int(cache.lengths.max())
        return logits[torch.arange(b, device=self.device), lengths - 1]

    def mixed_capture(self, batch: int, prompt_tokens: int, start: int) -> MixedCapture | None:
        """The mixed step of that shape as this executor last ran it (staged inputs, its graph once captured),
        or None when it never ran one."""
        bucket = bucket_for(batch, self.buckets)
        return None if self._mixed is None else self._mixed.captures.get((bucket, prompt_tokens, start))

    def mixed_eager_reason(self, batch: int, prompt_tokens: int, start: int) -> str | None:
        """Why the mixed steps of that shape run eagerly on a GPU (a failed capture), or None."""
        bucket = bucket_for(batch, self.buckets)
        return None if self._mixed is None else self._mixed.eager_keys.get((bucket, prompt_tokens, start))

    def _mixed_runner(self) -> MixedStepRunner:
        if self._mixed is None:
            table = dict(self.ops) if self.backend == "standard_graph" else standard_op_table(device=self.device)
            table.update(prefill_op_table(self.device))
            self._mixed = MixedStepRunner(self._plan_or_build(), self._ensure_pool(), table, self.cfg.vocab_size,
                                          self.device, self.use_graphs, self.side)
        return self._mixed

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: Any, active: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per active sequence -> logits ``[B, V]`` FP32 (inactive rows 0, their caches untouched);
        with ``readout="hidden"`` the hidden states ``[B, H]``. ``out`` (``[>= B, V]`` FP32, or ``[>= B, H]``)
        receives them without an allocation; otherwise a new tensor."""
        b = int(tokens.shape[0])
        reason = self.step_reason(b, cache)
        if self.backend == "standard" or reason:
            rows = (self.model.decode_hidden if self.readout == "hidden" else self.model.decode)(tokens, cache, active)
            if isinstance(cache, PooledCache):
                cache.length_bound += 1
            self.trace.record(StepRecord(0, self.backend, b, None, fallback=reason))
            if out is not None:
                out[:b].copy_(rows)
                return out[:b]
            return rows
        bucket = bucket_for(b, self.buckets)
        self._ensure_bucket(bucket)
        io = self._io_for(bucket)
        io.load(tokens, active, cache.slots, cache.lengths)
        rec = self._replay_or_run(bucket, StepRecord(0, self.backend, b, bucket))
        cache.lengths.add_(io.active[:b])
        cache.length_bound += 1
        self.trace.record(rec)
        if out is not None:
            out[:b].copy_(io.readout[:b])
            return out[:b]
        return io.readout[:b].clone()

    @torch.no_grad()
    def decode_in_place(self, io: StepIO, caches: Any) -> torch.Tensor:
        """One fast decode step over caches the executor does not own (``caches.layers``: vLLM's own tensors,
        each layer carrying its own device indices, ``integrations/vllm_inplace.py``; ``io``: tokens, the active
        mask, the readout buffer): no host read, no graph of the executor's own, so an engine may capture it
        into its graph. Returns ``io.readout``. Traced with what it launched (``graph``: inside a capture)."""
        if not self.fast:
            raise RuntimeError(f"decode_in_place needs the fast step ({self.model_reason or self.backend})")
        step_in_place(self.ops, caches, lambda calls: run_step(
            self._plan_or_build(), calls, io, caches, self.prefetcher if self.prefetcher.enabled else None,
            self.side), self.trace, self.backend, self.device, int(io.tokens.shape[0]))
        return io.readout

    def _replay_or_run(self, key: Any, rec: StepRecord) -> StepRecord:
        """Run the staged step of ``key`` (its graph, else eagerly) and fill ``rec`` with what it launched."""
        if self.graphs is not None and key in self.graphs:
            cap = self.graphs.replay(key)
            return dataclasses.replace(rec, kernels=dict(cap.kernels), standard_ops=list(cap.standard_ops),
                                       kernel_fallbacks=dict(cap.kernel_fallbacks), graph=True)
        before = counters.snapshot()
        calls = self._run(key)
        kernels, fallbacks = counter_delta(before, counters.snapshot())
        return dataclasses.replace(rec, kernels=kernels, standard_ops=calls.standard_ops(), kernel_fallbacks=fallbacks)

    # ------------------------------------------------------------------ verify steps
    def verify_reason(self, batch: int, tokens: int, cache: Any) -> str | None:
        """Why a verify step of ``batch`` sequences x ``tokens`` rows on ``cache`` cannot run as one fused step
        (``verify_step.py``; None: it can). The caller then runs its rows as decode steps."""
        if self.backend == "standard" or not self.fast:
            return "the standard backend runs no fused verify step" if self.backend == "standard" else self.model_reason
        reason = self.step_reason(batch, cache)
        if reason:
            return reason
        if tokens > self.spec_tokens:
            return (f"{tokens} tokens per sequence > spec_tokens {self.spec_tokens} (the executor's verify "
                    "scratch; DecodeExecutor(spec_tokens=1 + k))")
        def check() -> str | None:
            return self.envelope.check_step(batch=batch, context=cache.length_bound + tokens,
                                            speculative_tokens=tokens - 1)

        reason = check()
        if reason and reason.startswith("context"):
            cache.length_bound = int(cache.lengths.max())
            reason = check()
        if reason:
            return reason
        if verify_launches(batch, tokens, self.buckets, self._ensure_pool().scratch) is None:
            return (f"{batch} sequences x {tokens} tokens: more rows than the {self.pool.scratch} scratch rows "
                    "keep to the commit (DecodeExecutor(spec_all_rows=True) keeps every row of the largest bucket)")
        return None

    def record_verify_split(self, reason: str) -> None:
        """Count a verify step run as decode steps, with ``verify_reason``'s reason (trace metadata)."""
        self.verify_splits[reason] = self.verify_splits.get(reason, 0) + 1
        self.trace.set_meta(verify_splits=dict(self.verify_splits))

    @torch.no_grad()
    def verify(self, feed: torch.Tensor, cache: Any, active: torch.Tensor | None = None) -> torch.Tensor:
        """One fused verify step (``verify_step.py``): ``feed [B, T]`` (the last emitted token and the drafts),
        ``active [B, T]`` (default all) -> logits ``[B, T, V]`` FP32 (inactive rows 0; ``readout="hidden"``: the
        hidden states ``[B, T, H]``). Nothing is committed
        until ``commit_verify``. ``ValueError`` where ``verify_reason`` gives a reason."""
        b, T = (int(n) for n in feed.shape)
        reason = self.verify_reason(b, T, cache)
        if reason:
            raise ValueError(f"no fused verify step of {b} x {T}: {reason}")
        if active is None:
            active = torch.ones(b, T, dtype=torch.bool, device=self.device)
        out = []
        for first, n, bucket in verify_launches(b, T, self.buckets, self.pool.scratch):
            key = ("verify", bucket, T)
            self._ensure_bucket(key)
            io = self._io_for(key)
            rows = slice(first, first + n)
            load_verify(io, feed[rows], active[rows], cache.slots[rows], cache.lengths[rows],
                        self.pool.scratch_base + first * T)
            self.trace.record(self._replay_or_run(key, StepRecord(0, self.backend, n, bucket, kind="verify",
                                                                  tokens=T)))
            out.append(io.readout[: n * T].view(n, T, -1).clone())
        self._pending_verify = (cache.slots, T)
        return out[0] if len(out) == 1 else torch.cat(out)

    def commit_verify(self, cache: Any, keep: torch.Tensor) -> None:
        """After ``verify`` on ``cache``: each sequence's caches those after its first ``keep[b]`` rows (0: the
        sequence untouched), lengths advanced by ``keep``."""
        pending = self._pending_verify
        if pending is None or pending[0] is not cache.slots:
            raise ValueError("commit_verify without a verify step on this cache just before it")
        self._pending_verify = None
        commit_verify(self.pool, cache, keep, pending[1])

    def close(self) -> None:
        self.trace.close()


def _buckets(buckets: Sequence[int], max_batch: int) -> tuple[int, ...]:
    """The buckets below ``max_batch`` plus the first one holding it (``max_batch`` itself if none does)."""
    bs = sorted({int(b) for b in buckets if int(b) >= 1})
    out = [b for b in bs if b < max_batch]
    top = next((b for b in bs if b >= max_batch), max_batch)
    return tuple(out + [top])
