"""Torch-facing AttnRes mixing: compile cache, precompile, support gate, fallback.

    mix, normed = attn_res_mix(sources, norm_w, proj_w, eps, out_w=input_norm_w, out_eps=eps)
    mix, _      = attn_res_mix(sources, norm_w, proj_w, eps)         # no trailing RMSNorm

``sources`` is one contiguous [S, M, H] bf16 tensor (S <= 9: block snapshots + running prefix). ``pdl=True``
launches the PDL build (``AttnResConfig.pdl``: weights before griddepcontrol.wait, see kernel.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import Support
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec
from .config import MAX_SOURCES, VEC, AttnResConfig
from .reference import attn_res_mix_ref

NAME = "attn_res_mix"


def compile_attn_res_mix(dtype: str, S: int, H: int, config: AttnResConfig) -> Any:
    """Compile (or fetch) the mixer for S sources of width H; M stays symbolic."""
    if dtype != "bf16":
        raise ValueError(f"{NAME}: only bf16 is implemented, got {dtype}")
    key = compile_cache.CompileKey.make(NAME, dtype, (S, H), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import AttnResMixKernel

        bf = cutlass.BFloat16
        norm = config.has_norm
        args = (fake_tensor(bf, (S, None, H)), fake_tensor(bf, (H,)), fake_tensor(bf, (H,)),
                fake_tensor(bf, (None, H)), fake_tensor(bf, (H,)) if norm else None,
                fake_tensor(bf, (None, H)) if norm else None)
        return cute.compile(AttnResMixKernel(S, H, config), *args, cutlass.Float32(1e-5),
                            cutlass.Float32(1e-5), fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_variants(preset_name: str) -> list[dict[str, Any]]:
    """Every source count a decode step of ``preset_name`` mixes (1 .. blocks + 1, capped at 9), with
    the trailing norm (before attention / MLP / the final norm) and without it."""
    from ...presets import preset

    cfg = preset(preset_name).config
    H = cfg.hidden_size
    if H % VEC:
        return []
    s_max = min(MAX_SOURCES, cfg.num_attn_res_blocks + 1)
    return [{"dtype": "bf16", "S": S, "H": H, "config": AttnResConfig.from_heuristic(S, H, has_norm=norm)}
            for S in range(1, s_max + 1) for norm in (True, False)]


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_attn_res_mix(**v)
    return len(variants)


SUPPORT = TensorSpec(
    Arg("sources", ("S", "M", "H")), Arg("norm_w", ("H",)), Arg("proj_w", ("H",)),
    Arg("out_w", ("H",), optional=True), Arg("mix_out", ("M", "H"), optional=True),
    Arg("normed_out", ("M", "H"), optional=True),
    rules=(Rule("1 <= S <= MAX_SOURCES", "S={S} outside 1..{MAX_SOURCES}"), Rule("M > 0", "M=0"),
           Rule("H % VEC == 0", "H={H} not a multiple of {VEC}")),
    constants={"VEC": VEC, "MAX_SOURCES": MAX_SOURCES}, dtype=torch.bfloat16, requires=(("normed_out", "out_w"),))
OP = KernelOp(NAME, SUPPORT)


def is_supported(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor,
                 out_w: torch.Tensor | None = None, mix_out: torch.Tensor | None = None,
                 normed_out: torch.Tensor | None = None) -> Support:
    return OP.support({"sources": sources, "norm_w": norm_w, "proj_w": proj_w, "out_w": out_w, "mix_out": mix_out,
                       "normed_out": normed_out})


def attn_res_mix(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float, *,
                 out_w: torch.Tensor | None = None, out_eps: float | None = None,
                 mix_out: torch.Tensor | None = None, normed_out: torch.Tensor | None = None,
                 config: AttnResConfig | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mix, normed): softmax-weighted mix of the S sources, and RMSNorm(mix) * out_w when out_w is given.
    ``config`` overrides the heuristic (benches); its has_norm must match. ``pdl``: launch the
    programmatic-dependent-launch build (same bits)."""
    return OP({"sources": sources, "norm_w": norm_w, "proj_w": proj_w, "out_w": out_w, "mix_out": mix_out,
               "normed_out": normed_out},
              launch=lambda: _launch(sources, norm_w, proj_w, eps, out_w, out_eps, mix_out, normed_out, config, pdl),
              reference=lambda: attn_res_mix_ref(sources, norm_w, proj_w, eps, out_w, out_eps),
              outputs=(mix_out, normed_out))


def _launch(sources, norm_w, proj_w, eps, out_w, out_eps, mix_out, normed_out, config, pdl):
    from ..._lib.tensor import current_stream, to_cute

    S, M, H = sources.shape
    has_norm = out_w is not None
    cfg = config or AttnResConfig.from_heuristic(S, H, has_norm=has_norm)
    if pdl and not cfg.pdl:
        cfg = dataclasses.replace(cfg, pdl=True)
    if cfg.has_norm != has_norm:
        raise ValueError(f"config.has_norm={cfg.has_norm} but out_w is {'given' if has_norm else 'None'}")
    fn = compile_attn_res_mix("bf16", S, H, cfg)
    if mix_out is None:
        mix_out = torch.empty((M, H), dtype=sources.dtype, device=sources.device)
    if has_norm and normed_out is None:
        normed_out = torch.empty((M, H), dtype=sources.dtype, device=sources.device)
    fn(to_cute(sources, dynamic_dims=(1,)), to_cute(norm_w, dynamic_dims=()), to_cute(proj_w, dynamic_dims=()),
       to_cute(mix_out), to_cute(out_w, dynamic_dims=()) if has_norm else None,
       to_cute(normed_out) if has_norm else None, float(eps), float(eps if out_eps is None else out_eps),
       current_stream(sources.device))
    return mix_out, (normed_out if has_norm else None)


def step_op(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
            out_w: torch.Tensor | None, *, pdl: bool = False) -> torch.Tensor:
    """The fast step's ``attn_res`` op (``runtime.fast_ops``): RMSNorm(mix of ``sources``) * ``out_w``, or
    with ``out_w`` None the mix itself (a step that reads out hidden states)."""
    mix, normed = attn_res_mix(sources, norm_w, proj_w, eps, out_w=out_w, out_eps=eps, pdl=pdl)
    return mix if out_w is None else normed
