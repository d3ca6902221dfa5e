"""The measurements behind ``perf.decode_sweep`` (verify/checks/perf.py holds the check and its targets).

Per TP1 point (batch x context x routing), in ONE process, on ONE cache:

1. three ``DecodeExecutor`` backends over the same model, built per context with ``max_len = context +
   slack`` (the standard MLA op reads the whole pool length, so the pool is sized to the point):
   ``latency_specialized`` (row ``backend: fast``), ``standard_graph`` (row ``backend: standard``: the
   strong standard path of the targets, cuBLAS + fla + the MXFP4 experts through humming-kernels
   (``standard_mxfp4_experts``, the default for MXFP4 models; else ``torch._grouped_mm`` over BF16 copies) +
   PyTorch glue in the same CUDA graphs, ``runtime/standard_ops.py``; ``standard_compiled_glue``: that glue through
   torch.compile, the row's ``standard_glue`` says which served) and ``standard`` (row ``backend:
   reference``: the eager PyTorch reference model, information only);
2. the cache (from the fast executor's slot pool; the standard backend runs the reference model on the same
   views) is filled to ``context`` positions cheaply and never with zeros: MLA latents ~ N(0, 1), KDA state
   ~ N(0, 0.05^2), conv state ~ N(0, 0.5^2) (``context_fill.synthesize_context``);
3. the step's tokens: ``uniform`` = seeded random ids, ``real`` = tokenized text (``routing.prompt_token_ids``);
   one standard step with router hooks records the experts each MoE layer touches (``touched_measured``);
   the floor uses the uniform expectation for ``uniform`` and the measured counts for ``real``;
4. fast and standard: one ``decode`` captures the bucket's CUDA graph, then ``iters`` timed graph replays
   (CUDA events around each; decode only, no prefill). Reference: ``standard_iters`` eager steps (it has
   host synchronisation and cannot be captured), plus one step with CUDA events at every attention / MLP
   module (its per-layer-type time). Fast and standard per-layer-type times come from the same step captured
   as one graph per section (``measure/section_timing.py``, ``layer_times``), next to each type's floor;
5. cold L2 without weight copies: a step streams its whole weight set (GBs for k3-mini) through the 60 MB
   L2 once per replay, so every weight is evicted before its next read; a point whose weight bytes are under
   3x the L2 says so in ``cold_l2``.

TP > 1 points run in one spawned process per GPU (``tp_worker``): ``backend: fast`` is the TP fast step
(``runtime/tp_fast.py``: the executor's kernels on the rank's shards, the fused symmetric-memory all-reduce +
Triton epilogue, CUDA-graph replays); ``backend: standard`` is the same TP step with the standard op table and
the unfused NCCL communicator (NCCL all-reduce, then separate PyTorch ops), CUDA-graph replays on the same
cache; ``backend: reference`` is the TP model of reference modules (``runtime/tp.py``) with the unfused
communicator, eager, with the same model on the fused communicator beside it as ``tp_step_fused_us``. The isolated op (all-reduce + residual + AttnRes + RMSNorm,
fused vs unfused, CUDA-graph medians) goes to the ``.allreduce`` stream. Every rank times its own steps;
the slowest rank's numbers are kept.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

FILL_SEED = 11
CONTEXT_SLACK = 64  # positions past the context for warm-up / timed standard steps
REFERENCE_LAYER_ROUNDS = 3  # instrumented eager reference steps per point (their per-layer median and spread)


def check_fast_variants(variants: dict[str, dict[str, Any]] | None) -> str | None:
    """Why ``fast_variants`` is malformed, or None. Names are row backends ``fast_<word>``; options are
    ``DecodeOptions`` fields (runtime/options.py, checked by ``DecodeOptions.from_mapping``), e.g.
    ``{fast_mma: {gemm_wgmma_min_m: 0}}``."""
    import re

    from k3_fastpath.runtime.options import DecodeOptions

    for name, opts in (variants or {}).items():
        if not re.fullmatch(r"fast_[a-z0-9_]+", str(name)):
            return f"fast_variants: name {name!r} must be fast_<lowercase word>"
        if not isinstance(opts, dict) or not opts:
            return f"fast_variants.{name}: expected a mapping of options, got {opts!r}"
        try:
            DecodeOptions.from_mapping(opts)
        except ValueError as e:
            return f"fast_variants.{name}: {e}"
    return None


# ------------------------------------------------------------------------------------------ timing
def event_times_us(fn: Callable[[], Any], iters: int, warmup: int = 1) -> list[float]:
    """Per-call times of ``fn`` in microseconds between CUDA events, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


def stats(samples: Sequence[float]) -> dict[str, Any]:
    xs = sorted(samples)
    return {"step_us_median": statistics.median(xs), "step_us_p10": xs[len(xs) // 10],
            "step_us_p90": xs[(9 * len(xs)) // 10], "samples_n": len(xs), "step_us_samples": [round(x, 3) for x in xs]}


def throughput(step_us: float, batch: int, tp: int) -> dict[str, float]:
    per_user = 1e6 / step_us
    return {"tokens_per_s_user": per_user, "tokens_per_s_gpu": per_user * batch / tp}


@contextmanager
def layer_type_events(model: Any):
    """CUDA events around every attention and MLP module of a reference model: yields a list that holds
    ``(layer type, start, end)`` once the step has run (types kda / mla / moe / dense_mlp)."""
    spans: list[tuple[str, Any, Any]] = []
    open_: list[tuple[str, Any]] = []
    handles = []
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        for mod, kind in ((layer.self_attn, "kda" if layer.is_kda else "mla"),
                          (moe if moe is not None else layer.mlp, "moe" if moe is not None else "dense_mlp")):
            def pre(m, args, kind=kind):
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                open_.append((kind, e))

            def post(m, args, out):
                kind, s = open_.pop()
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                spans.append((kind, s, e))
            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        yield spans
    finally:
        for h in handles:
            h.remove()


def per_layer_type_us(model: Any, step: Callable[[], Any], rounds: int = 1
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """(microseconds per layer type, their spreads) of ``rounds`` instrumented steps: each type's median and
    (p10 .. p90) / median over the rounds; ``other`` = the rest (embedding, AttnRes, norms, lm_head, launch
    gaps)."""
    per: dict[str, list[float]] = {}
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with layer_type_events(model) as spans:
            start.record()
            step()
            end.record()
            end.synchronize()
        one: dict[str, float] = {}
        for kind, s, e in spans:
            one[kind] = one.get(kind, 0.0) + s.elapsed_time(e) * 1e3
        one["other"] = max(0.0, start.elapsed_time(end) * 1e3 - sum(one.values()))
        for k, v in one.items():
            per.setdefault(k, []).append(v)
    from k3_fastpath.measure.section_timing import spread

    return {k: statistics.median(v) for k, v in per.items()}, {k: spread(v) for k, v in per.items()}


def timing_spread(section: dict[str, float] | None, by_type: dict[str, float]) -> dict[str, dict[str, float]]:
    """A row's ``timing_spread``: the run-to-run spread of each nested timing it records, by field and key
    (``bundle audit`` compares ``<field>.<key>`` within it). ``pct_of_floor_by_layer_type`` is a floor
    divided by ``per_layer_type_us``: the same spread."""
    out = {"per_layer_type_us": dict(by_type), "pct_of_floor_by_layer_type": dict(by_type)}
    if section is not None:
        out["section_us"] = dict(section)
    return {f: {k: round(v, 4) for k, v in d.items()} for f, d in out.items()}


# ------------------------------------------------------------------------------------------ one point
def tokens_for(cfg: Any, routing: str, batch: int, seed: int) -> tuple[torch.Tensor, str]:
    from k3_fastpath.measure.routing import prompt_token_ids

    if routing == "uniform":
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, cfg.vocab_size, (batch,), generator=g), f"seeded random token ids (seed {seed})"
    if routing == "real":
        ids, source = prompt_token_ids(cfg, batch, 8, seed=seed)
        return ids[:, -1].contiguous(), source
    raise ValueError(f"routing must be 'uniform' or 'real', got {routing!r}")


def floor_for(cfg: Any, tp: int, batch: int, context: int, kv_bytes: int, routing: str,
              touched_measured: list[int] | None, bw: float) -> dict[str, Any]:
    from k3_fastpath.measure import floor as F

    touched = None if routing == "uniform" or touched_measured is None else touched_measured
    sb = F.step_bytes(cfg, tp=tp, batch=batch, context=context, kv_bytes=kv_bytes, touched=touched)
    try:
        split = F.step_bytes(cfg, tp=tp, batch=batch, context=context, kv_bytes=kv_bytes, touched=touched,
                             moe_latent_sharded=True)
    except ValueError:  # a front that does not divide by tp (tp_moe_front refuses it too)
        split = None
    return {"floor_us": sb.floor_us(bw), "floor_bytes": sb.total, "weight_bytes": sb.weight_bytes,
            # the floor with the LatentMoE router and latent projections split across the ranks
            # (runtime/tp_moe_front.py), which the one-GPU steps here do not run: equal to floor_us at TP1
            "floor_us_split_front": split.floor_us(bw) if split else None,
            "floor_bytes_split_front": split.total if split else None,
            "floor_us_by_layer_type": sb.floor_us_by_layer_type(bw), "touched_experts_floor": list(sb.touched),
            "cold_l2": (f"by volume: a step reads {sb.weight_bytes / 1e9:.2f} GB of weights, "
                        f"{sb.weight_bytes / F.L2_BYTES:.0f}x the 60 MB L2, so each weight is evicted before its "
                        f"next read" if sb.weight_bytes >= 3 * F.L2_BYTES else
                        f"NOT cold: {sb.weight_bytes / 1e6:.1f} MB of weights may stay in the 60 MB L2")}


def fill_cache(cache: Any, context: int, seed: int) -> None:
    from verify.checks.context_fill import synthesize_context

    synthesize_context(cache, context, seed)
    if hasattr(cache, "length_bound"):
        cache.length_bound = context


def kv_bytes_of(cache: Any) -> int:
    from k3_fastpath.reference.mla import MLACache

    for layer in cache.layers:
        if isinstance(layer, MLACache):
            return layer.latent.element_size()
    return 2


def _graph_row(ex: Any, tokens: torch.Tensor, cache: Any, out: torch.Tensor, iters: int, warmup: int,
               standard_iters: int) -> tuple[list[float], dict[str, Any]]:
    """One ``decode`` (captures the bucket's graph), then timed replays; eager timing with the reason when the
    step did not run as a captured step."""
    from k3_fastpath.runtime.graphs import bucket_for

    start = len(ex.trace)
    ex.decode(tokens, cache, out=out)
    rec = ex.trace.since(start)[-1] if len(ex.trace) > start else None
    bucket = bucket_for(int(tokens.shape[0]), ex.buckets)
    if ex.graphs is not None and bucket in ex.graphs and rec is not None and rec.fallback is None:
        return (event_times_us(lambda: ex.graphs.replay(bucket), iters, warmup),
                {"timer": "cuda_graph_replay", "bucket": bucket, "kernels": dict(rec.kernels),
                 "standard_ops": list(rec.standard_ops), "kernel_fallbacks": dict(rec.kernel_fallbacks)})
    return (event_times_us(lambda: ex.decode(tokens, cache, out=out), max(3, standard_iters), 1),
            {"timer": "eager", "fallback": rec.fallback if rec is not None else "no trace record",
             "not_fast": "the executor did not run this step as a captured step"})


def _kernel_profile(ex: Any, bucket: int) -> dict[str, Any]:
    from k3_fastpath.measure.kernel_profile import profile_replays

    try:
        return profile_replays(lambda: ex.graphs.replay(bucket))
    except (RuntimeError, ValueError) as e:  # no CUPTI on the host: the point keeps its timings
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def _glue_of(ex: Any) -> str:
    """What served a standard_graph executor's glue: ``torch.compile``, ``eager`` or partly both."""
    from k3_fastpath.runtime.standard_ops import glue_summary

    return glue_summary(ex.ops)


def standard_expert_fields(ex: Any) -> dict[str, str]:
    """A standard row's expert format and what it means for the ratio (from the executor's options)."""
    if ex.options.standard_mxfp4_experts:
        return {"expert_format": "mxfp4", "expert_format_note": "the standard path reads the fast path's MXFP4 "
                "expert bytes through humming-kernels (vLLM's sm_90 MXFP4 MoE backend; N padded to 256, K to 128)"}
    return {"expert_format": "bf16", "expert_format_note": "torch has no MXFP4 grouped GEMM on sm_90: the standard "
            "path's experts are dequantised to BF16 once (4x the fast path's expert bytes); floor_us is the "
            "model's (MXFP4) floor for both"}


def run_point(model: Any, fast: Any, std: Any, batch: int, context: int, routing: str, *, bw: float, iters: int,
              standard_iters: int, warmup: int, seed: int, strong: Any = None, layer_times: bool = True,
              reference: bool = True, floor_cfg: Any = None, rank_tp: int = 1,
              variants: dict[str, tuple[Any, dict[str, Any], dict[str, str]]] | None = None,
              kernel_profile: bool = False) -> list[dict[str, Any]]:
    """The backends at one (batch, context, routing) on one cache: fast, standard (``strong``, the
    graph-captured library path, when given; it shares ``fast``'s slot pool), each fast variant
    (``variants``: row name -> (executor over ``fast``'s pool, its options, its environment overrides),
    row ``vs_fast`` = fast's median / the variant's) and the eager reference (``std``); one record each.
    ``kernel_profile``: the fast, standard and variant graph rows also get ``kernel_profile`` (device time per
    kernel and op, GPU idle time: ``measure/kernel_profile.py``; a ``pdl: false`` variant's kernel times are
    free of the PDL wait that a PDL kernel's duration includes). ``rank_tp > 1``: ``model`` is one emulated rank of TP ``rank_tp`` of
    ``floor_cfg`` (the floor is that rank's share; rows say ``tp: rank_tp, emulated_rank: true``)."""
    from k3_fastpath.measure.routing import touched_in_step

    cfg = model.cfg
    dev = model.device
    cache = fast.new_cache(batch, context + CONTEXT_SLACK)
    try:
        fill_cache(cache, context, FILL_SEED + seed)
        tokens, source = tokens_for(cfg, routing, batch, seed)
        tokens = tokens.to(dev)
        touched = touched_in_step(model, lambda: std.decode(tokens, cache))
        fl = floor_for(floor_cfg or cfg, rank_tp, batch, context, kv_bytes_of(cache), routing, touched, bw)
        common = {"variant": "decode", "batch": batch, "context": context, "tp": rank_tp, "routing": routing,
                  "token_source": source, "touched_measured": touched, **fl}
        if rank_tp > 1:
            common.update(emulated_rank=True, preset=(floor_cfg or cfg).name)
        out = torch.empty(batch, cfg.vocab_size, dtype=torch.float32, device=dev)
        samples, f_extra = _graph_row(fast, tokens, cache, out, iters, warmup, standard_iters)
        st = stats(samples)
        rows = [{**common, "backend": "fast", **st, **f_extra, **throughput(st["step_us_median"], batch, 1),
                 "pct_of_floor": fl["floor_us"] / st["step_us_median"],
                 "x_floor": st["step_us_median"] / fl["floor_us"], "expert_format": cfg.expert_format}]
        if strong is not None:
            samples, g_extra = _graph_row(strong, tokens, cache, out, iters, warmup, standard_iters)
            gs = stats(samples)
            rows.append({**common, "backend": "standard", **gs, **g_extra, **throughput(gs["step_us_median"], batch, 1),
                         "pct_of_floor": fl["floor_us"] / gs["step_us_median"],
                         "x_floor": gs["step_us_median"] / fl["floor_us"], **standard_expert_fields(strong),
                         "standard_glue": _glue_of(strong)})
        if layer_times:  # per-layer-type times of both graph paths (section graphs, measure/section_timing.py)
            for row, ex in zip(rows, (fast, strong), strict=False):
                row.update(graph_layer_times(ex, tokens, cache, fl["floor_us_by_layer_type"], max(3, iters // 2)))
        if kernel_profile:
            for row, ex in zip(rows, (fast, strong), strict=False):
                if row.get("timer") == "cuda_graph_replay":
                    row["kernel_profile"] = _kernel_profile(ex, row["bucket"])
        for name, (ex, opts) in (variants or {}).items():
            try:
                rows.append(_variant_row(name, ex, opts, common, rows[0], tokens, cache, out, fl, iters=iters,
                                         warmup=warmup, standard_iters=standard_iters, layer_times=layer_times,
                                         kernel_profile=kernel_profile))
            except (RuntimeError, ValueError) as e:  # a variant must not cost the point its fast / standard rows
                rows[0].setdefault("variant_errors", {})[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not reference:
            return rows
        s_samples = event_times_us(lambda: std.decode(tokens, cache), standard_iters, 1)
        layer_us, layer_spread = per_layer_type_us(model, lambda: std.decode(tokens, cache),
                                                   rounds=REFERENCE_LAYER_ROUNDS)
        ss = stats(s_samples)
        floor_t = fl["floor_us_by_layer_type"]
        rows.append({**common, "backend": "reference", **ss, "timer": "eager", **throughput(ss["step_us_median"],
                     batch, 1), "pct_of_floor": fl["floor_us"] / ss["step_us_median"],
                     "x_floor": ss["step_us_median"] / fl["floor_us"], "per_layer_type_us": layer_us,
                     "pct_of_floor_by_layer_type": {k: floor_t[k] / v for k, v in layer_us.items()
                                                    if k in floor_t and v > 0},
                     "timing_spread": timing_spread(None, layer_spread)})
        return rows
    finally:
        if hasattr(cache, "release"):
            cache.release()


def _variant_row(name: str, ex: Any, opts: dict[str, Any], common: dict[str, Any],
                 fast_row: dict[str, Any], tokens: torch.Tensor, cache: Any, out: torch.Tensor, fl: dict[str, Any], *,
                 iters: int, warmup: int, standard_iters: int, layer_times: bool,
                 kernel_profile: bool = False) -> dict[str, Any]:
    """One fast variant's record at a point: captured and timed (and its sections, and with
    ``kernel_profile`` its CUPTI profile)."""
    samples, v_extra = _graph_row(ex, tokens, cache, out, iters, warmup, standard_iters)
    vs = stats(samples)
    row = {**common, "backend": name, "variant_of": "fast", "options": dict(opts), **vs, **v_extra,
           **throughput(vs["step_us_median"], int(tokens.shape[0]), 1),
           "pct_of_floor": fl["floor_us"] / vs["step_us_median"], "x_floor": vs["step_us_median"] / fl["floor_us"],
           "vs_fast": fast_row["step_us_median"] / vs["step_us_median"], "expert_format": fast_row["expert_format"]}
    if layer_times:
        row.update(graph_layer_times(ex, tokens, cache, fl["floor_us_by_layer_type"], max(3, iters // 2)))
    if kernel_profile and row.get("timer") == "cuda_graph_replay":
        row["kernel_profile"] = _kernel_profile(ex, row["bucket"])
    return row


def graph_layer_times(ex: Any, tokens: torch.Tensor, cache: Any, floor_by_type: dict[str, float],
                      rounds: int) -> dict[str, Any]:
    """``per_layer_type_us`` and ``pct_of_floor_by_layer_type`` of a graph-captured backend's step (one graph per
    section, ``section_timing.time_sections``), or the reason they are missing."""
    from k3_fastpath.measure.section_timing import pct_of_floor_by_type, time_sections

    try:
        t = time_sections(ex, tokens, cache, rounds=rounds)
    except (ValueError, RuntimeError) as e:
        return {"per_layer_type_us": None, "per_layer_type_reason": str(e).splitlines()[0][:200]}
    return {"per_layer_type_us": t["by_layer_type_us"],
            "pct_of_floor_by_layer_type": pct_of_floor_by_type(t["by_layer_type_us"], floor_by_type),
            "section_us": {k: round(v, 2) for k, v in t["section_us"].items()},
            "timing_spread": timing_spread(t["section_spread"], t["by_layer_type_spread"]),
            "sections_total_us": t["sections_total_us"], "sections_step_graph_us": t["step_graph_us"],
            "per_layer_type_timer": "one CUDA graph per section replayed in step order, events between "
                                    f"(sections add {t['section_overhead']:+.1%} over the step graph)"}


# ------------------------------------------------------------------------------------------ TP ranks
def allreduce_rows(comms: dict[str, Any], batches: Sequence[int], hidden: int, sources: int, iters: int,
                   seed: int) -> list[dict[str, Any]]:
    """Fused vs unfused all-reduce + residual add + AttnRes mix + RMSNorm, CUDA-graph medians of 20 calls."""
    from k3_fastpath._lib.timing import graph_time_us

    rows = []
    g = torch.Generator(device="cuda").manual_seed(seed)
    for b in batches:
        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

        partial, prefix, blocks = rnd(b, hidden), rnd(b, hidden), rnd(sources - 1, b, hidden)
        pw, nw, ow = rnd(1, hidden) * 0.05, 1 + 0.1 * rnd(hidden), 1 + 0.1 * rnd(hidden)
        row: dict[str, Any] = {"op": "allreduce_residual_attnres_rmsnorm", "batch": b, "hidden": hidden,
                               "sources": sources}
        outs = {}
        args = (prefix, blocks, pw, nw, ow, 1e-5)
        for name, comm in comms.items():
            def call(comm=comm, partial=partial, args=args):  # a copy per call: NCCL reduces in place
                return comm.reduce_add_mix_norm(partial.clone(), *args)
            outs[name] = call()
            comm.barrier()
            row[f"{name}_us"] = graph_time_us([call] * 20, iters=iters)["median_us"]
        a, c = outs["fused"], outs["unfused"]
        row["max_abs_diff_prefix"] = float((a[0].float() - c[0].float()).abs().max())
        row["max_abs_diff_normed"] = float((a[1].float() - c[1].float()).abs().max())
        row["speedup"] = row["unfused_us"] / row["fused_us"]
        rows.append(row)
    return rows


def tp_worker(rank: int, world: int, params: dict[str, Any]) -> dict[str, Any]:
    """One rank of the TP sweep (spawned by ``tp_launch.launch`` with NCCL): see the module docstring."""
    from k3_fastpath.measure.device_synthetic import device_model
    from k3_fastpath.presets import get_config
    from k3_fastpath.runtime.options import defaults
    from k3_fastpath.runtime.tp import TPModel
    from k3_fastpath.runtime.tp_allreduce import SymmMemComm
    from k3_fastpath.runtime.tp_comm import TorchComm
    from k3_fastpath.runtime.tp_fast import TPFastDecoder

    cfg = get_config(params["preset"])
    dev = torch.device("cuda", torch.cuda.current_device())
    comms = {"unfused": TorchComm(), "fused": SymmMemComm()}
    ar = allreduce_rows(comms, params["batches"], cfg.hidden_size, cfg.num_attn_res_blocks + 1, params["iters"],
                        params["seed"])
    if params.get("checkpoint"):  # the run's checkpoint: this rank's slices read from disk, straight to the GPU
        from k3_fastpath.runtime.tp import rank_config
        from verify.model_source import build_reference_model, checkpoint_rank_state_dict

        sd = checkpoint_rank_state_dict(params["checkpoint"], cfg, world, rank, dev)
        model = build_reference_model(rank_config(cfg, world), sd, dev, copy=False)
        del sd
    else:
        model = device_model(cfg, params["seed"], dev, tp=world, rank=rank)
    tps = {k: TPModel(cfg, model, c) for k, c in comms.items()}
    rows, notes = [], []
    for context in params["contexts"]:
        fast = TPFastDecoder(cfg, model, comms["fused"], max_batch=max(params["batches"]),
                             max_len=context + CONTEXT_SLACK)
        strong = TPFastDecoder(cfg, model, comms["unfused"], max_batch=max(params["batches"]),
                               max_len=context + CONTEXT_SLACK, backend="standard_graph", pool_from=fast,
                               options=defaults("tp:standard_graph").replace(
                                   standard_compiled_glue=params.get("standard_compiled_glue", False),
                                   standard_mxfp4_experts=params.get("standard_mxfp4_experts", False)))
        fast_pdl = TPFastDecoder(cfg, model, comms["fused"], max_batch=max(params["batches"]),
                                 max_len=context + CONTEXT_SLACK, pool_from=fast,
                                 options=defaults("tp:latency_specialized").replace(pdl=True)
                                 ) if params.get("tp_fast_pdl") else None
        for batch in params["batches"]:
            for routing in params["routing"]:
                try:
                    rows += tp_point(cfg, model, tps, world, batch, context, routing, params, fast=fast,
                                     strong=strong, fast_pdl=fast_pdl)
                except torch.cuda.OutOfMemoryError as e:
                    notes.append(f"tp={world} batch={batch} context={context} {routing}: out of memory "
                                 f"({str(e).splitlines()[0][:120]})")
                    torch.cuda.empty_cache()
        del fast, strong, fast_pdl
        torch.cuda.empty_cache()
    return {"rank": rank, "rows": rows, "allreduce": ar, "notes": notes}


def _tp_graph_row(dec: Any, tokens: torch.Tensor, cache: Any, iters: int) -> tuple[list[float], dict[str, Any]]:
    """One ``decode`` of a TP decoder (captures the bucket's graph on every rank), then timed replays."""
    from k3_fastpath.runtime.graphs import bucket_for

    dec.decode(tokens, cache)
    bucket = bucket_for(int(tokens.shape[0]), dec.buckets)
    dec.comm.barrier()
    return (event_times_us(lambda: dec.graphs.replay(bucket), iters, 2),
            {"timer": "cuda_graph_replay", "bucket": bucket, "allreduce": dec.comm.name,
             "standard_ops": dec.last_calls.standard_ops()})


def tp_point(cfg: Any, model: Any, tps: dict[str, Any], world: int, batch: int, context: int, routing: str,
             params: dict[str, Any], fast: Any = None, strong: Any = None,
             fast_pdl: Any = None) -> list[dict[str, Any]]:
    """One TP point on this rank: the fast TP step (CUDA-graph replays, fused all-reduce) when ``fast`` is
    given, the standard TP step (``strong``: library ops + NCCL + separate epilogue ops, CUDA-graph replays,
    same cache) when given, and the TP model's eager step with the unfused and the fused comm (``reference``)."""
    dev = model.device
    cache = fast.new_cache(batch) if fast is not None else model.new_cache(batch, context + CONTEXT_SLACK)
    try:
        fill_cache(cache, context, FILL_SEED + params["seed"])
        tokens = tokens_for(cfg, routing, batch, params["seed"])[0].to(dev)
        base = cache.lengths.clone()
        fl = floor_for(cfg, world, batch, context, kv_bytes_of(cache), "uniform", None, params["bw"])
        common = {"variant": "decode", "batch": batch, "context": context, "tp": world, "routing": routing, **fl}
        rows = []
        for name, dec in (("fast", fast), ("fast_pdl", fast_pdl), ("standard", strong)):
            if dec is None:
                continue
            cache.lengths = base.clone()
            samples, extra = _tp_graph_row(dec, tokens, cache, params["iters"])
            st = stats(samples)
            rows.append({**common, "backend": name, **st, **extra, **throughput(st["step_us_median"], batch, world),
                         "pct_of_floor": fl["floor_us"] / st["step_us_median"],
                         "x_floor": st["step_us_median"] / fl["floor_us"],
                         **({"expert_format": cfg.expert_format} if name.startswith("fast") else
                            {**standard_expert_fields(dec), "standard_glue": _glue_of(dec)})})
            if name == "fast_pdl" and rows[0]["backend"] == "fast":
                rows[-1].update(variant_of="fast", options={"pdl": True},
                                vs_fast=rows[0]["step_us_median"] / st["step_us_median"])
        cache.lengths = base.clone()
        if batch not in params.get("reference_batches", [batch]):
            return rows
        times = {}
        for name, tpm in tps.items():
            def step(tpm=tpm):
                cache.lengths = base.clone()  # every timed step decodes at the same position
                tpm.decode(tokens, cache)
            tpm.comm.barrier()
            times[name] = stats(event_times_us(step, params["standard_iters"], 1))
        st = times["unfused"]
        rows.append({**common, "backend": "reference", **st, "timer": "eager", "allreduce": "nccl (unfused epilogue)",
                     **throughput(st["step_us_median"], batch, world),
                     "pct_of_floor": fl["floor_us"] / st["step_us_median"],
                     "x_floor": st["step_us_median"] / fl["floor_us"],
                     "tp_step_fused_us": times["fused"]["step_us_median"], "tp_step_unfused_us": st["step_us_median"]})
        return rows
    finally:
        if hasattr(cache, "release"):
            cache.release()


def merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The step ends when the slowest rank ends: per point the rank with the largest median. A point that
    some rank did not measure is dropped with a note."""
    def key(r: dict[str, Any]) -> tuple:
        return (r["batch"], r["context"], r["routing"], r["backend"])

    merged = {"rows": [], "allreduce": [], "notes": [n for res in results for n in res["notes"]]}
    per_rank = [{key(r): r for r in res["rows"]} for res in results]
    for k, row in per_rank[0].items():
        others = [pr.get(k) for pr in per_rank[1:]]
        if any(o is None for o in others):
            merged["notes"].append(f"tp point batch={k[0]} context={k[1]} {k[2]} {k[3]}: not measured on every rank")
            continue
        row = dict(row)
        for o in others:
            if o["step_us_median"] > row["step_us_median"]:
                row.update({f: o[f] for f in ("step_us_median", "step_us_p10", "step_us_p90", "step_us_samples",
                                              "samples_n", "tokens_per_s_user", "tokens_per_s_gpu", "pct_of_floor",
                                              "x_floor", "tp_step_unfused_us") if f in o})
            if "tp_step_fused_us" in row:
                row["tp_step_fused_us"] = max(row["tp_step_fused_us"], o["tp_step_fused_us"])
        merged["rows"].append(row)
    fast = {key(r)[:3]: r for r in merged["rows"] if r["backend"] == "fast"}
    for r in merged["rows"]:  # a variant's ratio from the merged (slowest-rank) medians of both rows
        if r.get("variant_of") == "fast" and key(r)[:3] in fast:
            r["vs_fast"] = fast[key(r)[:3]]["step_us_median"] / r["step_us_median"]
    for rows in zip(*(res["allreduce"] for res in results), strict=True):
        r = dict(rows[0])
        for f in ("fused_us", "unfused_us"):
            r[f] = max(x[f] for x in rows)
        r["speedup"] = r["unfused_us"] / r["fused_us"]
        merged["allreduce"].append(r)
    return merged


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
