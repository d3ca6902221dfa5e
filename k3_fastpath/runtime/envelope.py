"""The fast decode path's envelope: which steps it takes over, and the one-line reason for every step it
does not.

The contract (ARCHITECTURE.md): a fast path declares where it runs (GPU arch, TP size and heads per GPU,
batch range, context range, dtypes, speculative decoding) and every step outside that runs the standard
path with its reason recorded in the execution trace (``fallback{reason=...}``). Two kinds of limits:

* model limits, fixed for an executor (``check_model``): device arch, compute dtype, KV-cache dtype, the
  KDA head geometry the ``kda_decode`` kernel implements, TP size;
* step limits (``check_step``): batch size, prefill tokens in the step, speculative tokens, context length.

``check_step`` runs on the host only (it never reads a device tensor), so checking a step never
synchronises with the GPU. Reasons are short stable strings: they are counted and compared across runs
("batch 65 > 64", "prefill tokens in step", "device cpu is not sm_90").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
PREFILL_REASON = "prefill tokens in step"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Envelope:
    """What ``decode_backend: latency_specialized`` serves; everything else runs the standard path.

    ``emulate``: run the fast step's structure where the kernels cannot run (CPU, another arch), every
    kernel call served by its ``reference.py`` and counted as that kernel's fallback. For tests of the
    dispatch, static buffers and trace on a CPU; never a serving mode.
    """

    archs: tuple[tuple[int, int], ...] = ((9, 0),)  # H100 / H200
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    kda_head_dims: tuple[int, ...] = (32, 64, 128)  # kernels/kda_decode/config.py HEAD_DIMS
    conv_width: int = 4  # kernels/kda_decode/config.py CONV_W
    max_attn_res_sources: int = 9  # kernels/attn_res_mix/config.py MAX_SOURCES
    min_batch: int = 1
    max_batch: int = 64
    max_context: int = 1_048_576  # positions a sequence may reach (the executor lowers it to its max_len)
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    kv_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, FP8)
    speculative: bool = True  # fused verify steps: 1 + drafts rows per sequence (runtime/verify_step.py)
    emulate: bool = False

    # ------------------------------------------------------------------ model
    def check_device(self, device: torch.device | str) -> str | None:
        device = torch.device(device)
        if self.emulate:
            return None
        if device.type != "cuda":
            return f"device {device.type} is not sm_90"
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap not in self.archs:
            return f"device {device} (sm_{cap[0]}{cap[1]}) is not sm_90"
        from .._lib import arch

        why = arch.unavailable_reason()
        if why:
            return "cutlass-dsl unavailable"
        return None

    def check_model(self, cfg: Any, *, device: torch.device | str, dtype: torch.dtype,
                    kv_dtype: torch.dtype | None = None, tp_size: int = 1) -> str | None:
        """None when a model of ``cfg`` in ``dtype`` on ``device`` can run the fast step, else the reason."""
        why = self.check_device(device)
        if why:
            return why
        if dtype not in self.dtypes:
            return f"dtype {_dtype_name(dtype)} (fast path needs {', '.join(_dtype_name(d) for d in self.dtypes)})"
        kv = dtype if kv_dtype is None else kv_dtype
        if kv not in self.kv_dtypes:
            return f"kv cache dtype {_dtype_name(kv)} not in {', '.join(_dtype_name(d) for d in self.kv_dtypes)}"
        if tp_size not in self.tp_sizes:
            return f"tp size {tp_size} not in {self.tp_sizes}"
        lac = cfg.linear_attn_config
        if cfg.kda_layer_ids and lac.head_dim not in self.kda_head_dims:
            return f"KDA head dim {lac.head_dim} not in {self.kda_head_dims}"
        if cfg.kda_layer_ids and lac.short_conv_kernel_size != self.conv_width:
            return f"KDA conv width {lac.short_conv_kernel_size} != {self.conv_width}"
        if cfg.num_attn_res_blocks + 1 > self.max_attn_res_sources:
            return f"{cfg.num_attn_res_blocks + 1} AttnRes sources > {self.max_attn_res_sources}"
        if cfg.hidden_size % 8:
            return f"hidden size {cfg.hidden_size} not a multiple of 8"
        return None

    # ------------------------------------------------------------------ step
    def check_step(self, *, batch: int, new_tokens: int = 1, context: int = 0, speculative_tokens: int = 0,
                   model_reason: str | None = None) -> str | None:
        """None when one decode step fits, else the reason.

        ``batch``: sequences in the step; ``new_tokens``: tokens per sequence (1 for pure decode, more means
        prefill or a mixed step); ``context``: the largest position any sequence reaches after the step
        (an upper bound is fine: the check must not read the GPU); ``model_reason``: ``check_model``'s.
        """
        if model_reason:
            return model_reason
        if new_tokens != 1:
            return PREFILL_REASON
        if speculative_tokens and not self.speculative:
            return f"speculative decoding ({speculative_tokens} draft tokens)"
        if batch < self.min_batch:
            return f"batch {batch} < {self.min_batch}"
        if batch > self.max_batch:
            return f"batch {batch} > {self.max_batch}"
        if context > self.max_context:
            return f"context {context} > max {self.max_context}"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"archs": [f"sm_{a}{b}" for a, b in self.archs], "tp_sizes": list(self.tp_sizes),
                "kda_head_dims": list(self.kda_head_dims), "batch": [self.min_batch, self.max_batch],
                "max_context": self.max_context, "dtypes": [_dtype_name(d) for d in self.dtypes],
                "kv_dtypes": [_dtype_name(d) for d in self.kv_dtypes], "speculative": self.speculative,
                "emulate": self.emulate}


def check_step(envelope: Envelope, **kwargs: Any) -> str | None:
    """Module-level form of ``Envelope.check_step`` (the reason, or None inside the envelope)."""
    return envelope.check_step(**kwargs)
