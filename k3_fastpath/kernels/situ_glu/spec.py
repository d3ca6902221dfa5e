"""The one declaration of kernels/situ_glu: the SiTU-GLU activation of the shared experts and the dense MLP in one
launch. Read by ``k3_fastpath.kernels``; imports neither torch nor cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="situ_glu",
    launch_names=("situ_glu",),
    api="k3_fastpath.kernels.situ_glu.api",
    config_type="k3_fastpath.kernels.situ_glu.config:SituGluConfig",
    support="k3_fastpath.kernels.situ_glu.api:is_supported",
    reference="k3_fastpath.kernels.situ_glu.reference:situ_glu_ref",
    compile_variants="k3_fastpath.kernels.situ_glu.api:compile_variants",
    gpu_tests=("tests/test_situ_glu_gpu.py",),
    pdl=True,
    # before griddepcontrol.wait: nothing (g and u are activations; it reads no weight)
    pdl_prologue_reads=(),
    serves_op="situ_glu",
    # DecodeOptions(situ_glu_kernel=True) puts it in the table; the default step keeps the PyTorch glue
    opt_in="situ_glu_kernel",
)
