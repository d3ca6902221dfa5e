"""Torch-facing SiTU-GLU activation: compile cache, precompile, support gate, fallback.

    h = situ_glu(g, u, beta, linear_beta)          # g, u: [M, I] bf16 (the gate / up projections) -> bf16

``out=`` may alias ``g`` or ``u``. ``pdl=True`` launches the PDL build (``SituGluConfig.pdl``). Outside the
envelope (not bf16, not on an sm_90 device, I % 8, non-contiguous, ...) the call is served by
``reference.py`` and counted as a fallback with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import Support
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec
from .config import VEC, SituGluConfig
from .reference import situ_glu_ref

NAME = "situ_glu"


def compile_situ_glu(dtype: str, I: int, config: SituGluConfig) -> Any:  # noqa: E741
    """Compile (or fetch) the kernel for width ``I``; M stays symbolic (one binary for every M)."""
    if dtype != "bf16":
        raise ValueError(f"{NAME}: only bf16 is implemented, got {dtype}")
    key = compile_cache.CompileKey.make(NAME, dtype, (I,), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import SituGluKernel

        bf = cutlass.BFloat16
        args = (fake_tensor(bf, (None, I)), fake_tensor(bf, (None, I)), fake_tensor(bf, (None, I)))
        return cute.compile(SituGluKernel(I, config), *args, fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_variants(preset_name: str) -> list[dict[str, Any]]:
    """Every width a decode step of ``preset_name`` activates: its rank's shared experts (as one GLU) and
    dense MLP."""
    from ...presets import preset
    from ...rank_shapes import rank_shapes

    p = preset(preset_name)
    cfg = p.config
    shapes = rank_shapes(cfg, p.tp_size)
    out, seen = [], set()
    for I in (shapes.shared_gate_up[0] // 2, shapes.dense_gate_up[0] // 2):  # noqa: E741
        if I in seen or I % VEC or I == 0:
            continue
        seen.add(I)
        out.append({"dtype": "bf16", "I": I, "config": SituGluConfig.from_heuristic(
            I, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)})
    return out


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_situ_glu(**v)
    return len(variants)


SUPPORT = TensorSpec(
    Arg("g", ("M", "I")), Arg("u", ("M", "I")), Arg("out", ("M", "I"), optional=True),
    rules=(Rule("I % VEC == 0", "I={I} not a multiple of {VEC}"), Rule("M > 0", "M=0")),
    constants={"VEC": VEC}, dtype=torch.bfloat16)
OP = KernelOp(NAME, SUPPORT)


def is_supported(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> Support:
    return OP.support({"g": g, "u": u, "out": out})


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float, *, out: torch.Tensor | None = None,
             config: SituGluConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """bf16 ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)`` (FP32 math, one rounding).
    ``config`` overrides the heuristic (its beta / linear_beta must be these); ``pdl``: the programmatic-
    dependent-launch build (same bits)."""
    return OP({"g": g, "u": u, "out": out}, launch=lambda: _launch(g, u, beta, linear_beta, out, config, pdl),
              reference=lambda: situ_glu_ref(g, u, beta, linear_beta), outputs=(out,))


def _launch(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float, out: torch.Tensor | None,
            config: SituGluConfig | None, pdl: bool) -> torch.Tensor:
    from ..._lib.tensor import current_stream, to_cute

    I = g.shape[1]  # noqa: E741
    cfg = config or SituGluConfig.from_heuristic(I, beta, linear_beta)
    if (cfg.beta, cfg.linear_beta) != (float(beta), float(linear_beta)):
        raise ValueError(f"config is compiled for beta={cfg.beta}, linear_beta={cfg.linear_beta}; "
                         f"the call asks {beta}, {linear_beta}")
    if pdl and not cfg.pdl:
        cfg = dataclasses.replace(cfg, pdl=True)
    fn = compile_situ_glu("bf16", I, cfg)
    if out is None:
        out = torch.empty_like(g)
    fn(to_cute(g), to_cute(u), to_cute(out), current_stream(g.device))
    return out


def step_op(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float, *, pdl: bool = False) -> torch.Tensor:
    """The fast step's opt-in ``situ_glu`` op (``runtime.fast_ops``; ``DecodeOptions(situ_glu_kernel=True)``):
    the shared experts' and the dense MLP's activation in one launch instead of the PyTorch glue."""
    return situ_glu(g, u, beta, linear_beta, pdl=pdl)
