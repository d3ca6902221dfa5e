"""The one declaration of kernels/rmsnorm_residual: fused residual add + RMSNorm of decode rows.
Read by ``k3_fastpath.kernels``; imports neither torch nor cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="rmsnorm_residual",
    launch_names=("rmsnorm_residual",),
    api="k3_fastpath.kernels.rmsnorm_residual.api",
    config_type="k3_fastpath.kernels.rmsnorm_residual.config:RMSNormConfig",
    support="k3_fastpath.kernels.rmsnorm_residual.api:is_supported",
    reference="k3_fastpath.kernels.rmsnorm_residual.reference:rmsnorm_residual_ref",
    compile_variants="k3_fastpath.kernels.rmsnorm_residual.api:compile_variants",
    gpu_tests=("tests/test_kernels_gpu.py",),
    pdl=True,
    # before griddepcontrol.wait: the norm weight; x and residual after it
    pdl_prologue_reads=("weight",),
    serves_op="rmsnorm",
    opt_in="",
)
