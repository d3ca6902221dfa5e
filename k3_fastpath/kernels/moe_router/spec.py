"""The one declaration of kernels/moe_router: the MoE router (FP32 logits by the skinny GEMM, sigmoid + correction
bias, top-k, renormalised weights). Read by ``k3_fastpath.kernels``; imports neither torch nor cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="moe_router",
    launch_names=("moe_router",),  # the logits GEMM counts as skinny_gemm
    api="k3_fastpath.kernels.moe_router.api",
    config_type="k3_fastpath.kernels.moe_router.config:MoERouterConfig",
    support="k3_fastpath.kernels.moe_router.api:is_supported",
    reference="k3_fastpath.kernels.moe_router.reference:moe_router_ref",
    compile_variants="k3_fastpath.kernels.moe_router.api:compile_variants",
    gpu_tests=("tests/test_moe_router_gpu.py",),
    pdl=True,
    # before griddepcontrol.wait: the selection kernel loads the correction bias; the logits after it
    pdl_prologue_reads=("bias",),
    serves_op="moe_router",
    opt_in="",
)
