"""Routed experts of LatentMoE (MXFP4 dequantised in registers, or BF16), grouped so every touched
expert's weights stream once per step, weighted combine and the latent RMSNorm. See kernel.py for the
algorithm, layout.py for the MXFP4 fragment layout, api.py for the op."""

from .api import (
           NAME,
           MoEExpertsConfig,
           compile_moe_experts,
           compile_variants,
           is_supported,
           moe_experts,
           precompile,
)
from .layout import ExpertWeights, pack_mxfp4, unpack_mxfp4
from .reference import moe_experts_ref

compile_kernel = compile_moe_experts
op = moe_experts
reference = moe_experts_ref

__all__ = ["NAME", "ExpertWeights", "MoEExpertsConfig", "compile_kernel", "compile_moe_experts", "compile_variants",
           "is_supported", "moe_experts", "moe_experts_ref", "op", "pack_mxfp4", "precompile", "reference",
           "unpack_mxfp4"]
