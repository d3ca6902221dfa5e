"""The class vLLM builds for a Kimi K3 checkpoint once the ``k3_fastpath`` plugin is loaded.

It is vLLM's own ``KimiK3ForConditionalGeneration`` (``vllm.models.kimi_k3``) with the ``decode_backend``
switch read first in ``__init__`` (``k3_fastpath.integrations.vllm.on_model_init``):

- off (absent, or any value but ``latency_specialized``): vLLM's constructor runs unchanged, and
  ``forward`` / ``compute_logits`` / ``load_weights`` are vLLM's (each override calls straight through);
- ``latency_specialized``: first ``vllm_routing.config_refusal`` — a configuration the route cannot serve
  (``vllm_routing.unsupported_settings``) is refused with ``RoutingUnavailableError`` naming every such
  setting in one line, before anything is allocated. Otherwise vLLM's model is built normally, plus:

  * ``load_weights``: after vLLM's loader, the executor's model is built over vLLM's loaded parameters in
    place (``vllm_weights.executor_model_in_place``: views, a few small prepared tensors; the routed experts
    copied into the executor's own layouts; checked against free device memory, inside vLLM's
    weight-loading memory accounting, so its KV cache is sized around it) and a ``DecodeExecutor`` (at
    tensor parallelism N > 1: a ``TPFastDecoder`` over the rank's share, on vLLM's TP group,
    ``vllm_tp_comm``; every rank classifies the same steps, so the collectives line up) built
    with ``fastpath_max_batch`` (default min(max_num_seqs, 64)) / ``fastpath_max_len`` (default
    min(max_model_len, 4096)) / ``fastpath_spec_all_rows`` (default false: scratch for verify steps of at
    most 64 rows, ``DecodeExecutor(spec_all_rows=...)``) from ``additional_config``, and (steps not in
    place) its cache pool and CUDA graphs built. The trace's meta
    records what is shared (``weights_in_place``). At the first forward the views are checked to still alias
    vLLM's parameters (``InPlaceWeights.aliasing_problem``: a post-load re-layout would leave a copy) and a
    later ``load_weights`` (a weight update) cannot reach the executor's expert layouts: either makes every
    step fall back from then on, with that reason;
  * ``forward``: at the first call with metadata the router binds vLLM's per-layer caches; each call is
    classified. Without speculative decoding (``vllm_routing.runs_in_place``) the router is
    ``vllm_inplace.InPlaceRouter``: a pure decode step of at most ``fastpath_max_batch`` requests runs the
    executor's fast step on vLLM's own KDA and MLA caches in place (``DecodeExecutor.decode_in_place``: vLLM's
    state indices, block table, seq_lens and slot mapping as device tensors, nothing read on the host), so
    vLLM may capture it into its FULL decode CUDA graph (the routing decision made when vLLM captures a batch
    size, baked in; padded rows carry index -1); the executor (at TP > 1 each rank's ``TPFastDecoder``, its
    collectives on vLLM's TP group inside the same graph) holds no cache pool and no graphs of its own.
    Otherwise (a speculative config: every decode row a verify row) it is
    ``vllm_routing.VllmDecodeRouter``: a decode or verify step runs on the executor's own pool, state imported
    per request and exported before a fallback step (``sync_back``), on the executor's own graphs, which needs
    ``enforce_eager`` (checked above). Either way a routed step runs on the executor (built with
    ``readout="hidden"``) and ``forward`` returns what vLLM's own K3 ``forward`` returns: ``[num_tokens,
    hidden]``, each token's hidden state before the final norm (padded tokens 0). ``compute_logits`` is vLLM's
    throughout (final norm, lm_head, its TP gather), and a drafter that reads the target's final hidden states
    (K3's MTP layer) reads real ones. Any other step runs vLLM's forward and is traced as ``fallback: "vllm
    standard path: <reason>"``;
  * the runner passes token ids beside the multimodal embeddings (``requires_raw_input_tokens``, set on the
    instance in route mode only), since the executor embeds tokens itself.

Tracing under vLLM's FULL graphs: a replay does not call ``forward``, so the trace holds the steps vLLM ran
eagerly (warm-up, fallbacks) and the captures (``graph: true``), not one record per replayed step.

vLLM imports this module itself (lazy ``"module:Class"`` registration), only for K3 checkpoints. Nothing
here has run inside a vLLM server on a GPU (the GPU host has no vLLM); see tests/test_vllm_routing.py for
what is tested on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from k3_fastpath.integrations.vllm import RoutingUnavailableError, on_model_init

try:
    from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration as _VllmKimiK3

    _IMPORT_ERROR: str | None = None
except ImportError as e:  # e.g. a platform for which vLLM exports no K3 implementation
    _VllmKimiK3 = nn.Module  # type: ignore[assignment,misc]
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

ARCHITECTURE = "KimiK3ForConditionalGeneration"
DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_LEN = 4096


def checkpoint_dir(model_config: Any) -> str:
    """The local directory of the checkpoint vLLM loaded: ``model_config.model`` itself, or for a Hub id the
    snapshot vLLM already downloaded (never downloads)."""
    from pathlib import Path

    if Path(model_config.model).is_dir():
        return str(model_config.model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_config.model, revision=getattr(model_config, "revision", None),
                                 local_files_only=True)
    except Exception as e:  # noqa: BLE001 (any failure means: no local copy to load)
        raise RuntimeError(f"decode_backend=latency_specialized: no local checkpoint for {model_config.model!r} "
                           f"to load the executor's weights from ({type(e).__name__}: {e})") from e


def vllm_tp_comm(device: torch.device) -> Any:
    """A ``Communicator`` over vLLM's own tensor-parallel group: its device group (NCCL) on a GPU, its gloo
    group on a CPU. Unfused: all-reduce, then the epilogue as PyTorch ops (``tp_comm.TorchComm``)."""
    from vllm.distributed.parallel_state import get_tp_group

    from k3_fastpath.runtime.tp_comm import TorchComm

    group = get_tp_group()
    return TorchComm(group.device_group if device.type == "cuda" else group.cpu_group)


class FastPathState:
    """The route-mode attachments of one model instance (kept out of ``nn.Module``'s registries)."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        extra = vllm_config.additional_config or {}
        get = extra.get if hasattr(extra, "get") else (lambda k, d=None: d)
        sched, mc = vllm_config.scheduler_config, vllm_config.model_config
        self.max_batch = int(get("fastpath_max_batch", min(int(sched.max_num_seqs), DEFAULT_MAX_BATCH)))
        self.max_len = int(get("fastpath_max_len", min(int(mc.max_model_len), DEFAULT_MAX_LEN)))
        spec = vllm_config.speculative_config  # a method the route serves (``config_refusal`` checked it)
        self.num_spec = int(spec.num_speculative_tokens) if spec is not None else 0
        self.spec_all_rows = bool(get("fastpath_spec_all_rows", False))  # DecodeExecutor(spec_all_rows=...)
        from k3_fastpath.integrations.vllm_routing import runs_in_place

        self.in_place = runs_in_place(vllm_config)  # steps on vLLM's caches in place (vllm_inplace.py)
        self.executor: Any = None
        self.router: Any = None
        self.stale: str | None = None  # set when vLLM's weights change under the executor
        self.weights: Any = None  # vllm_weights.InPlaceWeights: what the executor shares with vLLM


class KimiK3ForConditionalGeneration(_VllmKimiK3):  # type: ignore[misc,valid-type]
    """vLLM's Kimi K3 model plus the ``decode_backend`` switch (see the module docstring)."""

    def __init__(self, vllm_config, prefix: str = "") -> None:  # noqa: ANN001 (vLLM's signature)
        decision = on_model_init(vllm_config, ARCHITECTURE)
        fast: FastPathState | None = None
        if decision.action == "route":
            from k3_fastpath.integrations.vllm_routing import config_refusal

            why = config_refusal(vllm_config)
            if why:
                raise RoutingUnavailableError(f"decode_backend=latency_specialized on {ARCHITECTURE}: {why}")
            fast = FastPathState(vllm_config)
        if _IMPORT_ERROR is not None:
            raise RuntimeError(f"vLLM's Kimi K3 implementation ({'vllm.models.kimi_k3'}) cannot be imported on "
                               f"this platform ({_IMPORT_ERROR}); the k3_fastpath plugin only adds decode_backend "
                               "to it, it does not replace it")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.__dict__["_k3_fast"] = fast  # a plain attribute: not a submodule, not in state_dict
        if fast is not None:
            self.requires_raw_input_tokens = True

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights):  # noqa: ANN001, ANN201 (vLLM's signature)
        loaded = super().load_weights(weights)
        fast = self.__dict__.get("_k3_fast")
        if fast is not None:
            if fast.executor is None:
                fast.executor = self._build_executor(fast)
            else:  # a weight update: the shared tensors follow, the executor's expert layouts do not: stop routing
                fast.stale = "vLLM weights reloaded after the executor was built (its expert layouts are its own)"
        return loaded

    def _build_executor(self, fast: FastPathState) -> Any:
        from k3_fastpath.config import load_config
        from k3_fastpath.integrations.vllm_routing import check_device_memory, pool_bytes
        from k3_fastpath.integrations.vllm_weights import executor_model_in_place
        from k3_fastpath.runtime.executor import DecodeExecutor

        mc = fast.vllm_config.model_config
        tp = int(fast.vllm_config.parallel_config.tensor_parallel_size)
        param = next(self.parameters(), None)  # vLLM's weights sit on the device the executor serves on
        device = param.device if param is not None else torch.device("cpu")
        cfg = load_config(checkpoint_dir(mc))
        kv_dtype = torch.float8_e4m3fn if fast.vllm_config.cache_config.cache_dtype.startswith("fp8") else mc.dtype
        model, weights = executor_model_in_place(self.language_model, cfg, mc.dtype, tp=tp)
        experts = weights.routed_experts_copied * (2 if device.type == "cuda" else 1)  # stacks (+ fragments)
        spec_tokens = fast.num_spec + 1 if fast.num_spec else 0
        pool = 0 if fast.in_place else pool_bytes(model.cfg, fast.max_batch, fast.max_len, mc.dtype, kv_dtype,
                                                  spec_tokens, fast.spec_all_rows)
        check_device_memory(device, pool + weights.prepared_bytes + experts)
        if tp > 1:  # this rank's share, its partial sums meeting over vLLM's own TP group (an FP8 cache is refused)
            from k3_fastpath.runtime.tp_fast import TPFastDecoder

            ex = TPFastDecoder(cfg, model, vllm_tp_comm(device), max_batch=fast.max_batch, max_len=fast.max_len,
                               readout="hidden", in_place=fast.in_place)
        else:
            kv_scale = None
            if kv_dtype == torch.float8_e4m3fn:  # the executor's FP8 latents must use vLLM's k_scale
                mla = next(layer.self_attn for i, layer in enumerate(self._vllm_layers()) if cfg.is_mla_layer(i))
                kv_scale = float(mla._k_scale)
            ex = DecodeExecutor(model, max_batch=fast.max_batch, max_len=fast.max_len, kv_dtype=kv_dtype,
                                kv_scale=kv_scale, spec_tokens=spec_tokens, spec_all_rows=fast.spec_all_rows,
                                readout="hidden", use_graphs=not fast.in_place)
        ex.trace.set_meta(weights_in_place=weights.summary(), caches_in_place=fast.in_place)
        fast.weights = weights
        if not fast.in_place:  # in place: no pool, no graphs of its own (vLLM's warm-up runs compile the kernels)
            ex.warmup_and_capture()
        return ex

    def _vllm_layers(self) -> list[Any]:
        return list(self.language_model.model.layers)

    # ------------------------------------------------------------------ steps
    def _router(self, fast: FastPathState) -> Any:
        if fast.router is None:
            from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

            from k3_fastpath.integrations.vllm_routing import VllmDecodeRouter
            from k3_fastpath.integrations.vllm_state import VllmLayout

            if fast.executor is None:
                raise RuntimeError("decode_backend=latency_specialized: forward before load_weights built the executor")
            attn = [layer.self_attn for layer in self._vllm_layers()]
            cfg = fast.executor.cfg
            kda = next(a.prefix for i, a in enumerate(attn) if cfg.is_kda_layer(i))
            mla = next(a.layer_name for i, a in enumerate(attn) if not cfg.is_kda_layer(i))
            from k3_fastpath.integrations.vllm_inplace import InPlaceRouter

            layout = VllmLayout(conv_dim_first=is_conv_state_dim_first(),
                                block_size=int(fast.vllm_config.cache_config.block_size), num_spec=fast.num_spec)
            if fast.in_place:  # every layer's name: its cache group's metadata
                names = [a.prefix if cfg.is_kda_layer(i) else a.layer_name for i, a in enumerate(attn)]
                fast.router = InPlaceRouter(fast.executor, attn, layout, names)
            else:
                fast.router = VllmDecodeRouter(fast.executor, attn, layout, (kda, mla))
            if fast.weights is not None and fast.stale is None:  # vLLM's post-load step may re-lay a weight out
                fast.stale = fast.weights.aliasing_problem(self.language_model)
        return fast.router

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None, **kwargs: object):
        fast = self.__dict__.get("_k3_fast")
        if fast is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        from vllm.forward_context import get_forward_context, is_forward_context_available

        meta = get_forward_context().attn_metadata if is_forward_context_available() else None
        router = self._router(fast)
        plan = router.plan(meta, positions)
        if plan.route and (input_ids is None or fast.stale):
            from k3_fastpath.integrations.vllm_routing import StepPlan

            plan = StepPlan(fast.stale or "no token ids passed (inputs_embeds only)", batch=plan.batch)
        if plan.route:
            rows = router.run(plan, input_ids)  # one hidden state per real token, in vLLM's token order
            hidden = rows.new_zeros(int(positions.shape[-1]), rows.shape[-1])
            hidden[: rows.shape[0]] = rows
            return hidden
        router.sync_back(plan)
        router.record_fallback(plan)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
