"""The one declaration of kernels/skinny_gemm: the weight-streaming skinny GEMM y = x @ W^T for decode (M <= 64;
fma, mma.sync and TMA + wgmma variants). Read by ``k3_fastpath.kernels``; imports neither torch nor cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="skinny_gemm",
    launch_names=("skinny_gemm",),
    api="k3_fastpath.kernels.skinny_gemm.api",
    config_type="k3_fastpath.kernels.skinny_gemm.config:SkinnyGemmConfig",
    support="k3_fastpath.kernels.skinny_gemm.api:is_supported",
    reference="k3_fastpath.kernels.skinny_gemm.reference:skinny_gemm_ref",
    compile_variants="k3_fastpath.kernels.skinny_gemm.api:compile_variants",
    gpu_tests=("tests/test_kernels_gpu.py", "tests/test_skinny_gemm_wgmma_gpu.py"),  # fma / mma; wgmma
    pdl=True,
    # before griddepcontrol.wait: its CTA's share of W (up to PDL_PREFETCH_BYTES) prefetched into L2 (wgmma:
    # the first W tiles); x and the residual after it
    pdl_prologue_reads=("w",),
    serves_op="linear",
    opt_in="",
)
