"""The class vLLM builds for a Kimi K3 checkpoint once the ``k3_fastpath`` plugin is loaded.

It is vLLM's own ``KimiK3ForConditionalGeneration`` (``vllm.models.kimi_k3``) with one addition: its
``__init__`` reads ``vllm_config.additional_config["decode_backend"]`` first
(``k3_fastpath.integrations.vllm.on_model_init``):

- off (absent, or any value but ``latency_specialized``): vLLM's constructor runs unchanged; the
  model is exactly vLLM's;
- ``latency_specialized``: refused with ``RoutingUnavailableError`` before anything is allocated, naming
  what is missing (the vLLM-state -> ``DecodeExecutor`` adapter; see the plugin module), after the
  decision has been logged and traced. Never a silent standard-path model under the fast path's name.

vLLM imports this module itself (lazy ``"module:Class"`` registration), only for K3 checkpoints.
"""

from __future__ import annotations

import torch.nn as nn

from k3_fastpath.integrations.vllm import RoutingUnavailableError, on_model_init

try:
    from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration as _VllmKimiK3

    _IMPORT_ERROR: str | None = None
except ImportError as e:  # e.g. a platform for which vLLM exports no K3 implementation
    _VllmKimiK3 = nn.Module  # type: ignore[assignment,misc]
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

ARCHITECTURE = "KimiK3ForConditionalGeneration"


class KimiK3ForConditionalGeneration(_VllmKimiK3):  # type: ignore[misc,valid-type]
    """vLLM's Kimi K3 model plus the ``decode_backend`` switch."""

    def __init__(self, vllm_config, prefix: str = "") -> None:  # noqa: ANN001 (vLLM's signature)
        decision = on_model_init(vllm_config, ARCHITECTURE)
        if decision.action == "route":
            raise RoutingUnavailableError(
                f"{decision.message}. Serve Kimi K3 without decode_backend (vLLM's standard path), or run the "
                "fast path through k3-verify's builtin engine (--engine builtin:fast)")
        if _IMPORT_ERROR is not None:
            raise RuntimeError(f"vLLM's Kimi K3 implementation ({'vllm.models.kimi_k3'}) cannot be imported on "
                               f"this platform ({_IMPORT_ERROR}); the k3_fastpath plugin only adds decode_backend "
                               "to it, it does not replace it")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
