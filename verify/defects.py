"""Planted defects: small, realistic bugs in the fast path's kernels or glue, planted into one executor's own op
table, so a run can show that the suite catches them (issue #19: the sentinel evals must fail on each while
the clean fast path passes).

A defect rewrites the arguments of one fast-step op (``k3_fastpath.runtime.fast_ops``: the table the fast
step calls every op through) or post-processes its output, for every call of that op in every layer; it is
planted before the executor captures its CUDA graphs, stays CUDA-graph capturable (tensor ops only, no host
synchronisation) and counts the calls it changed (``PlantedDefect.calls``: eager calls and those captured
into a graph; a replay runs the captured defect without Python), so a run shows the defect was in the step. ``DEFECTS`` is the catalog; each entry says which bug it
models. The engine spec ``builtin:fast+defect=NAME`` (``verify.engines``) serves the fast path with one
defect planted, and every record and manifest entry names it, so a bundle of a planted run can never pass
for a clean one.

Not in the catalog, because K3 cannot show them: a bug that rescales a token's routed weights uniformly (the
top-k renormalisation dropped, ``norm_topk_prob`` lost) is absorbed by the RMSNorm over the latent routed sum
(``latent_moe_use_norm``, ``reference.moe.LatentMoE.routed``); planted on the trained sentinel it moved the
answers' likelihood by 2e-7 nats a token (bundles/runs/2026-12-07-h100-session31).

``wrap_op`` is the one way any planted change enters an executor (``equivalence.fp64``'s planted controls,
which scale an op's output, use it too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Args = tuple[Any, ...]


def wrap_op(executor: Any, op: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace op ``op`` of ``executor``'s own op table (other executors keep theirs) by ``make(fn)``, where
    ``fn`` is the op's current implementation; before the executor's graphs are captured."""
    from k3_fastpath.runtime.fast_ops import OpImpl

    if op not in executor.ops:
        raise ValueError(f"no op {op!r} in the fast step (its ops: {', '.join(sorted(executor.ops))})")
    impl = executor.ops[op]
    executor.ops[op] = OpImpl(op, make(impl.fn), kernel=impl.kernel, standard_reason=impl.standard_reason,
                              launch=impl.launch)


@dataclass(frozen=True)
class Defect:
    """One planted bug: ``op`` called with ``rewrite(args, kwargs)``'s arguments (None: unchanged), its output
    passed through ``after(args, kwargs, out)`` (None: unchanged). ``models``: the real bug it stands for."""

    name: str
    op: str
    models: str
    rewrite: Callable[[Args, dict[str, Any]], tuple[Args, dict[str, Any]]] | None = None
    after: Callable[[Args, dict[str, Any], Any], Any] | None = None


def _replace(args: Args, index: int, value: Any) -> Args:
    return args[:index] + (value,) + args[index + 1:]


LIKELIHOOD_PREFIX = "likelihood."  # the checks catch_table reads beside the evals (verify.checks.likelihood)

# argument positions of the ops the defects touch (fast_ops' table of signatures)
MLA_W_UK, MLA_CTX_LEN, MLA_SOFTMAX_SCALE = 10, 9, 12
KDA_DT_BIAS, KDA_STATE = 10, 16
ROUTER_X, ROUTER_W, ROUTER_BIAS, ROUTER_RENORM, ROUTER_SCALE = 0, 1, 2, 4, 5


def _mla_scale_nope_only(args: Args, kw: dict[str, Any]) -> tuple[Args, dict[str, Any]]:
    q_head_dim, nope = args[0].shape[-1], args[MLA_W_UK].shape[1]
    return _replace(args, MLA_SOFTMAX_SCALE, args[MLA_SOFTMAX_SCALE] * math.sqrt(q_head_dim / nope)), kw


def _mla_ctx_off_by_one(args: Args, kw: dict[str, Any]) -> tuple[Args, dict[str, Any]]:
    return _replace(args, MLA_CTX_LEN, (args[MLA_CTX_LEN] - 1).clamp_min(1)), kw


_ZEROS: dict[tuple[Any, ...], torch.Tensor] = {}


def _kda_dt_bias_dropped(args: Args, kw: dict[str, Any]) -> tuple[Args, dict[str, Any]]:
    bias = args[KDA_DT_BIAS]
    key = (bias.data_ptr(), bias.device, tuple(bias.shape), bias.dtype)
    if key not in _ZEROS:  # made on the first (uncaptured) call; replays reuse it
        _ZEROS[key] = torch.zeros_like(bias)
    return _replace(args, KDA_DT_BIAS, _ZEROS[key]), kw


def _kda_state_bf16(args: Args, kw: dict[str, Any], out: Any) -> Any:
    state = args[KDA_STATE]
    state.copy_(state.to(torch.bfloat16))
    return out


def _router_ids_sorted(args: Args, kw: dict[str, Any], out: Any) -> Any:
    ids, weights = out
    return torch.sort(ids, dim=-1).values, weights


def _router_bias_in_weights(args: Args, kw: dict[str, Any], out: Any) -> Any:
    ids, weights = out
    x, gate_w, bias = args[ROUTER_X], args[ROUTER_W], args[ROUTER_BIAS]
    idx = ids.long()
    sel = torch.sigmoid(x.float() @ gate_w.float().t()).gather(1, idx) + bias.float()[idx]
    if args[ROUTER_RENORM]:
        sel = sel / sel.sum(-1, keepdim=True)
    return ids, (sel * args[ROUTER_SCALE]).to(weights.dtype)


DEFECTS: dict[str, Defect] = {d.name: d for d in (
    Defect("mla_scale_nope_only", "mla_attention",
           "the MLA softmax scale from the 128 nope dims (1/sqrt(128)) instead of the whole q head "
           "(1/sqrt(192)): the NoPE rope dims taken for absent", rewrite=_mla_scale_nope_only),
    Defect("mla_ctx_off_by_one", "mla_attention",
           "a fence-post error in the paged attention's bound: ctx_len = pos, so the token just written "
           "to the latent cache is not attended", rewrite=_mla_ctx_off_by_one),
    Defect("kda_dt_bias_dropped", "kda_step",
           "the KDA decay gate without dt_bias (g = lower_bound * sigmoid(exp(A_log) * a)): a bias add "
           "lost in a fused kernel", rewrite=_kda_dt_bias_dropped),
    Defect("kda_state_bf16", "kda_step",
           "the KDA recurrent state stored in BF16 between steps instead of FP32 (a pool allocated in the "
           "activation dtype)", after=_kda_state_bf16),
    Defect("router_ids_sorted", "moe_router",
           "the router's expert ids written sorted by index while their weights stay in selection order (a "
           "kernel that sorts one output and not the other): each expert gets another's weight",
           after=_router_ids_sorted),
    Defect("router_bias_in_weights", "moe_router",
           "the routing correction bias added into the combine weights as well as the selection (it must "
           "only steer the selection)", after=_router_bias_in_weights),
)}


class PlantedDefect:
    """``defect`` planted into ``executor``; ``calls`` counts the calls it changed."""

    def __init__(self, executor: Any, name: str) -> None:
        if name not in DEFECTS:
            raise ValueError(f"unknown defect {name!r}; defects: {', '.join(DEFECTS)}")
        self.defect = d = DEFECTS[name]
        self.calls = 0

        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def planted(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                if d.rewrite is not None:
                    args, kwargs = d.rewrite(args, kwargs)
                out = fn(*args, **kwargs)
                return out if d.after is None else d.after(args, kwargs, out)
            return planted

        wrap_op(executor, d.op, make)

    def describe(self) -> dict[str, Any]:
        return {"name": self.defect.name, "op": self.defect.op, "models": self.defect.models,
                "calls": self.calls}


# ---------------------------------------------------------------- which eval caught which defect
def catch_table(clean: str, planted: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """From the clean run's bundle (the fast path against the reference) and one bundle per planted defect
    (``builtin:fast+defect=NAME`` on the same items against the clean run's baseline, or against the clean
    fast path ``builtin:fast``: 27x cheaper than the eager reference on the H200, and as near the reference as
    the clean run shows): per defect and eval task, the baseline, the status, the accuracies of both sides and
    their difference, how many items' responses the defect changed (``changed``: of ``compared``, from the sample
    records; None without them), the steps the defective engine ran on the fast path during the check
    (``fast_steps``, the result's ``served``; None where not recorded), and whether that eval caught the defect
    (failed where the clean run passed). The likelihood checks (``likelihood.*``) give rows too: ``measure``
    ``nll`` (each side's negative log-likelihood of the gold answers per token, their difference; ``changed``:
    the items the defective side found less likely) where the evals' rows measure ``accuracy``. Problems: a
    clean eval that did not pass (it cannot tell a defect apart), a bundle that is not a defect run or has
    another baseline, a defect no eval caught."""
    from verify.bundle.readers import eval_checks, read_bundle

    def engine(data: Any, role: str) -> dict[str, Any]:
        return next((e for e in data.manifest.get("engines", []) if isinstance(e, dict) and e.get("role") == role), {})

    base = read_bundle(clean)
    problems, rows = [], []
    if engine(base, "engine_under_test").get("spec") != "builtin:fast":
        problems.append(f"{clean}: the clean run's engine under test is "
                        f"{engine(base, 'engine_under_test').get('spec')!r}, not builtin:fast")
    def judged(data: Any) -> list[str]:  # the eval and likelihood checks of a bundle
        return eval_checks(data) + sorted(c for c in data.order if c.startswith(LIKELIHOOD_PREFIX))

    clean_ok = {c for c in judged(base) if base.status(c) == "passed"}
    problems += [f"clean run: {c} {base.status(c)} (it cannot tell a defect apart)"
                 for c in judged(base) if c not in clean_ok]
    for path in planted:
        data = read_bundle(path)
        name = engine(data, "engine_under_test").get("planted_defect")
        if not name:
            problems.append(f"{path}: its engine under test has no planted defect")
            continue
        baseline = engine(data, "baseline").get("spec")
        if baseline not in (engine(base, "baseline").get("spec"), "builtin:fast"):
            problems.append(f"{name}: baseline {baseline!r}, neither the clean run's "
                            f"{engine(base, 'baseline').get('spec')!r} nor the clean fast path")
        caught = []
        for check in judged(data):
            r = data.results.get(check)
            m = r.metrics if r is not None else {}
            nll = check.startswith(LIKELIHOOD_PREFIX)
            changed = _less_likely(m) if nll else _changed_responses(data, check)
            measure = "nll" if nll else "accuracy"
            served = (m.get("served") or {}).get("under_test") if isinstance(m.get("served"), dict) else None
            for task in sorted({k.split(":", 1)[0] for k in m if k.endswith(f":{measure}_diff")}):
                row = {"defect": name, "against": baseline, "check": check, "task": task, "measure": measure,
                       "status": data.status(check), "baseline": m.get(f"{task}:baseline_{measure}"),
                       "under_test": m.get(f"{task}:under_test_{measure}"),
                       "diff": m.get(f"{task}:{measure}_diff"), "p_value": m.get(f"{task}:p_value"),
                       "ci_low": (m.get(f"{task}:ci_diff") or [None])[0], "margin": m.get(f"{task}:margin"),
                       "changed": changed.get(task, (None, None))[0], "compared": changed.get(task, (None, None))[1],
                       "fast_steps": served.get("fast_steps") if isinstance(served, dict) else None,
                       "caught": check in clean_ok and data.status(check) == "failed",
                       "reason": (r.reason if r is not None else "")[:200]}
                rows.append(row)
                caught += [check] if row["caught"] else []
        if not caught:
            problems.append(f"{name}: no eval caught it{_moved(rows, name)}{_ablation_note(base, name)}")
    return rows, problems


ABLATION_OF_OP = {"mla_attention": ("mla_zeroed", "MLA")}  # a defect's op -> the held-out ablation of its layers


def _ablation_note(base: Any, name: str) -> str:
    """For a defect in a layer kind the scored model was measured without (its ``training.json``'s held-out
    ablation, recorded by the clean run's evals in their ``model`` metrics): how far that moved its held-out
    losses, the most over tasks; "" where there is no such measure."""
    from verify.bundle.readers import eval_checks

    ablation, kind = ABLATION_OF_OP.get(DEFECTS[name].op, (None, None)) if name in DEFECTS else (None, None)
    for check in eval_checks(base) if ablation else []:
        r = base.results.get(check)
        held = (((r.metrics if r is not None else {}).get("model") or {}).get("training") or {}).get("heldout") or {}
        zeroed, full = (held.get("ablated") or {}).get(ablation), held.get("checkpoint")
        both = [t for t in zeroed if t in full] if isinstance(zeroed, dict) and isinstance(full, dict) else []
        if both:
            change = max(abs(zeroed[t]["loss"] - full[t]["loss"]) / max(full[t]["loss"], 1e-12) for t in both)
            return (f"; with its {kind} layers zeroed the scored model's held-out losses moved {100 * change:.2g}% "
                    f"at most (its training.json)")
    return ""


def _moved(rows: list[dict[str, Any]], name: str) -> str:
    """What a defect no eval caught did to the answers' likelihood: the task where its interval lies furthest
    above zero (moved, under the margin), or that none excludes zero (not measurable on this model)."""
    nll = [r for r in rows if r["defect"] == name and r["measure"] == "nll" and r["ci_low"] is not None]
    if not nll:
        return ""
    top = max(nll, key=lambda r: r["ci_low"] / r["margin"] if r["margin"] else r["ci_low"])
    if top["ci_low"] <= 0:
        return "; its answers' likelihood moved by no measurable amount in any task (every interval holds 0)"
    return (f"; it made the answers less likely ({top['task']}: nll {top['diff']:+.3g}, CI low {top['ci_low']:.3g}) "
            f"by less than the margin {top['margin']:.3g}")


def _less_likely(metrics: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per task of a likelihood check: (items whose gold answer the engine under test found less likely, items)."""
    tasks = metrics.get("tasks") if isinstance(metrics.get("tasks"), dict) else {}
    return {t: (m["items_worse"], m["items"]) for t, m in tasks.items() if isinstance(m, dict) and "items_worse" in m}


def _changed_responses(data: Any, check: str) -> dict[str, tuple[int, int]]:
    """Per task of one eval check: (items whose responses differ between the two sides, items answered by
    both), from the bundle's sample records."""
    by: dict[tuple[str, Any], dict[str, Any]] = {}
    for recs in data.streams(check).values():
        for r in recs:
            if r.get("type") == "sample" and r.get("side") in ("baseline", "under_test"):
                by.setdefault((str(r.get("task")), r.get("doc_id")), {})[r["side"]] = r.get("responses")
    out: dict[str, tuple[int, int]] = {}
    for (task, _), sides in by.items():
        if len(sides) == 2:
            n, k = out.get(task, (0, 0))
            out[task] = (n + (sides["baseline"] != sides["under_test"]), k + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m verify.defects list`` (the defect names) | ``table CLEAN_BUNDLE DEFECT_BUNDLE...`` (a
    Markdown table of which eval caught which defect; exit 1 when a defect went uncaught or the clean run
    failed an eval, 2 on bad input)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["list"] and len(args) == 1:
        print(" ".join(DEFECTS))
        return 0
    if args[:1] != ["table"] or len(args) < 3:
        print("usage: python -m verify.defects list | table CLEAN_BUNDLE DEFECT_BUNDLE...", file=sys.stderr)
        return 2
    from verify.bundle.schema import BundleError

    try:
        rows, problems = catch_table(args[1], args[2:])
    except (BundleError, OSError) as e:
        print(f"defects table: {e}", file=sys.stderr)
        return 2
    def fmt(v: Any, measure: str) -> str:  # accuracies as percentages, NLLs as numbers
        return "-" if v is None else f"{100 * v:.1f}%" if measure == "accuracy" else f"{v:.4g}"

    print("| defect | against | eval task | measure | status | baseline | fast + defect | diff | p (nll: CI vs margin) | "
          "responses changed (nll: items less likely) | fast steps | caught |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = ("-" if r["p_value"] is None else f"{r['p_value']:.3g}") if r["measure"] == "accuracy" else (
            "-" if r["ci_low"] is None or r["margin"] is None else f"CI low {r['ci_low']:.3g} vs margin {r['margin']:.3g}")
        changed = "-" if r["changed"] is None else f"{r['changed']} of {r['compared']}"
        steps = "-" if r["fast_steps"] is None else str(r["fast_steps"])
        m = r["measure"]
        print(f"| {r['defect']} | {r['against']} | {r['task']} | {m} | {r['status']} | {fmt(r['baseline'], m)} | "
              f"{fmt(r['under_test'], m)} | {fmt(r['diff'], m)} | {p} | {changed} | {steps} | "
              f"{'yes' if r['caught'] else 'no'} |")
    for p in problems:
        print(f"- {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
