"""MoE router for decode rows: FP32 logits (skinny GEMM), sigmoid, + correction bias, top-k with the lowest
index winning exact ties, renormalised weights. See kernel.py for the selection algorithm."""

from .api import (
           NAME,
           compile_moe_router,
           compile_variants,
           is_supported,
           moe_router,
           moe_router_select,
           precompile,
)
from .config import MoERouterConfig
from .reference import moe_router_ref, moe_router_select_ref

compile_kernel = compile_moe_router
op = moe_router
reference = moe_router_ref

__all__ = ["NAME", "MoERouterConfig", "compile_kernel", "compile_moe_router", "compile_variants", "is_supported",
           "moe_router", "moe_router_ref", "moe_router_select", "moe_router_select_ref", "op", "precompile",
           "reference"]
