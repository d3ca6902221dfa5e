"""The one declaration of kernels/mla_decode: absorbed MLA decode over the latent cache (split-KV attention, then
the LSE combine with W_UV and the output gate). Read by ``k3_fastpath.kernels``; imports neither torch nor
cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="mla_decode",
    launch_names=("mla_decode", "mla_decode_merge"),  # mla_merge (context-parallel partials): mla_decode_merge
    api="k3_fastpath.kernels.mla_decode.api",
    config_type="k3_fastpath.kernels.mla_decode.config:MLADecodeConfig",
    support="k3_fastpath.kernels.mla_decode.api:is_supported",
    reference="k3_fastpath.kernels.mla_decode.reference:mla_decode_ref",
    compile_variants="k3_fastpath.kernels.mla_decode.api:compile_variants",
    gpu_tests=("tests/test_mla_decode_gpu.py",),
    pdl=True,
    # before griddepcontrol.wait: the attention kernel reads nothing (q, block table, ctx_len and the latent
    # cache are a step's); the final combine prefetches W_UV into L2
    pdl_prologue_reads=("w_uv",),
    serves_op="mla_attention",
    opt_in="",
)
