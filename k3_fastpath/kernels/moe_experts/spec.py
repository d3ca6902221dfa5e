"""The one declaration of kernels/moe_experts: the routed experts of LatentMoE (MXFP4 or BF16: plan, two grouped
GEMMs, weighted combine + latent RMSNorm). Read by ``k3_fastpath.kernels``; imports neither torch nor cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="moe_experts",
    launch_names=("moe_experts",),
    api="k3_fastpath.kernels.moe_experts.api",
    config_type="k3_fastpath.kernels.moe_experts.api:MoEExpertsConfig",
    support="k3_fastpath.kernels.moe_experts.api:is_supported",
    reference="k3_fastpath.kernels.moe_experts.reference:moe_experts_ref",
    compile_variants="k3_fastpath.kernels.moe_experts.api:compile_variants",
    gpu_tests=("tests/test_moe_experts_gpu.py",),
    pdl=True,
    # before griddepcontrol.wait: only the combine's latent norm weight; the plan reads ids after it and the
    # grouped GEMMs touch no expert weight (which experts depends on the router)
    pdl_prologue_reads=("norm_w",),
    serves_op="moe_experts",
    opt_in="",
)
