"""Torch-facing router: FP32 logits, sigmoid, + correction bias, top-k (lowest index wins exact ties),
renormalised weights, for decode batches M = 1..64. Two launches: the skinny GEMM with FP32 output
(``skinny_gemm``, its ``router`` epilogue is precompiled) and the selection kernel of this folder.

    ids, w = moe_router(x, gate_weight, bias, top_k, renormalize=True, scale=1.0)
        # x [M, H] bf16, gate_weight [E, H] bf16, bias [E] fp32 -> ids [M, k] int32, w [M, k] fp32
    ids, w = moe_router_select(logits, bias, top_k, renormalize=True, scale=1.0)   # logits [M, E] fp32

``pdl=True`` launches both kernels for programmatic dependent launch (the GEMM with ``SkinnyGemmConfig.pdl``,
the selection with ``MoERouterConfig.pdl``: parameters before griddepcontrol.wait, logits after it).

Same semantics as ``reference.moe.route`` (ids there are int64; here int32, the index dtype the expert
kernels take). Picks are in descending key order. Outside the envelope (see ``is_supported``) the call is
served by ``reference.py`` and counted as a fallback of ``moe_router`` with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import OK, Support, no
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec
from .config import MoERouterConfig
from .reference import moe_router_ref, moe_router_select_ref

NAME = "moe_router"
MAX_M = 64


def compile_moe_router(dtype: str, E: int, top_k: int, config: MoERouterConfig) -> Any:
    """Compile (or fetch) the selection kernel for E experts, top ``top_k``; M stays symbolic."""
    if dtype != "fp32":
        raise ValueError(f"{NAME}: router logits are FP32, got {dtype}")
    if (config.num_experts, config.top_k) != (E, top_k):
        raise ValueError(f"config {config} does not match E={E}, top_k={top_k}")
    key = compile_cache.CompileKey.make(NAME, dtype, (E, top_k), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import MoERouterKernel

        f32 = cutlass.Float32
        align = 16 if top_k % 4 == 0 else 4
        args = (fake_tensor(f32, (None, E)), fake_tensor(f32, (E,)),
                fake_tensor(cutlass.Int32, (None, top_k), align=align), fake_tensor(f32, (None, top_k), align=align))
        return cute.compile(MoERouterKernel(config), *args, cutlass.Float32(1.0), fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_variants(preset_name: str) -> list[dict[str, Any]]:
    """The router of ``preset_name``: (num_experts, num_experts_per_token, moe_renormalize)."""
    from ...presets import preset

    cfg = preset(preset_name).config
    if cfg.num_experts == 0:
        return []
    E, k = cfg.num_experts, cfg.num_experts_per_token
    return [{"dtype": "fp32", "E": E, "top_k": k,
             "config": MoERouterConfig.from_heuristic(E, k, cfg.moe_renormalize)}]


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_moe_router(**v)
    return len(variants)


def _align_of(top_k: int) -> int:
    return 16 if top_k % 4 == 0 else 4


_OUTS = (Arg("out_ids", ("M", "top_k"), torch.int32, optional=True, align="out_align"),
         Arg("out_weights", ("M", "top_k"), torch.float32, optional=True, align="out_align"))
_SELECT_RULES = (Rule("M > 0", "M=0"),)
SELECT_SUPPORT = TensorSpec(Arg("logits", ("M", "E")), Arg("bias", ("E",)), *_OUTS, rules=_SELECT_RULES,
                            dtype=torch.float32)
SUPPORT = TensorSpec(Arg("x", ("M", "H"), torch.bfloat16), Arg("gate_weight", ("E", "H"), torch.bfloat16),
                     Arg("bias", ("E",), torch.float32), *_OUTS,
                     rules=(Rule("M <= MAX_M", "M={M} outside 1..{MAX_M}"), *_SELECT_RULES), constants={"MAX_M": MAX_M})


def _config_fits(tensors: dict[str, Any], scalars: dict[str, Any], dims: dict[str, int]) -> Support:
    try:
        MoERouterConfig(dims["E"], scalars["top_k"])
    except ValueError as e:
        return no(str(e))
    return OK


def _logits_gemm_fits(tensors: dict[str, Any], scalars: dict[str, Any], dims: dict[str, int]) -> Support:
    from ..skinny_gemm.api import is_supported as gemm_supported

    s = _config_fits(tensors, scalars, dims)
    if not s:
        return s
    g = gemm_supported(tensors["x"], tensors["gate_weight"], out_dtype=torch.float32)
    return OK if g else no(f"logits: {g.reason}")


SELECT_OP = KernelOp(NAME, SELECT_SUPPORT, extra=_config_fits)
OP = KernelOp(NAME, SUPPORT, extra=_logits_gemm_fits)


def _scalars(top_k: int) -> dict[str, int]:
    return {"top_k": int(top_k), "out_align": _align_of(int(top_k))}


def is_supported_select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, out_ids=None,
                        out_weights=None) -> Support:
    return SELECT_OP.support({"logits": logits, "bias": bias, "out_ids": out_ids, "out_weights": out_weights},
                             _scalars(top_k))


def is_supported(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, out_ids=None,
                 out_weights=None) -> Support:
    """The whole op: the logits GEMM's envelope (bf16, M <= 64) and the selection kernel's."""
    return OP.support({"x": x, "gate_weight": gate_weight, "bias": bias, "out_ids": out_ids,
                       "out_weights": out_weights}, _scalars(top_k))


def _launch(logits, bias, top_k, renormalize, scale, out_ids, out_weights, config, pdl=False):
    from ..._lib.tensor import current_stream, to_cute

    M, E = logits.shape
    cfg = config or MoERouterConfig.from_heuristic(E, top_k, renormalize)
    if pdl and not cfg.pdl:
        cfg = dataclasses.replace(cfg, pdl=True)
    if (cfg.num_experts, cfg.top_k, cfg.renormalize) != (E, top_k, renormalize):
        raise ValueError(f"config {cfg} does not fit E={E}, top_k={top_k}, renormalize={renormalize}")
    fn = compile_moe_router("fp32", E, top_k, cfg)
    if out_ids is None:
        out_ids = torch.empty((M, top_k), dtype=torch.int32, device=logits.device)
    if out_weights is None:
        out_weights = torch.empty((M, top_k), dtype=torch.float32, device=logits.device)
    a = _align_of(top_k)
    fn(to_cute(logits), to_cute(bias, dynamic_dims=()), to_cute(out_ids, align=a), to_cute(out_weights, align=a),
       float(scale), current_stream(logits.device))
    return out_ids, out_weights


def _f32(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ids, w.float()


def moe_router_select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool = True,
                      scale: float = 1.0, *, out_ids: torch.Tensor | None = None,
                      out_weights: torch.Tensor | None = None, config: MoERouterConfig | None = None,
                      pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection from FP32 ``logits [M, E]``: (ids [M, k] int32, weights [M, k] fp32); ``pdl``: the
    programmatic-dependent-launch build."""
    return SELECT_OP({"logits": logits, "bias": bias, "out_ids": out_ids, "out_weights": out_weights},
                     scalars=_scalars(top_k), outputs=(out_ids, out_weights),
                     launch=lambda: _launch(logits, bias, top_k, renormalize, scale, out_ids, out_weights, config, pdl),
                     reference=lambda: _f32(*moe_router_select_ref(logits, bias, top_k, renormalize, scale)))


def moe_router(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
               renormalize: bool = True, scale: float = 1.0, *, out_ids: torch.Tensor | None = None,
               out_weights: torch.Tensor | None = None, logits: torch.Tensor | None = None,
               config: MoERouterConfig | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``x [M, H]``: (ids [M, k] int32, weights [M, k] fp32). ``logits`` (an [M, E] fp32 buffer)
    receives the logits when given; ``config`` overrides the selection heuristic (benches); ``pdl`` (or
    ``config.pdl``) launches both kernels for programmatic dependent launch."""
    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        from ..skinny_gemm.api import skinny_gemm
        from ..skinny_gemm.config import SkinnyGemmConfig

        use_pdl = pdl or (config is not None and config.pdl)
        gemm_cfg = None
        if use_pdl:  # the same config skinny_gemm would pick, launched for PDL
            M, H = x.shape
            gemm_cfg = dataclasses.replace(SkinnyGemmConfig.select(M, gate_weight.shape[0], H, out_fp32=True),
                                           pdl=True)
        lg = skinny_gemm(x, gate_weight, out=logits, out_dtype=torch.float32, config=gemm_cfg)
        return _launch(lg, bias, top_k, renormalize, scale, out_ids, out_weights, config, use_pdl)

    return OP({"x": x, "gate_weight": gate_weight, "bias": bias, "out_ids": out_ids, "out_weights": out_weights},
              scalars=_scalars(top_k), outputs=(out_ids, out_weights), launch=launch,
              reference=lambda: _f32(*moe_router_ref(x, gate_weight, bias, top_k, renormalize, scale)))


def step_op(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
            *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast step's ``moe_router`` op (``runtime.fast_ops``): (ids [Bk, k] int32, weights [Bk, k] fp32)."""
    return moe_router(x, gate_w, bias, top_k, renormalize, scale, pdl=pdl)
