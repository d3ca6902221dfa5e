"""The ops a fast decode step is made of, and which implementation serves each: one registry entry per op.

A fast step (``fast_step.py``) never calls a kernel directly; it calls ``ops[name](...)`` for

| op              | signature (all tensors on one device, Bk = the batch bucket)                          |
|-----------------|----------------------------------------------------------------------------------------|
| ``linear``      | ``(x [Bk,K] bf16, w [N,K] bf16, *, residual=None, out=None, out_dtype=None) -> [Bk,N]``  |
| ``rmsnorm``     | ``(x [Bk,H] bf16, w [H], eps) -> [Bk,H] bf16``                                          |
| ``attn_res``    | ``(sources [S,Bk,H] bf16, norm_w [H], proj_w [H], eps, out_w [H]) -> RMSNorm(mix)*out_w`` |
| ``kda_step``    | ``kernels.kda_decode.api.kda_decode``'s signature (pools + slots, in-place update)      |
| ``mla_attention`` | ``(q [Bk,h,nope+rope], kv [Bk,rank+rope] (kv_a output, c_kv not yet normed), kv_norm_w, eps, latent [N,L,rank+rope], scale, slot [Bk] i32, pos [Bk] i64, block_table [Bk,pages] i32, ctx_len [Bk] i32, w_uk [h,nope,rank] (FP32), w_uv [h,v,rank] bf16, softmax_scale, gate [Bk,h*v] or None) -> [Bk, h*v] bf16``: writes the new latent at (slot, pos), attends over positions 0..pos, gated |
| ``moe_router``  | ``(x [Bk,H] bf16, gate_w [E,H], bias [E] f32, top_k, renormalize, scale) -> (ids [Bk,k], w [Bk,k] f32)`` |
| ``moe_experts`` | ``(z [Bk,L] bf16, ids [Bk,k], weights [Bk,k] f32, bank: ExpertBank, norm_w=None, eps=1e-5) -> [Bk,L]``: the FP32 weighted sum, or with ``norm_w`` the routed latent norm fused (bf16) |

An entry (``OpImpl``) names the kernel whose launches it counts under, or, for an op served by PyTorch
inside the fast step, the reason (``standard_reason``), which the trace lists per step as a standard op.
Every implementation must be CUDA-graph capturable: no host synchronisation, no data-dependent shapes.
A kernel that refuses a call (its ``is_supported``) serves it from its reference and counts a fallback
with the reason; the trace lists it per step (``kernel_fallbacks``), and the executor runs such a bucket
eagerly instead of capturing it (the references synchronise with the host).

``op_table(pdl=True)`` (what ``DecodeOptions(pdl=True)`` runs) serves every op whose entry is still the
default kernel adapter by its programmatic-dependent-launch twin (``PDL_VARIANTS``): the same kernels with
``pdl=True``, each launched with the PDL attribute, reading only weights before ``griddepcontrol.wait``
(what each reads is in ``executor.pdl_support()`` and the kernels' docstrings). The PyTorch glue between
kernels launches normally.

Plugging in a kernel is one call::

    register_op("mla_attention", my_adapter, kernel="mla_decode")

where ``my_adapter`` has the signature above. Every op of the table is served by a kernel
(``mla_attention`` by ``kernels/mla_decode``, ``moe_experts`` by ``kernels/moe_experts``); what remains in
PyTorch between kernels is elementwise glue (``GLUE_OPS``). On a CPU, or outside a kernel's envelope,
each kernel api serves the call from its ``reference.py``, which is how the CPU tests run these adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..reference.common import rms_norm
from ..reference.mla import FP8, FP8_MAX

NO_KERNEL_YET = "no fast kernel yet (issue #4)"


@dataclass(frozen=True)
class OpImpl:
    name: str
    fn: Callable[..., Any]
    kernel: str | None = None  # kernels/ registry name whose launches this op counts under
    standard_reason: str | None = None  # set when the op runs on the standard path inside a fast step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


_REGISTRY: dict[str, OpImpl] = {}


def register_op(name: str, fn: Callable[..., Any], *, kernel: str | None = None,
                standard_reason: str | None = None) -> None:
    """Serve op ``name`` by ``fn`` from now on (replaces the previous entry)."""
    if (kernel is None) == (standard_reason is None):
        raise ValueError(f"op {name}: give exactly one of kernel= (a fast kernel) or standard_reason=")
    _REGISTRY[name] = OpImpl(name, fn, kernel, standard_reason)


def op_table(pdl: bool = False, situ_glu_kernel: bool = False) -> dict[str, OpImpl]:
    """A snapshot of the registry (an executor keeps the table it was built with). ``pdl``: each op still
    served by its default kernel adapter gets that adapter's PDL twin (``PDL_VARIANTS``); an op registered
    with another function keeps it. ``situ_glu_kernel``: the table also has the opt-in ``situ_glu`` op
    (``OPT_IN_OPS``), which the step then calls instead of its PyTorch SiTU-GLU glue."""
    _register_defaults()
    table = dict(_REGISTRY)
    if pdl:
        for name, (default_fn, pdl_fn) in PDL_VARIANTS.items():
            impl = table.get(name)
            if impl is not None and impl.fn is default_fn:
                table[name] = OpImpl(name, pdl_fn, kernel=impl.kernel)
    if situ_glu_kernel:
        fn, pdl_fn, kernel = OPT_IN_OPS["situ_glu"]
        table["situ_glu"] = OpImpl("situ_glu", pdl_fn if pdl else fn, kernel=kernel)
    return table


# ------------------------------------------------------------------------------------ fast-kernel ops
def _linear(x, w, *, residual=None, out=None, out_dtype=None):
    from ..kernels.skinny_gemm.api import skinny_gemm

    return skinny_gemm(x, w, residual, out=out, out_dtype=out_dtype)


def linear_pdl(x, w, *, residual=None, out=None, out_dtype=None):
    """``linear`` with the skinny GEMM launched for programmatic dependent launch (``config.pdl``): its
    weights stream toward L2 while the previous kernel finishes; activations are read after the wait. The
    config is the one ``skinny_gemm`` would pick (``SkinnyGemmConfig.select``), so only the launch differs."""
    import dataclasses

    from ..kernels.skinny_gemm.api import skinny_gemm
    from ..kernels.skinny_gemm.config import SkinnyGemmConfig

    fp32 = (out.dtype if out is not None else out_dtype) == torch.float32
    try:
        cfg = SkinnyGemmConfig.select(x.shape[0], w.shape[0], x.shape[1], out_fp32=fp32,
                                      residual=residual is not None)
    except ValueError:  # outside the kernel's envelope: skinny_gemm serves it from its reference
        cfg = None
    return skinny_gemm(x, w, residual, out=out, out_dtype=out_dtype,
                       config=dataclasses.replace(cfg, pdl=True) if cfg is not None else None)


def _rmsnorm(x, w, eps, *, pdl=False):
    from ..kernels.rmsnorm_residual.api import rmsnorm_residual

    return rmsnorm_residual(x, None, w, eps, pdl=pdl)[0]


def _attn_res(sources, norm_w, proj_w, eps, out_w, *, pdl=False):
    from ..kernels.attn_res_mix.api import attn_res_mix

    return attn_res_mix(sources, norm_w, proj_w, eps, out_w=out_w, out_eps=eps, pdl=pdl)[1]


def _kda_step(*args, **kwargs):
    from ..kernels.kda_decode.api import kda_decode

    return kda_decode(*args, **kwargs)


def _moe_router_kernel(x, gate_w, bias, top_k, renormalize, scale, *, pdl=False):
    from ..kernels.moe_router.api import moe_router

    return moe_router(x, gate_w, bias, top_k, renormalize, scale, pdl=pdl)


def _situ_glu(g, u, beta, linear_beta, *, pdl=False):
    from ..kernels.situ_glu.api import situ_glu

    return situ_glu(g, u, beta, linear_beta, pdl=pdl)


def _situ_glu_pdl(g, u, beta, linear_beta):
    return _situ_glu(g, u, beta, linear_beta, pdl=True)


# ------------------------------------------------------------------------------------ standard ops
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


def moe_router_standard(x, gate_w, bias, top_k, renormalize, scale):
    """``route_from_logits`` with its FP32 logits from the skinny GEMM."""
    return route_from_logits(_linear(x, gate_w, out_dtype=torch.float32), bias, top_k, renormalize, scale)


def moe_experts_kernel(z, ids, weights, bank, norm_w=None, eps=1e-5, *, pdl=False):
    """The routed experts through ``kernels/moe_experts``: only the touched experts' weights (MXFP4 as the
    checkpoint stores them, in the kernel's fragment layout built once per bank) stream, once per step.
    Returns the FP32 weighted sum, or with ``norm_w`` the routed latent RMSNorm fused into the combine
    (bf16). Router ids come as int32 from ``moe_router``; the standard router's int64 ids are narrowed."""
    from ..kernels.moe_experts.api import moe_experts

    if ids.dtype != torch.int32:  # glue, only behind the standard router
        ids = ids.to(torch.int32)
    return moe_experts(z, ids, weights.float(), bank.weights, beta=bank.beta, linear_beta=bank.linear_beta,
                       norm_weight=norm_w, eps=eps, pdl=pdl)


def write_mla_latent(kv, kv_norm_w, eps, latent, scale, slot, pos):
    """Glue before ``mla_decode``: ``concat(RMSNorm(c_kv), k_pe)`` (FP8-encoded with ``scale`` for an FP8
    pool, saturating like ``MLACache.encode``) into ``latent[slot[b], pos[b]]``. Padded rows write slot 0."""
    rank = kv_norm_w.shape[0]
    new = torch.cat([rms_norm(kv[:, :rank], kv_norm_w, eps), kv[:, rank:]], dim=-1)
    enc = (new.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8) if latent.dtype == FP8 else new.to(latent.dtype)
    latent[slot.long(), pos] = enc


def mla_attention_kernel(q, kv, kv_norm_w, eps, latent, scale, slot, pos, block_table, ctx_len, w_uk, w_uv,
                         softmax_scale, gate=None, *, pdl=False):
    """Absorbed gated-MLA decode through ``kernels/mla_decode`` over the slot pool (``reference.mla``
    semantics): writes the new latent at ``(slot, pos)`` (``write_mla_latent``), absorbs ``q_nope`` through
    W_UK (``absorb_q``: FP32 accumulate, rounded), then one ``mla_decode`` over the pool viewed as pages of
    ``block_table``'s page size: positions ``0 .. ctx_len - 1 = pos`` of each row's slot, W_UV and the
    output gate fused into the combine. ``max_ctx`` is the pool length (static: one graph per bucket)."""
    from ..kernels.mla_decode.api import absorb_q, mla_decode

    write_mla_latent(kv, kv_norm_w, eps, latent, scale, slot, pos)
    nope = w_uk.shape[1]
    q_lat = absorb_q(q[..., :nope], w_uk).contiguous()
    q_pe = q[..., nope:].contiguous()
    n, length, width = latent.shape
    page = length // (block_table.shape[1])
    paged = latent.view(n * length // page, page, width)
    return mla_decode(q_lat, q_pe, paged, block_table, ctx_len, w_uv, gate, softmax_scale=softmax_scale,
                      cache_scale=scale if latent.dtype == FP8 else None, max_ctx=length, pdl=pdl)


def mla_step_index(slot: torch.Tensor, pos: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table [Bk, pages] int32, ctx_len [Bk] int32 = pos + 1) of one step over slot pools of
    ``length`` positions: pages of ``mla_decode``'s 64 when ``length`` is a multiple of 64 (the executor's
    pools are, ``CachePool`` rounds up), else one page per slot, which the kernel refuses: the call then
    falls back to its reference and the trace counts it (never silent)."""
    from ..kernels.mla_decode.api import PAGE_SIZE, slot_block_table

    page = PAGE_SIZE if length % PAGE_SIZE == 0 else length
    return slot_block_table(slot, length, page), (pos + 1).to(torch.int32)


# ------------------------------------------------------------------------------------ PDL twins
def _rmsnorm_pdl(x, w, eps):
    return _rmsnorm(x, w, eps, pdl=True)


def _attn_res_pdl(sources, norm_w, proj_w, eps, out_w):
    return _attn_res(sources, norm_w, proj_w, eps, out_w, pdl=True)


def _kda_step_pdl(*args, **kwargs):
    return _kda_step(*args, pdl=True, **kwargs)


def _moe_router_kernel_pdl(x, gate_w, bias, top_k, renormalize, scale):
    return _moe_router_kernel(x, gate_w, bias, top_k, renormalize, scale, pdl=True)


def mla_attention_kernel_pdl(*args, **kwargs):
    """``mla_attention_kernel`` with both ``mla_decode`` launches for PDL (the glue before them is PyTorch)."""
    return mla_attention_kernel(*args, pdl=True, **kwargs)


def moe_experts_kernel_pdl(*args, **kwargs):
    """``moe_experts_kernel`` with all four ``moe_experts`` launches for PDL."""
    return moe_experts_kernel(*args, pdl=True, **kwargs)


# op -> (default kernel adapter, its PDL twin): what op_table(pdl=True) swaps
PDL_VARIANTS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "linear": (_linear, linear_pdl),
    "rmsnorm": (_rmsnorm, _rmsnorm_pdl),
    "attn_res": (_attn_res, _attn_res_pdl),
    "kda_step": (_kda_step, _kda_step_pdl),
    "moe_router": (_moe_router_kernel, _moe_router_kernel_pdl),
    "mla_attention": (mla_attention_kernel, mla_attention_kernel_pdl),
    "moe_experts": (moe_experts_kernel, moe_experts_kernel_pdl),
}


# opt-in op -> (kernel adapter, its PDL twin, kernel): in a table only when asked (op_table(situ_glu_kernel=True),
# DecodeOptions(situ_glu_kernel=True)); without it the step keeps the PyTorch glue (GLUE_OPS "situ_glu").
# ``situ_glu``: ``(g [Bk,I] bf16, u [Bk,I] bf16, beta, linear_beta) -> [Bk,I] bf16``, one kernel for the
# shared experts' and the dense MLP's activation (kernels/situ_glu) instead of ~12 elementwise kernels.
OPT_IN_OPS: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "situ_glu": (_situ_glu, _situ_glu_pdl, "situ_glu"),
}


# ------------------------------------------------------------------------------------ defaults
def _register_defaults() -> None:
    if _REGISTRY:
        return
    from .. import kernels

    register_op("linear", _linear, kernel="skinny_gemm")
    register_op("rmsnorm", _rmsnorm, kernel="rmsnorm_residual")
    register_op("attn_res", _attn_res, kernel="attn_res_mix")
    register_op("kda_step", _kda_step, kernel="kda_decode")
    if "moe_router" in kernels.names():
        register_op("moe_router", _moe_router_kernel, kernel="moe_router")
    else:
        register_op("moe_router", moe_router_standard, standard_reason=NO_KERNEL_YET)
    register_op("mla_attention", mla_attention_kernel, kernel="mla_decode")
    register_op("moe_experts", moe_experts_kernel, kernel="moe_experts")


GLUE_OPS = ("embedding", "mla_step_index (block table, ctx_len: once per step)",
            "mla_latent_write (RMSNorm(c_kv) | k_pe into the pool)", "mla_absorb_q (q_nope x W_UK, FP32 accumulate)",
            "situ_glu (dense MLP, shared experts)", "moe_residual_add", "logits_mask",
            "kda_beta_unpad (heads % 8 != 0 only)")  # PyTorch elementwise / gather ops between kernels, the same every step
