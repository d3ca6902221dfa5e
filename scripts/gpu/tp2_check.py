#!/usr/bin/env python3
"""TP2 on two H200s (device kind nvidia-h200-x2): numerics, fused vs unfused all-reduce, step time.

    NCCL_NVLS_ENABLE=0 python3 scripts/gpu/tp2_check.py [--preset k3-mini] [--parts numerics,allreduce,step]

Parts (each runs on its own, a failing part is reported and the others still run):

1. ``numerics``: k3-mini, BF16, seeded weights drawn on the GPUs (measure/device_synthetic.py). Two NCCL
   ranks run the TP model (runtime/tp.py) with the unfused (NCCL + PyTorch ops) and the fused (symmetric
   memory one-shot + Triton epilogue) communicator, and the TP fast step (runtime/tp_fast.py, CUDA graphs):
   a prefill of 4 x 16 tokens then 8 teacher-forced decode steps; and the TP model with decode context
   parallelism (``dcp``: runtime/tp_dcp.py, the MLA latents split by token, partials merged by LSE; short
   contexts only: 32K and 128K need the long-context cache fill of verify/checks/context_fill.py, not wired
   here). GPU 0 then runs TP1 (the reference model on the same weights) in BF16 and FP32 on the same tokens.
   Pass rule (BF16 bounds): err(TP2 BF16 vs TP1 FP32) <= 2 x err(TP1 BF16 vs TP1 FP32) + 1e-2 (max |logit
   diff| relative to max |logit|), argmax agreement reported;
2. ``allreduce``: all-reduce + residual + AttnRes mix + RMSNorm at hidden 7168, 9 sources, batch 1..64:
   fused vs unfused, CUDA-graph replay medians (20 calls per graph), slowest rank;
3. ``step``: the TP2 decode step at batch 1 / 8 / 64, context 1024, slowest rank: the fast TP step
   (runtime/tp_fast.py: the executor's kernels + fused all-reduce, CUDA-graph replays) and the TP model of
   reference modules (eager) with each communicator.

NVLink multicast is never enabled: NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set here
and in every rank before NCCL / symmetric memory initialise; the fused all-reduce uses P2P loads only.
Prints a short table; writes ``$OUT/tp2_check.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

PROMPT = (4, 16)
DECODE_STEPS = 8
STEP_BATCHES = (1, 8, 64)
KINDS = ("unfused", "fused", "fast", "dcp")  # the TP2 runs the numerics part holds to the TP1 FP32 oracle
STEP_CONTEXT = 1024


def _tokens(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = PROMPT
    return (torch.randint(3, cfg.vocab_size, (b, t), generator=g),
            torch.randint(3, cfg.vocab_size, (DECODE_STEPS, b), generator=g))


def _run(model, ids: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """Prefill logits of the last prompt position, then every teacher-forced decode step: [1 + steps, B, V]."""
    b, t = ids.shape
    cache = model.new_cache(b, t + DECODE_STEPS + 1)
    out = [model.prefill(ids, None, cache)[:, -1].float().cpu()]
    for k in range(DECODE_STEPS):
        out.append(model.decode(fed[k], cache).float().cpu())
    return torch.stack(out)


def _run_fast(prefill_model, fast, ids: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """The TP fast step's logits: the prompt prefilled by the TP model into the fast decoder's pooled cache,
    then every decode step through the fast decoder (CUDA graphs)."""
    b, _ = ids.shape
    cache = fast.new_cache(b)
    out = [prefill_model.prefill(ids, None, cache)[:, -1].float().cpu()]
    for k in range(DECODE_STEPS):
        out.append(fast.decode(fed[k].cuda(), cache).float().cpu())
    return torch.stack(out)


def numerics_worker(rank: int, world: int, preset: str, seed: int) -> dict:
    from k3_fastpath.measure.device_synthetic import device_model
    from k3_fastpath.presets import get_config
    from k3_fastpath.runtime.tp import TPModel
    from k3_fastpath.runtime.tp_allreduce import make_comm
    from k3_fastpath.runtime.tp_fast import TPFastDecoder

    cfg = get_config(preset)
    model = device_model(cfg, seed, torch.device("cuda", torch.cuda.current_device()), tp=world, rank=rank)
    ids, fed = _tokens(cfg, seed)
    comms = {kind: make_comm(kind) for kind in ("unfused", "fused")}
    out = {kind: _run(TPModel(cfg, model, comms[kind]), ids, fed) for kind in comms}
    out["dcp"] = _run(TPModel(cfg, model, comms["unfused"], dcp=True), ids, fed)  # MLA latents split by token
    fast = TPFastDecoder(cfg, model, comms["fused"], max_batch=PROMPT[0], max_len=PROMPT[1] + DECODE_STEPS + 1)
    out["fast"] = _run_fast(TPModel(cfg, model, comms["unfused"]), fast, ids, fed)
    return out


def numerics(preset: str, seed: int) -> dict:
    from k3_fastpath.measure.device_synthetic import device_model
    from k3_fastpath.presets import get_config
    from k3_fastpath.runtime.tp_launch import launch

    r0, r1 = launch(numerics_worker, 2, (preset, seed), backend="nccl", timeout_s=540)
    cfg = get_config(preset)
    ids, fed = _tokens(cfg, seed)
    ref = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        m = device_model(cfg, seed, "cuda:0", dtype=dt)
        ref[name] = _run(m, ids, fed)
        del m
        torch.cuda.empty_cache()
    oracle = ref["fp32"]

    def rel(a: torch.Tensor) -> float:
        return float((a - oracle).abs().amax(dim=-1).div(oracle.abs().amax(dim=-1)).max())

    base = rel(ref["bf16"])
    out = {"tp1_bf16_vs_fp32": base, "ranks_identical": all(torch.equal(r0[k], r1[k]) for k in r0)}
    problems = [] if out["ranks_identical"] else ["the two ranks' gathered logits differ"]
    for kind in KINDS:
        err = rel(r0[kind])
        agree = float((r0[kind].argmax(-1) == oracle.argmax(-1)).float().mean())
        out[f"tp2_{kind}_vs_fp32"] = err
        out[f"tp2_{kind}_argmax_agreement"] = agree
        out[f"tp2_{kind}_vs_tp1_bf16"] = float((r0[kind] - ref["bf16"]).abs().max() / ref["bf16"].abs().max())
        if not err <= 2 * base + 1e-2:
            problems.append(f"TP2 {kind}: error vs FP32 {err:.4f} > 2 x TP1 BF16's {base:.4f} + 0.01")
    out["tp1_bf16_argmax_agreement"] = float((ref["bf16"].argmax(-1) == oracle.argmax(-1)).float().mean())
    out["problems"] = problems
    return out


def allreduce_worker(rank: int, world: int, preset: str, seed: int) -> dict:
    from k3_fastpath.presets import get_config
    from k3_fastpath.runtime.tp_allreduce import SymmMemComm
    from k3_fastpath.runtime.tp_comm import TorchComm
    from verify.checks.perf_sweep import allreduce_rows

    cfg = get_config(preset)
    comms = {"unfused": TorchComm(), "fused": SymmMemComm()}
    return {"rank": rank, "rows": [], "notes": [],
            "allreduce": allreduce_rows(comms, [1, 2, 4, 8, 16, 32, 64], cfg.hidden_size,
                                        cfg.num_attn_res_blocks + 1, 30, seed)}


def step_worker(rank: int, world: int, preset: str, seed: int, bw: float) -> dict:
    from k3_fastpath.measure.device_synthetic import device_model
    from k3_fastpath.presets import get_config
    from k3_fastpath.runtime.tp import TPModel
    from k3_fastpath.runtime.tp_allreduce import SymmMemComm
    from k3_fastpath.runtime.tp_comm import TorchComm
    from k3_fastpath.runtime.tp_fast import TPFastDecoder
    from verify.checks.perf_sweep import CONTEXT_SLACK, tp_point

    cfg = get_config(preset)
    model = device_model(cfg, seed, torch.device("cuda", torch.cuda.current_device()), tp=world, rank=rank)
    comms = {"unfused": TorchComm(), "fused": SymmMemComm()}
    tps = {k: TPModel(cfg, model, c) for k, c in comms.items()}
    fast = TPFastDecoder(cfg, model, comms["fused"], max_batch=max(STEP_BATCHES), max_len=STEP_CONTEXT + CONTEXT_SLACK)
    params = {"seed": seed, "iters": 20, "standard_iters": 5, "bw": bw}
    rows = []
    for b in STEP_BATCHES:
        rows += tp_point(cfg, model, tps, world, b, STEP_CONTEXT, "uniform", params, fast=fast)
    return {"rank": rank, "rows": rows, "allreduce": [], "notes": []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="numerics,allreduce,step")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from k3_fastpath._lib.timing import read_bandwidth_gbs
    from k3_fastpath.runtime.tp_launch import launch
    from verify.checks.perf_sweep import merge_ranks

    n = torch.cuda.device_count()
    report: dict = {"preset": args.preset, "gpus": [torch.cuda.get_device_name(i) for i in range(n)],
                    "torch": torch.__version__, "env": {k: os.environ.get(k) for k in
                                                        ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}}
    if n < 2:
        report["error"] = f"needs 2 GPUs, {n} visible"
        print(report["error"])
        Path(args.out, "tp2_check.json").write_text(json.dumps(report, indent=2))
        return 2
    bw = read_bandwidth_gbs() * 1e9
    report["read_bytes_per_s"] = bw
    ok = True
    for part in args.parts.split(","):
        t0 = time.time()
        try:
            if part == "numerics":
                report[part] = numerics(args.preset, args.seed)
                ok &= not report[part]["problems"]
            elif part == "allreduce":
                rows = merge_ranks(launch(allreduce_worker, 2, (args.preset, args.seed), backend="nccl",
                                          timeout_s=540))["allreduce"]
                report[part] = rows
                ok &= all(r["speedup"] > 1.0 for r in rows)
            elif part == "step":
                report[part] = merge_ranks(launch(step_worker, 2, (args.preset, args.seed, bw), backend="nccl",
                                                  timeout_s=540))["rows"]
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception as e:
            ok = False
            report[part] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        report[f"{part}_s"] = round(time.time() - t0, 1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "tp2_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"TP2 check, {args.preset}, {report['gpus']}, read {bw / 1e12:.2f} TB/s")
    num = report.get("numerics", {})
    if "error" in num:
        print(f"numerics: ERROR {num['error']}")
    elif num:
        print(f"numerics (max |logit err| / max |logit| vs TP1 FP32; argmax agreement): TP1 BF16 "
              f"{num['tp1_bf16_vs_fp32']:.4f} ({num['tp1_bf16_argmax_agreement']:.2f})")
        for kind in KINDS:
            print(f"  TP2 {kind:8s} {num[f'tp2_{kind}_vs_fp32']:.4f} ({num[f'tp2_{kind}_argmax_agreement']:.2f})")
        print(f"  problems: {num['problems'] or 'none'}")
    ar = report.get("allreduce")
    if isinstance(ar, list):
        print(f"{'batch':>6} {'fused us':>9} {'unfused us':>11} {'speedup':>8}")
        for r in ar:
            print(f"{r['batch']:>6} {r['fused_us']:>9.2f} {r['unfused_us']:>11.2f} {r['speedup']:>8.2f}")
    elif ar:
        print(f"allreduce: ERROR {ar['error']}")
    st = report.get("step")
    if isinstance(st, list):
        print(f"{'batch':>6} {'fast graph us':>14} {'std+fused AR us':>16} {'std+NCCL us':>12} {'floor us':>9}")
        by = {(r["batch"], r["backend"]): r for r in st}
        for b in STEP_BATCHES:
            f, s_ = by.get((b, "fast"), {}), by.get((b, "standard"), {})
            print(f"{b:>6} {f.get('step_us_median', float('nan')):>14.1f} {s_.get('tp_step_fused_us', float('nan')):>16.1f} "
                  f"{s_.get('tp_step_unfused_us', float('nan')):>12.1f} {s_.get('floor_us', float('nan')):>9.1f}")
    elif st:
        print(f"step: ERROR {st['error']}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
