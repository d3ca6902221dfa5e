"""KDA decode step (T = 1): conv4 + SiLU, L2 norm, gates, delta-rule state update in place, gated RMSNorm,
one launch per layer for B slot-indexed sequences. See kernel.py for the algorithm, api.py for the layout."""

from .api import (
           NAME,
           compile_kda_decode,
           compile_variants,
           is_supported,
           kda_decode,
           kda_decode_vllm,
           precompile,
)
from .config import KDADecodeConfig
from .reference import kda_decode_ref, kda_decode_ref_outputs

compile_kernel = compile_kda_decode
op = kda_decode
reference = kda_decode_ref

__all__ = ["NAME", "KDADecodeConfig", "compile_kda_decode", "compile_kernel", "compile_variants", "is_supported",
           "kda_decode", "kda_decode_ref", "kda_decode_ref_outputs", "kda_decode_vllm", "op", "precompile", "reference"]
