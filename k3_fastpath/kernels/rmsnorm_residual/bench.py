"""Bench of the fused residual add + RMSNorm (H200, CUDA-graph medians; inputs fit L2, as in decode).

    python -m k3_fastpath.kernels.rmsnorm_residual.bench --preset k3-tp8-rank

Compares threads x vectors-per-thread configs (config.MAX_VEC_PER_THREAD is unmeasured; measure it with this)
against the eager PyTorch reference, for every normalised width of the preset and M = 1..64.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from ..._lib.timing import graph_time_us
from .api import compile_variants, rmsnorm_residual
from .config import VEC, RMSNormConfig
from .reference import rmsnorm_residual_ref


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tp8-rank")
    ap.add_argument("--m", default="1,2,8,16,64")
    a = ap.parse_args(argv)
    for v in compile_variants(a.preset):
        H, res = v["H"], v["config"].has_residual
        nv = H // VEC
        for M in (int(m) for m in a.m.split(",")):
            x = torch.randn(M, H, device="cuda").bfloat16()
            r = torch.randn(M, H, device="cuda").bfloat16() if res else None
            w = torch.randn(H, device="cuda").bfloat16()
            t = graph_time_us([partial(rmsnorm_residual_ref, x, r, w, 1e-5)])["median_us"]
            line = [f"H={H} res={res} M={M}: torch {t:.1f} us; ours (threads x vectors)"]
            for vpt in (1, 2, 4, 8):
                want = -(-nv // vpt)  # threads needed at vpt vectors each, rounded up to whole warps
                threads = -(-want // 32) * 32
                if not 32 <= threads <= 1024:
                    continue
                cfg = RMSNormConfig(threads, -(-nv // threads), res)
                t = graph_time_us([partial(rmsnorm_residual, x, r, w, 1e-5, config=cfg)])["median_us"]
                line.append(f"{threads}x{cfg.vec_per_thread} {t:.1f}")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
