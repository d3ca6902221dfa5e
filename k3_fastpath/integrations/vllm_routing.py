"""Routing vLLM's Kimi K3 decode steps to ``DecodeExecutor``: which steps, and the state that goes with them.

Per forward call the model class (``vllm_model.py``) asks ``VllmDecodeRouter.plan``:

1. ``classify_step`` reads vLLM's per-layer attention metadata of one KDA layer (``KimiK3KDAMetadata``) and
   one MLA layer (``MLACommonMetadata``): the step is routed only if it is a pure, non-speculative decode
   (every request one new token: ``num_prefills == 0``, ``num_spec_decodes == 0``, ``num_decode_tokens ==
   num_decodes == num_actual_tokens``), of at most the executor's ``max_batch`` requests, each with a real
   state index (> 0) and ``seq_len <= max_len``, at the positions vLLM passes. Anything else is a fallback
   with a one-line reason (prefill tokens in the step, speculative decoding, batch too large, context too
   long, no metadata in a profile run, ...);
2. the cache layouts (``vllm_state.layout_reason``), checked once per bound cache: a layout the executor
   cannot map bit for bit is a fallback reason for every step.

A routed step (``run``): each request is keyed by its vLLM KDA state index. The first time an index is
routed its state is imported into an executor pool row (KDA conv + recurrent state, MLA latents through the
block table up to ``seq_len - 1``); the step then runs ``DecodeExecutor.decode`` on a ``PooledCache`` whose
``slots`` are exactly those rows, in the batch's order (the fast step reads only ``slots`` / ``lengths``;
when the executor itself falls back, e.g. on a CPU, its standard path runs on a gathered copy that is
scattered back). The new MLA latent rows are written through to vLLM's paged cache every step, so vLLM's
MLA cache (and its prefix cache) never goes stale; KDA state stays in the pool while requests keep being
routed.

Before a fallback step (``sync_back``) every routed request's KDA state is exported to its vLLM state index
and all pool rows are freed, so vLLM's standard path continues from the right state; the next routed step
re-imports. That also makes index reuse safe: vLLM can only hand a freed state index to a new request
through a prefill, and a step with prefill tokens always falls back (flushing the map first; exporting a
finished request's state into its freed index is harmless, its next owner's prefill starts without
initial state). A routed
request whose ``seq_len - 1`` differs from the length the router holds (state moved on without it) is
re-imported as well. Cost: one re-import of every running request's state after each fallback step
(a device copy of its KDA states and MLA latents).

Weights (``vllm_weights.executor_model_in_place``): the executor runs over a ``K3ForCausalLM`` whose tensors
are views of vLLM's loaded parameters (row ranges of the fused ones), a few small tensors prepared
(``A_log`` padding, ``o_norm`` in FP32); the executor's ``ExpertBank`` copies the routed experts into its
own layouts. ``check_device_memory`` refuses with the numbers when the device cannot hold that and the pool.

Per routed step the host reads the batch's ``seq_lens`` and state indices once (a device sync; vLLM's
forward is eager here anyway, ``enforce_eager`` being required).

Assumption: without KDA prefix caching (refused) a request's state index is only handed to a new request
through a step with prefill tokens; a fully cached prompt scheduled as a one-token "decode" would defeat
the index-reuse detection above except through the length check.

Not tested here against a running vLLM on a GPU (the GPU host has no vLLM): the classification runs on
vLLM's own metadata classes, the state moves on tensors shaped by vLLM's own shape/dtype calculators, and
the end-to-end test drives the router with the reference model on a CPU (tests/test_vllm_routing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.cache_pool import PooledCache
from ..runtime.envelope import PREFILL_REASON
from ..runtime.trace import StepRecord
from .vllm_state import VllmLayout, export_request, import_request, layout_reason, write_latents

VLLM_PATH = "vllm standard path"  # prefix of the trace reason of a step vLLM's own forward ran


@dataclass(frozen=True)
class StepPlan:
    """What one forward call is: routed (``reason`` None) or not, and the per-request inputs of a routed step."""

    reason: str | None
    kind: str = "decode"  # "decode" | "prefill" | "profile" (no attention metadata)
    batch: int = 0
    state_indices: torch.Tensor | None = None  # [B] long, host
    seq_lens: torch.Tensor | None = None  # [B] long, host (includes this step's token)
    block_table: torch.Tensor | None = None  # [B, nb] (MLA), device

    @property
    def route(self) -> bool:
        return self.reason is None


def classify_step(attn_metadata: Any, kda_layer: str, mla_layer: str, *, max_batch: int, max_len: int,
                  positions: torch.Tensor | None = None) -> StepPlan:
    """Route or fall back, for one forward call, from vLLM's per-layer metadata dict (see module docstring)."""
    if attn_metadata is None:
        return StepPlan("no attention metadata (vLLM profile / dummy run)", kind="profile")
    if isinstance(attn_metadata, list):
        return StepPlan("micro-batched step (dual batch overlap)")
    kda, mla = attn_metadata.get(kda_layer), attn_metadata.get(mla_layer)
    if kda is None or mla is None:
        return StepPlan(f"no metadata for layer {kda_layer if kda is None else mla_layer}", kind="profile")
    if kda.num_prefills or mla.num_prefills:
        return StepPlan(PREFILL_REASON, kind="prefill", batch=int(kda.num_decodes + kda.num_prefills))
    if kda.num_spec_decodes:
        return StepPlan(f"speculative decoding ({kda.num_spec_decode_tokens} tokens of {kda.num_spec_decodes} "
                        "requests)", batch=int(kda.num_spec_decodes + kda.num_decodes))
    b = int(kda.num_decodes)
    if b == 0:
        return StepPlan("no decode tokens in step")
    if not (kda.num_decode_tokens == b == mla.num_decodes == mla.num_decode_tokens == kda.num_actual_tokens
            == mla.num_actual_tokens):
        return StepPlan(f"not one token per request (KDA {kda.num_decode_tokens} tokens / {b} requests, MLA "
                        f"{mla.num_decode_tokens} / {mla.num_decodes}, {mla.num_actual_tokens} actual)", batch=b)
    if b > max_batch:
        return StepPlan(f"batch {b} > {max_batch} (the executor's max_batch)", batch=b)
    if mla.decode is None or kda.non_spec_state_indices_tensor is None:
        return StepPlan("decode metadata missing (MLA decode / KDA state indices)", batch=b)
    seq_lens = mla.decode.seq_lens[:b].to("cpu", torch.long)
    state_idx = kda.non_spec_state_indices_tensor[:b].to("cpu", torch.long)
    if int(seq_lens.max()) > max_len:
        return StepPlan(f"context {int(seq_lens.max())} > {max_len} (the executor's max_len)", batch=b)
    if int(seq_lens.min()) < 1:
        return StepPlan(f"seq_len {int(seq_lens.min())} < 1", batch=b)
    if int(state_idx.min()) <= 0 or len(set(state_idx.tolist())) != b:
        return StepPlan(f"state indices {state_idx.tolist()} not distinct positive indices", batch=b)
    if positions is not None and not torch.equal(positions[:b].to("cpu", torch.long), seq_lens - 1):
        return StepPlan("positions differ from seq_len - 1 (M-RoPE or reordered batch)", batch=b)
    return StepPlan(None, batch=b, state_indices=state_idx, seq_lens=seq_lens,
                    block_table=mla.decode.block_table[:b])


class VllmDecodeRouter:
    """The executor's side of a vLLM K3 model: pool rows per vLLM state index, routed steps, sync back.

    ``vllm_layers[i]``: vLLM's layer ``i`` attention module (``kv_cache`` read at every use, so a re-bound cache
    is seen); ``names``: (KDA layer prefix, MLA layer name) whose metadata classify a step."""

    def __init__(self, executor: Any, vllm_layers: list[Any], layout: VllmLayout, names: tuple[str, str]) -> None:
        self.ex = executor
        self.cfg = executor.model.cfg  # the config of what the executor holds: one rank's shapes at TP > 1
        self.layers = vllm_layers
        self.layout = layout
        self.kda_name, self.mla_name = names
        self.pool_cache = executor.new_cache(executor.max_batch)  # rows 0..max_batch-1 of the executor's pool
        self.pooled = isinstance(self.pool_cache, PooledCache)
        self.rows: dict[int, int] = {}  # vLLM state index -> pool row
        self.lengths: dict[int, int] = {}  # vLLM state index -> tokens in the row's state
        self._free = list(range(executor.max_batch - 1, -1, -1))
        self._layout_checked: tuple[int, ...] | None = None
        self._layout_reason: str | None = None
        self.imports = 0
        self.exports = 0

    # ------------------------------------------------------------------ planning
    def caches(self) -> list[Any]:
        return [layer.kv_cache for layer in self.layers]

    def layout_problem(self) -> str | None:
        caches = self.caches()
        key = tuple(id(t) for kv in caches for t in (kv if isinstance(kv, (tuple, list)) else (kv,)))
        if key != self._layout_checked:
            self._layout_reason = layout_reason(self.cfg, caches, self.layout, conv_dtype=self.ex.dtype,
                                                kv_dtype=self.ex.kv_dtype)
            self._layout_checked = key
        return self._layout_reason

    def plan(self, attn_metadata: Any, positions: torch.Tensor | None = None) -> StepPlan:
        p = classify_step(attn_metadata, self.kda_name, self.mla_name, max_batch=self.ex.max_batch,
                          max_len=self.ex.max_len, positions=positions)
        if p.route:
            why = self.layout_problem()
            if why:
                return StepPlan(f"cache layout: {why}", batch=p.batch)
        return p

    # ------------------------------------------------------------------ state
    def _row_for(self, idx: int, block_table: torch.Tensor, context: int, keep: set[int]) -> int:
        """The pool row of state index ``idx`` holding ``context`` tokens, importing it if needed."""
        if idx in self.rows and self.lengths[idx] == context:
            return self.rows[idx]
        if idx in self.rows:  # vLLM's state for this index moved on without the router: take vLLM's
            row = self.rows[idx]
        else:
            if not self._free:
                self._evict(keep)
            row = self._free.pop()
        import_request(self.cfg, self.caches(), self.layout, self.pool_cache.layers, row, idx, block_table,
                       context)
        self.rows[idx], self.lengths[idx] = row, context
        self.imports += 1
        return row

    def _evict(self, keep: set[int]) -> None:
        """Export and free the rows of requests not in the current step (finished or not scheduled)."""
        for idx in [i for i in self.rows if i not in keep]:
            self._release(idx, export=True)
        if not self._free:
            raise RuntimeError(f"executor pool has no free row for a batch of <= {self.ex.max_batch} requests")

    def _release(self, idx: int, export: bool) -> None:
        row = self.rows.pop(idx)
        self.lengths.pop(idx)
        if export:
            export_request(self.cfg, self.caches(), self.layout, self.pool_cache.layers, row, idx)
            self.exports += 1
        self._free.append(row)

    def sync_back(self) -> int:
        """Before vLLM's own forward runs a step: every routed request's KDA state back to vLLM, pool rows
        freed. Returns how many requests were exported."""
        n = len(self.rows)
        for idx in list(self.rows):
            self._release(idx, export=True)
        return n

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def run(self, plan: StepPlan, tokens: torch.Tensor) -> torch.Tensor:
        """One routed decode step -> FP32 logits ``[B, V]`` (the executor records the step in its trace)."""
        assert plan.route and plan.state_indices is not None and plan.seq_lens is not None
        b = plan.batch
        keep = set(plan.state_indices.tolist())
        rows = [self._row_for(int(i), plan.block_table[r], int(plan.seq_lens[r]) - 1, keep)
                for r, i in enumerate(plan.state_indices.tolist())]
        dev = self.ex.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        context = (plan.seq_lens - 1).to(dev)
        step = self._step_cache(rows_t, context, int(plan.seq_lens.max()) - 1)
        gathered = not self.pooled or self.ex.step_reason(b, step) is not None
        if gathered:  # the executor's standard path runs model.decode on cache.layers: give it these rows
            step.layers = [layer.index_select(rows_t) if hasattr(layer, "index_select")
                           else type(layer)(latent=layer.latent.index_select(0, rows_t), scale=layer.scale)
                           for layer in self.pool_cache.layers]
        logits = self.ex.decode(tokens[:b].to(dev), step)
        if gathered:
            for dst, src in zip(self.pool_cache.layers, step.layers, strict=True):
                if hasattr(dst, "tensors"):
                    for d, s in zip(dst.tensors(), src.tensors(), strict=True):
                        d.index_copy_(0, rows_t, s)
                else:
                    dst.latent.index_copy_(0, rows_t, src.latent)
        write_latents(self.cfg, self.caches(), self.layout, self.pool_cache.layers, rows_t, plan.block_table,
                      context)
        for i, n in zip(plan.state_indices.tolist(), plan.seq_lens.tolist(), strict=True):
            self.lengths[int(i)] = int(n)
        return logits

    def _step_cache(self, rows: torch.Tensor, context: torch.Tensor, bound: int) -> Any:
        """A cache over exactly ``rows`` of the router's pool range (any order, not contiguous)."""
        base = self.pool_cache
        if self.pooled:
            return base.select(rows, context, bound)
        return type(base)(layers=list(base.layers), lengths=context.clone(), max_len=base.max_len)

    def record_fallback(self, plan: StepPlan) -> None:
        """Trace a step vLLM's own forward ran (``fallback: "vllm standard path: <reason>"``)."""
        self.ex.trace.record(StepRecord(0, self.ex.backend, plan.batch, None, fallback=f"{VLLM_PATH}: {plan.reason}",
                                        kind=plan.kind))


# ---------------------------------------------------------------------------------------------- setup
def unsupported_settings(vllm_config: Any) -> list[str]:
    """Every setting of this vLLM configuration under which no K3 decode step can be routed (or one would be
    served wrongly), one short line each, in a fixed order (empty: it can be routed). The rules follow
    upstream's specialized decode (``nvidia/specialized_decode/runtime/__init__.py``, ``unsupported``) where our
    route has the same limit, plus its own (``enforce_eager``; at TP > 1 a BF16 MLA cache)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    out = []
    if not getattr(mc, "enforce_eager", False):
        out.append("needs enforce_eager (--enforce-eager): a routed step decides on the host per step (classify, "
                   "import state) and replays the executor's own CUDA graphs; vLLM's graphs would freeze one path")
    if pc.pipeline_parallel_size != 1:
        out.append(f"pipeline parallel size {pc.pipeline_parallel_size}: the executor runs every layer of its "
                   "rank (PP=1)")
    if pc.tensor_parallel_size != 1 and cc.cache_dtype not in ("auto", "bfloat16"):
        out.append(f"kv cache dtype {cc.cache_dtype} at tensor parallel size {pc.tensor_parallel_size}: the TP "
                   "decoder keeps the MLA latents in the model dtype")
    if getattr(pc, "decode_context_parallel_size", 1) != 1:
        out.append(f"decode context parallel size {pc.decode_context_parallel_size}: not routed")
    if getattr(pc, "enable_expert_parallel", False):
        out.append("expert parallelism: the executor holds every routed expert of its layers")
    if getattr(pc, "enable_dbo", False) or getattr(pc, "use_ubatching", False):
        out.append("dual batch overlap (micro-batched steps): every decode step would arrive as two micro-batches, "
                   "which the route does not split")
    if getattr(mc, "enable_sleep_mode", False):
        out.append("sleep mode: vLLM's sleep / wake-up neither offloads nor restores the executor's weights, caches "
                   "and CUDA graphs")
    if getattr(vllm_config, "lora_config", None) is not None:
        out.append("LoRA: the executor applies no adapters")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding is configured: its multi-token decode steps are not routed")
    if getattr(cc, "use_kda_recoverssm", False) or getattr(cc, "use_replayssm", False):
        out.append("use_kda_recoverssm / use_replayssm: their per-step state records are not mapped")
    if getattr(cc, "mamba_cache_mode", "none") != "none":
        out.append(f"mamba_cache_mode={cc.mamba_cache_mode} (KDA prefix caching): vLLM copies KDA states between "
                   "blocks between steps, which the executor's pool rows would not follow")
    conv_dt, ssm_dt = getattr(cc, "mamba_cache_dtype", "auto"), getattr(cc, "mamba_ssm_cache_dtype", "auto")
    model_dt = str(getattr(mc, "dtype", "auto")).removeprefix("torch.")  # a VllmConfig may have no model_config
    if conv_dt not in ("auto", model_dt) or ssm_dt not in ("auto", "float32"):
        out.append(f"KDA cache dtypes mamba_cache_dtype={conv_dt} / mamba_ssm_cache_dtype={ssm_dt}: the executor "
                   "maps a conv state in the model dtype and an FP32 recurrent state, bit for bit")
    if cc.cache_dtype not in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
        out.append(f"kv cache dtype {cc.cache_dtype}: the executor maps bf16 or plain fp8 e4m3 MLA caches")
    return out


def config_refusal(vllm_config: Any) -> str | None:
    """Why this vLLM configuration can route no K3 decode step at all, every unsupported setting in one line
    (None: it can)."""
    found = unsupported_settings(vllm_config)
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    return f"{len(found)} unsupported settings: " + "; ".join(f"({i}) {w}" for i, w in enumerate(found, 1))


def check_device_memory(device: torch.device, need: int) -> None:
    """On a GPU, ``RuntimeError`` with the numbers unless ``need`` bytes (the executor's cache pool, its
    prepared tensors and its copy of the routed experts) fit the free memory (lower --gpu-memory-utilization
    to leave room)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if need > free * 0.95:
        raise RuntimeError(f"decode_backend=latency_specialized needs {need / 2**30:.1f} GiB on {device} for the "
                           f"executor's cache pool and its copy of the routed experts, {free / 2**30:.1f} GiB of "
                           f"{total / 2**30:.1f} GiB free: lower --gpu-memory-utilization")


def pool_bytes(cfg: Any, max_batch: int, max_len: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """Bytes of the executor's slot pool (``max_batch + 1`` slots) for the memory check."""
    from ..runtime.cache_pool import CachePool

    lac = cfg.linear_attn_config
    esz = torch.empty((), dtype=dtype).element_size()
    kv = torch.empty((), dtype=kv_dtype).element_size()
    kda = 3 * (lac.short_conv_kernel_size - 1) * lac.projection_dim * esz + lac.num_heads * lac.head_dim ** 2 * 4
    mla = CachePool.latent_length(max_len) * cfg.mla_latent_dim * kv
    return (max_batch + 1) * (len(cfg.kda_layer_ids) * kda + len(cfg.mla_layer_ids) * mla)
