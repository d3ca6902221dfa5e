"""Launch every fast kernel once on small shapes: the program ``kernels.sanitizer`` runs under
compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    compute-sanitizer --tool racecheck python -m k3_fastpath.kernels.sanitize_driver

Small shapes keep the sanitizer's 10-100x slowdown affordable; each kernel's variants that matter for
races (the split-K reduction of the skinny GEMM, the block reductions of the norms) are all exercised.
The driver exits non-zero, and never prints its closing line, if any call fell back to the reference:
a sanitizer run over a fallback proves nothing.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from k3_fastpath._lib import counters
    from k3_fastpath.kernels.attn_res_mix.api import attn_res_mix
    from k3_fastpath.kernels.kda_decode.api import kda_decode
    from k3_fastpath.kernels.kda_decode.bench import _ORDER, _case
    from k3_fastpath.kernels.rmsnorm_residual.api import rmsnorm_residual
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
    torch.cuda.synchronize()
    snap = counters.snapshot()
    print(f"sanitize_driver: launches {snap['launches']}", flush=True)
    if snap["fallbacks"]:
        print(f"sanitize_driver: FALLBACKS {snap['fallbacks']}", flush=True)
        return 1
    missing = {"skinny_gemm", "rmsnorm_residual", "attn_res_mix", "kda_decode"} - set(snap["launches"])
    if missing:
        print(f"sanitize_driver: never launched {sorted(missing)}", flush=True)
        return 1
    print("sanitize_driver: all kernels launched", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
