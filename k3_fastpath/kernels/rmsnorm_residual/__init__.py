"""Fused residual add + RMSNorm (decode rows, bf16 in/out, FP32 math). See kernel.py for the algorithm."""

from .api import NAME, compile_rmsnorm_residual, compile_variants, is_supported, precompile, rmsnorm_residual
from .config import RMSNormConfig
from .reference import rmsnorm_residual_ref

compile_kernel = compile_rmsnorm_residual
op = rmsnorm_residual
reference = rmsnorm_residual_ref

__all__ = ["NAME", "RMSNormConfig", "compile_kernel", "compile_rmsnorm_residual", "compile_variants",
           "is_supported", "op", "precompile", "reference", "rmsnorm_residual", "rmsnorm_residual_ref"]
