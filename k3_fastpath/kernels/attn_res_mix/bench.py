"""Bench of AttnRes mixing (H200, CUDA-graph medians): configs vs the eager PyTorch reference.

    python -m k3_fastpath.kernels.attn_res_mix.bench --preset k3-tp8-rank

Covers S = 1..9 sources, with and without the trailing RMSNorm, M = 1, 8, 64; times the heuristic and
both register strategies (sources kept in registers vs re-read) to measure config.MAX_S_IN_REGS /
MAX_VEC_PER_THREAD.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from ..._lib.timing import graph_time_us
from .api import attn_res_mix, compile_variants
from .config import VEC, AttnResConfig
from .reference import attn_res_mix_ref


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tp8-rank")
    ap.add_argument("--m", default="1,8,64")
    a = ap.parse_args(argv)
    for v in compile_variants(a.preset):
        S, H, norm = v["S"], v["H"], v["config"].has_norm
        nv = H // VEC
        cfgs = {"heuristic": v["config"]}
        for vpt, reload in ((1, False), (2, False), (2, True)):
            want = -(-nv // vpt)  # threads needed at vpt vectors each, rounded up to whole warps
            threads = min(1024, -(-want // 32) * 32)
            cfgs[f"{threads}x{vpt}{' reload' if reload else ''}"] = AttnResConfig(threads, -(-nv // threads), norm, reload)
        for M in (int(m) for m in a.m.split(",")):
            src = torch.randn(S, M, H, device="cuda").bfloat16()
            w = torch.randn(H, device="cuda").bfloat16()
            ow = w if norm else None
            ref = graph_time_us([partial(attn_res_mix_ref, src, w, w, 1e-5, ow)])["median_us"]
            line = [f"S={S} H={H} norm={norm} M={M}: torch {ref:.1f} us;"]
            for name, cfg in cfgs.items():
                t = graph_time_us([partial(attn_res_mix, src, w, w, 1e-5, out_w=ow, config=cfg)])["median_us"]
                line.append(f"{name} {t:.1f}")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
