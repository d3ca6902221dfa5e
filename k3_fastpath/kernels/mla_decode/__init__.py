"""Absorbed MLA decode over the 576-wide latent cache (BF16 or FP8 e4m3), split-KV with an LSE combine
that also merges context-parallel partials, W_UV up-projection and the output gate fused into the
combine. See kernel.py for the algorithm, api.py for the layout."""

from .api import (
    NAME,
    absorb_q,
    compile_mla_decode,
    compile_variants,
    is_supported,
    mla_decode,
    mla_decode_partial,
    mla_merge,
    precompile,
    slot_block_table,
    split_kv_b,
)
from .config import MLADecodeConfig
from .reference import mla_attention_ref, mla_decode_ref, mla_merge_ref

compile_kernel = compile_mla_decode
op = mla_decode
reference = mla_decode_ref

__all__ = ["NAME", "MLADecodeConfig", "absorb_q", "compile_kernel", "compile_mla_decode", "compile_variants",
           "is_supported", "mla_attention_ref", "mla_decode", "mla_decode_partial", "mla_decode_ref", "mla_merge",
           "mla_merge_ref", "op", "precompile", "reference", "slot_block_table", "split_kv_b"]
