"""Torch-facing KDA decode step: conv4 + SiLU, L2 norm, gates, delta-rule state update, gated RMSNorm, for a
batch of sequences whose caches live in slot-indexed pools. One launch per layer.

    y = kda_decode(q, k, v, g, a, beta_logits,                 # [B*T, C] x5, [B*T, H]: bf16 projection outputs
                   conv_q_w, conv_k_w, conv_v_w,               # [C, 4] (or [C, 1, 4]) fp32
                   A_log, dt_bias, o_norm_w,                   # [>= H] (first H used), [C], [D] fp32
                   slot,                                       # [B] int32 pool index per sequence; 0 = empty
                   conv_q, conv_k, conv_v,                     # [N, 3, C] bf16 pools
                   state,                                      # [N, H, D, D] fp32 pool
                   eps=1e-5, lower_bound=-5.0,                 # -> y [B*T, C] bf16 (input of o_proj)
                   slot_out=None, tokens=1)                    # [B*T] int32: where each token's state goes

``tokens = 1`` (``slot_out`` None) is the decode step: each sequence's caches are updated in place. A
speculative verify step passes ``tokens = T`` (1 + drafts) and ``slot_out``: rows ``b*T .. b*T + T-1`` are
sequence b's tokens in order, its caches are read at ``slot[b]`` and never written there; the conv
window and recurrent state after its token t are written at ``slot_out[b*T + t]`` (0: not kept, e.g. a
padded token of a sequence with fewer drafts), so committing ``a`` accepted tokens is taking the state at
``slot_out[b*T + a - 1]``. One launch either way; T decode steps' arithmetic (to FP32 rounding of the state).

Layout choice: q, k, v, g, a are separate contiguous [B, C] tensors (C = H*D), ``a`` being the f_b
projection output (the decay pre-activation) and ``g`` the output-gate pre-activation. The conv pools use
KDACache's [., W-1, C] layout (oldest input first), so a ``KDACache`` of N sequences *is* a pool.

vLLM's layout: ``kda_decode_vllm(..., slot, conv, state)`` is the decode step on vLLM's own KDA cache tensors in
place (``KimiK3DeltaAttention.kv_cache``: ``conv [N, W-1, 3C]``, the packed q|k|v window, and ``state
[N, H, V, K]``), ``slot`` being vLLM's state indices (-1 pads); same semantics, the kernel's
``config.vllm_layout`` build, counted as a ``kda_decode`` launch.

Empty slot: a sequence with ``slot[b] <= 0`` leaves every cache untouched and gets y = 0 on its rows. Non-zero
slots (and ``slot_out`` entries) in one call must be distinct across sequences (two sequences sharing one race). ``pdl=True`` launches the PDL build
(``KDADecodeConfig.pdl``: parameters before griddepcontrol.wait, caches after it; see kernel.py). Outside
the envelope (see ``is_supported``) the call is served by ``reference.py`` (same semantics) and counted
as a fallback.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import Support
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec
from .config import CONV_W, HEAD_DIMS, MAX_TOKENS, KDADecodeConfig
from .reference import kda_decode_ref, kda_decode_vllm_ref

NAME = "kda_decode"


def compile_kda_decode(dtype: str, H: int, D: int, config: KDADecodeConfig) -> Any:
    """Compile (or fetch) the step for H heads of dim D and ``config.tokens`` tokens per sequence; the batch B
    and the pool size N stay symbolic."""
    if dtype != "bf16":
        raise ValueError(f"{NAME}: only bf16 activations / conv state are implemented, got {dtype}")
    key = compile_cache.CompileKey.make(NAME, dtype, (H, D), config)
    conv_c = 3 * H * D if config.vllm_layout else H * D  # channels of a conv operand (vLLM's: packed q|k|v)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import KDADecodeKernel

        bf, f32 = cutlass.BFloat16, cutlass.Float32
        C = H * D
        act = [fake_tensor(bf, (None, C)) for _ in range(5)]  # q, k, v, g, a
        args = (*act, fake_tensor(bf, (None, H)),
                *(fake_tensor(f32, (C, CONV_W)) for _ in range(3)),
                fake_tensor(f32, (H,)), fake_tensor(f32, (C,)), fake_tensor(f32, (D,)),
                fake_tensor(cutlass.Int32, (None,), align=4), fake_tensor(cutlass.Int32, (None,), align=4),
                *(fake_tensor(bf, (None, CONV_W - 1, conv_c), align=2) for _ in range(3)),
                fake_tensor(f32, (None, H, D, D)), fake_tensor(bf, (None, C)))
        return cute.compile(KDADecodeKernel(H, D, config), *args, cutlass.Float32(1e-5), cutlass.Float32(-5.0),
                            cutlass.Int64(3 * conv_c), cutlass.Int64(H * D * D), fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_variants(preset_name: str) -> list[dict[str, Any]]:
    """The (H, D) of one rank of ``preset_name``: KDA heads per GPU (rank_shapes) and the head dim."""
    from ...presets import preset

    p = preset(preset_name)
    D = p.config.linear_attn_config.head_dim
    H = p.shapes.kda_heads
    if D not in HEAD_DIMS:
        return []
    return [{"dtype": "bf16", "H": H, "D": D, "config": KDADecodeConfig.from_heuristic(D)}]


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_kda_decode(**v)
    return len(variants)


def _conv_w(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], w.shape[-1]) if w.dim() == 3 and w.shape[1] == 1 else w


_bf, _f32 = torch.bfloat16, torch.float32
SUPPORT = TensorSpec(
    Arg("state", ("N", "H", "D", "D"), _f32, strided_rows=True), Arg("slot", ("B",), torch.int32, align=4),
    *(Arg(n, ("B*T", "H*D")) for n in ("q", "k", "v", "g", "a")), Arg("beta_logits", ("B*T", "H")),
    *(Arg(n, ("H*D", "CONV_W"), _f32) for n in ("conv_q_w", "conv_k_w", "conv_v_w")),
    Arg("A_log", ("NA",), _f32, align=4), Arg("dt_bias", ("H*D",), _f32), Arg("o_norm_w", ("D",), _f32),
    Arg("slot_out", ("B*T",), torch.int32, align=4),
    *(Arg(n, ("N", "CONV_W-1", "H*D"), align=2, strided_rows=True) for n in ("conv_q", "conv_k", "conv_v")),
    Arg("out", ("B*T", "H*D"), optional=True),
    rules=(Rule("D in HEAD_DIMS", "head dim {D} not in {HEAD_DIMS}"), Rule("B > 0", "B=0"),
           Rule("B <= 65535", "B={B} > 65535 (grid limit)"), Rule("NA >= H", "A_log needs >= H entries"),
           Rule("1 <= T <= MAX_TOKENS", "{T} tokens per sequence outside 1..{MAX_TOKENS}")),
    constants={"CONV_W": CONV_W, "HEAD_DIMS": tuple(HEAD_DIMS), "MAX_TOKENS": MAX_TOKENS, "T": 1},  # T: a call's
    dtype=_bf)  # scalar (tokens per sequence) overrides the decode step's 1
OP = KernelOp(NAME, SUPPORT)
VLLM_SUPPORT = TensorSpec(  # vLLM's layout: one packed conv pool, the state [N, H, V, K] (same shape), decode only
    *(a for a in SUPPORT.args if a.name not in ("conv_q", "conv_k", "conv_v", "slot_out")),
    Arg("conv", ("N", "CONV_W-1", "3*H*D"), align=2, strided_rows=True), rules=SUPPORT.rules, constants=SUPPORT.constants, dtype=_bf)
VLLM_OP = KernelOp(NAME, VLLM_SUPPORT)


def _operands(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
              conv_q, conv_k, conv_v, state, out, slot_out) -> dict[str, Any]:
    """The operands as the spec names them (conv weights as [C, W], dt_bias flat: how the kernel reads them;
    ``slot_out`` None: the decode step's in-place update, ``slot`` itself)."""
    return {"state": state, "q": q, "k": k, "v": v, "g": g, "a": a, "beta_logits": beta_logits,
            "conv_q_w": _conv_w(conv_q_w), "conv_k_w": _conv_w(conv_k_w), "conv_v_w": _conv_w(conv_v_w),
            "A_log": A_log, "dt_bias": dt_bias.reshape(-1), "o_norm_w": o_norm_w, "slot": slot,
            "slot_out": slot if slot_out is None else slot_out,
            "conv_q": conv_q, "conv_k": conv_k, "conv_v": conv_v, "out": out}


def _check_tokens(slot_out: torch.Tensor | None, tokens: int) -> None:
    if slot_out is None and tokens != 1:
        raise ValueError(f"{NAME}: {tokens} tokens per sequence need slot_out (where each token's state goes)")


def is_supported(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                 conv_q, conv_k, conv_v, state, out=None, slot_out=None, tokens: int = 1) -> Support:
    _check_tokens(slot_out, tokens)
    return OP.support(_operands(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w,
                                slot, conv_q, conv_k, conv_v, state, out, slot_out), {"T": int(tokens)})


def kda_decode(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
               conv_q, conv_k, conv_v, state, *, eps: float = 1e-5, lower_bound: float = -5.0,
               out: torch.Tensor | None = None, config: KDADecodeConfig | None = None,
               pdl: bool = False, slot_out: torch.Tensor | None = None, tokens: int = 1) -> torch.Tensor:
    """One decode (``tokens`` 1) or verify step of a KDA layer for B sequences; returns y [B*T, C] bf16
    (module docstring). ``config`` overrides the heuristic (benches); ``pdl``: the PDL build."""
    _check_tokens(slot_out, tokens)
    args = (q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
            conv_q, conv_k, conv_v, state)
    return OP(_operands(*args, out, slot_out), scalars={"T": int(tokens)},
              launch=lambda: _launch(*args, eps, lower_bound, out, config, pdl, slot_out, tokens),
              reference=lambda: kda_decode_ref(*args, eps=eps, lower_bound=lower_bound, slot_out=slot_out,
                                               tokens=tokens),
              outputs=(out,))


def kda_decode_vllm(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                    conv, state, *, eps: float = 1e-5, lower_bound: float = -5.0, out: torch.Tensor | None = None,
                    config: KDADecodeConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """One decode step of a KDA layer on vLLM's cache tensors in place (module docstring); y [B, C] bf16."""
    ops = _operands(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
                    None, None, None, state, out, None)
    for n in ("conv_q", "conv_k", "conv_v", "slot_out"):
        ops.pop(n)
    ops["conv"] = conv
    args = (q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot)
    cfg = dataclasses.replace(config or KDADecodeConfig.from_heuristic(state.shape[-1]), vllm_layout=True)
    return VLLM_OP(ops, launch=lambda: _launch(*args, conv, conv, conv, state, eps, lower_bound, out, cfg, pdl,
                                               None, 1),
                   reference=lambda: kda_decode_vllm_ref(*args, conv, state, eps=eps, lower_bound=lower_bound),
                   outputs=(out,))


def _launch(q, k, v, g, a, beta_logits, conv_q_w, conv_k_w, conv_v_w, A_log, dt_bias, o_norm_w, slot,
            conv_q, conv_k, conv_v, state, eps, lower_bound, out, config, pdl, slot_out, tokens):
    from ..._lib.kernel_op import rows_view
    from ..._lib.tensor import current_stream, to_cute

    _, H, D, _ = state.shape
    cfg = config or KDADecodeConfig.from_heuristic(D, tokens=tokens)
    if pdl and not cfg.pdl:
        cfg = dataclasses.replace(cfg, pdl=True)
    if cfg.tokens != tokens:
        raise ValueError(f"{NAME}: config for {cfg.tokens} tokens per sequence, call with {tokens}")
    fn = compile_kda_decode("bf16", H, D, cfg)
    if out is None:
        out = torch.empty_like(q)
    static = ()
    fn(to_cute(q), to_cute(k), to_cute(v), to_cute(g), to_cute(a), to_cute(beta_logits),
       to_cute(_conv_w(conv_q_w), dynamic_dims=static), to_cute(_conv_w(conv_k_w), dynamic_dims=static),
       to_cute(_conv_w(conv_v_w), dynamic_dims=static), to_cute(A_log[:H], align=4, dynamic_dims=static),
       to_cute(dt_bias.reshape(-1), dynamic_dims=static), to_cute(o_norm_w, dynamic_dims=static),
       to_cute(slot, align=4), to_cute(slot if slot_out is None else slot_out, align=4),
       *(to_cute(rows_view(c, 2), align=2) for c in (conv_q, conv_k, conv_v)), to_cute(rows_view(state)), to_cute(out),
       float(eps), float(lower_bound), conv_q.stride(0), state.stride(0), current_stream(q.device))
    return out


def step_op(*args: Any, pdl: bool = False, vllm_layout: bool = False, **kwargs: Any) -> torch.Tensor:
    """The fast step's ``kda_step`` op (``runtime.fast_ops``): ``kda_decode`` itself (a verify step passes
    ``slot_out`` and ``tokens``); ``vllm_layout``: ``kda_decode_vllm`` on vLLM's caches in place, its packed
    conv window in the ``conv_q`` position (``conv_k`` / ``conv_v`` None)."""
    if vllm_layout:
        *head, conv, _, _, state = args
        return kda_decode_vllm(*head, conv, state, pdl=pdl, **kwargs)
    return kda_decode(*args, pdl=pdl, **kwargs)
