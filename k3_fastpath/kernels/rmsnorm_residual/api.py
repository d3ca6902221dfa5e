"""Torch-facing fused residual add + RMSNorm: compile cache, precompile, support gate, fallback.

    normed, new_residual = rmsnorm_residual(x, residual, weight, eps)      # x, residual: [M, H] bf16
    normed, _ = rmsnorm_residual(x, None, weight, eps)                      # plain RMSNorm

``out=`` / ``residual_out=`` may alias ``x`` / ``residual`` (in place is safe, see kernel.py). ``pdl=True``
launches the PDL build (``RMSNormConfig.pdl``: weight loads before griddepcontrol.wait, see kernel.py).
Outside the envelope (not bf16, not on an sm_90 device, H % 8, non-contiguous, ...) the call is served
by ``reference.py`` and counted as a fallback with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import Support
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec
from .config import VEC, RMSNormConfig
from .reference import rmsnorm_residual_ref

NAME = "rmsnorm_residual"


def compile_rmsnorm_residual(dtype: str, H: int, config: RMSNormConfig) -> Any:
    """Compile (or fetch) the kernel for hidden size ``H``; M stays symbolic (one binary for every M)."""
    if dtype != "bf16":
        raise ValueError(f"{NAME}: only bf16 is implemented, got {dtype}")
    key = compile_cache.CompileKey.make(NAME, dtype, (H,), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import RMSNormResidualKernel

        bf = cutlass.BFloat16
        res = config.has_residual
        args = (fake_tensor(bf, (None, H)), fake_tensor(bf, (None, H)) if res else None, fake_tensor(bf, (H,)),
                fake_tensor(bf, (None, H)), fake_tensor(bf, (None, H)) if res else None)
        return cute.compile(RMSNormResidualKernel(H, config), *args, cutlass.Float32(1e-5), fake_stream(),
                            options=options)

    return compile_cache.get_or_compile(key, build)


def compile_variants(preset_name: str) -> list[dict[str, Any]]:
    """Every (H, residual?) a decode step of ``preset_name`` normalises: the residual stream (with and
    without the add), the MLA q_a / kv_a latents, the LatentMoE latent, the KDA per-head norm."""
    from ...presets import preset

    cfg = preset(preset_name).config
    wanted = [(cfg.hidden_size, True), (cfg.hidden_size, False), (cfg.q_lora_rank, False),
              (cfg.kv_lora_rank, False), (cfg.routed_expert_hidden_size, False),
              (cfg.linear_attn_config.head_dim, False)]
    out, seen = [], set()
    for H, res in wanted:
        if (H, res) in seen or H % VEC:
            continue
        seen.add((H, res))
        out.append({"dtype": "bf16", "H": H, "config": RMSNormConfig.from_heuristic(H, has_residual=res)})
    return out


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_rmsnorm_residual(**v)
    return len(variants)


SUPPORT = TensorSpec(
    Arg("x", ("M", "H")), Arg("residual", ("M", "H"), optional=True), Arg("weight", ("H",)),
    Arg("out", ("M", "H"), optional=True), Arg("residual_out", ("M", "H"), optional=True),
    rules=(Rule("H % VEC == 0", "H={H} not a multiple of {VEC}"), Rule("M > 0", "M=0")),
    constants={"VEC": VEC}, dtype=torch.bfloat16, requires=(("residual_out", "residual"),))
OP = KernelOp(NAME, SUPPORT)


def is_supported(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> Support:
    return OP.support({"x": x, "residual": residual, "weight": weight, "out": out, "residual_out": residual_out})


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     *, out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                     config: RMSNormConfig | None = None, pdl: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new_residual): new_residual = bf16(x + residual), normed = RMSNorm(new_residual) * weight.
    ``config`` overrides the heuristic (benches); its has_residual must match. ``pdl``: launch the
    programmatic-dependent-launch build (same bits)."""
    return OP({"x": x, "residual": residual, "weight": weight, "out": out, "residual_out": residual_out},
              launch=lambda: _launch(x, residual, weight, eps, out, residual_out, config, pdl),
              reference=lambda: rmsnorm_residual_ref(x, residual, weight, eps), outputs=(out, residual_out))


def _launch(x, residual, weight, eps, out, residual_out, config, pdl):
    from ..._lib.tensor import current_stream, to_cute

    H = x.shape[1]
    has_res = residual is not None
    cfg = config or RMSNormConfig.from_heuristic(H, has_residual=has_res)
    if pdl and not cfg.pdl:
        cfg = dataclasses.replace(cfg, pdl=True)
    if cfg.has_residual != has_res:
        raise ValueError(f"config.has_residual={cfg.has_residual} but residual is {'given' if has_res else 'None'}")
    fn = compile_rmsnorm_residual("bf16", H, cfg)
    if out is None:
        out = torch.empty_like(x)
    if has_res and residual_out is None:
        residual_out = torch.empty_like(x)
    fn(to_cute(x), to_cute(residual) if has_res else None, to_cute(weight, dynamic_dims=()), to_cute(out),
       to_cute(residual_out) if has_res else None, float(eps), current_stream(x.device))
    return out, (residual_out if has_res else None)


def step_op(x: torch.Tensor, w: torch.Tensor, eps: float, *, pdl: bool = False) -> torch.Tensor:
    """The fast step's ``rmsnorm`` op (``runtime.fast_ops``): RMSNorm(x) * w, no residual."""
    return rmsnorm_residual(x, None, w, eps, pdl=pdl)[0]
