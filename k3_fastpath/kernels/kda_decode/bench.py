"""Bench of the KDA decode step (H200, CUDA-graph medians, cold state: the state pools are rotated so the
L2 cannot hold them).

    python -m k3_fastpath.kernels.kda_decode.bench --heads 12,6 --batch 1,2,8,64 [--sweep] [--json out.json]

Per (H, B) row: ours (heuristic config; --sweep adds every rows_per_thread), the eager FP32 torch
reference, fla (``fla.ops.kda.fused_recurrent_kda`` on the same state with in-kernel q/k L2 norm: the
recurrence only, conv/gates/output norm not included, so a lower bound of an fla composition; None with the
reason when fla is missing or fails) and the floor = bytes / read bandwidth measured in the same run, bytes =
state read + write (2 * B * H * D * D * 4) + conv pools read + write + activations + output.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import torch

from ..._lib.timing import copies_for_cold_l2, eager_time_us, graph_time_us, read_bandwidth_gbs
from .api import kda_decode
from .config import KDADecodeConfig
from .reference import kda_decode_ref

D = 128


def _case(B: int, H: int, N: int) -> dict[str, Any]:
    C = H * D
    dev = "cuda"
    return {"q": torch.randn(B, C, device=dev).bfloat16(), "k": torch.randn(B, C, device=dev).bfloat16(),
            "v": torch.randn(B, C, device=dev).bfloat16(), "g": torch.randn(B, C, device=dev).bfloat16(),
            "a": torch.randn(B, C, device=dev).bfloat16(), "beta_logits": torch.randn(B, H, device=dev).bfloat16(),
            "conv_q_w": torch.randn(C, 4, device=dev), "conv_k_w": torch.randn(C, 4, device=dev),
            "conv_v_w": torch.randn(C, 4, device=dev), "A_log": torch.empty(H, device=dev).uniform_(1, 16).log(),
            "dt_bias": torch.randn(C, device=dev), "o_norm_w": torch.ones(D, device=dev),
            "slot": torch.randperm(N - 1, device=dev)[:B].int() + 1,
            "conv_q": torch.randn(N, 3, C, device=dev).bfloat16(), "conv_k": torch.randn(N, 3, C, device=dev).bfloat16(),
            "conv_v": torch.randn(N, 3, C, device=dev).bfloat16(), "state": torch.randn(N, H, D, D, device=dev) * 0.05}


_ORDER = ("q", "k", "v", "g", "a", "beta_logits", "conv_q_w", "conv_k_w", "conv_v_w", "A_log", "dt_bias", "o_norm_w",
          "slot", "conv_q", "conv_k", "conv_v", "state")


def _fla_fns(cases: list[dict[str, Any]], B: int, H: int) -> tuple[list | None, str | None]:
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception as e:  # not installed, or a broken install
        return None, f"fla not importable ({type(e).__name__}: {e})"
    fns = []
    for c in cases:
        q, k, v = (c[n].view(B, 1, H, D) for n in ("q", "k", "v"))
        g = torch.nn.functional.logsigmoid(c["a"].float()).view(B, 1, H, D)
        beta = torch.sigmoid(c["beta_logits"].float()).view(B, 1, H).to(q.dtype)
        h0 = c["state"][: B].clone()  # a contiguous [B, H, K, V] state of the batch

        def f(q=q, k=k, v=v, g=g, beta=beta, h0=h0):
            return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        fns.append(f)
    try:
        fns[0]()
    except Exception as e:
        return None, f"fla fused_recurrent_kda failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return fns, None


def bench_rows(heads_list=(12, 6), batches=(1, 2, 8, 64), sweep: bool = False) -> list[dict[str, Any]]:
    bw = read_bandwidth_gbs()
    rows = []
    for H in heads_list:
        for B in batches:
            state_bytes = B * H * D * D * 4
            copies = copies_for_cold_l2(2 * state_bytes)
            N = B + 1
            cases = [_case(B, H, N) for _ in range(copies)]
            nbytes = 2 * state_bytes + 2 * 3 * B * 3 * H * D * 2 + 5 * B * H * D * 2 + B * H * D * 2
            row: dict[str, Any] = {"H": H, "B": B, "copies": copies, "bytes": nbytes,
                                   "floor_us": nbytes / (bw * 1e9) * 1e6, "read_bw_gbs": bw}
            row["ours_us"] = graph_time_us([partial(kda_decode, *(c[n] for n in _ORDER)) for c in cases])["median_us"]
            if sweep:
                for rpt in (8, 16, 32):
                    cfg = KDADecodeConfig(D, rpt)
                    row[f"ours_rpt{rpt}_us"] = graph_time_us(
                        [partial(kda_decode, *(c[n] for n in _ORDER), config=cfg) for c in cases])["median_us"]
            # the reference gathers by slot with host-side indexing: not capturable, so timed eagerly
            row["torch_ref_us"] = eager_time_us([partial(kda_decode_ref, *(c[n] for n in _ORDER))
                                                 for c in cases[:2]], iters=10)["median_us"]
            row["torch_ref_timer"] = "eager"
            fns, why = _fla_fns(cases, B, H)
            row["fla_us"] = graph_time_us(fns)["median_us"] if fns else None
            if why:
                row["fla_reason"] = why
            rows.append(row)
            del cases
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="12,6")
    ap.add_argument("--batch", default="1,2,8,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = bench_rows([int(h) for h in a.heads.split(",")], [int(b) for b in a.batch.split(",")], a.sweep)
    for r in rows:
        fla = f"{r['fla_us']:.1f}" if r["fla_us"] is not None else f"n/a ({r.get('fla_reason')})"
        extra = " ".join(f"{k}={v:.1f}" for k, v in r.items() if k.startswith("ours_rpt"))
        print(f"H={r['H']} B={r['B']}: ours {r['ours_us']:.1f} us, torch {r['torch_ref_us']:.1f} us, fla {fla}, "
              f"floor {r['floor_us']:.2f} us {extra}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
