"""Weight-streaming skinny GEMM y = x @ W^T for decode (M <= 64). See kernel.py for the algorithm (fma and
mma.sync variants) and kernel_wgmma.py for the TMA + wgmma variant (M >= 4 by default;
``DecodeOptions.gemm_wgmma_min_m``)."""

from .api import NAME, compile_skinny_gemm, compile_variants, is_supported, precompile, skinny_gemm
from .config import SkinnyGemmConfig
from .reference import skinny_gemm_ref

compile_kernel = compile_skinny_gemm
op = skinny_gemm
reference = skinny_gemm_ref

__all__ = ["NAME", "SkinnyGemmConfig", "compile_kernel", "compile_skinny_gemm", "compile_variants",
           "is_supported", "op", "precompile", "reference", "skinny_gemm", "skinny_gemm_ref"]
