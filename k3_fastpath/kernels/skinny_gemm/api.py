"""Torch-facing skinny GEMM: y = x @ W^T (+ residual) for decode batches M = 1..64.

    y = skinny_gemm(x, w)                                # x [M, K] bf16, w [N, K] bf16 -> [M, N] bf16
    y = skinny_gemm(x, w, residual=h, out_dtype=torch.float32)

The config (variant, M bucket, split-K) comes from ``SkinnyGemmConfig.select(M, N, K)``: the TMA + wgmma
variant (kernel_wgmma.py) for M in ``wgmma_min_m``..64 (default WGMMA_MIN_M = 4; 0 turns it off; the decode
step's ``DecodeOptions.gemm_wgmma_min_m``), the heuristic (fma / mma.sync, kernel.py) below it. The compiled
kernel serves every M of its bucket. ``precompile(preset)`` compiles every ``rank_shapes(...).gemm_shapes()``
shape for every bucket at the default threshold (``compile_variants(preset, wgmma_min_m=)`` lists another's;
the executor's eager warm-up compiles whatever its step launches before any capture). ``step_op`` is the fast step's ``linear`` op. Outside the envelope the call is served by ``reference.py`` and counted as a fallback
with the reason. Launches count under one kernel name, ``skinny_gemm``; ``VARIANT_LAUNCHES`` splits them
by variant (the trace counters have no sub-keys).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

from ..._lib import compile_cache
from ..._lib.dispatch import OK, Support, no
from ..._lib.kernel_op import Arg, KernelOp, Rule, TensorSpec
from .config import MAX_M, WGMMA_MIN_M, SkinnyGemmConfig, m_buckets
from .reference import skinny_gemm_ref

NAME = "skinny_gemm"
VARIANT_LAUNCHES: Counter[str] = Counter()  # launches per config.variant, host-side like counters


def compile_skinny_gemm(dtype: str, N: int, K: int, config: SkinnyGemmConfig) -> Any:
    """Compile (or fetch) y = x @ W^T for W [N, K]; M stays symbolic up to ``config.m_max``."""
    if dtype != "bf16":
        raise ValueError(f"{NAME}: only bf16 weights/activations are implemented, got {dtype}")
    key = compile_cache.CompileKey.make(NAME, dtype, (N, K), config)

    def build(options: str) -> Any:
        import cutlass
        import cutlass.cute as cute

        from ..._lib.tensor import fake_stream, fake_tensor
        from .kernel import SkinnyGemmKernel
        from .kernel_wgmma import SkinnyGemmWgmmaKernel

        bf, f32 = cutlass.BFloat16, cutlass.Float32
        c = config
        ws = cnt = None
        if c.split_k > 1:
            ws = fake_tensor(f32, (c.split_k, c.num_blocks(N), 32 * c.warps_n, c.acc_per_thread))
            cnt = fake_tensor(cutlass.Int32, (c.num_blocks(N),))
        args = (fake_tensor(bf, (None, K)), fake_tensor(bf, (N, K)),
                fake_tensor(f32 if c.out_fp32 else bf, (None, N)),
                fake_tensor(bf, (None, N)) if c.residual else None, ws, cnt)
        kernel_cls = SkinnyGemmWgmmaKernel if c.variant == "wgmma" else SkinnyGemmKernel
        return cute.compile(kernel_cls(N, K, config), *args, fake_stream(), options=options)

    return compile_cache.get_or_compile(key, build)


def preset_shapes(preset_name: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of every decode GEMM of one rank of ``preset_name``."""
    from ...presets import preset

    return dict(preset(preset_name).shapes.gemm_shapes())


# Epilogues each projection is launched with besides plain bf16 output (what precompile covers): the router
# produces FP32 logits; output / down projections can fuse the residual add. Keep in sync with runtime/.
EXTRA_EPILOGUES: dict[str, tuple[tuple[bool, bool], ...]] = {  # name -> ((out_fp32, residual), ...)
    "router": ((True, False),),
    "kda_o_proj": ((False, True),), "mla_o_proj": ((False, True),),
    "shared_down": ((False, True),), "latent_up": ((False, True),), "dense_down": ((False, True),),
}


def compile_variants(preset_name: str, *, wgmma_min_m: int = WGMMA_MIN_M) -> list[dict[str, Any]]:
    """Every (N, K, config) a decode step of ``preset_name`` can launch at the wgmma threshold ``wgmma_min_m``:
    each M bucket, bf16 output, plus the EXTRA_EPILOGUES of the projections that use them."""
    out, seen = [], set()
    for name, (N, K) in preset_shapes(preset_name).items():
        for out_fp32, residual in ((False, False),) + EXTRA_EPILOGUES.get(name, ()):
            for M in m_buckets(wgmma_min_m):
                try:
                    cfg = SkinnyGemmConfig.select(M, N, K, out_fp32=out_fp32, residual=residual,
                                                  wgmma_min_m=wgmma_min_m)
                except ValueError:
                    continue
                if (N, K, cfg) in seen:
                    continue
                seen.add((N, K, cfg))
                out.append({"dtype": "bf16", "N": N, "K": K, "config": cfg, "shape_name": name, "M": M})
    return out


def precompile(preset_name: str) -> int:
    variants = compile_variants(preset_name)
    for v in variants:
        compile_skinny_gemm(v["dtype"], v["N"], v["K"], v["config"])
    return len(variants)


SUPPORT = TensorSpec(
    Arg("x", ("M", "K")), Arg("w", ("N", "K")), Arg("residual", ("M", "N"), optional=True),
    Arg("out", ("M", "N"), "out_dtype", optional=True),
    rules=(Rule("1 <= M <= MAX_M", "M={M} outside 1..{MAX_M}"), Rule("N % 8 == 0", "N={N} not a multiple of 8"),
           Rule("out_dtype in OUT_DTYPES", "out dtype {out_dtype}")),
    constants={"MAX_M": MAX_M, "OUT_DTYPES": (torch.bfloat16, torch.float32)}, dtype=torch.bfloat16)


def _config_fits(tensors: dict[str, Any], scalars: dict[str, Any], dims: dict[str, int]) -> Support:
    """With a ``config``, that config must fit (M within its bucket, the variant's K rule); without one,
    ``select`` must find one."""
    M, K, N = dims["M"], dims["K"], dims["N"]
    config = scalars["config"]
    if config is not None:
        if M > config.m_max:
            return no(f"M={M} > config m_max {config.m_max}")
        if K % config.k_granule:
            return no(f"{config.variant} needs K % {config.k_granule} == 0, got K={K}")
        return OK
    try:
        SkinnyGemmConfig.select(M, N, K, wgmma_min_m=scalars["wgmma_min_m"])
    except ValueError as e:
        return no(str(e))
    return OK


OP = KernelOp(NAME, SUPPORT, extra=_config_fits)


def is_supported(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 config: SkinnyGemmConfig | None = None, wgmma_min_m: int = WGMMA_MIN_M) -> Support:
    """Whether the kernel serves this call (``SUPPORT``, then ``_config_fits``)."""
    return OP.support({"x": x, "w": w, "residual": residual, "out": out},
                      {"out_dtype": out_dtype, "config": config, "wgmma_min_m": wgmma_min_m})


_workspaces: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, N: int, cfg: SkinnyGemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent split-K workspace + zeroed counters per (device, N, config); the kernel re-zeroes them."""
    key = (device, N, cfg)
    if key not in _workspaces:
        ws = torch.empty((cfg.split_k, cfg.num_blocks(N), 32 * cfg.warps_n, cfg.acc_per_thread),
                         dtype=torch.float32, device=device)
        cnt = torch.zeros(cfg.num_blocks(N), dtype=torch.int32, device=device)
        _workspaces[key] = (ws, cnt)
    return _workspaces[key]


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                config: SkinnyGemmConfig | None = None, pdl: bool = False,
                wgmma_min_m: int = WGMMA_MIN_M) -> torch.Tensor:
    """y = x @ w^T (+ residual) with FP32 accumulation. ``config`` overrides ``select`` (benches); ``pdl``
    launches the selected config's PDL build (its weights stream toward L2 while the previous kernel
    finishes, activations read after the wait); ``wgmma_min_m``: ``select``'s wgmma threshold."""
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.bfloat16
    return OP({"x": x, "w": w, "residual": residual, "out": out},
              scalars={"out_dtype": out_dtype, "config": config, "wgmma_min_m": wgmma_min_m},
              launch=lambda: _launch(x, w, residual, out, out_dtype, config, pdl, wgmma_min_m),
              reference=lambda: skinny_gemm_ref(x, w, residual, out_dtype=out_dtype), outputs=(out,))


def _launch(x, w, residual, out, out_dtype, config, pdl, wgmma_min_m):
    from ..._lib.tensor import current_stream, to_cute

    M, K = x.shape
    N = w.shape[0]
    cfg = config or SkinnyGemmConfig.select(M, N, K, out_fp32=out_dtype == torch.float32,
                                            residual=residual is not None, wgmma_min_m=wgmma_min_m)
    if pdl and not cfg.pdl:
        cfg = dataclasses.replace(cfg, pdl=True)
    if cfg.m_max < M or cfg.out_fp32 != (out_dtype == torch.float32) or cfg.residual != (residual is not None):
        raise ValueError(f"config {cfg} does not fit M={M}, out {out_dtype}, residual={residual is not None}")
    fn = compile_skinny_gemm("bf16", N, K, cfg)
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    ws = cnt = None
    if cfg.split_k > 1:
        ws_t, cnt_t = _workspace(x.device, N, cfg)
        ws, cnt = to_cute(ws_t, dynamic_dims=()), to_cute(cnt_t, dynamic_dims=())
    fn(to_cute(x), to_cute(w, dynamic_dims=()), to_cute(out),
       to_cute(residual) if residual is not None else None, ws, cnt, current_stream(x.device))
    VARIANT_LAUNCHES[cfg.variant] += 1
    return out


def step_op(x: torch.Tensor, w: torch.Tensor, *, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, pdl: bool = False,
            gemm_wgmma_min_m: int = WGMMA_MIN_M) -> torch.Tensor:
    """The fast step's ``linear`` op (``runtime.fast_ops``): ``skinny_gemm`` with the step's launch options."""
    return skinny_gemm(x, w, residual, out=out, out_dtype=out_dtype, pdl=pdl, wgmma_min_m=gemm_wgmma_min_m)
