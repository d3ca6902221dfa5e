"""SiTU-GLU activation of the shared experts and the dense MLP (bf16 in/out, FP32 math), one launch instead
of PyTorch's ~12 elementwise kernels. See kernel.py for the algorithm."""

from .api import NAME, compile_situ_glu, compile_variants, is_supported, precompile, situ_glu
from .config import SituGluConfig
from .reference import situ_glu_ref

compile_kernel = compile_situ_glu
op = situ_glu
reference = situ_glu_ref

__all__ = ["NAME", "SituGluConfig", "compile_kernel", "compile_situ_glu", "compile_variants", "is_supported", "op",
           "precompile", "reference", "situ_glu", "situ_glu_ref"]
