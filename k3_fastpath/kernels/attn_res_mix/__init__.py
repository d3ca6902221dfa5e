"""AttnRes source mixing (softmax over <= 9 residual-stream sources, optional RMSNorm). See kernel.py."""

from .api import NAME, attn_res_mix, compile_attn_res_mix, compile_variants, is_supported, precompile
from .config import AttnResConfig
from .reference import attn_res_mix_ref

compile_kernel = compile_attn_res_mix
op = attn_res_mix
reference = attn_res_mix_ref

__all__ = ["NAME", "AttnResConfig", "attn_res_mix", "attn_res_mix_ref", "compile_attn_res_mix",
           "compile_kernel", "compile_variants", "is_supported", "op", "precompile", "reference"]
