"""Bench of the MoE router (H200, CUDA-graph medians, cold L2: the gate weight rotates over distinct copies).

    python -m k3_fastpath.kernels.moe_router.bench --batch 1,8,64 [--sweep] [--json out.json]

Per batch M: ours (skinny-GEMM FP32 logits + the selection kernel: two launches), the torch composition
(``reference.moe.route``: FP32 matmul, sigmoid, stable sort, gather, renormalise; CUDA graph), and the
floor = gate-weight bytes (896 x 7168 bf16 = 12.8 MB) / read bandwidth measured in the same run.
``--sweep`` adds the selection kernel's rows_per_cta alternatives. ``bench_rows`` feeds
``k3-verify bench kernels`` (verify/checks/bench.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ..._lib.timing import copies_for_cold_l2, eager_time_us, graph_time_us, read_bandwidth_gbs
from .api import moe_router
from .config import MoERouterConfig
from .reference import moe_router_ref

E, H, TOP_K = 896, 7168, 16


def bench_rows(batches=(1, 8, 64), sweep: bool = False, bw_gbs: float | None = None) -> list[dict[str, Any]]:
    bw = bw_gbs or read_bandwidth_gbs()
    nbytes = E * H * 2
    copies = copies_for_cold_l2(nbytes)
    ws = [(torch.randn(E, H, device="cuda") * H**-0.5).bfloat16() for _ in range(copies)]
    bias = torch.randn(E, device="cuda") * 0.1
    rows = []
    for M in batches:
        x = torch.randn(M, H, device="cuda").bfloat16()
        row: dict[str, Any] = {"kernel": "moe_router", "M": M, "E": E, "H": H, "top_k": TOP_K, "bytes": nbytes,
                               "floor_us": nbytes / (bw * 1e3), "read_bw_gbs": bw}
        row["ours_us"] = graph_time_us([lambda w=w, x=x: moe_router(x, w, bias, TOP_K) for w in ws])["median_us"]
        ref_fns = [lambda w=w, x=x: moe_router_ref(x, w, bias, TOP_K) for w in ws]
        try:
            row["torch_us"], row["torch_timer"] = graph_time_us(ref_fns)["median_us"], "graph"
        except RuntimeError:  # a torch op that cannot be captured: time it eagerly and say so
            torch.cuda.synchronize()
            row["torch_us"], row["torch_timer"] = eager_time_us(ref_fns)["median_us"], "eager"
        row["vs_torch"] = row["torch_us"] / row["ours_us"]
        row["pct_of_floor"] = row["floor_us"] / row["ours_us"]
        if sweep:
            for rpc in (1, 2, 4, 8):
                cfg = MoERouterConfig(E, TOP_K, True, rpc)
                row[f"ours_rpc{rpc}_us"] = graph_time_us(
                    [lambda w=w, x=x, cfg=cfg: moe_router(x, w, bias, TOP_K, config=cfg) for w in ws])["median_us"]
        rows.append(row)
    del ws
    torch.cuda.empty_cache()
    return rows


def bench_check(ctx, ms: list[int], sweep: bool, bw_gbs: float) -> dict[str, Any]:
    """Rows for ``k3-verify bench kernels`` (verify/checks/bench.py): the K3 router at batch 1, 8, 64.
    No target of its own (issue 4 judges router + experts + tail together); an error is recorded as a row
    (``verify/checks/bench_rules.py`` makes it a problem)."""
    vs = {}
    try:
        rows = bench_rows([m for m in (1, 8, 64) if m in ms] or [1], sweep, bw_gbs)
    except Exception as e:  # record the failure instead of losing the other kernels' rows
        rows = [{"kernel": "moe_router", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}]
    for r in rows:
        ctx.record(r)
        if "error" in r:
            continue
        vs[f"M{r['M']}"] = r["vs_torch"]
        ctx.note(f"moe_router M={r['M']}: ours {r['ours_us']:.1f} us, torch {r['torch_us']:.1f} us, "
                 f"floor {r['floor_us']:.1f} us")
    return {"metrics": {"router_vs_torch": vs}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = bench_rows([int(b) for b in a.batch.split(",")], a.sweep)
    for r in rows:
        extra = " ".join(f"{k}={v:.1f}" for k, v in r.items() if k.startswith("ours_rpc"))
        print(f"M={r['M']}: ours {r['ours_us']:.1f} us, torch {r['torch_us']:.1f} us ({r['vs_torch']:.2f}x), "
              f"floor {r['floor_us']:.1f} us {extra}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
