"""The one declaration of kernels/attn_res_mix: AttnRes source mixing (softmax over <= 9 residual-stream
sources, optional trailing RMSNorm). Read by ``k3_fastpath.kernels``; imports neither torch nor cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="attn_res_mix",
    launch_names=("attn_res_mix",),
    api="k3_fastpath.kernels.attn_res_mix.api",
    config_type="k3_fastpath.kernels.attn_res_mix.config:AttnResConfig",
    support="k3_fastpath.kernels.attn_res_mix.api:is_supported",
    reference="k3_fastpath.kernels.attn_res_mix.reference:attn_res_mix_ref",
    compile_variants="k3_fastpath.kernels.attn_res_mix.api:compile_variants",
    gpu_tests=("tests/test_kernels_gpu.py",),
    pdl=True,
    # before griddepcontrol.wait: loads norm_w and proj_w, prefetches out_w into L2; the sources after it
    pdl_prologue_reads=("norm_w", "proj_w", "out_w"),
    serves_op="attn_res",
    opt_in="",
)
