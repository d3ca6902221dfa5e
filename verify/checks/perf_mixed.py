"""``perf.decode_sweep``'s mixed rows (stream ``perf.decode_sweep.mixed``): a step that decodes ``batch``
sequences at ``context`` while one more sequence prefills ``prefill_tokens`` prompt tokens, the shape of a
serving engine's chunked-prefill step. Kept apart from the decode-only points and labelled on every row.

Per (batch, context), on ONE cache from the fast executor's slot pool (``batch`` sequences filled to
``context`` with synthetic state, ``perf_sweep.fill_cache``; the prefilling sequence empty):

- ``fast``: ``DecodeExecutor(latency_specialized).mixed``: outside the fast envelope, so it falls back to
  the standard mixed step (``k3_fastpath/runtime/mixed_step.py``) and the row names the fallback;
- ``standard``: ``DecodeExecutor(standard_graph).mixed``: the same mixed step on the standard op table:
  cuBLAS projections, fla's chunked KDA and SDPA for the prompt, fla's recurrent KDA and the chunked
  absorbed MLA for the decode rows, ``torch._grouped_mm`` experts;
- ``reference`` (``mixed_reference``, information only): the eager reference model's ``prefill`` of the
  same right-padded step.

Both graph rows capture the step once (one eager warm-up that compiles and autotunes, then the capture) and
time ``iters`` replays with CUDA events, as the decode rows do; a key whose capture failed is timed eagerly
and says why. Each row records which implementation served the prompt (``prefill_impl``) and the timer.
"""

from __future__ import annotations

from typing import Any

import torch

from .perf_sweep import CONTEXT_SLACK, FILL_SEED, event_times_us, fill_cache, stats, throughput

MIXED_NOTE = "mixed step: decode rows + one sequence's prefill in one step (not decode-only)"


def mixed_max_batch(batches: list[int], mixed: bool, mixed_batches: list[int]) -> int:
    """The executors' ``max_batch`` for a sweep: its largest decode batch, or a mixed point's batch + 1."""
    return max(list(batches) + ([b + 1 for b in mixed_batches] if mixed else []))


def _row_cache(fast: Any, batch: int, context: int, prefill_tokens: int, seed: int) -> Any:
    """``batch + 1`` sequences from the fast executor's pool: the first ``batch`` at ``context`` positions of
    synthetic state, the last empty (length 0, zero KDA state) for the prompt."""
    from k3_fastpath.reference.kda import KDACache

    cache = fast.new_cache(batch + 1, context + prefill_tokens + CONTEXT_SLACK)
    fill_cache(cache, context, FILL_SEED + seed)
    for layer in cache.layers:
        if isinstance(layer, KDACache):
            for t in layer.tensors():
                t[batch].zero_()
    cache.lengths[batch] = 0
    return cache


def _prefill_impl(cap: Any) -> str:
    libs = {o["op"]: o["reason"] for o in (cap.standard_ops if cap is not None else [])}
    if not libs:
        return "reference model prefill (eager PyTorch: chunked KDA, plain MLA, per-expert loop)"
    return f"kda_prefill: {libs.get('kda_prefill')}; mla_prefill: {libs.get('mla_prefill')}"


def run_mixed(model: Any, fast: Any, strong: Any, std: Any, batch: int, context: int, prefill_tokens: int, *,
              iters: int, standard_iters: int, seed: int, reference: bool = True) -> list[dict[str, Any]]:
    """The mixed rows at one (batch, context): fast, standard (``strong``) and, with ``reference``, the eager
    reference (``std``), one record each (module docstring)."""
    cfg = model.cfg
    dev = model.device
    cache = _row_cache(fast, batch, context, prefill_tokens, seed)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, cfg.vocab_size, (batch + 1,), generator=g).to(dev)
    prompt = torch.randint(3, cfg.vocab_size, (prefill_tokens,), generator=g).to(dev)
    base = cache.lengths.clone()
    bound = cache.length_bound
    common = {"variant": "mixed", "batch": batch, "context": context, "tp": 1, "routing": "uniform",
              "prefill_tokens": prefill_tokens, "prefill_start": 0, "decode_sequences": batch, "note": MIXED_NOTE}
    rows = []
    try:
        def step(ex: Any) -> None:
            cache.lengths.copy_(base)
            cache.length_bound = bound
            ex.mixed(tokens, cache, batch, prompt)

        execs = [("fast", fast), ("standard", strong)] + ([("reference", std)] if reference else [])
        for name, ex in execs:
            if ex is None:
                continue
            start = len(ex.trace)
            step(ex)  # warm-up (+ capture on a GPU)
            step(ex)  # a replay when captured
            rec = ex.trace.since(start)[-1]
            cap = ex.mixed_capture(batch + 1, prefill_tokens, 0)
            if cap is not None and cap.graph is not None and rec.graph:
                samples, timer = event_times_us(cap.graph.replay, iters, 1), "cuda_graph_replay"
            else:
                samples, timer = event_times_us(lambda ex=ex: step(ex), max(3, standard_iters), 0), "eager"
            s = stats(samples)
            row = {**common, "backend": name, **s, "timer": timer, "fallback": rec.fallback, "step_kind": rec.kind,
                   "prefill_impl": _prefill_impl(cap), **throughput(s["step_us_median"], batch + prefill_tokens, 1)}
            if cap is not None:
                row["standard_ops"] = list(cap.standard_ops)
            why = ex.mixed_eager_reason(batch + 1, prefill_tokens, 0)
            if why:
                row["eager_reason"] = why
            if name == "reference":
                row["information_only"] = "the eager reference model: no serving engine runs its prefill"
            rows.append(row)
        return rows
    finally:
        if hasattr(cache, "release"):
            cache.release()


def mixed_summary(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> dict[str, Any]:
    """The check's ``metrics.mixed`` (information only; ``rescore_decode_sweep`` re-derives it): per (batch,
    context) each backend's median mixed step in microseconds and timer, and the mixed step over the same
    backend's decode-only step at that point (uniform routing): what one prompt of ``prefill_tokens`` costs
    the decoding sequences."""
    decode = {(p["backend"], p["batch"], p["context"]): p["step_us_median"] for p in points
              if p.get("variant") == "decode" and p.get("routing") == "uniform" and p.get("tp") == 1}
    out: dict[str, Any] = {}
    for r in rows:
        key = f"b{r['batch']} ctx{r['context']} +{r['prefill_tokens']} prompt tokens"
        d = decode.get((r["backend"], r["batch"], r["context"]))
        out.setdefault(key, {})[r["backend"]] = {
            "step_us_median": round(r["step_us_median"], 1), "timer": r["timer"],
            "x_decode_only": round(r["step_us_median"] / d, 2) if d else None}
    return {"note": MIXED_NOTE, "by_point": out} if out else {}
