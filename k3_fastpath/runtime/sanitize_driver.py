"""Launch every fast kernel once on small shapes: the program ``kernels.sanitizer`` runs under
compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    compute-sanitizer --tool racecheck python -m k3_fastpath.runtime.sanitize_driver

Small shapes keep the sanitizer's 10-100x slowdown affordable; each kernel's variants that matter for
races (the split-K reduction of the skinny GEMM, the block reductions of the norms) are all exercised.
The driver exits non-zero, and never prints its closing line, if any call fell back to the reference
(a sanitizer run over a fallback proves nothing) or if a launch counter of a registered kernel
(every spec's ``launch_names``) never moved.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from k3_fastpath._lib import counters
    from k3_fastpath.kernels.attn_res_mix.api import attn_res_mix
    from k3_fastpath.kernels.kda_decode.api import kda_decode, kda_decode_vllm
    from k3_fastpath.kernels.kda_decode.bench import _ORDER, _case
    from k3_fastpath.kernels.mla_decode.api import mla_decode, mla_decode_partial, mla_merge
    from k3_fastpath.kernels.mla_decode.bench import make_case
    from k3_fastpath.kernels.moe_experts.api import moe_experts
    from k3_fastpath.kernels.moe_experts.bench import make_experts
    from k3_fastpath.kernels.moe_router.api import moe_router, moe_router_select
    from k3_fastpath.kernels.rmsnorm_residual.api import rmsnorm_residual
    from k3_fastpath.kernels.situ_glu.api import situ_glu
    from k3_fastpath.kernels.skinny_gemm.api import skinny_gemm

    torch.manual_seed(0)
    dev = "cuda"
    counters.reset()
    bf = torch.bfloat16
    for M, N, K in ((1, 1152, 1536), (2, 1536, 512), (16, 1152, 1536), (64, 1536, 512)):  # TP16 q_b / kv_b
        x = torch.randn(M, K, device=dev).to(bf)
        w = (torch.randn(N, K, device=dev) / K**0.5).to(bf)
        skinny_gemm(x, w)
        skinny_gemm(x, w, residual=torch.randn(M, N, device=dev).to(bf), out_dtype=torch.float32)
    for M, H in ((1, 1024), (8, 7168)):
        x = torch.randn(M, H, device=dev).to(bf)
        r = torch.randn(M, H, device=dev).to(bf)
        w = (1 + 0.1 * torch.randn(H, device=dev)).to(bf)
        rmsnorm_residual(x, r, w, 1e-5)
        rmsnorm_residual(x, None, w, 1e-5)
        for S in (1, 3, 9):
            src = torch.randn(S, M, H, device=dev).to(bf)
            attn_res_mix(src, w, (torch.randn(H, device=dev) / H**0.5).to(bf), 1e-5)
            attn_res_mix(src, w, (torch.randn(H, device=dev) / H**0.5).to(bf), 1e-5, out_w=w, out_eps=1e-5)
    for B, H in ((1, 6), (3, 12)):
        c = _case(B, H, N=B + 2)
        c["slot"][0] = 0  # an empty slot: its caches must stay untouched (initcheck/memcheck see the skip path)
        kda_decode(*(c[n] for n in _ORDER))
        # vLLM's layout (the route in place): packed window and [V, K] state in shared pages padded by 48 bytes,
        # the padded row -1 as vLLM pads; the kernel must touch nothing between the pages
        conv = torch.cat([c["conv_q"], c["conv_k"], c["conv_v"]], dim=-1)
        state = c["state"].transpose(-1, -2)
        cb, sb = conv[0].numel() * 2, state[0].numel() * 4
        page = cb + sb + 48
        raw = torch.zeros(conv.shape[0] * page, dtype=torch.uint8, device=dev)
        pconv = raw.view(bf).as_strided(conv.shape, (page // 2, *conv.contiguous().stride()[1:]))
        pstate = raw.view(torch.float32).as_strided(state.shape, (page // 4, *state.contiguous().stride()[1:]), cb // 4)
        pconv.copy_(conv)
        pstate.copy_(state)
        slot = c["slot"].clone()
        slot[0] = -1
        head = [c[n] for n in _ORDER[:12]]
        kda_decode_vllm(*head, slot, pconv, pstate)
    for M, E, H, k in ((1, 896, 7168, 16), (3, 16, 128, 4)):  # K3 router, k3-tiny's
        moe_router(torch.randn(M, H, device=dev).to(bf), (torch.randn(E, H, device=dev) / H**0.5).to(bf),
                   0.1 * torch.randn(E, device=dev), k)
        moe_router_select(torch.zeros(M, E, device=dev), torch.zeros(E, device=dev), k)  # all keys tied
    for H, dims, fp8 in ((6, (512, 64, 128), False), (12, (512, 64, 128), True), (4, (32, 16, 32), False)):
        c = make_case(3, H, [130, 1, 0], dims, fp8)  # ragged, context 1, an empty sequence (zero partials)
        mla_decode(**c, num_splits=2)  # two splits: the LSE combine and an empty split
        cache = c["cache"]  # the same pages two pages apart (vLLM's layouts interleave layers by block)
        spread = torch.zeros(cache.shape[0], 3 * cache.shape[1], cache.shape[2], dtype=cache.dtype,
                             device=dev)[:, : cache.shape[1]]
        spread.copy_(cache)
        mla_decode(**{**c, "cache": spread})
        kw = {n: c[n] for n in ("q_lat", "q_pe", "cache", "block_table", "ctx_len", "cache_scale", "softmax_scale")}
        o, lse = mla_decode_partial(**kw)
        mla_merge(torch.stack([o, o]), torch.stack([lse, lse]), c["w_uv"], c["gate"])
    for fmt in ("mxfp4", "bf16"):  # k3-tiny's experts: 16 x (128 x 64), top-4; 9 tokens share expert 3
        ex = make_experts(fmt, 16, 128, 64)
        ids = torch.stack([torch.randperm(16, device=dev)[:4] for _ in range(9)]).int()
        ids[:, 0] = 3
        w = torch.rand(9, 4, device=dev)
        z = torch.randn(9, 64, device=dev).to(bf)
        moe_experts(z, ids, w, ex)
        moe_experts(z[:2], ids[:2], w[:2], ex, norm_weight=torch.ones(64, device=dev).to(bf))
    for M, I in ((1, 384), (5, 2112)):  # TP16 shared experts (one predicated CTA), TP16 dense (two CTAs)
        g, u = torch.randn(M, I, device=dev).to(bf), torch.randn(M, I, device=dev).to(bf)
        situ_glu(g, u, 4.0, 25.0)
        situ_glu(g, u, 4.0, 25.0, out=g, pdl=True)  # in place over g
    torch.cuda.synchronize()
    snap = counters.snapshot()
    print(f"sanitize_driver: launches {snap['launches']}", flush=True)
    if snap["fallbacks"]:
        print(f"sanitize_driver: FALLBACKS {snap['fallbacks']}", flush=True)
        return 1
    from k3_fastpath import kernels as registry

    # every registered kernel's launch names: a kernel added to the registry but not to main fails here
    missing = set(registry.launch_names()) - set(snap["launches"])
    if missing:
        print(f"sanitize_driver: never launched {sorted(missing)}", flush=True)
        return 1
    print("sanitize_driver: all kernels launched", flush=True)
    return executor_step()


def executor_step() -> int:
    """Three decode steps of the k3-tiny executor (CUDA graphs, the shared experts' GLU on the side stream,
    event fork / join) so racecheck / synccheck / memcheck see the two-stream overlap of issue #4 as
    it runs in a step. Prints its own line; kernel fallbacks here are reported, and fail the driver."""
    from k3_fastpath._lib import counters
    from k3_fastpath.presets import preset
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.runtime.options import DecodeOptions
    from k3_fastpath.synthetic import synthetic_state_dict

    cfg = preset("k3-tiny").config
    model = load_reference(cfg, synthetic_state_dict(cfg, 0, conditioning="stable"), dtype=torch.bfloat16,
                           device="cuda")
    ex = DecodeExecutor(model, max_len=128, max_batch=4, options=DecodeOptions(shared_stream=True))
    cache = ex.new_cache(3)
    counters.reset()
    for _ in range(3):
        ex.decode(torch.randint(3, cfg.vocab_size, (3,), device="cuda"), cache)
    torch.cuda.synchronize()
    snap = counters.snapshot()
    rec = ex.trace.records[-1]
    print(f"sanitize_driver: executor step graph={rec.graph} side_stream={ex.side.stream is not None} "
          f"launches {snap['launches']} fallbacks {snap['fallbacks']} step_fallback {rec.fallback}", flush=True)
    if snap["fallbacks"] or rec.fallback or ex.side.stream is None:
        return 1
    print("sanitize_driver: executor step with the side stream ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
