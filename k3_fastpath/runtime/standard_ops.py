"""The strong standard path: the executor's decode step with every op served by the libraries a serving
engine uses on Hopper instead of k3_fastpath's kernels, captured in the same CUDA graphs.

``DecodeExecutor(model, backend="standard_graph")`` runs ``fast_step.run_step`` (the same plan, slot pools,
static buffers, one graph per bucket, shared experts on a side stream) with this op table:

| op              | standard implementation                                                              |
|-----------------|--------------------------------------------------------------------------------------|
| ``linear``      | cuBLAS (``torch.nn.functional.linear``), the residual added by one more kernel         |
| ``rmsnorm``     | PyTorch (FP32 math), inside the graph                                                 |
| ``attn_res``    | PyTorch (FP32 math), inside the graph                                                 |
| ``kda_step``    | conv update in PyTorch on the pools + fla's ``fused_recurrent_kda_fwd`` (gate, beta,   |
|                 | q/k L2 norm in kernel, state updated in place through ``ssm_state_indices``) + fla's   |
|                 | ``rms_norm_gated``; without fla (a CPU) the same math in PyTorch                       |
| ``mla_attention`` | absorbed attention as cuBLAS batched GEMMs (BF16 latents gathered per chunk, FP32 |
|                 | out) + PyTorch online softmax over fixed chunks of the pool (static shapes, the pool  |
|                 | sized to the context measured)                                                        |
| ``moe_router``  | cuBLAS logits (FP32 out) + ``torch.sort`` top-k                                       |
| ``moe_experts`` | rows sorted by expert + ``torch._grouped_mm`` (cuBLAS-class grouped GEMM, sm_90) over |
|                 | BF16 experts dequantised once at build (``StandardExperts``); FP32 weighted combine;   |
|                 | with ``DecodeOptions(standard_mxfp4_experts=True)``: MXFP4 experts through            |
|                 | humming-kernels' MoE GEMMs, vLLM's sm_90 MXFP4 backend (``standard_mxfp4.py``)        |

``standard_op_table(compiled_glue=True)`` (``DecodeOptions(standard_compiled_glue=True)``; default off)
serves the PyTorch glue above through ``torch.compile`` on CUDA tensors (``compiled_glue.py`` says how it stays
capture-safe): ``GLUE_FNS`` (RMSNorm, the AttnRes mix + norm, the KDA conv update + row mask, the router's
selection after the cuBLAS logits, the experts' sort / offsets / gather, SiTU-GLU between the grouped GEMMs
and FP32 combine + latent norm), and ``linear`` becomes ``linear_standard_fused`` (the residual added in
cuBLAS's epilogue by ``addmm``, FP32 logits straight from the GEMM). MLA's chunked attention stays eager.

What it is for: ``perf.decode_sweep``'s fast-vs-standard ratio (issue #5 asks for a standard path at least
as strong as cuBLAS + fla + grouped GEMM + compiled glue, graph-captured). Expert format: by default the
experts are BF16 (torch has no MXFP4 grouped GEMM for sm_90; 4x the bytes of the fast path's MXFP4);
``standard_mxfp4_experts`` reads the fast path's MXFP4 bytes through humming, as vLLM does on Hopper. The
sweep records say which. Every op is capturable: no host
synchronisation, no data-dependent shapes. The trace lists each op with the library that served it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ..kernels.attn_res_mix.reference import attn_res_mix_ref
from ..kernels.kda_decode.reference import _conv_w3
from ..kernels.mla_decode.api import write_latent as write_mla_latent
from ..kernels.rmsnorm_residual.reference import rmsnorm_residual_ref
from ..reference.common import compute_dtype, rms_norm, situ_glu
from ..reference.kda import kda_gate, kda_recurrent_step, l2_normalize
from .compiled_glue import GLUE_COMPILED, GLUE_EAGER, GlueSet, compile_unavailable
from .fast_ops import OpImpl, route_from_logits
from .standard_mxfp4 import HUMMING_LIB, HummingExperts, align, humming_unavailable
from .standard_verify import kda_verify_standard

CUBLAS = "standard path: cuBLAS (torch.nn.functional.linear)"
TORCH = "standard path: PyTorch ops in the CUDA graph"


# ------------------------------------------------------------------------------------------ dense
def linear_standard(x, w, *, residual=None, out=None, out_dtype=None):
    y = torch.nn.functional.linear(x, w)
    if out_dtype is not None and y.dtype != out_dtype:
        y = y.to(out_dtype)
    if residual is not None:
        if out is not None and out.data_ptr() == residual.data_ptr():
            return out.add_(y)
        y = residual + y
    if out is not None:
        return out.copy_(y)
    return y


def linear_standard_fused(x, w, *, residual=None, out=None, out_dtype=None):
    """``linear_standard``'s contract with the epilogue in cuBLAS (compiled-glue tables): the residual added by
    ``addmm`` (beta = 1, in place when ``out`` is the residual: FP32 accumulate, ONE rounding, as the fast
    path's fused residual), an FP32 output straight from ``mm(out_dtype=float32)``, ``mm(out=)`` instead of
    a copy. Anything else (a CPU tensor, mixed dtypes) is ``linear_standard``."""
    dt = x.dtype
    want = out_dtype or (out.dtype if out is not None else dt)
    if not x.is_cuda or x.dim() != 2 or w.dtype != dt or (out is not None and out.dtype != want):
        return linear_standard(x, w, residual=residual, out=out, out_dtype=out_dtype)
    if residual is not None:
        if residual.dtype != dt or want != dt:
            return linear_standard(x, w, residual=residual, out=out, out_dtype=out_dtype)
        if out is None:
            return torch.addmm(residual, x, w.t())
        if out.data_ptr() == residual.data_ptr() and out.stride() == residual.stride():
            return out.addmm_(x, w.t())
        return torch.addmm(residual, x, w.t(), out=out)
    if want == dt:
        return torch.mm(x, w.t(), out=out) if out is not None else torch.mm(x, w.t())
    if want == torch.float32 and dt in (torch.bfloat16, torch.float16) and mm_out_dtype_works(str(x.device)):
        y = torch.mm(x, w.t(), out_dtype=torch.float32)
        return out.copy_(y) if out is not None else y
    return linear_standard(x, w, out=out, out_dtype=out_dtype)


def rmsnorm_standard(x, w, eps):
    return rmsnorm_residual_ref(x, None, w, eps)[0]


def attn_res_standard(sources, norm_w, proj_w, eps, out_w):
    mix, normed = attn_res_mix_ref(sources, norm_w, proj_w, eps, out_w=out_w, out_eps=eps)
    return mix if out_w is None else normed


# ------------------------------------------------------------------------------------------ KDA
@functools.lru_cache(maxsize=1)
def fla_kda() -> tuple[Any, Any] | None:
    """(fused_recurrent_kda_fwd, rms_norm_gated) from fla, or None when fla (or a GPU for it) is missing."""
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:
        return None
    return fused_recurrent_kda_fwd, rms_norm_gated


def fla_for(device: torch.device | str) -> tuple[Any, Any] | None:
    """fla's pair for a KDA step on ``device``: on CUDA where fla imports, else None (the PyTorch step)."""
    return fla_kda() if torch.device(device).type == "cuda" else None


FLA_KDA_STEP = "standard path: PyTorch conv update + fla fused_recurrent_kda_fwd + fla rms_norm_gated"
TORCH_KDA_STEP = "standard path: PyTorch KDA step"


def _kda_library(device: torch.device | str | None) -> str:
    """What ``kda_step_standard`` runs on ``device``: fla on CUDA tensors where fla imports, else PyTorch (the
    reason in parentheses; None: both, as the first call's tensors decide)."""
    if fla_kda() is None:
        return f"{TORCH_KDA_STEP} (fla not importable)"
    if device is None:
        return f"{FLA_KDA_STEP} on CUDA tensors, else {TORCH_KDA_STEP.removeprefix('standard path: ')}"
    return FLA_KDA_STEP if fla_for(device) is not None else f"{TORCH_KDA_STEP} (fla runs on CUDA tensors)"


def _conv_standard(x, w, pool, idx):
    """SiLU causal depthwise conv of one new input per row on pool rows ``idx`` (updated in place)."""
    win = torch.cat([pool.index_select(0, idx), x[:, None, :].to(pool.dtype)], dim=1)  # [B, W, C]
    wt = _conv_w3(w)[:, 0, :].t().float()  # [W, C]
    y = torch.nn.functional.silu((win.float() * wt[None]).sum(dim=1))
    pool.index_copy_(0, idx, win[:, 1:])  # inductor writes the rows in place (no copy of the pool)
    return y


def kda_conv_standard(q, k, v, conv_q_w, conv_k_w, conv_v_w, conv_q, conv_k, conv_v, idx, out_dtype):
    """Glue: the q, k, v conv updates of one KDA step (their pools updated in place), outputs in ``out_dtype``."""
    qc = _conv_standard(q, conv_q_w, conv_q, idx).to(out_dtype)
    kc = _conv_standard(k, conv_k_w, conv_k, idx).to(out_dtype)
    vc = _conv_standard(v, conv_v_w, conv_v, idx).to(out_dtype)
    return qc, kc, vc


def kda_zero_empty_standard(y, idx, dtype):
    """Glue: rows of slot 0 (padded / inactive) zeroed, the output rounded to ``dtype``."""
    return (y * (idx != 0).to(y.dtype)[:, None]).to(dtype)


def kda_step_standard(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                      conv_q, conv_k, conv_v, state, *, eps: float = 1e-5, lower_bound: float = -5.0, out=None,
                      glue=None, slot_out=None, tokens: int = 1):
    """``kernels.kda_decode``'s op contract in library code. Rows of slot 0 compute on slot 0's (scratch)
    state like any row and are zeroed on output; real slots are distinct within a step. ``glue``: the
    table's ``GlueSet`` (None: eager) for the conv update and the row mask. A verify step (``slot_out``,
    ``tokens``) is ``standard_verify.kda_verify_standard``."""
    if slot_out is not None:
        y = kda_verify_standard(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w,
                                slot, conv_q, conv_k, conv_v, state, eps=eps, lower_bound=lower_bound,
                                slot_out=slot_out, tokens=tokens, fla=fla_for(q.device),
                                decode_step=kda_step_standard, glue=glue)
        return out.copy_(y) if out is not None else y
    B, C = q.shape
    _, H, D, _ = state.shape
    idx = slot.long()
    fla = fla_for(q.device)
    qc, kc, vc = _glue(glue, "kda_conv", q, k, v, conv_q_w, conv_k_w, conv_v_w, conv_q, conv_k, conv_v, idx,
                       q.dtype if fla is not None else torch.float32)
    if fla is not None:
        fused_recurrent_kda_fwd, rms_norm_gated = fla
        o, _ = fused_recurrent_kda_fwd(
            qc.reshape(B, 1, H, D), kc.reshape(B, 1, H, D), vc.reshape(B, 1, H, D),
            a.view(B, 1, H, D), beta_logits.view(B, 1, H), A_log=A_log[:H].contiguous(),
            dt_bias=dt_bias.reshape(H, D).contiguous(), scale=D ** -0.5, initial_state=state,
            output_final_state=True, inplace_final_state=True, ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=lower_bound)
        y = rms_norm_gated(o.view(B * H, D), g.reshape(B * H, D), o_norm_w, None, activation="sigmoid",
                           eps=eps).view(B, C)
    else:
        cdt = compute_dtype(state.dtype)
        qn = l2_normalize(qc.to(cdt).view(B, H, D)) * D ** -0.5
        kn = l2_normalize(kc.to(cdt).view(B, H, D))
        g_log = kda_gate(a.view(B, H, D), A_log, dt_bias, lower_bound)
        o, s_new = kda_recurrent_step(qn, kn, vc.to(cdt).view(B, H, D), g_log,
                                      torch.sigmoid(beta_logits.to(cdt)), state.index_select(0, idx))
        state.index_copy_(0, idx, s_new.to(state.dtype))
        y = (rms_norm(o, o_norm_w.to(cdt), eps) * torch.sigmoid(g.to(cdt).view(B, H, D))).reshape(B, C)
    y = _glue(glue, "kda_zero_empty", y, idx, q.dtype)
    if out is not None:
        return out.copy_(y)
    return y


# ------------------------------------------------------------------------------------------ MLA
_CHUNK_BYTES = 1 << 29  # per-chunk temporaries of mla_attention_standard (~0.5 GiB; see _latent_chunk)


def _latent_chunk(bk: int, max_len: int, heads: int = 1, width: int = 576, fp8: bool = False) -> int:
    """Context positions per attention chunk of ``mla_attention_standard``.

    Per (row, position) one chunk holds: the gathered latent in BF16 (``2 * width`` bytes, plus the
    ``width`` FP8 bytes it was converted from), the FP32 scores and probabilities and the BF16
    probabilities (``10 * heads``) and the indices / mask (~24). The chunk is the most positions whose
    temporaries stay within ``_CHUNK_BYTES`` (0.5 GiB), spread evenly over the pool (no tiny last chunk),
    a multiple of 128, at least 128. Why that size: every chunk costs ~20 launches whatever its size
    (a dozen of them tiny: indices, max, rescale), while its bytes are what the step must move anyway; at
    batch 64 x 128K positions x 12 heads (TP8) that is 21 chunks of ~0.5 GB each (launch gaps well under
    1% of the time), and one chunk at batch 1. Smaller, L2-resident chunks (<= ~2^14 rows, 19 MB) would
    save re-reading the gathered copy from HBM but cost ~25x the launches; ``_CHUNK_BYTES`` is the knob
    to sweep on the GPU."""
    per_row = (2 + fp8) * width + 10 * heads + 24
    most = max(128, _CHUNK_BYTES // per_row // max(bk, 1))
    n_chunks = -(-max_len // most)
    even = -(-max_len // n_chunks)
    return min(max_len, -(-even // 128) * 128)


@functools.lru_cache(maxsize=8)
def bmm_out_dtype_works(device: str) -> bool:
    """Whether ``torch.bmm(bf16, bf16, out_dtype=torch.float32)`` (cuBLAS, FP32 output) exists here; probed
    once per device outside capture (the executor's eager warm-up step calls the op first)."""
    try:
        a = torch.ones(2, 2, 8, dtype=torch.bfloat16, device=device)
        return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except Exception:
        return False


def _bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` batched, accumulated and returned in ``out_dtype``: BF16/FP16 inputs straight into cuBLAS
    with an FP32 output where torch has it (no FP32 copy of the inputs); elsewhere (a CPU) the inputs are
    upcast first, which gives the same numbers up to the summation order."""
    if a.dtype == b.dtype == out_dtype:
        return torch.bmm(a, b)
    if (a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16) and out_dtype == torch.float32
            and bmm_out_dtype_works(str(a.device))):
        return torch.bmm(a, b, out_dtype=out_dtype)
    return torch.bmm(a.to(out_dtype), b.to(out_dtype))


def _latent_rows(latent: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The pool ``[N, L, D]`` as one row per (slot, position), ``[rows, D]`` (FP8 as its bytes), and the
    row stride between slots: ``row = slot * stride + position``. One index tensor on dim 0 is the gather
    torch serves with its vectorised 16-byte copy kernel. None when the strides do not allow the view."""
    words = latent.view(torch.uint8) if latent.dtype.itemsize == 1 else latent
    s0, s1, s2 = words.stride()
    if s2 != 1 or s1 <= 0 or s0 % s1:
        return None
    n, length, width = words.shape
    per = s0 // s1
    return words.as_strided(((n - 1) * per + length, width), (s1, 1)), per


def mla_attention_standard(q, kv, kv_norm_w, eps, latent, scale, slot, pos, block_table, ctx_len, w_uk, w_uv,
                           softmax_scale, gate=None):
    """``kernels.mla_decode.api.step_op``'s contract in library code: writes the new latent
    (``write_mla_latent``), absorbs q through W_UK, attends over positions ``0..pos`` of the row's slot,
    applies W_UV and the sigmoid gate; returns ``[Bk, heads * v_dim]`` in ``q.dtype``. ``block_table`` /
    ``ctx_len`` are the kernel's view of the same pool and unused here (``pos`` says the same).

    The FlashMLA / FlashInfer recipe with cuBLAS batched GEMMs, over fixed chunks of the pool (static
    shapes: capturable, the pool sized to the context): per chunk, one gather of ``latent[slot, s0:s1]``
    in its stored dtype (FP8 converted to BF16 exactly; its scale folded into the FP32 scores and the
    output instead of rounding ``c * scale`` to BF16); scores ``[q_lat | q_pe] . c`` as ONE GEMM over all
    576 dims, BF16 in, FP32 out; online softmax in FP32; P rounded to BF16 for the P.V GEMM against the
    first ``rank`` dims of the same gathered chunk, FP32 out. No FP32 copy of a latent is made.

    Masking: positions past ``pos`` (and every position of a padded slot-0 row) are gathered from
    position ``pos`` instead (the latent this step just wrote), so a stale slot's bytes are never read,
    not even to be multiplied by 0; those duplicates are valid scores of the row, so the raw chunk max is
    a safe stabiliser, and their probabilities are zeroed by the mask in the same pass that casts P to
    BF16. A row with nothing visible (slot 0) gets P = 0 everywhere and outputs 0, never 0/0."""
    from ..reference.mla import FP8

    write_mla_latent(kv, kv_norm_w, eps, latent, scale, slot, pos)
    bk, heads, _ = q.shape
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    dt = q.dtype
    cdt = compute_dtype(dt)
    mdt = dt if dt in (torch.bfloat16, torch.float16) else cdt  # GEMM input dtype of the latents and P
    fp8 = latent.dtype == FP8
    dev = q.device
    rows = slot.long()
    pos = pos.long()
    lim = torch.where(rows == 0, -1, pos)  # last visible position; -1: none (padded rows)
    q_nope = q[..., :nope].transpose(0, 1)  # [heads, Bk, nope]
    q_lat = (torch.bmm(q_nope, w_uk) if w_uk.dtype == dt else _bmm(q_nope, w_uk, cdt)).to(dt)
    q_cat = torch.cat([q_lat.transpose(0, 1), q[..., nope:]], dim=-1).to(mdt)  # [Bk, heads, rank + rope]
    # score scale: softmax_scale, times the FP8 dequantisation scale (exact in FP32); the output takes it too
    s = scale.to(device=dev, dtype=cdt).reshape(()) * softmax_scale if fp8 else softmax_scale
    m = torch.full((bk, heads, 1), torch.finfo(cdt).min, dtype=cdt, device=dev)  # finite: no inf - inf
    denom = torch.zeros(bk, heads, 1, dtype=cdt, device=dev)
    acc = torch.zeros(bk, heads, rank, dtype=cdt, device=dev)
    max_len, width = latent.shape[1], latent.shape[2]
    chunk = _latent_chunk(bk, max_len, heads, width, fp8)
    flat = _latent_rows(latent)
    for s0 in range(0, max_len, chunk):
        s1 = min(max_len, s0 + chunk)
        t = torch.arange(s0, s1, device=dev)
        ok = t[None, :] <= lim[:, None]  # [Bk, C]
        tpos = torch.where(ok, t[None, :], pos[:, None])
        if flat is not None:
            lat = flat[0][(rows[:, None] * flat[1] + tpos).reshape(-1)].view(bk, s1 - s0, width)
        else:
            src = latent.view(torch.uint8) if fp8 else latent
            lat = src[rows[:, None], tpos]
        lat = (lat.view(FP8) if fp8 else lat).to(mdt)  # [Bk, C, D]: FP8 -> BF16 is exact
        sc = _bmm(q_cat, lat.transpose(1, 2), cdt)  # [Bk, heads, C] raw scores
        m_new = torch.maximum(m, sc.amax(dim=-1, keepdim=True) * s)
        p = (torch.addcmul(-m_new, sc, s) if torch.is_tensor(s) else torch.add(-m_new, sc, alpha=s)).exp_()
        pm = torch.mul(p, ok[:, None, :].to(cdt), out=torch.empty(p.shape, dtype=mdt, device=dev))
        alpha = torch.exp(m - m_new)
        denom = torch.addcmul(pm.sum(dim=-1, keepdim=True, dtype=cdt), denom, alpha)
        acc = torch.addcmul(_bmm(pm, lat[..., :rank], cdt), acc, alpha)
        m = m_new
    if fp8:
        acc = acc * scale.to(device=dev, dtype=cdt).reshape(())
    o_lat = (acc / denom.clamp_min(torch.finfo(cdt).tiny)).to(dt).transpose(0, 1)  # [heads, Bk, rank]
    w_v = w_uv.transpose(1, 2)  # [heads, rank, v]
    o = (torch.bmm(o_lat, w_v) if w_uv.dtype == dt else _bmm(o_lat, w_v, cdt)).to(dt)
    o = o.transpose(0, 1).reshape(bk, heads * w_uv.shape[1])
    if gate is not None:
        o = (o.float() * torch.sigmoid(gate.float())).to(dt)
    return o


# ------------------------------------------------------------------------------------------ experts
class StandardExperts:
    """One MoE layer's routed experts dequantised to BF16 once, stacked ``[E, out, in]`` (the grouped GEMM
    reads them transposed, K-major). Shared by every standard executor over the same ``ExpertBank``."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, bank: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        w = bank.weights
        E = bank.num_experts
        self.w1, self.w3, self.w2 = (torch.stack([w.dense(n, e, dtype) for e in range(E)])
                                     for n in ("w1", "w3", "w2"))

    @classmethod
    def of(cls, bank: Any) -> StandardExperts:
        """The BF16 stacks of ``bank``'s experts, once per LatentMoE module: every executor over the same
        model has its own plan and bank, but one set of standard experts."""
        hit = cls._cache.get(bank.module)
        if hit is None:
            hit = cls._cache[bank.module] = cls(bank)
        return hit


@functools.lru_cache(maxsize=8)
def grouped_mm_works(device: str) -> bool:
    """Whether ``torch._grouped_mm`` runs here (sm_90 BF16 on CUDA); probed once per device, outside capture."""
    if not device.startswith("cuda") or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
        b = torch.randn(2, 32, 64, device=device, dtype=torch.bfloat16)
        offs = torch.tensor([2, 5], device=device, dtype=torch.int32)
        got = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
        want = torch.cat([a[:2] @ b[0].t(), a[2:] @ b[1].t()])
        torch.cuda.synchronize(device)
        return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
    except Exception:
        return False


def _grouped(x: torch.Tensor, w: torch.Tensor, expert_of_row: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows of ``x`` (sorted by expert) times their expert's ``w[e]^T``."""
    if grouped_mm_works(str(x.device)):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return torch.bmm(x[:, None, :], w.index_select(0, expert_of_row).transpose(1, 2))[:, 0]  # CPU


def experts_dispatch_standard(z, ids, num_experts, dtype):
    """Glue: the Bk x k (row, expert) pairs sorted by expert -> (order, expert of each sorted pair, grouped-GEMM
    offsets from a device-side count, source row of each pair, the gathered rows in ``dtype``)."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    e_sorted = flat.index_select(0, order)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=z.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    row = order // k
    return order, e_sorted, offs, row, z.index_select(0, row).to(dtype)


def experts_glu_standard(g, u, beta, linear_beta, dtype):
    """Glue: SiTU-GLU (FP32 math) between the w1 / w3 and the w2 grouped GEMMs, rounded to ``dtype``."""
    return situ_glu(g, u, beta, linear_beta).to(dtype)


def experts_combine_standard(y, weights, order, row, norm_w, eps, dtype):
    """Glue: the FP32 weighted sum of each row's expert outputs (``index_add_``), or with ``norm_w`` its latent
    RMSNorm rounded to ``dtype``."""
    wt = weights.reshape(-1).float().index_select(0, order)
    acc = torch.zeros(weights.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    acc.index_add_(0, row, y.float() * wt[:, None])
    if norm_w is None:
        return acc
    return rms_norm(acc, norm_w, eps).to(dtype)


def moe_experts_standard(z, ids, weights, bank, norm_w=None, eps=1e-5, *, glue=None):
    """The routed experts as a grouped GEMM: the Bk x k (row, expert) pairs sorted by expert, offsets from a
    device-side count, w1 / w3 grouped GEMMs, SiTU-GLU (FP32 math), w2 grouped GEMM, weighted FP32 combine
    (``index_add_``), optionally the latent RMSNorm. Same math as ``moe_experts_ref`` (bf16 h and y).
    ``glue``: the table's ``GlueSet`` (None: eager) for everything between the grouped GEMMs."""
    st = StandardExperts.of(bank)
    order, e_sorted, offs, row, xs = _glue(glue, "experts_dispatch", z, ids, bank.num_experts, st.w1.dtype)
    h = _glue(glue, "experts_glu", _grouped(xs, st.w1, e_sorted, offs), _grouped(xs, st.w3, e_sorted, offs),
              bank.beta, bank.linear_beta, st.w2.dtype)
    y = _grouped(h, st.w2, e_sorted, offs)
    return _glue(glue, "experts_combine", y, weights, order, row, norm_w, eps, z.dtype)


def moe_experts_humming(z, ids, weights, bank, norm_w=None, eps=1e-5, *, glue=None):
    """``moe_experts``' op contract through humming-kernels (``standard_mxfp4.py`` says what runs): ``z [Bk, L]`` bf16, ``ids``/``weights``
    ``[Bk, k]`` -> FP32 ``[Bk, L]`` (or with ``norm_w`` the latent RMSNorm, ``z.dtype``)."""
    he = HummingExperts.of(bank)
    bk, k = ids.shape
    rows = bk * k
    b13, b2 = he.block("w13", rows), he.block("w2", rows)
    idx13 = align(ids, he.num_experts, b13)
    idx2 = idx13 if b2 == b13 else align(ids, he.num_experts, b2)
    gu = he.gemm("w13", z, idx13, k, rows)  # [Bk * k, 2I], row t * k + j
    h = _glue(glue, "experts_glu", gu[:, :he.inter], gu[:, he.inter:], bank.beta, bank.linear_beta, torch.bfloat16)
    y = he.gemm("w2", h, idx2, 1, rows)  # [Bk * k, L]
    pairs = torch.arange(rows, device=z.device)
    return _glue(glue, "experts_combine", y, weights, pairs, pairs // k, norm_w, eps, z.dtype)


def standard_op_table(compiled_glue: bool = False, device: torch.device | str | None = None,
                      mxfp4_experts: bool = False) -> dict[str, OpImpl]:
    """The op table of ``backend="standard_graph"`` (see the module docstring); each entry names its library.

    ``compiled_glue``: the glue through ``torch.compile`` on CUDA tensors (``compiled_glue.py``); ``device``:
    the tensors the table will serve (None: the first glue call says). On a CPU, or where torch.compile is
    unusable or raises, the glue runs eagerly and the op's ``standard_reason`` says why (updated when a
    compile fails at warm-up, so the steps' trace records say what served them). ``mxfp4_experts``: the
    routed experts in MXFP4 through humming-kernels (``standard_mxfp4.py``); ``ValueError`` with the reason
    where humming cannot serve ``device``."""
    kda_lib = _kda_library(device)
    experts_lib = ("standard path: torch._grouped_mm over BF16 experts (sorted rows), FP32 combine"
                   if hasattr(torch, "_grouped_mm") else "standard path: gathered bmm over BF16 experts")
    experts_fn = moe_experts_standard
    if mxfp4_experts:
        why = humming_unavailable(str(device if device is not None else "cpu"))
        if why:
            raise ValueError(f"decode option standard_mxfp4_experts: {why}")
        experts_lib, experts_fn = HUMMING_LIB, moe_experts_humming
    libs = {"linear": CUBLAS, "rmsnorm": TORCH, "attn_res": TORCH, "kda_step": kda_lib,
            "mla_attention": "standard path: absorbed MLA as cuBLAS bmm (BF16 latent chunks, FP32 out)",
            "moe_router": "standard path: cuBLAS FP32 logits + torch.sort top-k", "moe_experts": experts_lib}
    if not compiled_glue:
        fns = {"linear": linear_standard, "rmsnorm": rmsnorm_standard, "attn_res": attn_res_standard,
               "kda_step": kda_step_standard, "mla_attention": mla_attention_standard,
               "moe_router": moe_router_standard_lib, "moe_experts": experts_fn}
        return {n: OpImpl(n, fn, standard_reason=libs[n]) for n, fn in fns.items()}
    glue = GlueSet(GLUE_FNS, compiled=True, device=device)
    fns = {"linear": linear_standard_fused, "rmsnorm": functools.partial(glue, "rmsnorm"),
           "attn_res": functools.partial(glue, "attn_res"),
           "kda_step": functools.partial(kda_step_standard, glue=glue), "mla_attention": mla_attention_standard,
           "moe_router": functools.partial(moe_router_standard_lib, glue=glue),
           "moe_experts": functools.partial(experts_fn, glue=glue)}
    table: dict[str, OpImpl] = {}

    def reasons() -> None:  # (re)written in place: the executor's OpCalls read this very dict
        for n, fn in fns.items():
            if n == "linear" and glue.device is None:
                why = f"{CUBLAS}; on CUDA tensors {CUBLAS_FUSED.removeprefix('standard path: ')}"
            elif n == "linear":
                why = CUBLAS_FUSED if glue.device.type == "cuda" else \
                    f"{CUBLAS}; {GLUE_EAGER} ({compile_unavailable(glue.device)})"
            elif n in OP_GLUE:
                why = f"{libs[n]}; {glue.status(OP_GLUE[n])}"
            else:
                why = f"{libs[n]}; {GLUE_EAGER} (not in the compiled glue)"
            table[n] = OpImpl(n, fn, standard_reason=why)

    glue.on_change = reasons
    reasons()
    return table


def glue_summary(ops: dict[str, OpImpl]) -> str:
    """What served a standard op table's glue, from its reasons: ``torch.compile``, ``eager`` or
    ``torch.compile (partly eager)`` (for the sweep's rows)."""
    why = [ops[n].standard_reason or "" for n in OP_GLUE if n in ops]
    compiled = [GLUE_COMPILED in w for w in why]
    eager = [GLUE_EAGER in w or "+ eager (" in w or GLUE_COMPILED not in w for w in why]
    if all(compiled) and not any(eager):
        return "torch.compile"
    return "torch.compile (partly eager)" if any(compiled) else "eager"


@functools.lru_cache(maxsize=8)
def mm_out_dtype_works(device: str) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` (cuBLAS, FP32 output) exists here."""
    try:
        a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except Exception:
        return False


def moe_router_standard_lib(x, gate_w, bias, top_k, renormalize, scale, *, glue=None):
    """The reference router's selection (``fast_ops.route_from_logits``) on cuBLAS FP32-output logits;
    ``glue``: the table's ``GlueSet`` (None: eager) for the selection."""
    if mm_out_dtype_works(str(x.device)) and x.dtype == gate_w.dtype:
        logits = torch.mm(x, gate_w.t(), out_dtype=torch.float32)
    else:
        logits = torch.nn.functional.linear(x.float(), gate_w.float())
    return _glue(glue, "router_select", logits, bias, top_k, renormalize, scale)


# ------------------------------------------------------------------------------------------ glue
CUBLAS_FUSED = ("standard path: cuBLAS addmm / mm (the residual added in the GEMM epilogue, one rounding; FP32 "
                "logits straight from the GEMM)")
# the pure-tensor glue functions compiled_glue=True serves through torch.compile (on CUDA tensors)
GLUE_FNS = {"rmsnorm": rmsnorm_standard, "attn_res": attn_res_standard, "kda_conv": kda_conv_standard,
            "kda_zero_empty": kda_zero_empty_standard, "router_select": route_from_logits,
            "experts_dispatch": experts_dispatch_standard, "experts_glu": experts_glu_standard,
            "experts_combine": experts_combine_standard}
OP_GLUE = {"rmsnorm": ("rmsnorm",), "attn_res": ("attn_res",), "kda_step": ("kda_conv", "kda_zero_empty"),
           "moe_router": ("router_select",), "moe_experts": ("experts_dispatch", "experts_glu", "experts_combine")}


def _glue(glue: GlueSet | None, name: str, *args: Any) -> Any:
    """Glue function ``name`` of ``GLUE_FNS``: eager without a ``GlueSet``, else as the set routes it."""
    return GLUE_FNS[name](*args) if glue is None else glue(name, *args)


__all__ = ["GLUE_FNS", "OP_GLUE", "StandardExperts", "glue_summary", "grouped_mm_works", "kda_step_standard",
           "linear_standard", "linear_standard_fused", "mla_attention_standard", "moe_experts_humming", "moe_experts_standard",
           "moe_router_standard_lib", "standard_op_table"]
