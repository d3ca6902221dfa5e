"""Bench of the skinny GEMM on every decode shape of a preset (H200): the measurements config.py needs.

    python -m k3_fastpath.kernels.skinny_gemm.bench --preset k3-tp8-rank --preset k3-tp16-rank --sweep
    python -m k3_fastpath.kernels.skinny_gemm.bench --preset k3-tp8-rank --preset k3-mini --m 16,32,64 --wgmma

For each rank GEMM shape and M it reports, as CUDA-graph medians with cold L2 (distinct weight copies):
the heuristic config, cuBLAS (torch bf16 x @ W^T), the bandwidth floor (weight bytes / read bandwidth
measured in the same run) and, with --sweep, the best of a candidate grid and its config. --wgmma
also times the TMA + wgmma variant (``SkinnyGemmConfig.wgmma_for``) and, with --sweep, its knobs one at a
time (``wgmma_candidates``). --json writes every row. Use the results to replace the "unmeasured"
constants in config.py, citing them.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from ..._lib.timing import copies_for_cold_l2, graph_time_us, read_bandwidth_gbs
from .api import preset_shapes, skinny_gemm
from .config import MMA_BUCKETS, SkinnyGemmConfig


def candidates(M: int, N: int, K: int) -> list[SkinnyGemmConfig]:
    """The sweep grid for one shape: every valid fma config (M <= 8) and mma config of M's bucket."""
    grid = []
    if M <= 8 and K % 8 == 0:
        for rows, wn, wk, unroll in itertools.product((1, 2, 4), (2, 4, 8), (1, 2), (2, 4, 8)):
            grid.append(dict(variant="fma", m_max=M, rows_per_warp=rows, warps_n=wn, warps_k=wk, k_unroll=unroll))
    if K % 32 == 0:
        m_max = next(b for b in MMA_BUCKETS if b >= M)
        for mt, wn, split, unroll in itertools.product((1, 2), (1, 2, 4, 8), (1, 2, 4, 8, 16), (2, 4)):
            if (K // 32) // split >= 2:
                grid.append(dict(variant="mma", m_max=m_max, rows_per_warp=mt, warps_n=wn, split_k=split,
                                 k_unroll=unroll))
    out = []
    for kw in grid:
        try:
            out.append(SkinnyGemmConfig(**kw))
        except ValueError:
            pass
    return out


def ofat_candidates(M: int, N: int, K: int) -> list[SkinnyGemmConfig]:
    """One factor at a time around the heuristic's pick: every field the heuristic sets by a constant
    (rows per warp, warps per CTA, split-K, unroll, min CTAs per SM) varied alone, the others kept. About
    a dozen configs per point instead of the full grid's ~130, so a sweep of every shape x M fits one GPU
    call; each row says which constant the winner changed (``best_changes``)."""
    from dataclasses import replace

    h = SkinnyGemmConfig.from_heuristic(M, N, K)
    values = {"rows_per_warp": (1, 2, 4) if h.variant == "fma" else (1, 2), "warps_n": (2, 4, 8),
              "k_unroll": (2, 4, 8), "min_ctas_per_sm": (1, 2)}
    if h.variant == "mma":
        values["split_k"] = (1, 2, 4, 8, 16)
    out = []
    for field, vals in values.items():
        for v in vals:
            if getattr(h, field) == v:
                continue
            try:
                cfg = replace(h, **{field: v})
            except ValueError:
                continue
            if cfg.variant == "mma" and (K // 32) // cfg.split_k < 2:
                continue
            out.append(cfg)
    return out


def wgmma_candidates(M: int, N: int, K: int) -> list[SkinnyGemmConfig]:
    """One factor at a time around ``wgmma_for``: split-K, pipeline depth, one or two warpgroups, two 64-row
    tiles per warpgroup, K per stage (with the stages re-fitted to the same bytes in flight)."""
    from dataclasses import replace

    h = SkinnyGemmConfig.wgmma_for(M, N, K)
    k_stages = -(-K // 64)
    grid = [dict(split_k=s) for s in (1, 2, 4, 8, 16) if s != h.split_k and k_stages // s >= 2]
    grid += [dict(stages=st) for st in (2, 3, 4, 6, 8, 10) if st != h.stages]
    grid += [dict(warps_n=12 - h.warps_n, stages=4), dict(rows_per_warp=2, stages=4),
             dict(k_unroll=2, stages=max(2, h.stages // 2)), dict(k_unroll=4, stages=2)]
    out = []
    for kw in grid:
        try:
            out.append(replace(h, **kw))
        except ValueError:
            continue
    return out


def _changes(base: SkinnyGemmConfig, cfg: SkinnyGemmConfig) -> dict:
    return {f: getattr(cfg, f) for f in ("variant", "m_max", "rows_per_warp", "warps_n", "warps_k", "split_k",
                                         "k_unroll", "min_ctas_per_sm", "stages") if getattr(cfg, f) != getattr(base, f)}


def _time_grid(timed, grid, best: tuple) -> tuple[tuple, dict[str, float]]:
    """Median time of every config in ``grid`` (a config the kernel rejects for the shape is skipped with the
    reason); returns (the fastest (us, config), starting from ``best``), {repr(config): us})."""
    times: dict[str, float] = {}
    for cfg in grid:
        try:
            t = timed(cfg)["median_us"]
        except Exception as e:  # a config the kernel rejects for this shape
            print(f"  skip {cfg}: {e}")
            continue
        times[repr(cfg)] = t
        best = min(best, (t, cfg), key=lambda b: b[0])
    return best, times


def fma_alternative(M: int, N: int, K: int) -> SkinnyGemmConfig | None:
    """The FMA variant at 3 <= M <= 8, timed beside the heuristic's mma pick so the bench measures where
    the mma variant overtakes it (config.FMA_MAX_M)."""
    if not 3 <= M <= 8 or K % 8:
        return None
    return SkinnyGemmConfig("fma", m_max=M, rows_per_warp=2 if -(-N // 8) >= 132 else 1, warps_n=4, k_unroll=4)


def bench_one(M: int, N: int, K: int, sweep: bool | str, wgmma: bool = False) -> dict:
    """One shape at one M. ``sweep``: False, "ofat" (one factor at a time, ``ofat_candidates``) or
    True / "full" (the whole ``candidates`` grid). ``wgmma``: also the wgmma variant (any M: M <= 16 in its 16-row bucket), and with
    ``sweep`` its one-factor-at-a-time grid."""
    copies = copies_for_cold_l2(N * K * 2)
    ws = [(torch.randn(N, K, device="cuda") / K**0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(M, K, device="cuda").bfloat16()
    outs = [torch.empty(M, N, dtype=torch.bfloat16, device="cuda") for _ in ws]

    def timed(cfg):
        return graph_time_us([lambda w=w, o=o: skinny_gemm(x, w, out=o, config=cfg) for w, o in zip(ws, outs, strict=True)])

    heur = SkinnyGemmConfig.from_heuristic(M, N, K)  # every config is passed explicitly: no env opt-in here
    row = {"M": M, "N": N, "K": K, "heuristic": repr(heur), "heuristic_us": timed(heur)["median_us"],
           "cublas_us": graph_time_us([lambda w=w, o=o: torch.matmul(x, w.t(), out=o)
                                       for w, o in zip(ws, outs, strict=True)])["median_us"]}
    alt = fma_alternative(M, N, K)
    if alt is not None and alt != heur:
        row["fma_alt"], row["fma_alt_us"] = repr(alt), timed(alt)["median_us"]
    if wgmma and K % 8 == 0 and N % 8 == 0:
        wg = SkinnyGemmConfig.wgmma_for(M, N, K)
        row["wgmma"], row["wgmma_us"] = repr(wg), timed(wg)["median_us"]
        if sweep:
            best_wg, row["wgmma_sweep_us"] = _time_grid(timed, wgmma_candidates(M, N, K), (row["wgmma_us"], wg))
            row["wgmma_best_us"], row["wgmma_best"] = best_wg[0], repr(best_wg[1])
            row["wgmma_best_changes"] = _changes(wg, best_wg[1])
    if sweep:
        grid = ofat_candidates(M, N, K) if sweep == "ofat" else candidates(M, N, K)
        row["sweep"], row["sweep_configs"] = ("ofat" if sweep == "ofat" else "full"), len(grid)
        best, row["sweep_us"] = _time_grid(timed, grid, (row["heuristic_us"], heur))
        row["best_us"], row["best"] = best[0], repr(best[1])
        row["best_changes"] = _changes(heur, best[1])
        row["heuristic_vs_best"] = row["heuristic_us"] / best[0]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", default=None)
    ap.add_argument("--m", default="1,2,3,4,8,16,32,64")
    ap.add_argument("--shape", action="append", default=None, help="only these shape names")
    ap.add_argument("--sweep", nargs="?", const="ofat", default=False, choices=("ofat", "full"),
                    help="also time alternatives: ofat (default: one factor at a time) or full (the whole grid)")
    ap.add_argument("--wgmma", action="store_true", help="also time the TMA + wgmma variant (any M)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    bw = read_bandwidth_gbs()
    print(f"read bandwidth {bw:.0f} GB/s")
    rows = []
    seen = set()
    for p in a.preset or ["k3-tp8-rank"]:
        for name, (N, K) in preset_shapes(p).items():
            if (a.shape and name not in a.shape) or (N, K) in seen:
                continue
            seen.add((N, K))
            for M in (int(m) for m in a.m.split(",")):
                row = bench_one(M, N, K, a.sweep, a.wgmma)
                row.update(preset=p, shape=name, floor_us=N * K * 2 / (bw * 1e3))
                rows.append(row)
                extra = f" best {row['best_us']:.1f} {row['best']}" if a.sweep else ""
                if "wgmma_us" in row:
                    extra += f" | wgmma {row['wgmma_us']:.1f}"
                    if "wgmma_best_us" in row:
                        extra += f" (best {row['wgmma_best_us']:.1f} changing {row['wgmma_best_changes']})"
                print(f"{p} {name} {N}x{K} M={M}: ours {row['heuristic_us']:.1f} us, cuBLAS {row['cublas_us']:.1f},"
                      f" floor {row['floor_us']:.1f}{extra}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"read_bandwidth_gbs": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
