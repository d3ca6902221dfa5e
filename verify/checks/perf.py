"""Performance checks. ``perf.bandwidth_probe`` measures what every floor in the bundle is divided by.

Read bandwidth: a read-only reduction over a ``bytes``-sized BF16 buffer (far larger than the 60 MB
L2), timed with CUDA events, 3 warm-ups and 20 timed repeats; the median is the run's read bandwidth.
Also a 2 GiB BF16 GEMV through cuBLAS (``torch.mv``) and the dense BF16 matmul rate (8192^3), so a
reader can tell a slow machine from a slow kernel. The check fails when the repeats spread by more than
10% (a throttling or shared GPU makes every ratio in the bundle meaningless).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

from verify.checks import status_rules
from verify.checks.registry import check
from verify.context import CheckContext


def _time_ms(fn, warmup: int = 3, repeats: int = 20) -> list[float]:
    from verify.checks.perf_sweep import event_times_us

    return [t / 1e3 for t in event_times_us(fn, repeats, warmup)]


def measure_read_bandwidth(nbytes: int = 4 << 30) -> dict[str, Any]:
    """Median read bandwidth (bytes/s) of a read-only reduction over ``nbytes`` of BF16."""
    import torch

    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    times = _time_ms(lambda: x.sum(dtype=torch.float32))
    med = statistics.median(times)
    return {"bytes": nbytes, "median_ms": med, "read_bytes_per_s": nbytes / (med * 1e-3), "times_ms": times}


def _gemv_probe() -> tuple[list[float], float]:
    """cuBLAS BF16 GEMV over 2 GiB of weights: (times in ms, read bytes/s)."""
    import torch

    n = 32768
    k = (2 << 30) // (2 * n)
    w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    v = torch.empty(k, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    times = _time_ms(lambda: torch.mv(w, v))
    return times, w.numel() * 2 / (statistics.median(times) * 1e-3)


def _matmul_probe() -> tuple[list[float], float]:
    """Dense BF16 8192^3 matmul: (times in ms, TFLOP/s)."""
    import torch

    a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    times = _time_ms(lambda: a @ a, warmup=3, repeats=10)
    return times, 2 * 8192**3 / (statistics.median(times) * 1e-3) / 1e12


@check("perf.bandwidth_probe",
       "the GPU's measured HBM read bandwidth and bf16 matmul rate (the floor every perf number is divided by)",
       requires=("cuda",))
def bandwidth_probe(ctx: CheckContext, bytes: int = 4 << 30) -> Any:
    import torch

    read = measure_read_bandwidth(int(bytes))
    torch.cuda.empty_cache()
    gemv, gemv_bw = _gemv_probe()
    torch.cuda.empty_cache()
    mm, tflops = _matmul_probe()
    torch.cuda.empty_cache()
    ctx.record({"probe": "read_reduction", **read})
    ctx.record({"probe": "cublas_gemv", "bytes": 2 << 30, "times_ms": gemv, "read_bytes_per_s": gemv_bw})
    ctx.record({"probe": "bf16_matmul_8192", "times_ms": mm, "tflops": tflops})
    spread = (max(read["times_ms"]) - min(read["times_ms"])) / statistics.median(read["times_ms"])
    metrics = {"read_tb_per_s": read["read_bytes_per_s"] / 1e12, "cublas_gemv_tb_per_s": gemv_bw / 1e12,
               "bf16_matmul_tflops": tflops, "read_spread": spread, "device": torch.cuda.get_device_name(0)}
    return ctx.verdict(status_rules.bandwidth_probe_problems(ctx.recorded), metrics)


# ------------------------------------------------------------------------------------------ decode sweep
# Issue #5 targets (H200), judged by decode_sweep so the bundle states each as met or missed.
TARGET_FAST_X_FLOOR = 1.15  # fast-path decode step <= 1.15x its HBM floor at every batch 1..64
TARGET_SPEEDUP = {1: 2.4, 8: 1.8, 64: 1.4}  # fast vs standard, same process, same cache
SWEEP_PRESET = "k3-mini"


def _sweep_targets(points: list[dict], allreduce: list[dict]) -> tuple[dict[str, Any], list[str]]:
    """Metrics (each target with its numbers and met / missed) and the problems that fail the check."""
    problems: list[str] = []
    targets: dict[str, Any] = {}
    fast = [p for p in points if p["backend"] == "fast" and p.get("variant") == "decode"]
    graphs = [p for p in fast if p.get("timer") == "cuda_graph_replay"]
    worst = max(graphs, key=lambda p: p["x_floor"], default=None)
    if worst is not None:
        met = worst["x_floor"] <= TARGET_FAST_X_FLOOR
        targets["fast_step_x_floor"] = {
            "target": f"<= {TARGET_FAST_X_FLOOR}x the HBM floor at every batch 1..64", "status": "met" if met else "missed",
            "worst": round(worst["x_floor"], 3), "at": {k: worst[k] for k in ("batch", "context", "tp", "routing")},
            "by_point": {f"tp{p['tp']} b{p['batch']} ctx{p['context']} {p['routing']}": round(p["x_floor"], 3)
                         for p in graphs}}
        if not met:
            problems.append(f"fast step {worst['x_floor']:.2f}x its floor at batch {worst['batch']} context "
                            f"{worst['context']} ({worst['routing']}) > {TARGET_FAST_X_FLOOR}x")
    for p in fast:
        if p.get("timer") != "cuda_graph_replay":
            problems.append(f"batch {p['batch']} context {p['context']}: the fast executor did not run a captured "
                            f"fast step ({p.get('fallback')})")
    by_key = {}
    for p in points:
        if p.get("variant") == "decode":
            by_key.setdefault((p["tp"], p["batch"], p["context"], p["routing"]), {})[p["backend"]] = p
    for b, want in TARGET_SPEEDUP.items():
        got = {k: v["standard"]["step_us_median"] / v["fast"]["step_us_median"] for k, v in by_key.items()
               if k[1] == b and "standard" in v and "fast" in v}
        if not got:
            targets[f"speedup_batch_{b}"] = {"target": f">= {want}x", "status": "not measured"}
            continue
        low_key = min(got, key=got.get)
        met = got[low_key] >= want
        targets[f"speedup_batch_{b}"] = {"target": f">= {want}x fast vs standard", "status": "met" if met else "missed",
                                         "min": round(got[low_key], 3), "at_context": low_key[2],
                                         "by_point": {f"ctx{k[2]} {k[3]}": round(v, 3) for k, v in got.items()}}
        if not met:
            problems.append(f"fast vs standard at batch {b}: {got[low_key]:.2f}x < {want}x (context {low_key[2]})")
    if allreduce:
        slow = [r for r in allreduce if r["speedup"] <= 1.0]
        targets["tp2_fused_allreduce_vs_unfused"] = {
            "target": "fused all-reduce + residual + norm faster than NCCL all-reduce + separate ops",
            "status": "missed" if slow else "met",
            "speedup_by_batch": {str(r["batch"]): round(r["speedup"], 3) for r in allreduce},
            "fused_us_by_batch": {str(r["batch"]): round(r["fused_us"], 2) for r in allreduce},
            "unfused_us_by_batch": {str(r["batch"]): round(r["unfused_us"], 2) for r in allreduce}}
        problems += [f"TP2 fused all-reduce+norm at batch {r['batch']}: {r['fused_us']:.1f} us, not faster than "
                     f"unfused {r['unfused_us']:.1f} us" for r in slow]
    ref = {k: v["reference"]["step_us_median"] / v["fast"]["step_us_median"] for k, v in by_key.items()
           if "reference" in v and "fast" in v}
    if ref:
        targets["fast_vs_eager_reference"] = {
            "target": "information only: the eager PyTorch reference model, not the standard path of the targets",
            "by_point": {f"tp{k[0]} b{k[1]} ctx{k[2]} {k[3]}": round(v, 3) for k, v in ref.items()}}
    std_x = {f"tp{k[0]} b{k[1]} ctx{k[2]} {k[3]}": round(v["standard"]["x_floor"], 3) for k, v in by_key.items()
             if "standard" in v and "x_floor" in v["standard"]}
    if std_x:
        targets["standard_x_floor"] = {"target": "information only: the standard path's step / the HBM floor",
                                       "by_point": std_x}
    var = {}
    for p in points:
        if p.get("variant_of") == "fast" and p.get("vs_fast"):
            var.setdefault(p["backend"], {"options": p.get("options"), "by_point": {}})["by_point"][
                f"tp{p['tp']} b{p['batch']} ctx{p['context']} {p['routing']}"] = round(p["vs_fast"], 3)
    if var:
        targets["fast_variants"] = {"target": "information only: fast's step / the variant's step (> 1: the "
                                              "variant is faster), same cache, same process", **var}
    typed = [p for p in points if p.get("pct_of_floor_by_layer_type")]
    if typed:  # the issue asks for the standard path's % of floor next to the fast path's, per layer type
        by_point: dict[str, dict[str, Any]] = {}
        for p in typed:
            by_point.setdefault(f"tp{p['tp']} b{p['batch']} ctx{p['context']} {p['routing']}", {})[p["backend"]] = {
                k: round(v, 3) for k, v in p["pct_of_floor_by_layer_type"].items()}
        targets["pct_of_floor_by_layer_type"] = {
            "target": "information only: floor / measured time per layer type (fast and standard: section graphs; "
                      "reference: eager module events)", "by_point": by_point}
    return targets, problems


def eager_reference_row(record: Mapping[str, Any]) -> bool:
    """A sweep row of the eager PyTorch reference model: no target gates it (``fast_vs_eager_reference`` is
    information only) and its times are bound by the host's dispatch, so its per-layer split moves run to
    run beyond any spread 3 rounds record (bundles/runs/2026-12-02-h200-session12)."""
    return record.get("backend") == "reference" and record.get("timer") == "eager"


@check("perf.decode_sweep",
       "decode step time, fast vs standard, batch x context x TP x routing, against the HBM floor",
       requires=("cuda", "sm90", "cutlass"), information_only=eager_reference_row)
def decode_sweep(ctx: CheckContext, batches: list[int] = [1], contexts: list[int] = [1024],
                 tp: list[int] = [1], routing: list[str] = ["uniform", "real"], mixed: bool = True,
                 preset: str = SWEEP_PRESET,
                 iters: int = 20, standard_iters: int = 5, warmup: int = 3, kv_cache: str = "bf16",
                 mixed_batches: list[int] = [1, 8], mixed_prefill_tokens: int = 256, mixed_max_context: int = 4096,
                 mixed_reference: bool = True,
                 standard_graph: bool = True, reference_batches: list[int] | None = None,
                 layer_times: bool = True, standard_compiled_glue: bool = False,
                 standard_mxfp4_experts: bool | None = None,
                 fast_variants: dict[str, dict[str, Any]] | None = None, single_expert_copy: bool = False,
                 tp_fast_pdl: bool = False, kernel_profile: bool = False, spec_ks: list[int] = [],
                 spec_batches: list[int] = [1, 8], spec_acceptance: list[int] = [2, 4, 6]) -> Any:
    """Decode step time, fast vs standard in one process, batch x context x TP, against the HBM floor
    measured in this run (verify/checks/perf_sweep.py says how each number is taken). ``reference_batches``:
    the batches that also time the eager reference model (information only, slow at long context; default
    all); ``layer_times``: per-layer-type times of the fast and standard graph paths;
    ``standard_compiled_glue``: the standard path's glue through torch.compile (rows say ``standard_glue``);
    ``standard_mxfp4_experts``: the standard path's experts in MXFP4 through humming-kernels, the fast path's
    expert bytes, as vLLM runs them on Hopper (rows say ``expert_format``; ``runtime/standard_mxfp4.py``);
    default (None): so for a model with MXFP4 experts, and a run where humming cannot serve them fails with
    the reason rather than timing a BF16 stand-in; ``false`` times BF16 experts (4x the bytes, said per row);
    ``fast_variants``: more fast executors timed beside ``fast`` on the same cache, e.g. ``{fast_pdl: {pdl:
    true}, fast_mma: {gemm_wgmma_min_m: 0}}`` (TP1 points; ``perf_sweep.check_fast_variants``);
    ``single_expert_copy``: the executors keep the routed experts once, in the kernel's layout
    (``step_plan.ExpertBank``; what lets a full TP16 rank fit an H200), TP1 points; ``tp_fast_pdl``: TP > 1
    points also time the fast TP decoder with PDL (row ``fast_pdl``, same cache); ``kernel_profile``: TP1
    fast / standard / variant graph rows also record device time per kernel and op (own and exclusive) and
    the GPU's idle time in the step (``k3_fastpath/measure/kernel_profile.py``); ``mixed``: at ``mixed_batches``
    and contexts up to ``mixed_max_context``, a mixed step (those sequences decode while one more prefills
    ``mixed_prefill_tokens``) on each backend, graph-captured, into the ``mixed`` stream, apart from the
    decode-only points (``perf_mixed.py``; ``mixed_reference`` adds the eager reference model's step,
    information only); ``spec_ks``: at ``spec_batches``, a fused speculative verify step of ``1 + k`` rows per
    request for each k on the fast and standard backends, into the ``spec`` stream (``perf_spec.py``;
    tokens/s/user at the synthetic acceptance lengths ``spec_acceptance``). On a checkpoint run the
    model is the checkpoint (TP1: the tensors the run read; TP > 1: each rank reads its slices from the same
    directory) and ``preset`` is not used."""
    import torch

    from k3_fastpath._lib.timing import read_bandwidth_gbs
    from k3_fastpath.measure.device_synthetic import device_model
    from k3_fastpath.presets import get_config
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.runtime.options import DecodeOptions, defaults
    from k3_fastpath.runtime.verify_step import MAX_VERIFY_ROWS
    from verify.checks import perf_mixed as M
    from verify.checks import perf_spec as SP
    from verify.checks import perf_sweep as S

    routing = list(routing)
    bad = [r for r in routing if r not in ("uniform", "real")]
    if bad or not batches or not contexts or not tp:
        return ctx.failed(f"bad sweep parameters: routing {bad or routing}, batches {batches}, contexts {contexts}, "
                          f"tp {tp}")
    bad_variants = S.check_fast_variants(fast_variants)
    if bad_variants:
        return ctx.failed(bad_variants)
    kv_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}.get(kv_cache)
    if kv_dtype is None:
        return ctx.failed(f"kv_cache must be bf16 or fp8, got {kv_cache!r}")
    if any(not 1 <= k <= 7 for k in spec_ks) or any(n < 1 for n in spec_acceptance):
        return ctx.failed(f"spec_ks {spec_ks} must lie in 1..7 and spec_acceptance {spec_acceptance} be >= 1")
    spec_tokens = max(spec_ks) + 1 if spec_ks else 0
    spec_scratch = MAX_VERIFY_ROWS if spec_ks else 0  # the KDA scratch slots of the executors' pools
    from k3_fastpath.measure.rank_emulation import (
        RankEmulationError,
        cache_pool_bytes,
        emulation_model,
        emulation_record,
    )
    from k3_fastpath.presets import is_preset_spec, preset_spec

    if ctx.on_checkpoint:  # the run's checkpoint, whatever the tier's preset says (TP1: its tensors as read)
        if preset != SWEEP_PRESET:
            ctx.note(f"preset {preset}: not used, this run verifies checkpoint {ctx.model_source.path}")
        preset = ctx.preset
    spec = preset_spec(preset) if is_preset_spec(preset) else None
    rank_tp = spec.tp_size if spec is not None else 1
    cfg = spec.config if spec is not None else ctx.config if ctx.on_checkpoint else get_config(preset)
    if rank_tp > 1 and list(tp) != [1]:
        return ctx.failed(f"preset {preset} is one emulated rank of TP{rank_tp} on one GPU: tp must be [1], got {tp}")
    bw = read_bandwidth_gbs() * 1e9
    ctx.record({"probe": "read_bandwidth", "read_bytes_per_s": bw, "preset": preset})
    points: list[dict] = []
    mixed_rows: list[dict] = []
    spec_rows: list[dict] = []
    notes: list[str] = []
    allreduce: list[dict] = []

    def emit(rows: list[dict], stream: str | None = None) -> None:
        for r in rows:
            if stream:
                ctx.writer.record(f"{ctx.check_id}.{stream}", r)
            else:
                ctx.record(r)
                points.append(r)

    def over_budget(what: str) -> bool:
        if ctx.elapsed() > 0.9 * ctx.budget_s:
            notes.append(f"{what}: skipped, the check is past 90% of its {ctx.budget_s:.0f}s budget")
            return True
        return False

    if standard_mxfp4_experts is None:  # the model's own expert format, as a Hopper user serves it
        standard_mxfp4_experts = cfg.expert_format == "mxfp4"
    std_experts = "mxfp4" if standard_mxfp4_experts else "bf16"
    if standard_graph and standard_mxfp4_experts:
        from k3_fastpath.runtime.standard_mxfp4 import humming_unavailable

        why = humming_unavailable(f"cuda:{torch.cuda.current_device()}")
        if why:
            return ctx.failed(f"the standard path's MXFP4 experts: {why} (standard_mxfp4_experts: false times BF16 "
                              "experts instead, 4x the bytes)")
    if 1 in tp and rank_tp > 1:  # one TP rank's shards as a TP1 model, no communication (rank_emulation.py)
        max_len = max(contexts) + mixed_prefill_tokens + 2 * S.CONTEXT_SLACK
        t_build = time.perf_counter()
        try:
            model, spec = emulation_model(preset, ctx.seed, "cuda", standard=standard_graph,
                                          single_copy=single_expert_copy, standard_experts=std_experts,
                                          cache_bytes=cache_pool_bytes(cfg, rank_tp,
                                                                       slots=max(batches) + 1 + spec_scratch,
                                                                       max_len=max_len,
                                                                       kv_bytes=1 if kv_cache == "fp8" else 2))
        except RankEmulationError as e:
            return ctx.failed(str(e))
        ctx.record({"probe": "rank_emulation", **emulation_record(spec, standard=standard_graph, batch=max(batches),
                                                                  single_copy=single_expert_copy,
                                                                  standard_experts=std_experts),
                    "build_s": round(time.perf_counter() - t_build, 1)})
        mixed = False
        notes.append(f"{spec.name}: rank 0 of TP{rank_tp} emulated on one GPU (no all-reduce; TP2 rows measure "
                     f"communication); mixed variant off")
    elif 1 in tp and ctx.on_checkpoint:
        from verify.model_source import build_reference_model

        model = build_reference_model(cfg, ctx.state_dict(), "cuda")
    elif 1 in tp:
        model = device_model(cfg, ctx.seed, "cuda")
    if 1 in tp:
        for context in sorted(contexts):
            if over_budget(f"tp=1 context={context}"):
                continue
            max_len = context + mixed_prefill_tokens + 2 * S.CONTEXT_SLACK
            t_exec = time.perf_counter()
            mb = M.mixed_max_batch(batches, mixed and context <= mixed_max_context, mixed_batches)
            fast_opts = DecodeOptions(single_expert_copy=single_expert_copy)
            fast = DecodeExecutor(model, backend="latency_specialized", max_batch=mb, max_len=max_len,
                                  kv_dtype=kv_dtype, options=fast_opts, spec_tokens=spec_tokens)
            std = DecodeExecutor(model, backend="standard", max_batch=mb, max_len=max_len, kv_dtype=kv_dtype)
            strong = DecodeExecutor(model, backend="standard_graph", max_batch=mb, max_len=max_len,
                                    kv_dtype=kv_dtype, pool_from=fast, spec_tokens=spec_tokens,
                                    options=defaults("standard_graph").replace(
                                        single_expert_copy=single_expert_copy,
                                        standard_compiled_glue=standard_compiled_glue,
                                        standard_mxfp4_experts=standard_mxfp4_experts)) if standard_graph else None
            variants = {}
            for name, opts in (fast_variants or {}).items():
                variants[name] = (DecodeExecutor(model, backend="latency_specialized", max_batch=mb,
                                                 max_len=max_len, kv_dtype=kv_dtype, pool_from=fast,
                                                 options=fast_opts.replace(**opts), spec_tokens=spec_tokens), opts)
            notes.append(f"tp=1 context={context}: executors built in {time.perf_counter() - t_exec:.1f}s")
            for batch in sorted(batches):
                for r in routing:
                    if over_budget(f"tp=1 batch={batch} context={context} {r}"):
                        continue
                    t_point = time.perf_counter()
                    try:
                        rows = S.run_point(model, fast, std, batch, context, r, bw=bw, iters=iters,
                                           standard_iters=standard_iters, warmup=warmup, seed=ctx.seed,
                                           strong=strong, layer_times=layer_times,
                                           reference=reference_batches is None or batch in reference_batches,
                                           floor_cfg=cfg, rank_tp=rank_tp, variants=variants,
                                           kernel_profile=kernel_profile)
                        wall = round(time.perf_counter() - t_point, 1)
                        emit([{**row, "point_wall_s": wall} for row in rows])
                    except torch.cuda.OutOfMemoryError as e:
                        notes.append(f"tp=1 batch={batch} context={context} {r}: out of memory "
                                     f"({str(e).splitlines()[0][:120]})")
                        torch.cuda.empty_cache()
                if mixed and batch in mixed_batches and context <= mixed_max_context and not over_budget("mixed"):
                    try:
                        rows = M.run_mixed(model, fast, strong, std, batch, context, mixed_prefill_tokens,
                                           iters=iters, standard_iters=standard_iters, seed=ctx.seed,
                                           reference=mixed_reference)
                        emit(rows, stream="mixed")
                        mixed_rows += rows
                    except torch.cuda.OutOfMemoryError as e:
                        notes.append(f"mixed batch={batch} context={context}: out of memory ({str(e)[:120]})")
                        torch.cuda.empty_cache()
                if spec_ks and batch in spec_batches and not over_budget(f"spec batch={batch} context={context}"):
                    try:
                        rows = SP.run_spec(model, [("fast", fast), ("standard", strong)], batch, context, spec_ks,
                                           spec_acceptance, iters=iters, seed=ctx.seed, tp=rank_tp)
                        emit(rows, stream="spec")
                        spec_rows += rows
                    except torch.cuda.OutOfMemoryError as e:
                        notes.append(f"spec batch={batch} context={context}: out of memory ({str(e)[:120]})")
                        torch.cuda.empty_cache()
            if mixed and context > mixed_max_context:
                notes.append(f"mixed variant at context {context}: skipped (> mixed_max_context {mixed_max_context})")
            fast.close()
            std.close()
            if strong is not None:
                strong.close()
            for ex, _, _ in variants.values():
                ex.close()
            del fast, std, strong, variants
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    for size in (t for t in tp if t > 1):
        visible = torch.cuda.device_count()
        if visible < size:
            notes.append(f"tp={size}: skipped, {visible} GPU(s) visible")
            continue
        if over_budget(f"tp={size}"):
            continue
        from k3_fastpath.runtime.tp_launch import launch

        params = {"preset": preset, "batches": sorted(batches), "contexts": sorted(contexts), "routing": routing,
                  "iters": iters, "standard_iters": standard_iters, "seed": ctx.seed, "bw": bw,
                  "reference_batches": sorted(reference_batches or batches),
                  "standard_compiled_glue": standard_compiled_glue, "standard_mxfp4_experts": standard_mxfp4_experts,
                  "tp_fast_pdl": tp_fast_pdl,
                  "checkpoint": ctx.model_source.path}  # a checkpoint: each rank reads its slices of it
        merged = S.merge_ranks(launch(S.tp_worker, size, (params,), backend="nccl",
                                      timeout_s=max(60.0, ctx.budget_s - ctx.elapsed())))
        emit(merged["rows"])
        emit(merged["allreduce"], stream="allreduce")
        allreduce += merged["allreduce"]
        notes += merged["notes"]
    for n in notes:
        ctx.note(n)
    targets, problems = _sweep_targets(points, allreduce)
    weights = ctx.weights() if ctx.on_checkpoint else f"synthetic (seed {ctx.seed}, drawn on the GPU)"
    metrics = {"preset": preset, "weights": weights, "read_bandwidth_tb_per_s": bw / 1e12, "points": len(points), "targets": targets,
               "notes": notes,
               "cold_l2": "weights are not rotated: each step streams its whole weight set (>> the 60 MB L2) once, "
                          "so every weight is cold when read; per point in records[cold_l2]"}
    if mixed_rows:
        metrics["mixed"] = M.mixed_summary(mixed_rows, points)
    if spec_rows:
        metrics["spec"] = SP.spec_summary(spec_rows, points)
    if not points:
        problems.insert(0, "no sweep point was measured" + (f": {notes[0]}" if notes else ""))
    return ctx.verdict(problems, metrics)


def rescore_decode_sweep(records: Any, result: Any) -> list[str]:
    """``bundle verify``: re-derive each sweep point's statistics, every target's status and the check's status
    (failed exactly when a target is missed or no point was measured) from the raw records (step samples,
    floors, the all-reduce rows) and compare them with what the result states."""
    import math

    if result.id != "perf.decode_sweep" or result.status in ("skipped", "error"):
        return []
    problems: list[str] = []
    points = [r for r in records.get("perf.decode_sweep", []) if all(k in r for k in ("batch", "context", "backend"))]
    for i, p in enumerate(points, start=1):
        xs = sorted(p.get("step_us_samples") or [])
        med = p.get("step_us_median")
        if xs and isinstance(med, (int, float)) and not math.isclose(statistics.median(xs), med, rel_tol=1e-3,
                                                                      abs_tol=1e-3):
            problems.append(f"point {i}: step_us_median {med} but its samples give {statistics.median(xs)}")
        if p.get("floor_us") and "pct_of_floor" in p and isinstance(med, (int, float)) and \
                not math.isclose(p["pct_of_floor"], p["floor_us"] / med, rel_tol=1e-6):
            problems.append(f"point {i}: pct_of_floor {p['pct_of_floor']} != floor_us / step_us_median")
    if "mixed" in result.metrics:
        from verify.checks.perf_mixed import mixed_summary

        if mixed_summary(list(records.get("perf.decode_sweep.mixed", [])), points) != result.metrics["mixed"]:
            problems.append("metrics.mixed is not what the perf.decode_sweep.mixed records give")
    if "spec" in result.metrics:
        from verify.checks.perf_spec import spec_summary

        if spec_summary(list(records.get("perf.decode_sweep.spec", [])), points) != result.metrics["spec"]:
            problems.append("metrics.spec is not what the perf.decode_sweep.spec records give")
    claimed = result.metrics.get("targets")
    if not isinstance(claimed, dict):  # a result that states no targets (an older writer): nothing to compare
        return problems
    needed = ("variant", "tp", "routing", "step_us_median", "x_floor")
    if not all(all(k in p for k in needed) for p in points):
        return problems + ["the result states targets but its points lack the keys they are derived from"]
    allreduce = list(records.get("perf.decode_sweep.allreduce", []))
    targets, missed = _sweep_targets(points, allreduce)
    for name, t in targets.items():
        if not isinstance(t, dict) or "status" not in t:
            continue
        got = (claimed.get(name) or {}).get("status")
        if got != t["status"]:
            problems.append(f"target {name}: the result says {got!r}, the records give {t['status']!r}")
    want = "failed" if missed or not points else "passed"  # the check's own rule: a missed target fails it
    if result.status != want:
        problems.append(f"status {result.status!r}, but its records give {want!r}"
                        + (f" ({missed[0]})" if missed else ""))
    return problems

