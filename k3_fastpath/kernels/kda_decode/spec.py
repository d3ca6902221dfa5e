"""The one declaration of kernels/kda_decode: the KDA decode step (T = 1: conv4 + SiLU, L2 norm, gates, delta-rule
state update in place, gated RMSNorm). Read by ``k3_fastpath.kernels``; imports neither torch nor cutlass-dsl."""

from k3_fastpath._lib.kernel_spec import KernelSpec

SPEC = KernelSpec(
    name="kda_decode",
    launch_names=("kda_decode",),
    api="k3_fastpath.kernels.kda_decode.api",
    config_type="k3_fastpath.kernels.kda_decode.config:KDADecodeConfig",
    support="k3_fastpath.kernels.kda_decode.api:is_supported",
    reference="k3_fastpath.kernels.kda_decode.reference:kda_decode_ref",
    compile_variants="k3_fastpath.kernels.kda_decode.api:compile_variants",
    gpu_tests=("tests/test_kda_decode_gpu.py",),
    pdl=True,
    # before griddepcontrol.wait: the per-layer parameters; slot, the projections, the conv and recurrent
    # state after it
    pdl_prologue_reads=("conv_q_w", "conv_k_w", "conv_v_w", "A_log", "dt_bias", "o_norm_w"),
    serves_op="kda_step",
    opt_in="",
)
