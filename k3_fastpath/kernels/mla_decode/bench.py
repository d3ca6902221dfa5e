"""Bench of absorbed MLA decode (H200, CUDA-graph medians, cold L2: small caches rotate over copies).

    python -m k3_fastpath.kernels.mla_decode.bench --ctx 1024,32768,131072 --batch 1,8,64 --heads 12 [--sweep]

Per (cache dtype, context, batch) row, every sequence at the same context, TP8 heads (12) by default:
ours (split-KV attention + combine with W_UV and the gate: two launches), the torch SDPA-style reference
(scores = bmm(q, K^T), FP32 softmax, bmm(P, C), then W_UV and the gate; FP8 dequantised first) and the
floor = bytes / read bandwidth measured in the same run, bytes = the cache read (B x ctx x 576 x element
size) + W_UV + queries + gate + output. ``--sweep`` adds the time of every split count the heuristic
considers best x {1/2, 2} (what config.SPLIT_COST_TILES needs). ``bench_check`` feeds
``k3-verify bench kernels``, whose rule (``verify/checks/bench_rules.py``) holds the target: >= 85% of the
read bandwidth at >= 32K context, batch >= 8.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from ..._lib.timing import copies_for_cold_l2, graph_time_us, read_bandwidth_gbs
from .api import mla_decode, slot_block_table
from .config import TILE, MLADecodeConfig, choose_splits

R, P, V = 512, 64, 128
SCALE = 192 ** -0.5
FP8 = torch.float8_e4m3fn


def _torch_ref(q_lat, q_pe, K, w_uv, gate, scale_t):
    """SDPA-style composition on a contiguous [B, ctx, 576] cache (bf16 tensor-core bmm, FP32 softmax)."""
    if K.dtype == FP8:
        K = (K.float() * scale_t).bfloat16()
    q = torch.cat([q_lat, q_pe], dim=-1)  # [B, H, 576]
    s = torch.bmm(q, K.transpose(1, 2)).float() * SCALE  # [B, H, ctx]
    p = torch.softmax(s, dim=-1).bfloat16()
    o_lat = torch.bmm(p, K[..., :R])  # [B, H, R]
    o = torch.einsum("bhr,hvr->bhv", o_lat.float(), w_uv.float()).bfloat16().reshape(q.shape[0], -1)
    return (o.float() * torch.sigmoid(gate.float())).bfloat16()


def make_case(B: int, H: int, lens: list[int], dims=(R, P, V), fp8: bool = False) -> dict[str, Any]:
    """A small paged case (shuffled 64-position pages, NaN past every context) for the sanitizer driver:
    the keyword arguments of ``mla_decode`` plus ``softmax_scale``."""
    r, p, v = dims
    need = [math.ceil(n / TILE) for n in lens]
    n_pages = sum(need) + 2
    pool = torch.randn(n_pages, TILE, r + p, device="cuda")
    table = torch.full((B, max(need + [1]) + 1), -1, dtype=torch.int32, device="cuda")
    ids = torch.randperm(n_pages, device="cuda").to(torch.int32)
    i = 0
    for b in range(B):
        table[b, : need[b]] = ids[i: i + need[b]]
        i += need[b]
    return {"q_lat": torch.randn(B, H, r, device="cuda").bfloat16(),
            "q_pe": torch.randn(B, H, p, device="cuda").bfloat16(),
            "cache": pool.to(FP8) if fp8 else pool.bfloat16(), "block_table": table,
            "ctx_len": torch.tensor(lens, dtype=torch.int32, device="cuda"),
            "w_uv": (torch.randn(H, v, r, device="cuda") * r**-0.5).bfloat16(),
            "gate": torch.randn(B, H * v, device="cuda").bfloat16(),
            "cache_scale": torch.ones(1, device="cuda") if fp8 else None, "softmax_scale": SCALE}


def _row(ctx: int, B: int, H: int, fp8: bool, bw: float, sweep: bool) -> dict[str, Any]:
    D = R + P
    elem = 1 if fp8 else 2
    cache_bytes = B * ctx * D * elem
    nbytes = cache_bytes + H * V * R * 2 + B * H * D * 2 + 2 * B * H * V * 2
    copies = copies_for_cold_l2(cache_bytes)
    max_len = math.ceil(ctx / TILE) * TILE
    dev = "cuda"
    q_lat = (torch.randn(B, H, R, device=dev) * 1.5).bfloat16()
    q_pe = (torch.randn(B, H, P, device=dev) * 1.5).bfloat16()
    w_uv = (torch.randn(H, V, R, device=dev) * R**-0.5).bfloat16()
    gate = torch.randn(B, H * V, device=dev).bfloat16()
    scale_t = torch.ones(1, device=dev)
    ctx_len = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    table = slot_block_table(torch.arange(B, device=dev), max_len, TILE)
    pools = []
    for _ in range(copies):
        pool = torch.randn(B, max_len, D, device=dev).to(FP8 if fp8 else torch.bfloat16)
        pools.append(pool)
    row: dict[str, Any] = {"kernel": "mla_decode", "cache": "fp8" if fp8 else "bf16", "ctx": ctx, "B": B, "H": H,
                           "copies": copies, "bytes": nbytes, "floor_us": nbytes / (bw * 1e3), "read_bw_gbs": bw}

    def ours(pool, splits=None):
        return mla_decode(q_lat, q_pe, pool.view(-1, TILE, D), table, ctx_len, w_uv, gate, softmax_scale=SCALE,
                          cache_scale=scale_t if fp8 else None, max_ctx=ctx, num_splits=splits)

    row["ours_us"] = graph_time_us([lambda p=p: ours(p) for p in pools])["median_us"]
    row["torch_us"] = graph_time_us([lambda p=p: _torch_ref(q_lat, q_pe, p[:, :ctx], w_uv, gate, scale_t)
                                     for p in pools[:2]])["median_us"]
    row["vs_torch"] = row["torch_us"] / row["ours_us"]
    row["pct_of_floor"] = row["floor_us"] / row["ours_us"]
    row["tb_per_s"] = nbytes / (row["ours_us"] * 1e-6) / 1e12
    if sweep:
        cfg = MLADecodeConfig.from_heuristic(H, D, fp8)
        s0, _ = choose_splits(B, -(-H // cfg.heads_per_cta), ctx)
        row["heuristic_splits"] = s0
        for s in sorted({max(1, s0 // 2), max(1, s0 * 3 // 4), min(256, s0 * 3 // 2), min(256, 2 * s0)} - {s0}):
            row[f"ours_splits{s}_us"] = graph_time_us([lambda p=p, s=s: ours(p, s) for p in pools])["median_us"]
    del pools
    torch.cuda.empty_cache()
    return row


def bench_rows(contexts=(1024, 32768, 131072), batches=(1, 8, 64), heads: int = 12, dtypes=("bf16", "fp8"),
               sweep: bool = False, bw_gbs: float | None = None) -> list[dict[str, Any]]:
    bw = bw_gbs or read_bandwidth_gbs()
    return [_row(ctx, B, heads, dt == "fp8", bw, sweep) for dt in dtypes for ctx in contexts for B in batches]


def bench_check(ctx, ms: list[int], sweep: bool, bw_gbs: float) -> dict[str, Any]:
    """Rows for ``k3-verify bench kernels`` (verify/checks/bench.py): contexts 1K/32K/128K x batch 1/8/64,
    BF16 and FP8 caches, an ``error`` row where a point raised (``verify/checks/bench_rules.py`` judges
    them). Returns {"metrics": {...}}."""
    pct = {}
    for dt in ("bf16", "fp8"):
        for c in (1024, 32768, 131072):
            for B in (1, 8, 64):
                try:
                    row = _row(c, B, 12, dt == "fp8", bw_gbs, sweep)
                except Exception as e:  # record and keep going: one failed row must not hide the others
                    row = {"kernel": "mla_decode", "cache": dt, "ctx": c, "B": B,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                ctx.record(row)
                if "ours_us" not in row:
                    continue
                pct[f"{dt}_ctx{c}_B{B}"] = row["pct_of_floor"]
                ctx.note(f"mla_decode {dt} ctx={c} B={B}: ours {row['ours_us']:.1f} us, torch {row['torch_us']:.1f},"
                         f" floor {row['floor_us']:.1f} ({row['pct_of_floor']:.0%})")
    return {"metrics": {"mla_pct_of_floor": pct}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", default="1024,32768,131072")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dtype", default="bf16,fp8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = bench_rows([int(c) for c in a.ctx.split(",")], [int(b) for b in a.batch.split(",")], a.heads,
                      a.dtype.split(","), a.sweep)
    for r in rows:
        extra = " ".join(f"{k}={v:.1f}" for k, v in r.items() if k.startswith("ours_splits"))
        print(f"{r['cache']} ctx={r['ctx']} B={r['B']}: ours {r['ours_us']:.1f} us ({r['pct_of_floor']:.0%} of floor, "
              f"{r['tb_per_s']:.2f} TB/s), torch {r['torch_us']:.1f} us ({r['vs_torch']:.1f}x) {extra}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
