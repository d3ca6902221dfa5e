"""``equivalence.fp64``: the fast path's logit error against an FP64 run of the reference, gated at
``max_ratio`` (2) times the error of the BF16 standard path against the same FP64 run, with planted errors
that the gate must catch.

Per point (batch x context x KV cache):

1. one BF16 model of the seeded synthetic checkpoint, ``conditioning="default"`` (no scaled-down routed
   experts, AttnRes or KDA decay: the draw on which a small error in one op shows), or the run's
   checkpoint; the oracle is a copy of it in FP64 (every float tensor, its cache FP64 too); the standard
   path is the BF16 reference model itself (``k3_fastpath/reference``, the PyTorch standard path);
2. the BF16 reference cache is filled to the context as in ``equivalence.decode`` (a prefill, or synthetic
   state then teacher-forced steps) in the point's KV cache format (``fp8``: e4m3 at ``fp8_scale``, a
   non-unit scale, so a path that drops the scale shows); the oracle's and every fast side's caches are
   copies of it, so all sides start from the same state;
3. ``steps`` decode steps, every side fed the oracle's greedy token and started at every step from the
   oracle's state (rounded to the side's cache format): the per-step error of each path's arithmetic, not of
   a trajectory (on the default draw BF16 trajectories part chaotically from the FP64 one within a few
   steps, and their errors then say nothing about the path). Per step and sequence:
   ``fp64_rules.row_error`` of the standard path and of each fast side against the oracle;
4. at the first point, planted controls: one more fast executor per ``controls`` entry with that op's output
   scaled by ``scale`` (e.g. ``kda_step`` x1.03: a 3% error in one op), run beside the clean one. The
   default scales are the smallest the 2x gate sees on k3-mini (the tier files say what was measured):
   the gate is as blunt for an op as the logits are insensitive to it, and a control it misses fails the
   check.

The status is ``fp64_rules.fp64_problems`` of the records (module docstring there): the clean fast path
within ``max_ratio`` of the standard path at every point, every planted control outside it, no non-finite
logit, no fast-path fallback; ``bundle verify`` applies it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from verify.checks import fp64_rules
from verify.checks.context_fill import context_length, fill_reference
from verify.checks.equivalence import _kv_dtype, check_model
from verify.checks.fp64_rules import CLEAN, STANDARD, control_name
from verify.checks.registry import check
from verify.context import CheckContext

DEFAULT_CONTROLS = [{"op": "kda_step", "scale": 1.03}, {"op": "moe_experts", "scale": 1.06},
                    {"op": "mla_attention", "scale": 1.5}]


def plant_error(executor: Any, op: str, scale: float) -> None:
    """Scale op ``op``'s output by ``scale`` in ``executor``'s own op table (``verify.defects.wrap_op``: before
    its graphs are captured; other executors keep theirs). The op must return its output tensor."""
    from verify.defects import wrap_op

    def make(fn: Callable[..., Any]) -> Callable[..., Any]:
        def scaled(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"op {op} returns {type(out).__name__}, not a tensor: it cannot carry a planted error")
            return out.mul_(scale)
        return scaled

    wrap_op(executor, op, make)


def fp64_oracle(model: Any) -> Any:
    """An FP64 copy of ``model`` (every float tensor FP64) that shares its MXFP4 expert bytes."""
    from k3_fastpath.reference.model import K3ForCausalLM

    sd = {k: v.detach().double() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    with torch.device("meta"):
        oracle = K3ForCausalLM(model.cfg, dtype=torch.float64)
    oracle.load_state_dict(sd, strict=True, assign=True)
    return oracle.eval()


def run_point(model: Any, oracle: Any, make_executor: Callable[[str], Any], sides: list[str], batch: int,
              context: Any, steps: int, prompt_len: int, seed: int, kv: tuple[torch.dtype, float | None]
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One point (module docstring, steps 2-3): each fast side in turn on its own executor
    (``make_executor(side)``, closed before the next: one expert bank at a time), replayed beside a fresh
    oracle from the same start, the first (clean) side in lockstep with the standard path. Returns the step
    rows and the clean side's trace summary."""
    from k3_fastpath.runtime.cache_pool import copy_cache
    from k3_fastpath.runtime.trace import summarize

    n = context_length(context)
    max_len = (n or prompt_len) + steps + 1
    kv_dtype, kv_scale = kv
    start = model.new_cache(batch, max_len, kv_dtype=kv_dtype, kv_scale=kv_scale)
    first = fill_reference(model, start, n, prompt_len, seed * 1000 + batch)
    rows = [{"step": s, "standard_err": [], "fast_err": {}, "nonfinite": False} for s in range(steps)]
    tokens = [first.argmax(-1)]

    def replay(sides: list[tuple[str, Callable[[torch.Tensor, Any], torch.Tensor], Any, Callable[[Any, Any], Any]]]
               ) -> None:
        """One fresh oracle from the start, the given (name, decode, cache, sync) sides in lockstep beside it;
        the first replay also fixes the tokens (the oracle's greedy ones)."""
        orc = copy_cache(oracle.new_cache(batch, max_len), start)
        for s in range(steps):
            for _, _, cache, sync in sides:  # every side starts the step from the oracle's state (rounded)
                sync(cache, orc)
            lo = oracle.decode(tokens[s], orc)
            if s + 1 == len(tokens):
                tokens.append(lo.argmax(-1))
            for name, decode, cache, _ in sides:
                ls = decode(tokens[s], cache)
                err = fp64_rules.row_error(ls, lo)
                if name == STANDARD:
                    rows[s]["standard_err"] = err
                else:
                    rows[s]["fast_err"][name] = err
                rows[s]["nonfinite"] = rows[s]["nonfinite"] or not bool(torch.isfinite(ls).all() and torch.isfinite(lo).all())

    ref = model.new_cache(batch, max_len, kv_dtype=kv_dtype, kv_scale=kv_scale)
    trace: dict[str, Any] = {}
    for i, side in enumerate(sides):  # the clean side in lockstep with the standard path, each control alone
        ex = make_executor(side)
        cache = ex.new_cache(batch, max_len)
        try:
            out = torch.empty(batch, model.cfg.vocab_size, dtype=torch.float32, device=model.device)
            begin = len(ex.trace)
            fast = (side, lambda t, c, ex=ex, out=out: ex.decode(t, c, out=out), cache, ex.copy_cache)
            replay([(STANDARD, model.decode, ref, copy_cache), fast] if i == 0 else [fast])
            if side == CLEAN:
                trace = summarize(ex.trace.since(begin))
        finally:
            if hasattr(cache, "release"):
                cache.release()
            ex.close()
            del ex
    return rows, trace


def _executor_factory(model: Any, controls: list[dict[str, Any]], batch: int, max_len: int,
                      kv: tuple[torch.dtype, float | None], use_graphs: bool, emulate: bool) -> Callable[[str], Any]:
    """``side -> DecodeExecutor`` (captured): the clean fast path, or one with a control's error planted."""
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor

    planted = {control_name(c["op"], float(c["scale"])): c for c in controls}

    def make(side: str) -> Any:
        ex = DecodeExecutor(model, max_batch=batch, max_len=max_len, buckets=[batch], use_graphs=use_graphs,
                            kv_dtype=kv[0], kv_scale=kv[1], envelope=Envelope(emulate=emulate))
        if side != CLEAN:
            plant_error(ex, planted[side]["op"], float(planted[side]["scale"]))
        ex.warmup_and_capture()
        return ex

    return make


@check("equivalence.fp64",
       "fast path vs an FP64 reference: logit error within 2x the BF16 standard path's, planted errors caught",
       requires=("cuda", "sm90", "cutlass"))
def fp64(ctx: CheckContext, batches: list[int] = [8], contexts: list[Any] = ["short"],
         kv_caches: list[str] = ["bf16", "fp8"], fp8_scale: float = 0.25, steps: int = 32, preset: str = "auto",
         conditioning: str = "default", prompt_len: int = 16, max_ratio: float = 2.0,
         controls: list[dict[str, Any]] = DEFAULT_CONTROLS, use_graphs: bool = True, emulate: bool = False) -> Any:
    """The check (module docstring); ``controls`` run at the first point only."""
    if not (fp8_scale > 0 and fp8_scale != 1.0):
        return ctx.failed(f"fp8_scale must be a positive non-unit scale, got {fp8_scale}")
    for c in controls:
        if set(c) != {"op", "scale"} or not float(c["scale"]) != 1.0:
            return ctx.failed(f"control {c}: expected {{op: NAME, scale: S}} with S != 1")
    kvs = {k: (_kv_dtype(k), fp8_scale if k == "fp8" else None) for k in kv_caches}
    model, preset, conditioning, weights = check_model(ctx, preset, conditioning)
    from k3_fastpath.runtime.step_plan import ModelPlan

    ModelPlan.build(model)
    oracle = fp64_oracle(model)
    points = [(b, c, k) for c in contexts for k in kv_caches for b in batches]
    ctx.record({"kind": "plan", "points": [list(p) for p in points], "controls": controls,
                "controls_at": list(points[0]) if controls and points else None, "max_ratio": max_ratio,
                "steps": steps, "fp8_scale": fp8_scale, "emulated": emulate})
    summaries = []
    for i, (batch, context, kv) in enumerate(points):
        key = {"batch": batch, "context": context, "kv_cache": kv}
        if ctx.elapsed() > 0.9 * ctx.budget_s:
            ctx.record({"kind": "not_run", **key, "why": f"not run, the check is past 90% of its {ctx.budget_s:.0f}s budget"})
            continue
        t0 = time.monotonic()
        max_len = (context_length(context) or prompt_len) + steps + 1
        here = controls if i == 0 else []
        sides = [CLEAN, *(control_name(c["op"], float(c["scale"])) for c in here)]
        make = _executor_factory(model, here, batch, max_len, kvs[kv], use_graphs, emulate)
        try:
            rows, trace = run_point(model, oracle, make, sides, batch, context, steps, prompt_len, ctx.seed, kvs[kv])
        except torch.cuda.OutOfMemoryError as e:
            ctx.record({"kind": "not_run", **key, "why": f"out of memory ({str(e).splitlines()[0][:100]})"})
            continue
        finally:
            if ctx.device == "cuda":
                torch.cuda.empty_cache()
        for row in rows:
            ctx.record({"kind": "step", **key, **row})
        s = fp64_rules.point_summary(rows, max_ratio)
        ctx.record({"kind": "point", **key, "standard_median": s["standard_median"], "sides": s["sides"],
                    "seconds": round(time.monotonic() - t0, 1), "trace": trace})
        summaries.append({**key, "standard_median": s["standard_median"],
                          **{f"ratio[{n}]": v["ratio"] for n, v in s["sides"].items()}})
    metrics = {"preset": preset, "weights": weights, "conditioning": conditioning, "steps": steps,
               "max_ratio": max_ratio, "fp8_scale": fp8_scale, "points": summaries, "emulated": emulate}
    return ctx.verdict(fp64_rules.fp64_problems(ctx.recorded), metrics)
