"""The ops a fast decode step is made of, and which implementation serves each: one registry entry per op.

A fast step (``fast_step.py``) never calls a kernel directly; it calls ``ops[name](...)`` for

| op              | signature (all tensors on one device, Bk = the batch bucket)                          |
|-----------------|----------------------------------------------------------------------------------------|
| ``linear``      | ``(x [Bk,K] bf16, w [N,K] bf16, *, residual=None, out=None, out_dtype=None) -> [Bk,N]``  |
| ``rmsnorm``     | ``(x [Bk,H] bf16, w [H], eps) -> [Bk,H] bf16``                                          |
| ``attn_res``    | ``(sources [S,Bk,H] bf16, norm_w [H], proj_w [H], eps, out_w [H] or None) -> RMSNorm(mix)*out_w`` (None: the mix) |
| ``kda_step``    | ``kernels.kda_decode.api.kda_decode``'s signature (pools + slots, in-place update)      |
| ``mla_attention`` | ``(q [Bk,h,nope+rope], kv [Bk,rank+rope] (kv_a output, c_kv not yet normed), kv_norm_w, eps, latent [N,L,rank+rope], scale, slot [Bk] i32, pos [Bk] i64, block_table [Bk,pages] i32, ctx_len [Bk] i32, w_uk [h,nope,rank] (FP32), w_uv [h,v,rank] bf16, softmax_scale, gate [Bk,h*v] or None) -> [Bk, h*v] bf16``: writes the new latent at (slot, pos), attends over positions 0..pos, gated |
| ``moe_router``  | ``(x [Bk,H] bf16, gate_w [E,H], bias [E] f32, top_k, renormalize, scale) -> (ids [Bk,k], w [Bk,k] f32)`` |
| ``moe_experts`` | ``(z [Bk,L] bf16, ids [Bk,k], weights [Bk,k] f32, bank: ExpertBank, norm_w=None, eps=1e-5) -> [Bk,L]``: the FP32 weighted sum, or with ``norm_w`` the routed latent norm fused (bf16) |
| ``situ_glu``    | opt-in (``DecodeOptions(situ_glu_kernel=True)``): ``(g [Bk,I] bf16, u [Bk,I] bf16, beta, linear_beta) -> [Bk,I] bf16`` |

Each op is served by the kernel whose spec names it (``KernelSpec.serves_op``): the entry's function is
that kernel api's ``step_op`` adapter, and the entry counts launches under the kernel's name. Nothing here
lists the kernels: ``op_table(options)`` reads the specs, keeps an opt-in kernel's op only when its
``DecodeOptions`` field (``KernelSpec.opt_in``) is on, and binds each adapter's keyword-only launch options
(``pdl``: the programmatic-dependent-launch build, reading only weights before ``griddepcontrol.wait``, as
``executor.pdl_support()`` and the kernels' docstrings say; ``gemm_wgmma_min_m``: the skinny GEMM's wgmma
threshold) from ``options``. The table is the executor's own: ``overrides`` (an op name -> ``OpImpl``)
replace entries of that table only, e.g. a planted error or a custom kernel under test; an op served by
PyTorch inside the fast step names its reason (``standard_reason``), which the trace lists per step.
Every implementation must be CUDA-graph capturable: no host synchronisation, no data-dependent shapes.
A kernel that refuses a call (its ``is_supported``) serves it from its reference and counts a fallback
with the reason; the trace lists it per step (``kernel_fallbacks``), and the executor runs such a bucket
eagerly instead of capturing it (the references synchronise with the host). What remains in PyTorch
between kernels is elementwise glue (``GLUE_OPS``). On a CPU each kernel api serves the call from its
``reference.py``, which is how the CPU tests run these adapters.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .options import DecodeOptions


@dataclass(frozen=True)
class OpImpl:
    """One op of a fast step: ``fn`` called with the bound launch options ``launch`` (keyword arguments)."""

    name: str
    fn: Callable[..., Any]
    kernel: str | None = None  # kernels/ registry name whose launches this op counts under
    standard_reason: str | None = None  # set when the op runs on the standard path inside a fast step
    launch: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.kernel is None) == (self.standard_reason is None):
            raise ValueError(f"op {self.name}: give exactly one of kernel= (a fast kernel) or standard_reason=")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **self.launch, **kwargs)


def launch_options(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The ``DecodeOptions`` fields an adapter takes: its keyword-only parameters named like one (the others,
    e.g. ``linear``'s ``out``, are per-call arguments of the step)."""
    known = {f.name for f in dataclasses.fields(DecodeOptions)}
    return tuple(n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY and n in known)


def op_table(options: DecodeOptions | None = None,
             overrides: Mapping[str, OpImpl] | None = None) -> dict[str, OpImpl]:
    """A new table of the fast step's ops under ``options`` (default ``DecodeOptions()``): one entry per kernel
    spec (an opt-in one only when its option is on), each adapter's launch options bound, then
    ``overrides``, which may only replace ops the table has."""
    from .. import kernels
    from .._lib.kernel_spec import resolve

    opts = options or DecodeOptions()
    table: dict[str, OpImpl] = {}
    for spec in kernels.all_specs():
        if spec.opt_in and not getattr(opts, spec.opt_in):
            continue
        fn = resolve(f"{spec.api}:step_op")
        table[spec.serves_op] = OpImpl(spec.serves_op, fn, kernel=spec.name,
                                       launch={n: getattr(opts, n) for n in launch_options(fn)})
    for name, impl in (overrides or {}).items():
        if name not in table:
            raise ValueError(f"override of op {name!r}: the step has no such op under these options "
                             f"(its ops: {', '.join(sorted(table))})")
        if not isinstance(impl, OpImpl):
            raise TypeError(f"override of op {name!r} must be an OpImpl, got {type(impl).__name__}")
        table[name] = impl
    return table


# ------------------------------------------------------------------------------------ glue
def route_from_logits(logits, bias, top_k, renormalize, scale):
    """The reference router's selection (``reference.moe.route``) from FP32 logits: sigmoid, + bias, stable
    descending sort (lower expert index wins exact ties), top-k, renormalised weights. Capturable."""
    scores = torch.sigmoid(logits)
    order = torch.sort(scores + bias.to(scores.dtype), dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w * scale


def mla_step_index(slot: torch.Tensor, pos: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table [Bk, pages] int32, ctx_len [Bk] int32 = pos + 1) of one step over slot pools of
    ``length`` positions: pages of ``mla_decode``'s 64 when ``length`` is a multiple of 64 (the executor's
    pools are, ``CachePool`` rounds up), else one page per slot, which the kernel refuses: the call then
    falls back to its reference and the trace counts it (never silent)."""
    from ..kernels.mla_decode.api import PAGE_SIZE, slot_block_table

    page = PAGE_SIZE if length % PAGE_SIZE == 0 else length
    return slot_block_table(slot, length, page), (pos + 1).to(torch.int32)


GLUE_OPS = ("embedding", "mla_step_index (block table, ctx_len: once per step)",
            "mla_latent_write (RMSNorm(c_kv) | k_pe into the pool)", "mla_absorb_q (q_nope x W_UK, FP32 accumulate)",
            "situ_glu (dense MLP, shared experts)", "moe_residual_add", "logits_mask",
            "kda_beta_unpad (heads % 8 != 0 only)")  # PyTorch elementwise / gather ops between kernels, the same every step
