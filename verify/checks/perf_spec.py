"""``perf.decode_sweep``'s speculative rows (stream ``perf.decode_sweep.spec``): one fused verify step of
``batch x (1 + k)`` rows (``k3_fastpath/runtime/verify_step.py``), fast vs the standard path doing the same
verify step, decode-only otherwise. Kept apart from the decode points and labelled on every row.

Per (batch, context, k), on ONE cache from the fast executor's pool (``batch`` sequences filled to
``context`` with synthetic state, ``perf_sweep.fill_cache``): a verify step of random feeds (every row
active) is captured once per backend (``DecodeExecutor.verify``: warm-up + capture) and its graph replayed
``iters`` times between CUDA events. Nothing is committed, so every replay is the same step. A verify step
costs the same whatever the drafts turn out to be, so the tokens per second per user at a synthetic
acceptance length ``L`` (tokens emitted per verify step: the kept drafts + 1, ``L <= k + 1``) are
``L / step time``, the seeds' measure. Backends: ``fast`` (our kernels: one ``kda_decode`` launch over each
request's rows, the GEMMs and experts at M = rows) and ``standard`` (``standard_graph``: cuBLAS, fla's
``fused_recurrent_kda_fwd`` over the rows with per-token state indices as vLLM runs speculative KDA,
``standard_verify.py``, the same MLA and experts ops as its decode step). A point whose rows do not fit a
fused step (``verify_reason``) is recorded with the reason, untimed. The weights are not rotated: each
step streams its whole weight set (>> L2) once, as the decode rows say.
"""

from __future__ import annotations

from typing import Any

import torch

from .perf_sweep import CONTEXT_SLACK, FILL_SEED, event_times_us, fill_cache, stats

SPEC_NOTE = "speculative verify step: 1 + k rows per request in one step (tokens/s/user at acceptance length L)"
SEEDS_TARGET = {"tokens_per_s_user": 842.0, "batch": 1, "k": 7, "acceptance_length": 6,
                "verify_over_decode": 1.3, "where": "the full k3-tp16-rank, compute only (issue #22)"}


def run_spec(model: Any, execs: list[tuple[str, Any]], batch: int, context: int, ks: list[int],
             acceptance: list[int], *, iters: int, seed: int, tp: int = 1) -> list[dict[str, Any]]:
    """The verify rows at one (batch, context): one per (backend, k) (module docstring). ``tp``: the TP size
    the rows stand for (an emulated rank's, as its decode rows say)."""
    fast = execs[0][1]
    cache = fast.new_cache(batch, context + max(ks) + 1 + CONTEXT_SLACK)
    fill_cache(cache, context, FILL_SEED + seed)
    g = torch.Generator().manual_seed(seed)
    rows = []
    try:
        for k in ks:
            T = k + 1
            feed = torch.randint(3, model.cfg.vocab_size, (batch, T), generator=g).to(model.device)
            common = {"variant": "spec", "batch": batch, "context": context, "tp": tp, "routing": "uniform", "k": k,
                      "tokens_per_request": T, "rows": batch * T, "note": SPEC_NOTE}
            for name, ex in execs:
                if ex is None:
                    continue
                why = ex.verify_reason(batch, T, cache)
                if why:
                    rows.append({**common, "backend": name, "not_fused": why})
                    continue
                ex.verify(feed, cache)  # warm-up + capture
                start = len(ex.trace)
                ex.verify(feed, cache)
                rec = ex.trace.since(start)[-1]
                key = ("verify", rec.bucket, T)
                if ex.graphs is not None and key in ex.graphs:
                    samples, timer = event_times_us(lambda ex=ex, key=key: ex.graphs.replay(key), iters, 1), \
                        "cuda_graph_replay"
                else:
                    samples, timer = event_times_us(lambda ex=ex, feed=feed: ex.verify(feed, cache),
                                                    max(3, iters // 4), 0), "eager"
                s = stats(samples)
                med = s["step_us_median"]
                rows.append({**common, "backend": name, **s, "timer": timer, "graph": rec.graph,
                             "kernels": dict(rec.kernels), "standard_ops": list(rec.standard_ops),
                             "kernel_fallbacks": dict(rec.kernel_fallbacks),
                             "tokens_per_s_user": {str(n): n * 1e6 / med for n in acceptance if n <= T}})
        return rows
    finally:
        if hasattr(cache, "release"):
            cache.release()


def spec_summary(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> dict[str, Any]:
    """The check's ``metrics.spec`` (information only; ``rescore_decode_sweep`` re-derives it): per (batch,
    context, k) each backend's median verify step, over the same backend's decode step at that point and TP
    (``x_decode``, uniform routing), tokens/s/user per acceptance length, fast's speed-up over standard; the
    seeds' target (``SEEDS_TARGET``) read at batch 1, k 7."""
    decode = {(p["backend"], p["batch"], p["context"], p.get("tp")): p["step_us_median"] for p in points
              if p.get("variant") == "decode" and p.get("routing") == "uniform"}
    out: dict[str, Any] = {}
    for r in rows:
        key = f"b{r['batch']} ctx{r['context']} k{r['k']}"
        if "not_fused" in r:
            out.setdefault(key, {})[r["backend"]] = {"not_fused": r["not_fused"]}
            continue
        d = decode.get((r["backend"], r["batch"], r["context"], r.get("tp", 1)))
        out.setdefault(key, {})[r["backend"]] = {
            "step_us_median": round(r["step_us_median"], 1), "timer": r["timer"],
            "x_decode": round(r["step_us_median"] / d, 3) if d else None,
            "tokens_per_s_user": {n: round(v, 1) for n, v in r["tokens_per_s_user"].items()}}
    for point in out.values():
        f, s = point.get("fast", {}), point.get("standard", {})
        if "step_us_median" in f and "step_us_median" in s:
            point["standard_over_fast"] = round(s["step_us_median"] / f["step_us_median"], 3)
    if not out:
        return {}
    summary: dict[str, Any] = {"note": SPEC_NOTE, "by_point": out}
    seeds = [v["fast"] for k, v in out.items() if k.startswith("b1 ") and k.endswith(" k7") and "x_decode" in
             v.get("fast", {})]
    if seeds:
        t = SEEDS_TARGET
        summary["seeds_target"] = {**t, "measured_tokens_per_s_user": seeds[0]["tokens_per_s_user"].get(
            str(t["acceptance_length"])), "measured_verify_over_decode": seeds[0]["x_decode"]}
    return summary
