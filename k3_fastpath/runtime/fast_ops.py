"""The ops a fast decode step is made of, and which implementation serves each: one registry entry per op.

A fast step (``fast_step.py``) never calls a kernel directly; it calls ``ops[name](...)`` for

| op              | signature (all tensors on one device, Bk = the batch bucket)                          |
|-----------------|----------------------------------------------------------------------------------------|
| ``linear``      | ``(x [Bk,K] bf16, w [N,K] bf16, *, residual=None, out=None, out_dtype=None) -> [Bk,N]``  |
| ``rmsnorm``     | ``(x [Bk,H] bf16, w [H], eps) -> [Bk,H] bf16``                                          |
| ``attn_res``    | ``(sources [S,Bk,H] bf16, norm_w [H], proj_w [H], eps, out_w [H]) -> RMSNorm(mix)*out_w`` |
| ``kda_step``    | ``kernels.kda_decode.api.kda_decode``'s signature (pools + slots, in-place update)      |
| ``mla_attention`` | ``(q [Bk,h,nope+rope], kv [Bk,rank+rope] (kv_a output, c_kv not yet normed), kv_norm_w, eps, latent [N,L,rank+rope], scale, slot [Bk] i32, pos [Bk] i64, w_uk [h,nope,rank], w_uv [h,v,rank] (FP32), softmax_scale) -> [Bk, h*v]``: writes the new latent at (slot, pos), attends over positions 0..pos |
| ``moe_router``  | ``(x [Bk,H] bf16, gate_w [E,H], bias [E] f32, top_k, renormalize, scale) -> (ids [Bk,k], w [Bk,k] f32)`` |
| ``moe_experts`` | ``(z [Bk,L] bf16, ids [Bk,k], weights [Bk,k] f32, bank: ExpertBank) -> [Bk,L] f32`` (the weighted sum before the routed norm) |

An entry (``OpImpl``) names the kernel whose launches it counts under, or, for an op served by PyTorch
inside the fast step, the reason (``standard_reason``), which the trace lists per step as a standard op.
Every implementation must be CUDA-graph capturable: no host synchronisation, no data-dependent shapes.

Plugging in a new kernel is one call, e.g. when ``kernels/mla_decode`` lands::

    register_op("mla_attention", my_adapter, kernel="mla_decode")

where ``my_adapter`` has the signature above. ``moe_router`` is already served by ``kernels/moe_router``
when that kernel is registered; ``mla_attention`` and ``moe_experts`` run the PyTorch implementations
below until theirs land (issue #4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..reference.common import compute_dtype, rms_norm, situ_glu
from ..reference.mla import FP8

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


def op_table() -> dict[str, OpImpl]:
    """A snapshot of the registry (an executor keeps the table it was built with)."""
    _register_defaults()
    return dict(_REGISTRY)


# ------------------------------------------------------------------------------------ fast-kernel ops
def _linear(x, w, *, residual=None, out=None, out_dtype=None):
    from ..kernels.skinny_gemm.api import skinny_gemm

    return skinny_gemm(x, w, residual, out=out, out_dtype=out_dtype)


def linear_pdl(x, w, *, residual=None, out=None, out_dtype=None):
    """``linear`` with the skinny GEMM launched for programmatic dependent launch (``config.pdl``): its
    weights stream toward L2 while the previous kernel finishes; activations are read after the wait."""
    import dataclasses

    from ..kernels.skinny_gemm.api import skinny_gemm
    from ..kernels.skinny_gemm.config import SkinnyGemmConfig

    fp32 = (out.dtype if out is not None else out_dtype) == torch.float32
    try:
        cfg = SkinnyGemmConfig.from_heuristic(x.shape[0], w.shape[0], x.shape[1], out_fp32=fp32,
                                              residual=residual is not None)
    except ValueError:  # outside the kernel's envelope: skinny_gemm serves it from its reference
        cfg = None
    return skinny_gemm(x, w, residual, out=out, out_dtype=out_dtype,
                       config=dataclasses.replace(cfg, pdl=True) if cfg is not None else None)


def _rmsnorm(x, w, eps):
    from ..kernels.rmsnorm_residual.api import rmsnorm_residual

    return rmsnorm_residual(x, None, w, eps)[0]


def _attn_res(sources, norm_w, proj_w, eps, out_w):
    from ..kernels.attn_res_mix.api import attn_res_mix

    return attn_res_mix(sources, norm_w, proj_w, eps, out_w=out_w, out_eps=eps)[1]


def _kda_step(*args, **kwargs):
    from ..kernels.kda_decode.api import kda_decode

    return kda_decode(*args, **kwargs)


def _moe_router_kernel(x, gate_w, bias, top_k, renormalize, scale):
    from ..kernels.moe_router.api import moe_router

    return moe_router(x, gate_w, bias, top_k, renormalize, scale)


# ------------------------------------------------------------------------------------ standard ops
def moe_router_standard(x, gate_w, bias, top_k, renormalize, scale):
    """The reference router (``reference.moe.route``) with its FP32 logits from the skinny GEMM: sigmoid,
    + bias, stable descending sort (lower expert index wins exact ties), top-k, renormalised weights."""
    logits = _linear(x, gate_w, out_dtype=torch.float32)
    scores = torch.sigmoid(logits)
    order = torch.sort(scores + bias.to(scores.dtype), dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w * scale


def _situ(g: torch.Tensor, u: torch.Tensor, bank: Any) -> torch.Tensor:
    return situ_glu(g, u, bank.beta, bank.linear_beta).to(g.dtype)


def moe_experts_standard(z, ids, weights, bank):
    """Every expert on every row, weighted by a dense [Bk, E] routing matrix that is 0 off the chosen
    experts: static shapes (graph-capturable), same per-expert math as ``RoutedExpert`` (bf16 GEMMs,
    SiTU-GLU in FP32, FP32 weighted sum). Reads every expert each step: a placeholder until moe_experts."""
    bk = z.shape[0]
    dense = torch.zeros(bk, bank.num_experts, dtype=torch.float32, device=z.device)
    dense.scatter_(1, ids.long(), weights.float())
    if bank.stacked is not None:
        w1, w3, w2 = bank.stacked
        zb = z.unsqueeze(0).expand(bank.num_experts, bk, z.shape[1])
        h = _situ(torch.bmm(zb, w1.transpose(1, 2)), torch.bmm(zb, w3.transpose(1, 2)), bank)
        y = torch.bmm(h, w2.transpose(1, 2))  # [E, Bk, L]
        return torch.einsum("be,ebl->bl", dense, y.float())
    acc = torch.zeros(bk, z.shape[1], dtype=torch.float32, device=z.device)
    for e in range(bank.num_experts):  # MXFP4 dequantized per step: slow, but no extra memory
        w1, w3, w2 = bank.dense(e, z.dtype)
        y = torch.nn.functional.linear(_situ(z @ w1.T, z @ w3.T, bank), w2)
        acc.add_(y.float() * dense[:, e:e + 1])
    return acc


def _latent_chunk(bk: int, max_len: int) -> int:
    """Context positions per attention chunk: Bk x chunk <= 2^18 rows (~0.6 GB of FP32 latents)."""
    return max(128, min(max_len, (1 << 18) // max(bk, 1)))


def mla_attention_standard(q, kv, kv_norm_w, eps, latent, scale, slot, pos, w_uk, w_uv, softmax_scale):
    """Absorbed gated-MLA decode over a slot-indexed latent pool, in PyTorch (``reference.mla`` semantics).

    Writes ``concat(RMSNorm(c_kv), k_pe)`` (FP8-encoded with ``scale`` for an FP8 pool) at ``(slot[b],
    pos[b])``, then attends over positions ``0..pos[b]`` of ``slot[b]`` with an online softmax over
    fixed-size chunks of the whole pool length (static shapes: the same work at every context, so a graph
    captured once serves every step). Scores and sums in FP32; q_lat and the latent output rounded to the
    model dtype where the reference rounds them.
    """
    bk, heads, _ = q.shape
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    dt = q.dtype
    cdt = compute_dtype(dt)
    fp8 = latent.dtype == FP8
    new = torch.cat([rms_norm(kv[:, :rank], kv_norm_w, eps), kv[:, rank:]], dim=-1)
    enc = (new.float() / scale).clamp(-448.0, 448.0).to(FP8) if fp8 else new.to(latent.dtype)
    rows = slot.long()
    latent[rows, pos] = enc
    q_lat = torch.einsum("bhd,hdr->bhr", q[..., :nope].to(cdt), w_uk).to(dt).to(cdt)
    q_pe = q[..., nope:].to(cdt)
    m = torch.full((bk, heads), float("-inf"), dtype=cdt, device=q.device)
    denom = torch.zeros(bk, heads, dtype=cdt, device=q.device)
    acc = torch.zeros(bk, heads, rank, dtype=cdt, device=q.device)
    max_len = latent.shape[1]
    chunk = _latent_chunk(bk, max_len)
    for s0 in range(0, max_len, chunk):
        s1 = min(max_len, s0 + chunk)
        lat = latent[rows, s0:s1]
        lat = ((lat.float() * scale).to(dt) if fp8 else lat.to(dt)).to(cdt)
        ok = torch.arange(s0, s1, device=q.device)[None, :] <= pos[:, None]  # [Bk, n]
        lat = torch.where(ok[..., None], lat, 0.0)  # a stale slot never enters, not even as NaN * 0
        sc = (torch.einsum("bhr,bsr->bhs", q_lat, lat[..., :rank])
              + torch.einsum("bhd,bsd->bhs", q_pe, lat[..., rank:])) * softmax_scale
        sc = sc.masked_fill(~ok[:, None, :], float("-inf"))
        m_new = torch.maximum(m, sc.amax(dim=-1))  # finite from chunk 0 on: position 0 is always valid
        alpha = torch.exp(m - m_new)
        p = torch.exp(sc - m_new[..., None])
        denom = denom * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("bhs,bsr->bhr", p, lat[..., :rank])
        m = m_new
    o_lat = (acc / denom[..., None]).to(dt)
    o = torch.einsum("bhr,hdr->bhd", o_lat.to(cdt), w_uv).to(dt)
    return o.reshape(bk, heads * w_uv.shape[1])


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
    register_op("mla_attention", mla_attention_standard, standard_reason=NO_KERNEL_YET)
    register_op("moe_experts", moe_experts_standard, standard_reason=NO_KERNEL_YET)


GLUE_OPS = ("embedding", "routed_latent_norm", "situ_glu", "mla_output_gate", "moe_residual_add",
            "logits_mask", "kda_beta_unpad (heads % 8 != 0 only)")  # PyTorch elementwise / gather ops between kernels, the same every step
