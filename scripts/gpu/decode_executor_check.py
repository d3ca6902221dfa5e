"""The decode executor on the H200 in one run: build k3-mini, capture, check numerics, graphs, allocation and
synchronisation, counters, step times. Prints a short table; writes ``$OUT/decode_executor_check.json``
(and the execution traces under ``$OUT/trace/``).

    python scripts/gpu/decode_executor_check.py [--batches 1,8,64] [--steps 32] [--long 32768]
        [--tp16-layers 0] [--budget 480]

``--cpu-dry-run`` runs the same parts on a CPU with k3-tiny and the fast step emulated (kernels served by
their references; no graphs, no allocation/sync part): it proves the script itself before GPU time is
spent on it (tests/test_executor_cpu.py runs it).

Each part runs on its own: a failure is recorded (with its traceback's last line) and the next part runs.
Parts that would not fit the remaining time budget are skipped with that reason. Exit code 0 when every
part that ran passed, 1 otherwise.

Parts: build (k3-mini, stable synthetic init, drawn on the GPU) -> capture (compile every kernel, one graph
per bucket; each graph launches mla_decode once per MLA layer and moe_experts once per MoE layer, no
standard op) -> equivalence (fast vs reference per batch, short context; the mla_decode / moe_experts
launch counters moved by layers x steps) -> graphs_vs_eager (bitwise) ->
no_alloc_no_sync (replay under set_sync_debug_mode("error"), allocation count) -> pdl_prefetch_bitwise (PDL
on and L2 prefetch on change no bit) -> timing (graph replay vs eager fast step vs reference; L2 prefetch
on/off; PDL on/off) -> long_context (one batch at --long positions) -> fp8 (FP8
KV cache) -> tp16_rank (optional: --tp16-layers N layers of one TP16 rank, 6 KDA heads, 896 experts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from k3_fastpath._lib import compile_cache  # noqa: E402
from k3_fastpath.presets import preset  # noqa: E402
from k3_fastpath.runtime.envelope import Envelope  # noqa: E402
from k3_fastpath.runtime.executor import DecodeExecutor  # noqa: E402
from k3_fastpath.runtime.options import DecodeOptions  # noqa: E402
from k3_fastpath.runtime.trace import fast_path_problems, summarize  # noqa: E402
from verify.checks.context_fill import fill_reference  # noqa: E402
from verify.checks.equivalence import build_synthetic_model, run_point  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/decode_executor_check"))
RESULTS: dict = {"parts": {}}
T0 = time.monotonic()
DEV = "cuda"  # "cpu" under --cpu-dry-run


def executor(model, **kw) -> DecodeExecutor:
    """A DecodeExecutor; under --cpu-dry-run with the fast step emulated on the CPU."""
    return DecodeExecutor(model, envelope=Envelope(emulate=DEV == "cpu"), **kw)


def part(name: str, need_s: float, budget: float):
    """Decorator: run the part if ``need_s`` seconds remain, record status/seconds/result or the error."""
    def wrap(fn):
        left = budget - (time.monotonic() - T0)
        if left < need_s:
            RESULTS["parts"][name] = {"status": "skipped", "reason": f"{left:.0f}s left of the budget, needs ~{need_s:.0f}s"}
            return None
        t = time.monotonic()
        try:
            out = fn() or {}
            status = "failed" if out.get("problems") else "ok"
            RESULTS["parts"][name] = {"status": status, "seconds": round(time.monotonic() - t, 1), **out}
        except Exception as e:  # recorded, never fatal: the next part still runs
            RESULTS["parts"][name] = {"status": "error", "seconds": round(time.monotonic() - t, 1),
                                      "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                                      "traceback": traceback.format_exc()[-2000:]}
        print(f"[{time.monotonic() - T0:6.0f}s] {name}: {RESULTS['parts'][name]['status']}", flush=True)
        return None
    return wrap


def _events_ms(fn, iters: int) -> list[float]:
    if DEV == "cpu":
        out = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return sorted(out)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)


def _median(xs: list[float]) -> float:
    return xs[len(xs) // 2]


def _trace_problems(summary: dict) -> list[str]:
    """fast_path_problems, except that a CPU dry run expects every kernel call to fall back (emulation)."""
    return fast_path_problems(summary, expect_fast=DEV == "cuda")


def _layer_counts(cfg) -> dict[str, int]:
    """Launches one fast step makes of the kernels that replaced the PyTorch MLA / routed-expert ops."""
    return {"mla_decode": len(cfg.mla_layer_ids),
            "moe_experts": sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))}


def _launch_problems(summary: dict, steps: int, cfg) -> list[str]:
    """The mla_decode / moe_experts launch counters must move by (layers x steps) over ``steps`` fast steps
    (a CPU dry run: the same count of calls served by their references), and no standard op may remain."""
    problems = [f"standard op left in a fast step: {k} ({n} step(s))" for k, n in summary["standard_ops"].items()]
    for name, per_step in _layer_counts(cfg).items():
        if DEV == "cuda":
            got = summary["kernels"].get(name, 0)
        else:
            got = sum(n for k, n in summary["kernel_fallbacks"].items() if k.startswith(name + ":"))
        if got != per_step * steps:
            problems.append(f"{name}: {got} launches in {steps} steps, expected {per_step} per step")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--tp16-layers", type=int, default=0)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("K3_EXECUTOR_BUDGET", 480)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    global DEV, OUT
    if args.cpu_dry_run:
        DEV = "cpu"
        args.preset = "k3-tiny"
        OUT = Path(os.environ.get("OUT", "/tmp/decode_executor_check_dry"))
    OUT.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    budget = args.budget
    from k3_fastpath._lib import arch

    RESULTS["env"] = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)",
                      "torch": torch.__version__,
                      "cutlass_dsl": arch.cutlass_version(), "args": vars(args)}
    state: dict = {}
    prompt = 16

    @part("build", 30, budget)
    def _():
        cfg = preset(args.preset).config
        state["model"] = build_synthetic_model(cfg, args.seed, "stable", DEV)
        if DEV == "cpu":
            return {"preset": args.preset}
        torch.cuda.synchronize()
        return {"preset": args.preset, "gpu_mem_gb": round(torch.cuda.memory_allocated() / 1e9, 1)}

    if "model" not in state:
        return _finish()
    model = state["model"]
    max_len = prompt + args.steps + 1

    @part("capture", 60, budget)
    def _():
        n0 = len(compile_cache.records())
        ex = executor(model, max_batch=max(batches), max_len=max_len, buckets=batches, trace_dir=str(OUT / "trace"))
        if not ex.fast:
            return {"problems": [f"fast path unavailable: {ex.model_reason}"]}
        t = time.monotonic()
        ex.warmup_and_capture()
        state["ex"] = ex
        recs = compile_cache.records()[n0:]
        caps = {b: {"kernels": sum(c.kernels.values()), "standard_ops": c.standard_ops,
                    "kernel_fallbacks": c.kernel_fallbacks, "capture_s": round(c.capture_s, 2)}
                for b, c in (ex.graphs.graphs.items() if ex.graphs is not None else ())}
        problems = [f"bucket {b}: kernel fallbacks {c['kernel_fallbacks']}" for b, c in caps.items()
                    if c["kernel_fallbacks"]]
        per_step = _layer_counts(model.cfg)
        for b, cap in (ex.graphs.graphs.items() if ex.graphs is not None else ()):
            problems += [f"bucket {b}: {n} {k} launch(es) captured, expected {per_step[k]}"
                         for k, n in ((k, cap.kernels.get(k, 0)) for k in per_step) if n != per_step[k]]
            problems += [f"bucket {b}: standard op {o['op']} ({o['reason']})" for o in cap.standard_ops]
        problems += [f"bucket {b} left eager (kernel fallbacks at warm-up: {f})" for b, f in ex.eager_buckets.items()]
        return {"seconds_warmup_capture": round(time.monotonic() - t, 1), "compiled": len(recs),
                "compile_s": round(sum(r.seconds for r in recs), 1), "buckets": caps,
                "expert_weights": ex.trace.meta.get("expert_weights"),
                "mla_pool_len": ex.trace.meta.get("mla_pool_len"),
                "shared_experts_stream": ex.trace.meta.get("shared_experts_stream"), "disk_cache": compile_cache.disk_status(),
                "problems": problems}

    ex = state.get("ex")
    if ex is None:
        return _finish()

    @part("equivalence", 20 * len(batches), budget)
    def _():
        rows, problems = {}, []
        for b in batches:
            r = run_point(model, ex, b, "short", args.steps, prompt, 5, args.seed)
            rows[b] = {k: r[k] for k in ("first_divergence", "mismatches", "kl_mean", "kl_max", "max_abs_logit_err",
                                         "max_rel_logit_err", "nonfinite_steps")}
            rows[b]["topk_violations"] = r["topk_violations"][:5]
            rows[b]["trace"] = r["trace"]
            problems += [f"batch {b}: {p}" for p in _trace_problems(r["trace"])]
            problems += [f"batch {b}: {p}" for p in _launch_problems(r["trace"], args.steps, model.cfg)]
            if r["topk_violations"]:
                problems.append(f"batch {b}: {len(r['topk_violations'])} top-5 violations")
            if r["nonfinite_steps"] or r["kl_mean"] > 0.01:
                problems.append(f"batch {b}: kl_mean {r['kl_mean']:.3g}, non-finite steps {r['nonfinite_steps']}")
        return {"steps": args.steps, "points": rows, "problems": problems}

    @part("graphs_vs_eager", 30, budget)
    def _():
        b = 8 if 8 in batches else batches[0]
        eager = executor(model, max_batch=max(batches), max_len=max_len, buckets=batches, use_graphs=False)
        ref = model.new_cache(b, max_len)
        first = fill_reference(model, ref, None, prompt, args.seed + 5)
        ce, cg = eager.new_cache(b, max_len), ex.new_cache(b, max_len)
        eager.copy_cache(ce, ref)
        ex.copy_cache(cg, ref)
        tok, same = first.argmax(-1), []
        for _ in range(4):
            x, y = eager.decode(tok, ce), ex.decode(tok, cg)
            same.append(bool(torch.equal(x, y)))
            tok = x.argmax(-1)
        cg.release()
        return {"batch": b, "bitwise_equal_per_step": same,
                "problems": [] if all(same) else ["graph replay differs from the eager fast step"]}

    @part("no_alloc_no_sync", 20, budget)
    def _():
        if DEV == "cpu":
            return {"note": "CUDA only: not run in a CPU dry run"}
        b = 8 if 8 in batches else batches[0]
        cache = ex.new_cache(b, max_len)
        out = torch.empty(b, model.cfg.vocab_size, device="cuda")
        toks = [torch.randint(3, 1000, (b,), device="cuda") for _ in range(4)]
        act = torch.ones(b, dtype=torch.bool, device="cuda")
        ex.decode(toks[0], cache, act, out=out)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        problems = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in toks[1:]:
                ex.decode(t, cache, act, out=out)
        except RuntimeError as e:
            problems.append(f"host sync inside a replayed step: {str(e).splitlines()[0][:200]}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
        if allocs:
            problems.append(f"{allocs} allocation(s) in 3 replayed steps")
        cache.release()
        return {"batch": b, "allocations": allocs, "problems": problems}

    @part("pdl_prefetch_bitwise", 60, budget)
    def _():
        b = 8 if 8 in batches else batches[0]
        out, problems = {}, []
        for label, kw in (("prefetch", {"options": DecodeOptions(prefetch=True)}), ("pdl", {"options": DecodeOptions(pdl=True)})):
            e = executor(model, max_batch=max(batches), max_len=max_len, buckets=batches, **kw)
            e.warmup_and_capture()
            state[label] = e
            ref = model.new_cache(b, max_len)
            first = fill_reference(model, ref, None, prompt, args.seed + 3)
            c0, c1 = ex.new_cache(b, max_len), e.new_cache(b, max_len)
            ex.copy_cache(c0, ref)
            e.copy_cache(c1, ref)
            tok, same = first.argmax(-1), []
            for _ in range(4):
                x, y = ex.decode(tok, c0), e.decode(tok, c1)
                same.append(bool(torch.equal(x, y)))
                tok = x.argmax(-1)
            c0.release()
            c1.release()
            out[label] = {"bitwise_equal_per_step": same, "trace_problems": _trace_problems(
                summarize(list(e.trace.records)))}
            if not all(same):
                problems.append(f"{label} on changes the logits")
            problems += [f"{label}: {p}" for p in out[label]["trace_problems"]]
        return {"batch": b, **out, "problems": problems}

    @part("timing", 60, budget)
    def _():
        rows = {}
        pre, pdl = state.get("prefetch"), state.get("pdl")
        if pre is None or pdl is None:
            return {"problems": ["the prefetch / pdl executors were not built (see pdl_prefetch_bitwise)"]}
        eager = executor(model, max_batch=max(batches), max_len=max_len, buckets=batches, use_graphs=False)
        for b in batches:
            out = torch.empty(b, model.cfg.vocab_size, device=DEV)
            tok = torch.randint(3, model.cfg.vocab_size, (b,), device=DEV)
            row = {}
            for label, e in (("fast_graph", ex), ("fast_graph_prefetch", pre), ("fast_graph_pdl", pdl),
                             ("fast_eager", eager)):
                c = e.new_cache(b, max_len)
                n = 3 if label == "fast_eager" or DEV == "cpu" else 20
                for _ in range(2):
                    e.decode(tok, c, out=out)
                row[label + "_ms"] = round(_median(_events_ms(lambda e=e, c=c, tok=tok, out=out: e.decode(tok, c, out=out), n)), 3)
                c.release()
            rc = model.new_cache(b, max_len)
            row["reference_ms"] = round(_median(_events_ms(lambda rc=rc, tok=tok: model.decode(tok, rc), 3)), 3)
            cap = ex.graphs.graphs[b] if ex.graphs is not None else None
            row["launches_per_step"] = sum(cap.kernels.values()) if cap is not None else None
            row["speedup_vs_reference"] = round(row["reference_ms"] / row["fast_graph_ms"], 2)
            rows[b] = row
        return {"rows": rows, "note": "graph replay medians of executor.decode (staging included), CUDA events; "
                                      "reference = K3ForCausalLM.decode eagerly (it synchronises)"}

    @part("long_context", 60, budget)
    def _():
        b = 8 if 8 in batches else 1
        lx = executor(model, max_batch=b, max_len=args.long + 17, buckets=(b,))
        lx.warmup_and_capture()
        r = run_point(model, lx, b, args.long, 16, prompt, 5, args.seed + 7)
        problems = _trace_problems(r["trace"]) + ([f"{len(r['topk_violations'])} top-5 violations"]
                                                      if r["topk_violations"] else [])
        return {"batch": b, "context": args.long, "kl_mean": r["kl_mean"], "max_rel_logit_err": r["max_rel_logit_err"],
                "first_divergence": r["first_divergence"], "problems": problems}

    @part("fp8", 30, budget)
    def _():
        b = 8 if 8 in batches else batches[0]
        fx = executor(model, max_batch=b, max_len=max_len, buckets=(b,), kv_dtype=torch.float8_e4m3fn)
        fx.warmup_and_capture()
        r = run_point(model, fx, b, "short", 16, prompt, 5, args.seed + 9)
        problems = _trace_problems(r["trace"]) + ([f"{len(r['topk_violations'])} top-5 violations"]
                                                      if r["topk_violations"] else [])
        return {"batch": b, "kl_mean": r["kl_mean"], "first_divergence": r["first_divergence"], "problems": problems}

    if args.tp16_layers > 0:
        @part("tp16_rank", 120, budget)
        def _():
            from k3_fastpath.presets import _k3_layers

            full = preset("k3-tp16-rank").config
            kda, mla = _k3_layers(args.tp16_layers)
            cfg = full.replace(num_hidden_layers=args.tp16_layers,
                               linear_attn_config=dataclasses.replace(full.linear_attn_config, kda_layers=kda,
                                                                      full_attn_layers=mla))
            m = build_synthetic_model(cfg, args.seed, "stable", "cuda", tp=16)
            tx = DecodeExecutor(m, max_batch=8, max_len=max_len, buckets=(1, 8))
            if not tx.fast:
                return {"problems": [f"fast path unavailable: {tx.model_reason}"]}
            tx.warmup_and_capture()
            r = run_point(m, tx, 8, "short", 16, prompt, 5, args.seed + 11)
            tok = torch.randint(3, 1000, (1,), device="cuda")
            c = tx.new_cache(1, max_len)
            ms = _median(_events_ms(lambda: tx.decode(tok, c), 20))
            problems = _trace_problems(r["trace"]) + ([f"{len(r['topk_violations'])} top-5 violations"]
                                                          if r["topk_violations"] else [])
            return {"layers": args.tp16_layers, "kda_heads": m.cfg.linear_attn_config.num_heads,
                    "kl_mean": r["kl_mean"], "first_divergence": r["first_divergence"], "batch1_step_ms": round(ms, 3),
                    "problems": problems}

    return _finish()


def _finish() -> int:
    RESULTS["seconds"] = round(time.monotonic() - T0, 1)
    (OUT / "decode_executor_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print(f"\n{'part':<18} {'status':<8} {'s':>6}  detail")
    for name, r in RESULTS["parts"].items():
        detail = r.get("error") or r.get("reason") or "; ".join(r.get("problems", [])[:2])
        if name == "timing" and r.get("rows"):
            detail = " | ".join(f"B={b}: graph {v['fast_graph_ms']} ms, +prefetch {v['fast_graph_prefetch_ms']}, "
                                f"+pdl {v['fast_graph_pdl_ms']}, eager {v['fast_eager_ms']}, ref {v['reference_ms']}"
                                for b, v in r["rows"].items())
        if name == "equivalence" and r.get("points"):
            detail = " | ".join(f"B={b}: kl {v['kl_mean']:.2g}, mism {v['mismatches']}" for b, v in r["points"].items())
        print(f"{name:<18} {r['status']:<8} {r.get('seconds', 0):>6}  {detail}"[:400])
    bad = [n for n, r in RESULTS["parts"].items() if r["status"] in ("failed", "error")]
    print(f"\nwritten {OUT / 'decode_executor_check.json'}; {'FAILED: ' + ', '.join(bad) if bad else 'all parts that ran passed'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
