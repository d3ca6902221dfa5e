"""``equivalence.decode``: the fast decode executor against the reference model, on identical weights and
identical cache state, greedy tokens side by side (the way vLLM's model tests compare generations).

Per grid point (batch x context):

1. one BF16 model from the seeded synthetic checkpoint (``conditioning="stable"`` by default: the default
   draw amplifies BF16 rounding noise until two correct implementations disagree on most tokens, see
   ``k3_fastpath/synthetic.py``); the fast side is a ``DecodeExecutor`` over the same model object;
2. the reference cache is filled to the context: ``"short"`` = a prefill of ``prompt_len`` random tokens;
   a number N = positions ``[0, N - prompt_len)`` synthesized (MLA latents ~ N(0, 1), KDA recurrent state
   ~ N(0, 0.05^2), conv state ~ N(0, 0.5^2); a full-size prefill at 128K would up-project the whole latent
   cache) followed by ``prompt_len`` teacher-forced reference decode steps; the executor's cache is a
   copy of it, so the same state enters both paths;
3. ``steps`` decode steps. Both sides are fed the reference's greedy token; at every step each side's own
   greedy choice is compared. Up to a sequence's first divergence this is exactly two independent greedy
   generations; after it, the inputs stay identical so logit errors and KL keep measuring numerics, and
   every later mismatch is checked by the same rule;
4. the rule at each sequence's first divergence: each side's token is in the other's top-``top_k``; later
   mismatches (near-ties while both sides follow the reference's tokens) are checked by the same rule and
   bounded by rate over the grid's row-steps (``max_later_violation_rate``). Per step: max |logit
   difference| (absolute and relative to max |reference logit| of the row), KL(reference || fast) per row
   (FP64 softmax), both sides' tokens;
5. the fast executor's execution trace over the point's decode steps: no whole-step fallback, no kernel
   call refused by its kernel, at least one fast step. Ops without a fast kernel yet (``standard_ops``) are
   allowed and listed in the metrics.

Fails on: a top-k violation at a first divergence, later violations above ``max_later_violation_rate`` of
the grid's row-steps or improbably many at one point (``status_rules.POINT_EXCESS_P``), a non-finite fast
logit, mean KL over the point above ``max_mean_kl``, or a trace problem; a planned point with no record
(out of memory, past 90% of the budget) is a problem too. The status is
``status_rules.equivalence_problems`` of the records (a ``plan``, per point its step rows and summary), which
``bundle verify`` applies again. ``max_mean_kl`` defaults to 0.01: on k3-tiny with the fast step emulated on a CPU (every kernel
served by its FP32 reference rounded to BF16, the kernels' own rounding points), batch 4, 12 steps, mean KL
was 3e-4 (short context) / 5e-4 (100 positions) with the stable draw and no top-5 violation, and 0.036 with
five top-5 violations with the default draw. Measured on the H200 for k3-mini (256 steps, the whole grid:
batch 1/2/8/64 x short/32K/128K; bundles/runs/2026-11-30-h200-session4 and 2026-12-01-h200-session5): mean
KL 2.9e-4 to 3.4e-4, max KL 0.003, max relative logit error 0.084; one violation at a first divergence in
12 points x 256 steps (batch 64 at 128K on the mma GEMMs: a near-tie; the same point on the wgmma GEMMs, the
default since, had none); later violations at 0.02-0.04% of row-steps, all near-ties by ``tie_margins``.

On a checkpoint run (``--checkpoint DIR``) step 1's model holds the checkpoint's own tensors (``ctx.model_source``,
read before any check): ``preset`` and ``conditioning`` apply to preset runs only, and the metrics say
``weights: checkpoint <digest>``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from verify.checks import status_rules
from verify.checks.context_fill import context_length, fill_reference
from verify.checks.registry import check
from verify.checks.status_rules import MAX_LATER_VIOLATION_RATE, MAX_MEAN_KL
from verify.context import CheckContext


# ------------------------------------------------------------------------------------------ comparison
def step_metrics(ref: torch.Tensor, fast: torch.Tensor) -> dict[str, Any]:
    """Logit error and KL(ref || fast) per row of two ``[B, V]`` logit tensors (rows of zeros = inactive)."""
    r, f = ref.double(), fast.double()
    diff = (r - f).abs().amax(dim=-1)
    scale = r.abs().amax(dim=-1).clamp_min(1e-30)
    lr, lf = torch.log_softmax(r, -1), torch.log_softmax(f, -1)
    kl = (lr.exp() * (lr - lf)).sum(-1)
    return {"max_abs_err": diff.tolist(), "max_rel_err": (diff / scale).tolist(), "kl": kl.tolist(),
            "finite": bool(torch.isfinite(f).all())}


def tie_margins(lr: torch.Tensor, lf: torch.Tensor, ref_tok: int, fast_tok: int) -> dict[str, Any]:
    """How close a top-k violation was (information; the rule itself is unchanged): each token's 1-based rank
    in the other side's logits, the logit gap by which each side preferred its own token over the other's,
    and the row's typical logit error (99th percentile of |ref - fast| over the vocabulary: the max would be
    set by the diverging logits themselves). Both gaps under it = a near-tie that rounding noise flips."""
    r, f = lr.double(), lf.double()
    gap_r = float(r[ref_tok] - r[fast_tok])
    gap_f = float(f[fast_tok] - f[ref_tok])
    p99 = float(torch.quantile((r - f).abs().float(), 0.99)) if r.numel() <= 1 << 24 else float("nan")
    return {"ref_token_rank_in_fast": int((f > f[ref_tok]).sum()) + 1,
            "fast_token_rank_in_ref": int((r > r[fast_tok]).sum()) + 1,
            "ref_logit_gap": gap_r, "fast_logit_gap": gap_f, "row_p99_abs_err": p99,
            "within_row_error": max(gap_r, gap_f) <= p99}


def compare_greedy(ref_decode: Callable[[torch.Tensor], torch.Tensor],
                   fast_decode: Callable[[torch.Tensor], torch.Tensor], first_logits: torch.Tensor, steps: int,
                   top_k: int = 5, on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``steps`` decode steps on both sides from the same state (see the module docstring, step 3-4).

    ``ref_decode(tokens)`` / ``fast_decode(tokens)`` decode one token per row and return ``[B, V]`` logits;
    ``first_logits`` are the reference's logits that pick the first token. Returns the point's summary;
    ``on_step`` receives each step's record.
    """
    tokens = first_logits.argmax(-1)
    b = tokens.shape[0]
    first_div: list[int | None] = [None] * b
    mismatches, violations = [], []
    worst_abs = worst_rel = kl_max = 0.0
    kl_sum, kl_n, nonfinite = 0.0, 0, 0
    for s in range(steps):
        lr = ref_decode(tokens)
        lf = fast_decode(tokens)
        m = step_metrics(lr, lf)
        nr, nf = lr.argmax(-1), lf.argmax(-1)
        top_r, top_f = lr.topk(top_k, -1).indices, lf.topk(top_k, -1).indices
        diff_rows = (nr != nf).nonzero().flatten().tolist()
        for row in diff_rows:
            ok_f = bool((top_r[row] == nf[row]).any())
            ok_r = bool((top_f[row] == nr[row]).any())
            rec = {"step": s, "seq": row, "ref_token": int(nr[row]), "fast_token": int(nf[row]),
                   "first": first_div[row] is None, "fast_in_ref_topk": ok_f, "ref_in_fast_topk": ok_r}
            if not (ok_f and ok_r):
                rec.update(tie_margins(lr[row], lf[row], int(nr[row]), int(nf[row])))
            mismatches.append(rec)
            if first_div[row] is None:
                first_div[row] = s
            if not (ok_f and ok_r):
                violations.append(rec)
        worst_abs = max(worst_abs, max(m["max_abs_err"]))
        worst_rel = max(worst_rel, max(m["max_rel_err"]))
        finite_kl = [k for k in m["kl"] if math.isfinite(k)]
        kl_sum += sum(finite_kl)
        kl_n += len(finite_kl)
        kl_max = max([kl_max, *finite_kl])
        nonfinite += 0 if m["finite"] else 1
        if on_step is not None:
            on_step({"step": s, "ref_tokens": nr.tolist(), "fast_tokens": nf.tolist(), "mismatch_rows": diff_rows,
                     "max_abs_err": max(m["max_abs_err"]), "max_rel_err": max(m["max_rel_err"]),
                     "kl_max": max(m["kl"]), "kl_mean": sum(m["kl"]) / b, "finite": m["finite"]})
        tokens = nr  # both sides continue from the reference's greedy token
    return {"steps": steps, "batch": b, "first_divergence": first_div,
            "sequences_diverged": sum(d is not None for d in first_div), "mismatches": len(mismatches),
            "topk_violations": violations, "first_divergence_violations": [v for v in violations if v["first"]],
            "later_violation_rate": sum(not v["first"] for v in violations) / max(steps * b, 1),
            "max_abs_logit_err": worst_abs, "max_rel_logit_err": worst_rel,
            "kl_mean": kl_sum / max(kl_n, 1), "kl_max": kl_max, "nonfinite_steps": nonfinite,
            "mismatch_list": mismatches[:200]}


# ------------------------------------------------------------------------------------------ the check
def build_synthetic_model(cfg: Any, seed: int, conditioning: str, device: str | torch.device, tp: int = 1) -> Any:
    """A BF16 reference model of the seeded synthetic checkpoint, built in place on ``device``: on a GPU the
    weights are drawn there (``runtime.device_synthetic``; TP > 1 = one rank's share, the rank emulation of
    ``runtime.tp.rank_config``), the modules are made on the meta device and take the tensors as they are
    (no CPU copy of a k3-mini-sized model). On a CPU: ``synthetic.synthetic_state_dict`` (TP 1 only)."""
    from k3_fastpath.reference.model import K3ForCausalLM

    device = torch.device(device)
    if device.type == "cuda":
        from k3_fastpath.measure.device_synthetic import device_state_dict
        from k3_fastpath.runtime.tp import rank_config

        sd = device_state_dict(cfg, seed, device, tp=tp, conditioning=conditioning)
        cfg = rank_config(cfg, tp)
    else:
        from k3_fastpath.synthetic import synthetic_state_dict

        if tp != 1:
            raise ValueError("a TP rank emulation is built on a GPU only")
        sd = synthetic_state_dict(cfg, seed, conditioning=conditioning)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, dtype=torch.bfloat16)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def check_model(ctx: CheckContext, preset: str, conditioning: str | None) -> tuple[Any, str, str | None, str]:
    """(BF16 reference model, preset, conditioning, weights description) a comparing check runs on: the run's
    checkpoint when it has one (``preset`` and ``conditioning`` then do not apply), else the seeded synthetic
    checkpoint of ``preset`` (``"auto"``: k3-mini on a GPU, the run's preset on a CPU)."""
    if ctx.on_checkpoint:  # the run's checkpoint, whatever the tier's preset says
        from verify.model_source import build_reference_model

        if preset != "auto":
            ctx.note(f"preset {preset}: not used, this run verifies checkpoint {ctx.model_source.path}")
        return build_reference_model(ctx.config, ctx.state_dict(), ctx.device), ctx.preset, None, ctx.weights()
    from k3_fastpath.presets import get_config

    if preset == "auto":
        preset = "k3-mini" if ctx.device == "cuda" else ctx.preset
    model = build_synthetic_model(get_config(preset), ctx.seed, conditioning, ctx.device)
    return model, preset, conditioning, f"synthetic (seed {ctx.seed}, conditioning {conditioning})"


def _keep_reference_experts_dense(model: Any, when: Any) -> int:
    """``cache_dense_experts`` per ``when`` (True / False / "auto"); the bytes kept."""
    from k3_fastpath.reference.moe import cache_dense_experts, keep_dense_experts_if_room

    if when not in (True, False, "auto"):
        raise ValueError(f"reference_dense_experts must be true, false or 'auto', got {when!r}")
    if when == "auto":
        return keep_dense_experts_if_room(model)
    return cache_dense_experts(model) if when else 0


def _drop_reference_experts_dense(model: Any) -> int:
    """Undo ``cache_dense_experts`` (returns 0, the bytes now kept)."""
    from k3_fastpath.reference.moe import MXFP4Weight

    for m in model.modules():
        if isinstance(m, MXFP4Weight):
            m.drop_dense()
    return 0


def _kv_dtype(kv_cache: str) -> torch.dtype:
    kinds = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    if kv_cache not in kinds:
        raise ValueError(f"kv_cache must be one of {sorted(kinds)}, got {kv_cache!r}")
    return kinds[kv_cache]


def run_point(model: Any, executor: Any, batch: int, context: Any, steps: int, prompt_len: int, top_k: int,
              seed: int, record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One grid point: fill, copy, compare; returns the point summary with the trace summary of its steps."""
    from k3_fastpath.runtime.trace import summarize

    n = context_length(context)
    max_len = (n or prompt_len) + steps + 1
    ref_cache = model.new_cache(batch, max_len, kv_dtype=executor.kv_dtype, kv_scale=executor.kv_scale)
    first = fill_reference(model, ref_cache, n, prompt_len, seed * 1000 + batch)
    fast_cache = executor.new_cache(batch, max_len)
    try:
        executor.copy_cache(fast_cache, ref_cache)
        out = torch.empty(batch, model.cfg.vocab_size, dtype=torch.float32, device=model.device)
        start = len(executor.trace)
        result = compare_greedy(lambda t: model.decode(t, ref_cache),
                                lambda t: executor.decode(t, fast_cache, out=out), first, steps, top_k, record)
        result["trace"] = summarize(executor.trace.since(start))
    finally:  # also when a step runs out of memory: the executor's slots go back for the next point
        if hasattr(fast_cache, "release"):
            fast_cache.release()
    return result


@check("equivalence.decode",
       "fast path vs reference: greedy tokens side by side, top-5 at first divergence, logit error, no fallback",
       requires=("cuda", "sm90", "cutlass"))
def decode(ctx: CheckContext, batches: list[int] = [1, 8], contexts: list[Any] = ["short"],
           steps: int = 64, preset: str = "auto",
           conditioning: str = "stable", prompt_len: int = 16, top_k: int = 5, max_mean_kl: float = MAX_MEAN_KL,
           kv_cache: str = "bf16", use_graphs: bool = True, emulate: bool = False,
           reference_dense_experts: Any = "auto", max_later_violation_rate: float = MAX_LATER_VIOLATION_RATE,
           executor_options: dict[str, Any] | None = None) -> Any:
    """The check (module docstring). ``reference_dense_experts``: keep the reference's MXFP4 experts
    dequantised (``reference.moe.cache_dense_experts``: bitwise the same reference, without dequantising every
    touched expert per step); ``"auto"`` = on a GPU when it takes under 40% of the free memory.
    ``executor_options``: ``DecodeOptions`` fields for the fast side (``runtime/options.py``; what
    ``perf.decode_sweep`` variants take too), e.g. to check an opt-in kernel before it becomes the default;
    recorded in the metrics."""
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.runtime.options import DecodeOptions

    options = dict(executor_options or {})
    try:
        decode_options = DecodeOptions.from_mapping(options)
    except ValueError as e:
        return ctx.failed(f"executor_options: {e}")
    kv_dtype = _kv_dtype(kv_cache)
    model, preset, conditioning, weights = check_model(ctx, preset, conditioning)
    from k3_fastpath.runtime.step_plan import ModelPlan

    ModelPlan.build(model)  # re-points the experts at their stacked tensors once, before their dense copies
    dense_kept = _keep_reference_experts_dense(model, reference_dense_experts)
    ctx.record({"kind": "plan", "batches": list(batches), "contexts": list(contexts), "steps": steps, "top_k": top_k,
                "max_mean_kl": max_mean_kl, "max_later_violation_rate": max_later_violation_rate, "later_violations": "grid",
                "emulated": emulate})
    points = []
    standard_ops: dict[str, int] = {}
    for context in contexts:
        n = context_length(context)
        ex = DecodeExecutor(model, max_batch=max(batches), max_len=(n or prompt_len) + steps + 1, buckets=batches,
                            use_graphs=use_graphs, kv_dtype=kv_dtype, envelope=Envelope(emulate=emulate),
                            options=decode_options)
        ex.warmup_and_capture()
        for batch in batches:
            where = f"batch {batch} context {context}"
            if ctx.elapsed() > 0.9 * ctx.budget_s:  # a partial grid is reported as such, never as a pass
                ctx.record({"kind": "not_run", "batch": batch, "context": context,
                            "why": f"not run, the check is past 90% of its {ctx.budget_s:.0f}s budget"})
                continue
            tried = {"attempt": 1}  # an out-of-memory retry writes its steps again, as attempt 2

            def record(step: dict[str, Any], batch=batch, context=context, tried=tried) -> None:
                ctx.record({"kind": "step", "batch": batch, "context": context, "attempt": tried["attempt"], **step})

            t0 = time.monotonic()
            r = None
            for attempt in (1, 2):
                try:
                    tried["attempt"] = attempt
                    r = run_point(model, ex, batch, context, steps, prompt_len, top_k, ctx.seed, record)
                    break
                except torch.cuda.OutOfMemoryError as e:
                    torch.cuda.empty_cache()
                    if attempt == 1 and dense_kept:  # give the reference's dequantised experts back, retry
                        dense_kept = _drop_reference_experts_dense(model)
                        ctx.note(f"{where}: out of memory with the reference's experts kept dequantised; "
                                 f"dropped them (the reference dequantises per step from here) and retried")
                        continue
                    ctx.record({"kind": "not_run", "batch": batch, "context": context,
                                "why": f"out of memory ({str(e).splitlines()[0][:100]})"})
            if r is None:  # the point is reported as not run; the grid goes on
                continue
            r["seconds"] = round(time.monotonic() - t0, 1)
            summary = {k: v for k, v in r.items() if k not in ("mismatch_list",)}
            ctx.record({"kind": "point", "batch": batch, "context": context, "attempt": tried["attempt"],
                        "preset": preset, **summary, "mismatch_list": r["mismatch_list"]})
            points.append({"batch": batch, "context": context, "first_divergence": r["first_divergence"],
                           "mismatches": r["mismatches"], "kl_mean": r["kl_mean"], "kl_max": r["kl_max"],
                           "max_rel_logit_err": r["max_rel_logit_err"],
                           "first_divergence_violations": len(r["first_divergence_violations"]),
                           "later_violations": len(r["topk_violations"]) - len(r["first_divergence_violations"]),
                           "seconds": r["seconds"]})
            for k, v in r["trace"]["standard_ops"].items():
                standard_ops[k] = standard_ops.get(k, 0) + v
        ex.close()
        del ex
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    problems = status_rules.equivalence_problems(ctx.recorded)
    metrics = {"preset": preset, "weights": weights, "conditioning": conditioning, "kv_cache": kv_cache, "steps": steps,
               "top_k": top_k, "max_mean_kl": max_mean_kl, "points": points,
               "standard_ops_steps": standard_ops, "emulated": emulate, "executor_options": options,
               "reference_dense_expert_bytes": dense_kept,
               "worst_kl_mean": max((p["kl_mean"] for p in points), default=0.0),
               "worst_rel_logit_err": max((p["max_rel_logit_err"] for p in points), default=0.0)}
    return ctx.verdict(problems, metrics)
