"""Torch-facing routed experts of LatentMoE for decode batches of 1..64 tokens.

    acc = moe_experts(z, ids, weights, experts)                       # -> [N, L] fp32 (the weighted sum)
    zn  = moe_experts(z, ids, weights, experts, norm_weight=w, eps=1e-5)   # -> [N, L] bf16, normed
        z [N, L] bf16 (the latent: routed_expert_down_proj output), ids [N, k] int32 and weights [N, k]
        fp32 (``moe_router``), experts: ``layout.ExpertWeights`` (MXFP4 as the checkpoint stores it, or
        BF16), beta / linear_beta: the SiTU-GLU constants (K3: 4 and 25)

Same semantics as ``reference.moe.LatentMoE.routed`` up to and including the latent RMSNorm (then the
up projection is a skinny GEMM). Four launches (plan, gate/up, down, combine; see kernel.py), no host
synchronisation: CUDA-graph capturable. Two bf16 workspaces (h [N*k, I], y [N*k, L]) per call from the
caching allocator. Outside the envelope (``is_supported``) the call is served by ``reference.py`` and
counted as a fallback with the reason. ``pdl=True`` (or ``config.pdl``) launches all four kernels for
programmatic dependent launch (kernel.py says what each does before its ``griddepcontrol.wait``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import Support
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec
from .config import (
    COMBINE_THREADS,
    CTAS_PER_SM,
    GP,
    MAX_PAIRS,
    MAX_TOKENS,
    NUM_SMS_H200,
    ExpertGemmConfig,
)
from .layout import ExpertWeights
from .reference import moe_experts_ref

NAME = "moe_experts"
SORT_SIZES = (64, 256, 1024)  # plan kernel variants: pairs N * k up to 64 / 256 / 1024


@dataclass(frozen=True)
class MoEExpertsConfig:
    fmt: str
    glu: ExpertGemmConfig
    down: ExpertGemmConfig
    beta: float = 4.0
    linear_beta: float = 25.0
    norm: bool = True
    pdl: bool = False  # all four launches for programmatic dependent launch (the GEMM configs carry it too)

    def __post_init__(self) -> None:
        if self.glu.pdl != self.pdl or self.down.pdl != self.pdl:
            raise ValueError(f"pdl={self.pdl} but the GEMM configs have glu.pdl={self.glu.pdl}, "
                             f"down.pdl={self.down.pdl}")

    @classmethod
    def from_heuristic(cls, fmt: str, I: int, L: int, beta: float = 4.0, linear_beta: float = 25.0,
                       norm: bool = True, pdl: bool = False) -> MoEExpertsConfig:
        return cls(fmt, ExpertGemmConfig.from_heuristic(fmt, True, I, L, pdl),
                   ExpertGemmConfig.from_heuristic(fmt, False, L, I, pdl), float(beta), float(linear_beta), norm,
                   pdl)

    def with_pdl(self) -> MoEExpertsConfig:
        return dataclasses.replace(self, glu=dataclasses.replace(self.glu, pdl=True),
                                   down=dataclasses.replace(self.down, pdl=True), pdl=True)


def _max_ctas() -> int:
    return NUM_SMS_H200 * CTAS_PER_SM


def compile_plan(E: int, sort_n: int, pdl: bool = False) -> Any:
    key = compile_cache.CompileKey.make(f"{NAME}_plan", "i32", (E, sort_n), ("pdl",) if pdl else None)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import PlanKernel

        i32 = cutlass.Int32
        args = [fake_tensor(i32, (None,), align=4), fake_tensor(i32, (1,), align=4)]
        args += [fake_tensor(i32, (None,), align=4) for _ in range(4)]
        return cute.compile(PlanKernel(E, sort_n, pdl), *args, fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_gemm(E: int, rows: int, K: int, k_top: int, beta: float, linear_beta: float,
                 config: ExpertGemmConfig) -> Any:
    """The grouped GEMM over ``rows`` x ``K`` expert matrices (glu: w1 and w3; else w2)."""
    key = compile_cache.CompileKey.make(f"{NAME}_gemm", config.fmt, (E, rows, K, k_top, beta, linear_beta), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import ExpertGemmKernel

        bf, i32, u8 = cutlass.BFloat16, cutlass.Int32, cutlass.Uint8
        if config.fmt == "mxfp4":
            a = fake_tensor(u8, (E, rows // 16, K // GP, 32, 16))
            s = fake_tensor(u8, (E, rows // 16, K // GP, 8, 4), align=4)
        else:
            a, s = fake_tensor(bf, (E, rows, K)), None
        second = config.glu
        args = (fake_tensor(bf, (None, K)), a, s, a if second else None, s if second else None,
                fake_tensor(i32, (1,), align=4), *(fake_tensor(i32, (None,), align=4) for _ in range(4)),
                fake_tensor(bf, (None, rows)))
        kern = ExpertGemmKernel(E, rows, K, config, k_top, beta, linear_beta, _max_ctas())
        return cute.compile(kern, *args, i32(1), fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def compile_combine(L: int, k_top: int, norm: bool, pdl: bool = False) -> Any:
    key = compile_cache.CompileKey.make(f"{NAME}_combine", "bf16", (L, k_top, norm),
                                        (COMBINE_THREADS, "pdl") if pdl else COMBINE_THREADS)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import CombineKernel

        bf, f32 = cutlass.BFloat16, cutlass.Float32
        args = (fake_tensor(bf, (None, L)), fake_tensor(f32, (None, k_top), align=4),
                fake_tensor(bf if norm else f32, (None, L)), fake_tensor(bf, (L,)) if norm else None)
        return cute.compile(CombineKernel(L, k_top, norm, COMBINE_THREADS, pdl), *args, f32(1e-5), fake_stream(),
                            options=options)

    return compile_cache.get_or_compile(key, build)


def compile_moe_experts(dtype: str, E: int, I: int, L: int, k_top: int, config: MoEExpertsConfig) -> Any:
    """Every kernel of one layer shape (plans for each pair-count bucket, both GEMMs, the combine) into the
    compile cache; returns the gate/up GEMM's function."""
    if dtype != config.fmt:
        raise ValueError(f"{NAME}: dtype {dtype!r} != config.fmt {config.fmt!r}")
    for n in SORT_SIZES:
        compile_plan(E, n, config.pdl)
    fn = compile_gemm(E, I, L, k_top, config.beta, config.linear_beta, config.glu)
    compile_gemm(E, L, I, k_top, config.beta, config.linear_beta, config.down)
    compile_combine(L, k_top, config.norm, config.pdl)
    return fn


def compile_variants(preset_name: str) -> list[dict[str, Any]]:
    """The routed experts of one rank of ``preset_name`` in the checkpoint's format (MXFP4 for K3)."""
    from ...presets import preset

    p = preset(preset_name)
    cfg = p.config
    if cfg.num_experts == 0:
        return []
    E, I, L, k = cfg.num_experts, p.shapes.expert_w13[0], cfg.routed_expert_hidden_size, cfg.num_experts_per_token
    c = MoEExpertsConfig.from_heuristic(cfg.expert_format, I, L, cfg.activation_situ_beta,
                                        cfg.activation_situ_linear_beta, cfg.latent_moe_use_norm)
    return [{"dtype": cfg.expert_format, "E": E, "I": I, "L": L, "k_top": k, "config": c}]


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_moe_experts(**v)
    return len(variants)


# ------------------------------------------------------------------------------------------ support
EXPERT_TENSORS = 6  # mxfp4: (packed, scale) of w1, w3, w2; bf16: w1, w3, w2
SUPPORT = TensorSpec(
    Arg("z", ("N", "L"), torch.bfloat16), Arg("ids", ("N", "k"), torch.int32, align=4),
    Arg("weights", ("N", "k"), torch.float32, align=4), Arg("norm_weight", ("L",), torch.bfloat16, optional=True),
    Arg("out", ("N", "L"), "out_dtype", optional=True),
    *(Arg(f"expert weight {i}", None, "expert_dtype", optional=True, align=4) for i in range(EXPERT_TENSORS)),
    rules=(Rule("1 <= N <= MAX_TOKENS", "N={N} outside 1..{MAX_TOKENS}"),
           Rule("1 <= k <= 16 and N * k <= MAX_PAIRS", "top-k {k} (needs 1..16)"),
           Rule("fmt in ('mxfp4', 'bf16')", "expert format {fmt}"),
           Rule("latent == L", "experts' latent {latent} != z width {L}"),
           Rule("I % GP == 0 and L % GP == 0 and E < 2097152", "I={I}, L={L}: both must be multiples of {GP}")),
    constants={"MAX_TOKENS": MAX_TOKENS, "MAX_PAIRS": MAX_PAIRS, "GP": GP})
OP = KernelOp(NAME, SUPPORT)


def _operands(z, ids, weights, experts: ExpertWeights, norm_weight, out) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, scalars) as ``SUPPORT`` names them: the expert weights as the kernel reads them (the fragment
    layout once compacted), their format and sizes."""
    mats = [t for n in ("w1", "w3", "w2") for t in (
        (experts.frag[n] if experts.compacted else getattr(experts, n)) if experts.fmt == "mxfp4"
        else (getattr(experts, n),))]
    tensors = {"z": z, "ids": ids, "weights": weights, "norm_weight": norm_weight, "out": out,
               **{f"expert weight {i}": mats[i] if i < len(mats) else None for i in range(EXPERT_TENSORS)}}
    scalars = {"fmt": experts.fmt, "E": experts.num_experts, "I": experts.inter, "latent": experts.latent,
               "out_dtype": torch.bfloat16 if norm_weight is not None else torch.float32,
               "expert_dtype": torch.uint8 if experts.fmt == "mxfp4" else torch.bfloat16}
    return tensors, scalars


def is_supported(z, ids, weights, experts: ExpertWeights, norm_weight=None, out=None) -> Support:
    tensors, scalars = _operands(z, ids, weights, experts, norm_weight, out)
    return OP.support(tensors, scalars)


# ------------------------------------------------------------------------------------------ op
def _sort_size(P: int) -> int:
    return next(n for n in SORT_SIZES if n >= P)


def moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights, *,
                beta: float = 4.0, linear_beta: float = 25.0, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-5, out: torch.Tensor | None = None,
                config: MoEExpertsConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """Routed experts + weighted combine (+ the latent RMSNorm with ``norm_weight``); see the module doc.
    ``pdl``: every launch for programmatic dependent launch (same bits)."""
    tensors, scalars = _operands(z, ids, weights, experts, norm_weight, out)
    return OP(tensors, scalars=scalars,
              launch=lambda: _launch(z, ids, weights, experts, beta, linear_beta, norm_weight, eps, out, config, pdl),
              reference=lambda: moe_experts_ref(z, ids, weights, experts, beta=beta, linear_beta=linear_beta,
                                                norm_weight=norm_weight, eps=eps, out=out))


def _launch(z, ids, weights, experts, beta, linear_beta, norm_weight, eps, out, config, pdl):
    from ..._lib.tensor import current_stream, to_cute

    N, L = z.shape
    k = ids.shape[1]
    P = N * k
    E, I = experts.num_experts, experts.inter
    norm = norm_weight is not None
    cfg = config or MoEExpertsConfig.from_heuristic(experts.fmt, I, L, beta, linear_beta, norm)
    if pdl and not cfg.pdl:
        cfg = cfg.with_pdl()
    if cfg.norm != norm or (cfg.beta, cfg.linear_beta) != (float(beta), float(linear_beta)):
        raise ValueError(f"config {cfg} does not fit norm={norm}, beta={beta}, linear_beta={linear_beta}")
    sort_n = _sort_size(P)
    plan_fn = compile_plan(E, sort_n, cfg.pdl)
    glu_fn = compile_gemm(E, I, L, k, cfg.beta, cfg.linear_beta, cfg.glu)
    down_fn = compile_gemm(E, L, I, k, cfg.beta, cfg.linear_beta, cfg.down)
    comb_fn = compile_combine(L, k, norm, cfg.pdl)
    dev = z.device
    i32 = torch.int32
    nact = torch.empty(1, dtype=i32, device=dev)
    act = [torch.empty(P, dtype=i32, device=dev) for _ in range(4)]  # expert, start, count, sorted pair
    h = torch.empty((P, I), dtype=torch.bfloat16, device=dev)
    y = torch.empty((P, L), dtype=torch.bfloat16, device=dev)
    if out is None:
        out = torch.empty((N, L), dtype=torch.bfloat16 if norm else torch.float32, device=dev)
    stream = current_stream(dev)
    plan_args = [to_cute(nact, align=4, dynamic_dims=())] + [to_cute(t, align=4) for t in act]
    plan_fn(to_cute(ids.reshape(-1), align=4), *plan_args, stream)
    if experts.fmt == "mxfp4":
        fr = experts.fragments()
        w13 = [to_cute(fr["w1"][0], dynamic_dims=()), to_cute(fr["w1"][1], align=4, dynamic_dims=()),
               to_cute(fr["w3"][0], dynamic_dims=()), to_cute(fr["w3"][1], align=4, dynamic_dims=())]
        w2 = [to_cute(fr["w2"][0], dynamic_dims=()), to_cute(fr["w2"][1], align=4, dynamic_dims=()), None, None]
    else:
        w13 = [to_cute(experts.w1, dynamic_dims=()), None, to_cute(experts.w3, dynamic_dims=()), None]
        w2 = [to_cute(experts.w2, dynamic_dims=()), None, None, None]
    for fn, x, ws, dst, rows, gcfg in ((glu_fn, z, w13, h, I, cfg.glu), (down_fn, h, w2, y, L, cfg.down)):
        items = min(E, P) * (rows // gcfg.rows_per_item)
        fn(to_cute(x), *ws, *plan_args, to_cute(dst), max(1, min(items, _max_ctas())), stream)
    comb_fn(to_cute(y), to_cute(weights, align=4), to_cute(out), to_cute(norm_weight, dynamic_dims=()) if norm else None,
            float(eps), stream)
    return out


def step_op(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bank: Any, norm_w: torch.Tensor | None = None,
            eps: float = 1e-5, *, pdl: bool = False) -> torch.Tensor:
    """The fast step's ``moe_experts`` op (``runtime.fast_ops``) over an expert bank (``.weights``, ``.beta``,
    ``.linear_beta``: MXFP4 as the checkpoint stores it, in this kernel's fragment layout built once per bank):
    the FP32 weighted sum, or with ``norm_w`` the routed latent RMSNorm fused into the combine (bf16). Router
    ids come as int32 from ``moe_router``; the standard router's int64 ids are narrowed (glue)."""
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    return moe_experts(z, ids, weights.float(), bank.weights, beta=bank.beta, linear_beta=bank.linear_beta,
                       norm_weight=norm_w, eps=eps, pdl=pdl)
