"""vLLM general plugin: the ``decode_backend`` switch (``--additional-config '{"decode_backend": ...}'``).

Declared in pyproject.toml as ``[project.entry-points."vllm.general_plugins"] k3_fastpath =
"k3_fastpath.integrations.vllm:register"``; vLLM calls ``register()`` in every process it starts (and
may call it more than once). ``VLLM_PLUGINS`` without ``k3_fastpath`` keeps it out entirely.

What ``register()`` does:
1. registers the Kimi K3 architecture (``KimiK3ForConditionalGeneration``) with vLLM's ``ModelRegistry``
   lazily, as the string ``"k3_fastpath.integrations.vllm_model:KimiK3ForConditionalGeneration"``: a
   subclass of vLLM's own K3 model that reads ``vllm_config.additional_config`` in ``__init__``. Nothing
   K3-specific is imported until vLLM loads a K3 checkpoint. If another plugin already replaced vLLM's
   K3 class, that registration is left alone (and logged);
2. wraps ``BaseModelLoader.create_model`` once, so that every other model vLLM builds passes through the
   same decision: a non-K3 model with the switch set is logged and traced as
   ``decode_backend=latency_specialized ignored: model <arch> is not Kimi K3`` and changes nothing.

The decision (``decide``), per model construction:
- ``decode_backend`` absent or any value other than ``latency_specialized`` -> ``off``: nothing changes,
  nothing is written (vLLM's K3 class is constructed exactly as without the plugin);
- ``latency_specialized`` on a non-K3 model -> ``ignored`` (log + trace line), nothing changes;
- ``latency_specialized`` on Kimi K3 -> ``route``: eligible decode steps go to
  ``k3_fastpath.runtime.executor.DecodeExecutor`` (``vllm_model.py`` for the model class,
  ``vllm_routing.py`` for which steps and how vLLM's cache state moves, ``vllm_state.py`` for the layouts).
  Routed: pure non-speculative decode steps of at most ``fastpath_max_batch`` requests with contexts up to
  ``fastpath_max_len``. Everything else runs vLLM's own forward after the routed requests' state is handed
  back, and is traced with its reason. A configuration in which no step can be routed, or one would be
  served wrongly (``vllm_routing.unsupported_settings`` lists the rules: no ``--enforce-eager``, TP/PP > 1,
  LoRA, sleep mode, speculative decoding, ...) is refused at model construction with
  ``RoutingUnavailableError`` and one line naming every unsupported setting, never served on the standard
  path under the fast path's name. Not yet run inside a vLLM server on a GPU (no vLLM on the GPU
  host); what is tested is listed in tests/test_vllm_routing.py.

Trace: with ``K3_FASTPATH_TRACE=<dir>`` each decision other than ``off`` appends one line to
``<dir>/trace-<pid>.jsonl`` (the executor's trace file and format, ``type: "meta"``,
``source: "vllm_plugin"``), so ``k3_fastpath.runtime.trace.read_trace`` lists it beside executor steps; in
route mode every forward call then adds one step record (a routed step as the executor records it, kernels
or its own fallback reason; any other as ``fallback: "vllm standard path: <reason>"``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DECODE_BACKEND_KEY = "decode_backend"
LATENCY_SPECIALIZED = "latency_specialized"
PLUGIN_NAME = "k3_fastpath"  # the entry point's name: what VLLM_PLUGINS must list
K3_ARCHITECTURES = ("KimiK3ForConditionalGeneration",)
# K3's own draft model goes through the same loader; the K3 class decides for the pair
K3_FAMILY = K3_ARCHITECTURES + ("KimiK3MTPModel",)
MODEL_CLASS = "k3_fastpath.integrations.vllm_model:KimiK3ForConditionalGeneration"
VLLM_K3_MODULE = "vllm.models.kimi_k3"
TRACE_SOURCE = "vllm_plugin"
_HOOK_MARK = "_k3_fastpath_decode_backend_hook"

ROUTE_MESSAGE = ("eligible decode steps (pure decode, no speculative tokens, within the executor's max_batch / "
                 "max_len) run on k3_fastpath.runtime.executor.DecodeExecutor; every other step runs vLLM's "
                 "forward after the routed state is handed back")


class RoutingUnavailableError(ValueError):
    """``decode_backend=latency_specialized`` was asked for a K3 model in a configuration where no decode step
    could be routed: one line naming every unsupported setting (``vllm_routing.unsupported_settings``), raised
    at model construction as upstream's specialized decode refuses at start-up (a ``ValueError``)."""


@dataclass(frozen=True)
class Decision:
    action: str  # "off" | "ignored" | "route"
    decode_backend: str | None  # the value found in additional_config (None: absent)
    architecture: str
    message: str


def _logger() -> logging.Logger:
    # a child of vLLM's "vllm" logger, so the lines land in the server log with vLLM's format
    return logging.getLogger("vllm.k3_fastpath")


def decode_backend_of(vllm_config: Any) -> str | None:
    """``additional_config["decode_backend"]`` of a ``VllmConfig`` (a dict, or an object with ``get``)."""
    extra = getattr(vllm_config, "additional_config", None)
    if extra is None:
        return None
    value = extra.get(DECODE_BACKEND_KEY) if hasattr(extra, "get") else getattr(extra, DECODE_BACKEND_KEY, None)
    return None if value is None else str(value)


def architecture_of(vllm_config: Any) -> str:
    archs = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or []
    return str(archs[0]) if archs else "unknown"


def decide(vllm_config: Any, architecture: str | None = None) -> Decision:
    """What the switch means for one model construction (pure: logs and writes nothing)."""
    arch = architecture or architecture_of(vllm_config)
    value = decode_backend_of(vllm_config)
    if value != LATENCY_SPECIALIZED:
        return Decision("off", value, arch, f"decode_backend={value}: standard path, nothing changed")
    if arch not in K3_FAMILY:
        return Decision("ignored", value, arch,
                        f"decode_backend={LATENCY_SPECIALIZED} ignored: model {arch} is not Kimi K3")
    return Decision("route", value, arch, f"decode_backend={LATENCY_SPECIALIZED} on {arch}: {ROUTE_MESSAGE}")


def write_trace(decision: Decision, **extra: Any) -> Path | None:
    """Append the decision to ``$K3_FASTPATH_TRACE/trace-<pid>.jsonl``; returns the file (None: unset)."""
    from k3_fastpath.runtime.trace import TRACE_ENV

    trace_dir = os.environ.get(TRACE_ENV, "").strip()
    if not trace_dir:
        return None
    d = Path(trace_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"trace-{os.getpid()}.jsonl"
    line = {"type": "meta", "source": TRACE_SOURCE, "executor": None, "pid": os.getpid(), **asdict(decision),
            **extra}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line, sort_keys=True, default=str) + "\n")
    return path


def on_model_init(vllm_config: Any, architecture: str | None = None) -> Decision:
    """Decide, then log and trace anything that is not ``off``. Called by the K3 model class's
    ``__init__`` and by the loader hook for every other model."""
    decision = decide(vllm_config, architecture)
    if decision.action == "off":
        return decision
    log = _logger()
    (log.warning if decision.action == "ignored" else log.info)("k3_fastpath: %s", decision.message)
    write_trace(decision)
    return decision


def _install_loader_hook() -> bool:
    """Wrap ``BaseModelLoader.create_model`` (once per process) so non-K3 models see the decision too.
    Returns True if this call installed it."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.create_model
    if getattr(original, _HOOK_MARK, False):
        return False

    def create_model(self: Any, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        archs = getattr(model_config, "architectures", None) or []
        arch = str(archs[0]) if archs else architecture_of(vllm_config)
        if arch not in K3_FAMILY:  # a K3 model decides in its own __init__
            on_model_init(vllm_config, arch)
        return original(self, vllm_config, model_config, prefix)

    setattr(create_model, _HOOK_MARK, True)
    create_model.__wrapped__ = original  # type: ignore[attr-defined]
    create_model.__doc__ = original.__doc__
    BaseModelLoader.create_model = create_model  # type: ignore[method-assign]
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent: vLLM may call it several times)."""
    from vllm import ModelRegistry

    for arch in K3_ARCHITECTURES:
        current = ModelRegistry.models.get(arch)
        owner = getattr(current, "module_name", None)
        if current is None or owner in (VLLM_K3_MODULE, MODEL_CLASS.split(":")[0]):
            ModelRegistry.register_model(arch, MODEL_CLASS)
        else:
            _logger().warning("k3_fastpath: %s is registered by %s; leaving it (decode_backend not available)",
                              arch, owner or type(current).__name__)
    _install_loader_hook()
