"""Torch-facing absorbed MLA decode (one new token per sequence) over a paged latent cache.

    y = mla_decode(q_lat, q_pe, cache, block_table, ctx_len, w_uv, gate, softmax_scale=192**-0.5,
                   cache_scale=None, max_ctx=None)
        q_lat [B, H, R] bf16     q_nope absorbed through W_UK and rounded (``absorb_q``)
        q_pe  [B, H, P] bf16     the unrotated rope part of the query (NoPE)
        cache [pages, page_size, R + P] bf16 or float8_e4m3fn (then ``cache_scale``: fp32 [1] on device)
        block_table [B, max_pages] int32, ctx_len [B] int32 (positions 0 .. ctx_len[b]-1 are attended)
        w_uv  [H, V, R] bf16     per-head value up-projection (``split_kv_b``), gate [B, H*V] bf16 or None
        -> y [B, H*V] bf16, the input of o_proj: bf16(bf16(W_UV bf16(o_lat)) * sigmoid(gate))

    o_lat, lse = mla_decode_partial(q_lat, q_pe, cache, block_table, ctx_len, softmax_scale=...)
    y = mla_merge(o_parts, lse_parts, w_uv, gate)      # context parallelism: [G, B, H, R] / [G, B, H]

Two launches: the split-KV attention (grid splits x B x head groups; the split count comes from
``config.choose_splits`` for the batch's longest context) and the combine (LSE merge + W_UV + gate).
``max_ctx`` (a host int >= every ctx_len) sizes the split grid; without it the op reads ctx_len.max()
(a device sync: pass it under CUDA-graph capture). The caller guarantees ctx_len[b] <= max_pages *
page_size and that the table's pages of b hold b's positions. A slot-indexed pool [N, L, D] is a paged
cache with page_size L (L % 64 == 0) or any divisor of L that is a multiple of 64: ``slot_block_table``.
Outside the envelope (see ``is_supported``) the call is served by ``reference.py`` and counted as a
fallback with the reason. ``pdl=True`` (or ``config.pdl``) launches both kernels for programmatic
dependent launch (``MLADecodeConfig.pdl``, kernel.py): the same arithmetic, the same bits.
``step_op`` is the fast step's ``mla_attention`` op over a slot pool (``write_latent`` + ``absorb_q`` +
``mla_decode``).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import OK, Support, no
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec, rows_view
from ...reference.common import rms_norm
from ...reference.mla import FP8_MAX
from .config import MAX_SPLITS, TILE, MLADecodeConfig, choose_splits
from .reference import mla_attention_ref, mla_decode_ref, mla_merge_ref

NAME = "mla_decode"
FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634


def _cache_dtype_name(dtype: torch.dtype) -> str:
    return "fp8" if dtype == FP8 else "bf16"


def compile_mla_attention(dtype: str, H: int, R: int, P: int, page_size: int, config: MLADecodeConfig) -> Any:
    if dtype not in ("bf16", "fp8") or config.fp8 != (dtype == "fp8"):
        raise ValueError(f"{NAME}: cache dtype {dtype!r} with config.fp8={config.fp8}")
    key = compile_cache.CompileKey.make(NAME, dtype, (H, R, P, page_size), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import MLAAttentionKernel

        bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        row_bytes = (R + P) * (1 if config.fp8 else 2)
        args = (fake_tensor(bf, (None, H, R)), fake_tensor(bf, (None, H, P)),
                fake_tensor(cutlass.Uint8, (None, page_size, row_bytes)), fake_tensor(i32, (None, None), align=4),
                fake_tensor(i32, (None,), align=4), fake_tensor(f32, (1,), align=4),
                fake_tensor(f32, (None, None, H, R)), fake_tensor(f32, (None, None, H), align=4))
        return cute.compile(MLAAttentionKernel(H, R, P, page_size, config), *args, f32(1.0), i32(TILE),
                            cutlass.Int64(page_size * row_bytes), fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_mla_combine(H: int, R: int, V: int, final: bool, config: MLADecodeConfig) -> Any:
    """The merge for H heads of rank R; ``final``: + W_UV [H, V, R] and the gate (config.gate); launched
    for PDL with config.pdl."""
    knobs = (config.gate and final, config.combine_rows, MAX_SPLITS) + (("pdl",) if config.pdl else ())
    key = compile_cache.CompileKey.make(f"{NAME}_combine", "fp32", (H, R, V, "final" if final else "partial"), knobs)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import MLACombineKernel

        bf, f32 = cutlass.BFloat16, cutlass.Float32
        gate = config.gate and final
        args = (fake_tensor(f32, (None, None, H, R)), fake_tensor(f32, (None, None, H), align=4),
                fake_tensor(bf, (H, V, R)) if final else None,
                fake_tensor(bf, (None, H * V)) if gate else None,
                fake_tensor(bf, (None, H * V)) if final else None,
                None if final else fake_tensor(f32, (None, H, R)),
                None if final else fake_tensor(f32, (None, H), align=4))
        kern = MLACombineKernel(H, R, V, final, gate, config.combine_rows, MAX_SPLITS, config.pdl)
        return cute.compile(kern, *args, fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_mla_decode(dtype: str, H: int, R: int, P: int, V: int, page_size: int, config: MLADecodeConfig) -> Any:
    """Compile (or fetch) both kernels of one decode configuration (B, pages, splits stay symbolic);
    returns the attention kernel's function (the combine lands in the same cache)."""
    fn = compile_mla_attention(dtype, H, R, P, page_size, config)
    compile_mla_combine(H, R, V, True, config)
    return fn


PAGE_SIZE = 64  # the page size the serving cache uses (FlashMLA's); other multiples of 64 compile on demand


def compile_variants(preset_name: str) -> list[dict[str, Any]]:
    """MLA heads per GPU of ``preset_name`` x cache dtype (BF16 and FP8), page size 64, the preset's gate."""
    from ...presets import preset

    p = preset(preset_name)
    cfg = p.config
    H = p.shapes.mla_heads
    R, P, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = []
    for dtype in ("bf16", "fp8"):
        c = MLADecodeConfig.from_heuristic(H, R + P, dtype == "fp8", cfg.mla_use_output_gate)
        out.append({"dtype": dtype, "H": H, "R": R, "P": P, "V": V, "page_size": PAGE_SIZE, "config": c})
    return out


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_mla_decode(**v)
    return len(variants)


# ------------------------------------------------------------------------------------------ helpers
def split_kv_b(kv_b_weight: torch.Tensor, heads: int, nope: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [heads*(nope+v), R]`` -> contiguous (W_UK [heads, nope, R], W_UV [heads, v, R])."""
    w = kv_b_weight.view(heads, nope + v_dim, -1)
    return w[:, :nope].contiguous(), w[:, nope:].contiguous()


def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat [B, H, R] = q_nope [B, H, nope] W_UK [H, nope, R], accumulated in FP32 (FP64 for FP64 input)
    and rounded to q_nope's dtype, as the reference's absorbed path computes it."""
    cdt = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
    return torch.einsum("bhd,hdr->bhr", q_nope.to(cdt), w_uk.to(cdt)).to(q_nope.dtype)


def slot_block_table(slot: torch.Tensor, max_len: int, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """Block table of a slot-indexed pool [N, max_len, D] viewed as [N * max_len / page_size, page_size, D]."""
    if max_len % page_size:
        raise ValueError(f"max_len {max_len} is not a multiple of page_size {page_size}")
    per = max_len // page_size
    return (slot.long()[:, None] * per + torch.arange(per, device=slot.device)[None, :]).to(torch.int32)


_ones: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    if device not in _ones:
        _ones[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _ones[device]


@lru_cache(maxsize=4096)
def _splits(B: int, groups: int, max_ctx: int) -> tuple[int, int]:
    return choose_splits(B, groups, max_ctx)


# ------------------------------------------------------------------------------------------ support
_COMBINE_R = "R % 16 == 0 and R >= 16 and 128 % (R // 4) == 0"  # R/4 FP32 vectors per combine row divide 128
_ATTENTION_ARGS = (
    Arg("q_lat", ("B", "H", "R")), Arg("q_pe", ("B", "H", "P")),
    Arg("cache", ("pages", "page_size", "R+P"), (torch.bfloat16, FP8), strided_rows=True),
    Arg("block_table", ("B", "max_pages"), torch.int32, align=4), Arg("ctx_len", ("B",), torch.int32, align=4),
    Arg("cache_scale", None, torch.float32, optional=True, align=4))
_ATTENTION_RULES = (
    Rule("0 < B <= 65535", "B={B} outside 1..65535"),
    Rule("MAX_SPLITS * B * H * R < 2147483648", "B={B} x H={H}: the split workspace would pass 2^31 elements"),
    Rule("page_size % TILE == 0", "page_size {page_size} not a multiple of {TILE}"),
    Rule(f"(R + P) % 16 == 0 and {_COMBINE_R}", "R={R}, P={P}: needs (R + P) % 16 == 0 and R/4 dividing 128"))
_UP_ARGS = (Arg("w_uv", ("H", "V", "R")), Arg("gate", ("B", "H*V"), optional=True),
            Arg("out", ("B", "H*V"), optional=True))
_UP_RULES = (Rule("1 <= V <= 128", "V={V} outside 1..128"),)
_CONSTANTS = {"MAX_SPLITS": MAX_SPLITS, "TILE": TILE}


def _attention_fits(tensors: dict[str, Any], scalars: dict[str, Any], dims: dict[str, int]) -> Support:
    """What no expression states: an FP8 cache's one scale, and a config for the head count and width."""
    fp8 = tensors["cache"].dtype == FP8
    scale = tensors.get("cache_scale")
    if fp8 and (scale is None or scale.numel() != 1):
        return no("fp8 cache needs cache_scale (one fp32 value)")
    try:
        MLADecodeConfig.from_heuristic(dims["H"], dims["R"] + dims["P"], fp8)
    except ValueError as e:
        return no(str(e))
    return OK


DECODE_OP = KernelOp(NAME, TensorSpec(*_ATTENTION_ARGS, *_UP_ARGS, rules=(*_ATTENTION_RULES, *_UP_RULES),
                                      constants=_CONSTANTS, dtype=torch.bfloat16), extra=_attention_fits)
PARTIAL_OP = KernelOp(NAME, TensorSpec(*_ATTENTION_ARGS, rules=_ATTENTION_RULES, constants=_CONSTANTS,
                                       dtype=torch.bfloat16), extra=_attention_fits)
MERGE_OP = KernelOp(f"{NAME}_merge", TensorSpec(
    Arg("o_parts", ("G", "B", "H", "R"), torch.float32), Arg("lse_parts", ("G", "B", "H"), torch.float32, align=4),
    *_UP_ARGS, rules=(Rule("1 <= G <= MAX_SPLITS", "G={G} outside 1..{MAX_SPLITS}"),
                      Rule("1 <= B <= 65535", "B={B} outside 1..65535"),
                      Rule(_COMBINE_R, "R={R}: R/4 must divide 128"), *_UP_RULES),
    constants=_CONSTANTS, dtype=torch.bfloat16))


def _attention_operands(q_lat, q_pe, cache, block_table, ctx_len, cache_scale) -> dict[str, Any]:
    return {"q_lat": q_lat, "q_pe": q_pe, "cache": cache, "block_table": block_table, "ctx_len": ctx_len,
            "cache_scale": cache_scale}


def is_supported(q_lat, q_pe, cache, block_table, ctx_len, w_uv, gate=None, cache_scale=None, out=None) -> Support:
    return DECODE_OP.support({**_attention_operands(q_lat, q_pe, cache, block_table, ctx_len, cache_scale),
                              "w_uv": w_uv, "gate": gate, "out": out})


# ------------------------------------------------------------------------------------------ launches
def _attention(q_lat, q_pe, cache, block_table, ctx_len, cache_scale, softmax_scale, max_ctx, config,
               num_splits=None, pdl=False):
    """Launch the split-KV kernel; returns (o_part [S, B, H, R], lse [S, B, H], config)."""
    from ..._lib.tensor import current_stream, to_cute

    B, H, R = q_lat.shape
    P = q_pe.shape[2]
    fp8 = cache.dtype == FP8
    cfg = config or MLADecodeConfig.from_heuristic(H, R + P, fp8)
    if pdl and not cfg.pdl:
        cfg = dataclasses.replace(cfg, pdl=True)
    if cfg.fp8 != fp8:
        raise ValueError(f"config {cfg} does not fit a {'fp8' if fp8 else 'bf16'} cache")
    if max_ctx is None:
        max_ctx = int(ctx_len.max())  # device sync: callers that capture graphs pass max_ctx
    groups = -(-H // cfg.heads_per_cta)
    splits, per = _splits(B, groups, max(1, int(max_ctx)))
    if num_splits is not None:  # a bench / test override of the heuristic
        tiles = -(-max(1, int(max_ctx)) // TILE)
        per = -(-tiles // max(1, min(int(num_splits), MAX_SPLITS, tiles)))
        splits = -(-tiles // per)
    fn = compile_mla_attention(_cache_dtype_name(cache.dtype), H, R, P, cache.shape[1], cfg)
    o_part = torch.empty((splits, B, H, R), dtype=torch.float32, device=q_lat.device)
    lse = torch.empty((splits, B, H), dtype=torch.float32, device=q_lat.device)
    scale_t = cache_scale.reshape(1) if cache_scale is not None else _unit_scale(q_lat.device)
    pages = rows_view(cache)  # vLLM's pages may lie further apart than one page: the stride is a parameter
    fn(to_cute(q_lat), to_cute(q_pe), to_cute(pages.view(torch.uint8)), to_cute(block_table, align=4, dynamic_dims=(0, 1)),
       to_cute(ctx_len, align=4), to_cute(scale_t, align=4, dynamic_dims=()),
       to_cute(o_part, dynamic_dims=(0, 1)), to_cute(lse, align=4, dynamic_dims=(0, 1)),
       float(softmax_scale * LOG2E), per * TILE, cache.stride(0) * cache.element_size(), current_stream(q_lat.device))
    return o_part, lse, cfg


def _combine_final(o_part, lse, w_uv, gate, out, cfg):
    from ..._lib.tensor import current_stream, to_cute

    S, B, H, R = o_part.shape
    V = w_uv.shape[1]
    c = MLADecodeConfig(cfg.heads_per_cta, cfg.stages, cfg.fp8, gate is not None, cfg.combine_rows, cfg.pdl)
    fn = compile_mla_combine(H, R, V, True, c)
    if out is None:
        out = torch.empty((B, H * V), dtype=torch.bfloat16, device=o_part.device)
    fn(to_cute(o_part, dynamic_dims=(0, 1)), to_cute(lse, align=4, dynamic_dims=(0, 1)),
       to_cute(w_uv, dynamic_dims=()), to_cute(gate) if gate is not None else None, to_cute(out), None, None,
       current_stream(o_part.device))
    return out


def _combine_partial(o_part, lse, cfg):
    from ..._lib.tensor import current_stream, to_cute

    S, B, H, R = o_part.shape
    fn = compile_mla_combine(H, R, 1, False, cfg)
    o_lat = torch.empty((B, H, R), dtype=torch.float32, device=o_part.device)
    lse_out = torch.empty((B, H), dtype=torch.float32, device=o_part.device)
    fn(to_cute(o_part, dynamic_dims=(0, 1)), to_cute(lse, align=4, dynamic_dims=(0, 1)), None, None, None,
       to_cute(o_lat), to_cute(lse_out, align=4), current_stream(o_part.device))
    return o_lat, lse_out


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               ctx_len: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor | None = None, *,
               softmax_scale: float, cache_scale: torch.Tensor | None = None, max_ctx: int | None = None,
               out: torch.Tensor | None = None, config: MLADecodeConfig | None = None,
               num_splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """One decode step of the absorbed attention for B sequences -> y [B, H*V] bf16 (see module doc).
    ``config`` / ``num_splits`` override the heuristics (benches, tests); ``pdl``: both launches for
    programmatic dependent launch."""
    def launch() -> torch.Tensor:
        o_part, lse, cfg = _attention(q_lat, q_pe, cache, block_table, ctx_len, cache_scale, softmax_scale, max_ctx,
                                      config, num_splits, pdl)
        return _combine_final(o_part, lse, w_uv, gate, out, cfg)

    return DECODE_OP({**_attention_operands(q_lat, q_pe, cache, block_table, ctx_len, cache_scale),
                      "w_uv": w_uv, "gate": gate, "out": out}, launch=launch,
                     reference=lambda: mla_decode_ref(q_lat, q_pe, cache, block_table, ctx_len, w_uv, gate,
                                                      softmax_scale=softmax_scale, cache_scale=cache_scale, out=out))


def mla_decode_partial(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                       ctx_len: torch.Tensor, *, softmax_scale: float, cache_scale: torch.Tensor | None = None,
                       max_ctx: int | None = None, config: MLADecodeConfig | None = None, pdl: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of context-parallel decode: (o_lat [B, H, R] fp32 normalised, lse [B, H] fp32);
    a sequence with no position here gets o_lat = 0, lse = -inf. Merge the ranks with ``mla_merge``."""
    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        o_part, lse, cfg = _attention(q_lat, q_pe, cache, block_table, ctx_len, cache_scale, softmax_scale, max_ctx,
                                      config, pdl=pdl)
        return _combine_partial(o_part, lse, cfg)

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = mla_attention_ref(q_lat, q_pe, cache, block_table, ctx_len, softmax_scale=softmax_scale,
                                   cache_scale=cache_scale)
        return o.float(), lse.float()

    return PARTIAL_OP(_attention_operands(q_lat, q_pe, cache, block_table, ctx_len, cache_scale), launch=launch,
                      reference=reference)


def mla_merge(o_parts: torch.Tensor, lse_parts: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor | None = None,
              *, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Merge G context-parallel partials (``o_parts [G, B, H, R]`` fp32, ``lse_parts [G, B, H]`` fp32) by
    their LSE, then W_UV and the gate -> y [B, H*V] bf16. Counted as a launch of ``mla_decode_merge``."""
    return MERGE_OP({"o_parts": o_parts, "lse_parts": lse_parts, "w_uv": w_uv, "gate": gate, "out": out},
                    launch=lambda: _combine_final(o_parts, lse_parts, w_uv, gate, out,
                                                  MLADecodeConfig(8, 2, False, gate is not None, pdl=pdl)),
                    reference=lambda: mla_merge_ref(o_parts, lse_parts, w_uv, gate), outputs=(out,))


def write_latent(kv: torch.Tensor, kv_norm_w: torch.Tensor, eps: float, latent: torch.Tensor, scale: Any,
                 slot: torch.Tensor, pos: torch.Tensor) -> None:
    """Glue before ``mla_decode``: ``concat(RMSNorm(c_kv), k_pe)`` (FP8-encoded with ``scale`` for an FP8
    pool, saturating like ``reference.mla.MLACache.encode``) into ``latent[slot[b], pos[b]]``. Padded rows
    write slot 0."""
    rank = kv_norm_w.shape[0]
    new = torch.cat([rms_norm(kv[:, :rank], kv_norm_w, eps), kv[:, rank:]], dim=-1)
    enc = (new.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8) if latent.dtype == FP8 else new.to(latent.dtype)
    latent[slot.long(), pos] = enc


def step_op(q, kv, kv_norm_w, eps, latent, scale, slot, pos, block_table, ctx_len, w_uk, w_uv, softmax_scale,
            gate=None, *, pdl: bool = False, paged: bool = False) -> torch.Tensor:
    """The fast step's ``mla_attention`` op (``runtime.fast_ops``): absorbed gated-MLA decode over the slot
    pool (``reference.mla`` semantics). Writes the new latent at ``(slot, pos)`` (``write_latent``), absorbs
    ``q_nope`` through W_UK (``absorb_q``: FP32 accumulate, rounded), then one ``mla_decode`` over the pool
    viewed as pages of ``block_table``'s page size: positions ``0 .. ctx_len - 1 = pos`` of each row's slot,
    W_UV and the output gate fused into the combine. ``max_ctx`` is the pool length (static: one graph per
    bucket). ``paged``: ``latent`` is a paged cache ``[pages, page_size, D]`` (vLLM's, in place), ``(slot,
    pos)`` the (page, offset) of each row's new latent, ``block_table`` / ``ctx_len`` the engine's; ``max_ctx``
    is then the table's width in positions."""
    write_latent(kv, kv_norm_w, eps, latent, scale, slot, pos)
    nope = w_uk.shape[1]
    q_lat = absorb_q(q[..., :nope], w_uk).contiguous()
    q_pe = q[..., nope:].contiguous()
    if paged:  # the latent is vLLM's paged cache itself, the block table vLLM's
        pages, max_ctx = latent, block_table.shape[1] * latent.shape[1]
    else:
        n, length, width = latent.shape
        page = length // (block_table.shape[1])
        pages, max_ctx = latent.view(n * length // page, page, width), length
    return mla_decode(q_lat, q_pe, pages, block_table, ctx_len, w_uv, gate, softmax_scale=softmax_scale,
                      cache_scale=scale if latent.dtype == FP8 else None, max_ctx=max_ctx, pdl=pdl)
