"""Serving features the fast path must keep, checked through engines (``ctx.engine_under_test()`` against
``ctx.baseline_engine()``, the reference path). On a CPU both are ``builtin:reference``: the metrics say so
(``engine_under_test``, ``baseline``, ``same_engine``).

``features.structured_output``: JSON schemas (nested objects, arrays, enums, bounded integers and numbers,
pattern strings, booleans), regexes and choices, greedy (chat) and sampled (completions) on both engines.
Every output must be complete (``finish_reason == "stop"``) and validate: ``jsonschema`` for schemas,
``re.fullmatch`` for regexes, membership for choices. One invalid output fails the check.

With ``speculative`` (``ngram:3``, ``synthetic:3:p=0.8``) both engines decode speculatively
(``ctx.engine_under_test(speculative=...)``): every speculated token must pass the grammar too, and the
samples record their acceptance counts (at least one draft must have been examined).

``features.temperature_sampling``: for every temperature x filter cell (top-k / top-p off and on), ``samples``
one-token requests without a seed go to the engine under test; their token counts are compared with the
reference distribution, computed here in float64 from the baseline's raw log-probabilities
(softmax(logits / T), then top-k, then top-p) by a G-test. False alarms: the family-wise rate is ``alpha``
(default 1e-3) over the whole grid, Bonferroni: each cell is tested at ``alpha / cells``. Tokens with an
expected count under ``min_expected`` (5) are pooled, rarest together, so the chi-square approximation holds.
A sample of a token the filters remove is a failure on its own. Tokens within a tolerance of a top-k / top-p
boundary (where fast vs reference logits may legitimately decide differently: ``logit_tol``, ``mass_tol``;
1e-6 when both sides are one engine) are left out of both the test and the violations, and counted.
Then: the same seed gives the same tokens (alone and twice in one batch), and other seeds give other tokens.
A one-token request samples the prefill's logits, which no engine serves on a fast decode path:
``features.decode_sampling`` tests the tokens decode steps sample.

``features.full_context``: a greedy request that fills the engine's configured context exactly
(prompt + max_tokens == max_model_len) must succeed on both engines with every prompt token counted; the
token sequences are compared as vLLM's model tests do (identical, or at the first divergence each side's
token is in the other's top-n log-probabilities). One token over the limit, as a longer prompt or as a
prompt filling the context plus one token, must raise ``ContextLimitError`` naming the limit. Its status
is ``feature_rules.full_context_problems`` of its records (each side's generation or error, the comparison,
the over-limit requests), which ``bundle verify`` applies again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verify.checks import feature_rules
from verify.checks.feature_rules import (
    BOUNDARY_LOGIT_TOL,
    CASES,
    TOP_P_RULE,
    g_test,
    pooled_bins,
    reference_distribution,
    validate_output,
)
from verify.checks.registry import check
from verify.context import CheckContext
from verify.engines.base import Constraint, ContextLimitError, EngineError, SamplingParams

# ---------------------------------------------------------------------------------------------- engines


def _engines(ctx: CheckContext, speculative: str | None = None) -> tuple[Any, Any, dict[str, Any]]:
    eut = ctx.engine_under_test(speculative=speculative)
    base = ctx.baseline_engine(speculative=speculative)
    info = {"engine_under_test": eut.name, "baseline": base.name, "same_engine": eut is base}
    if speculative:
        info["speculative"] = speculative
    if eut is base:
        info["note"] = (f"the engine under test is the baseline itself ({eut.name}): this run checks the "
                        "feature on the reference path; fast path vs reference needs --engine on an sm_90 GPU")
    ctx.record({"kind": "engines", "engine_under_test": eut.describe(), "baseline": base.describe(),
                **({"speculative": speculative} if speculative else {})})
    return eut, base, info


def _roles(eut: Any, base: Any) -> list[tuple[str, Any]]:
    return [("engine_under_test", eut)] + ([] if eut is base else [("baseline", base)])


def _prompt_ids(seed: int, n: int, vocab: int, low: int = 3) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(low, vocab, size=n)]


# ---------------------------------------------------------------------------------------------- structured output
@check("features.structured_output",
       "JSON-schema / regex / choice constrained outputs all validate (100%), engine under test and baseline",
       imports=("jsonschema", "xgrammar"))
def structured_output(ctx: CheckContext, temperatures: list[float] = [0.0, 1.0], samples: int = 2,
                      max_tokens: int = 256, cases: list[str] | None = None, speculative: str | None = None) -> Any:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise EngineError("features.structured_output validates with jsonschema: pip install 'k3-verify[eval]'"
                          ) from None
    temperatures = [0.0, 1.0] if temperatures is None else [float(t) for t in temperatures]
    chosen = [c for c in CASES if cases is None or c["name"] in cases]
    if cases is not None and len(chosen) != len(set(cases)):
        unknown = sorted(set(cases) - {c["name"] for c in chosen})
        raise ValueError(f"unknown structured-output cases {unknown}; known: {[c['name'] for c in CASES]}")
    eut, base, info = _engines(ctx, speculative)
    totals: dict[str, dict[str, int]] = {}
    greedy: dict[str, dict[str, str]] = {}
    for role, engine in _roles(eut, base):
        tot = totals.setdefault(role, {"outputs": 0, "valid": 0, "complete": 0})
        for case in chosen:
            constraint = Constraint(case["kind"], case["spec"])
            for t in temperatures:
                if t == 0.0:  # greedy through the chat template
                    outs = [("chat", engine.chat([{"role": "user", "content": case["prompt"]}],
                                                 SamplingParams(max_tokens=max_tokens), constraint))]
                else:  # sampled completions, one seed per request from the engine's stream
                    params = SamplingParams(max_tokens=max_tokens, temperature=t, seed=None)
                    outs = [("completion", c) for c in engine.generate([case["prompt"]] * samples, params,
                                                                        constraint)]
                for mode, c in outs:
                    why = validate_output(case["kind"], case["spec"], c.text)
                    if c.finish_reason != "stop":
                        why = f"incomplete (finish_reason {c.finish_reason} after {len(c.token_ids)} tokens)" + (
                            f"; {why}" if why else "")
                    tot["outputs"] += 1
                    tot["valid"] += why is None
                    tot["complete"] += c.finish_reason == "stop"
                    ctx.record({"kind": "sample", "role": role, "engine": engine.name, "case": case["name"],
                                "constraint": case["kind"], "temperature": t, "mode": mode, "text": c.text,
                                "tokens": len(c.token_ids), "finish_reason": c.finish_reason,
                                "valid": why is None, "error": why,
                                **({"acceptance": c.extra.get("acceptance")} if speculative else {})})
                    if t == 0.0:
                        greedy.setdefault(case["name"], {})[role] = c.text
    problems = feature_rules.structured_output_problems(ctx.recorded)
    agree = [v.get("engine_under_test") == v.get("baseline", v.get("engine_under_test")) for v in greedy.values()]
    metrics: dict[str, Any] = dict(info)
    for role, tot in totals.items():
        metrics[f"{role}_outputs"] = tot["outputs"]
        metrics[f"{role}_valid"] = tot["valid"]
        metrics[f"{role}_valid_fraction"] = tot["valid"] / tot["outputs"] if tot["outputs"] else 0.0
    metrics.update({"cases": [c["name"] for c in chosen], "temperatures": temperatures,
                    "greedy_agreement": sum(agree) / len(agree) if agree else None})
    return ctx.verdict(problems, metrics)


def _logits_of(engine: Any, prompt: list[int]) -> np.ndarray:
    lp = engine.next_token_logprobs(prompt)
    v = engine.vocab_size
    missing = [i for i in range(v) if i not in lp]
    if missing:
        raise EngineError(f"{engine.name} returned {len(lp)} of {v} next-token log-probabilities; the sampling "
                          "check needs the whole distribution")
    return np.array([lp[i] for i in range(v)], dtype=np.float64)


DEFAULT_FILTERS = [{"top_k": 0, "top_p": 1.0}, {"top_k": 20, "top_p": 1.0}, {"top_k": 0, "top_p": 0.8},
                   {"top_k": 50, "top_p": 0.9}]


@check("features.temperature_sampling",
       "sampled token frequencies match softmax(logits/T) with top-k/top-p (G-test, Bonferroni); seeds reproduce")
def temperature_sampling(ctx: CheckContext, temperatures: list[float] = [0.5, 1.0, 1.5],
                         filters: list[dict[str, Any]] | None = None, samples: int = 2000, alpha: float = 1e-3,
                         min_expected: float = 5.0, prompt_len: int = 12, logit_tol: float = BOUNDARY_LOGIT_TOL,
                         mass_tol: float = 0.005, seq_tokens: int = 8, other_seeds: int = 3) -> Any:
    temperatures = [0.5, 1.0, 1.5] if temperatures is None else [float(t) for t in temperatures]
    filters = DEFAULT_FILTERS if filters is None else [dict(f) for f in filters]
    if not temperatures or any(t <= 0 for t in temperatures) or not filters or samples < 1:
        raise ValueError("temperature_sampling needs temperatures > 0, at least one filter and samples >= 1")
    eut, base, info = _engines(ctx)
    prompt = _prompt_ids(ctx.seed + 101, prompt_len, eut.vocab_size)
    ref = _logits_of(base, prompt)
    own = _logits_of(eut, prompt) if eut is not base else ref
    own_err = float(np.max(np.abs((own - own.max()) - (ref - ref.max()))))
    if eut is base:  # the same logits on both sides: only float32-vs-float64 rounding can move a boundary
        logit_tol, mass_tol = 1e-6, 1e-6
    cells = [(t, int(f.get("top_k", 0)), float(f.get("top_p", 1.0))) for t in temperatures for f in filters]
    alpha_cell = alpha / len(cells)
    ctx.record({"kind": "reference_logits", "engine": base.name, "logits": ref.tolist(), "alpha": alpha,
                "logit_tol": logit_tol, "mass_tol": mass_tol, "top_p_rule": TOP_P_RULE, "min_expected": min_expected})
    worst_p = 1.0
    ambiguous_samples = 0
    for t, k, tp in cells:
        p, amb = reference_distribution(ref, t, k, tp, logit_tol, mass_tol)
        params = SamplingParams(max_tokens=1, temperature=t, top_k=k, top_p=tp, seed=None, ignore_eos=True)
        outs = eut.generate([prompt] * samples, params)
        toks = np.array([c.token_ids[0] if c.token_ids else -1 for c in outs])
        missing = int((toks < 0).sum())
        toks = toks[toks >= 0]
        counts = np.bincount(toks, minlength=len(p))[: len(p)]
        clear = ~amb
        forbidden = int(counts[(p == 0) & clear].sum())
        n_amb = int(counts[amb].sum())
        ambiguous_samples += n_amb
        n = int(counts[clear & (p > 0)].sum())
        q = np.where(clear, p, 0.0)
        q = q / q.sum() if q.sum() > 0 else q
        bins = pooled_bins(n * q, min_expected)
        obs = np.array([counts[b].sum() for b in bins], dtype=np.float64)
        exp = np.array([n * q[b].sum() for b in bins], dtype=np.float64)
        g, df, pval = g_test(obs, exp) if n > 0 else (0.0, 0, 1.0)
        worst_p = min(worst_p, pval)
        ok = forbidden == 0 and pval >= alpha_cell and not missing
        ctx.record({"kind": "frequency", "temperature": t, "top_k": k, "top_p": tp, "samples": len(toks),
                    "missing_tokens": missing, "tested_samples": n, "ambiguous_samples": n_amb,
                    "forbidden_samples": forbidden, "kept_tokens": int((p > 0).sum()), "bins": len(bins), "G": g,
                    "df": df, "p_value": pval, "alpha_per_test": alpha_cell, "ok": ok,
                    "counts": {str(i): int(c) for i, c in enumerate(counts) if c},
                    "expected_bins": [round(float(e), 4) for e in exp], "observed_bins": obs.astype(int).tolist()})
    seq = _seed_checks(eut, prompt, seq_tokens, other_seeds, ctx.seed)
    ctx.record({"kind": "seeds", **seq})
    problems = feature_rules.temperature_sampling_problems(ctx.recorded)
    metrics = dict(info, cells=len(cells), samples_per_cell=samples, alpha_family=alpha, alpha_per_test=alpha_cell,
                   correction="bonferroni", test="G-test (chi-square tail), rare tokens pooled to expected >= "
                   f"{min_expected:g}", min_p_value=worst_p, ambiguous_samples=ambiguous_samples,
                   boundary_logit_tol=logit_tol, boundary_mass_tol=mass_tol,
                   own_vs_baseline_max_logit_diff=own_err, same_seed_same_tokens=seq["same_seed_same_tokens"],
                   other_seeds_differ=seq["other_seeds_differ"])
    return ctx.verdict(problems, metrics)


def _seed_checks(engine: Any, prompt: list[int], n: int, others: int, seed: int) -> dict[str, Any]:
    def run(prompts: list[list[int]], s: int) -> list[list[int]]:
        p = SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True)
        return [c.token_ids for c in engine.generate(prompts, p)]

    s0 = seed + 7
    first = run([prompt], s0)[0]
    again = run([prompt], s0)[0]
    pair = run([prompt, prompt], s0)
    other = [run([prompt], s0 + i)[0] for i in range(1, others + 1)]
    problems = []
    same = first == again and pair[0] == first and pair[1] == first
    if not same:
        problems.append(f"seed {s0}: the same seed gave different tokens ({first} / {again} / {pair})")
    differ = any(o != first for o in other)
    if not differ:
        problems.append(f"seeds {s0 + 1}..{s0 + others} all gave seed {s0}'s tokens {first}: the seed is ignored")
    return {"seed": s0, "tokens": first, "again": again, "batched": pair, "other_seeds": other,
            "same_seed_same_tokens": same, "other_seeds_differ": differ, "problems": problems}


# ---------------------------------------------------------------------------------------------- full context
def _expect_rejection(engine: Any, prompt: list[int], max_tokens: int, limit: int) -> str | None:
    """None if the engine rejects the over-long request clearly, else what it did instead."""
    total = len(prompt) + max_tokens
    try:
        c = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    except ContextLimitError as e:
        if str(limit) not in str(e):
            return f"rejected {total} tokens but the message does not name the limit {limit}: {e}"
        return None
    except Exception as e:  # a crash or another error is not the clear rejection the check asks for
        return f"{total} tokens raised {type(e).__name__} instead of ContextLimitError: {e}"
    return (f"accepted {len(prompt)} + {max_tokens} = {total} tokens over max_model_len {limit} (reported "
            f"prompt_tokens {c.prompt_tokens}, {len(c.token_ids)} generated): silently truncated or overrun")


@check("features.full_context",
       "a request at the full configured context succeeds and matches the baseline; one token over is rejected")
def full_context(ctx: CheckContext, max_tokens: int = 4, top_logprobs: int = 5,
                 max_model_len: int | None = None) -> Any:
    eut, base, info = _engines(ctx)
    limit = int(max_model_len or eut.max_model_len)
    if limit > eut.max_model_len:
        raise ValueError(f"max_model_len {limit} is over the engine's configured {eut.max_model_len}")
    if base.max_model_len < limit:
        raise EngineError(f"the baseline {base.name} serves {base.max_model_len} positions, fewer than the "
                          f"{limit} under test: start it with --max-model-len {limit}")
    if not 1 <= max_tokens < limit:
        raise ValueError(f"max_tokens must lie in 1..{limit - 1}, got {max_tokens}")
    prompt = _prompt_ids(ctx.seed + 202, limit - max_tokens, eut.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, logprobs=top_logprobs, ignore_eos=True)
    results = {}
    for role, engine in _roles(eut, base):
        head = {"kind": "full_context", "role": role, "engine": engine.name, "prompt_len": len(prompt),
                "max_tokens": max_tokens, "top_logprobs": top_logprobs}
        try:
            c = engine.generate([prompt], params)[0]
        except Exception as e:
            ctx.record({**head, "error": f"{type(e).__name__}: {e}"})
            continue
        results[role] = c
        ctx.record({**head, "prompt_tokens": c.prompt_tokens, "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "logprobs": [{str(k): v for k, v in d.items()} for d in c.logprobs or []]})
    cmp: dict[str, Any] = {}
    if "engine_under_test" in results:
        other = results.get("baseline", results["engine_under_test"])
        ok, cmp = feature_rules.compare_greedy(results["engine_under_test"].token_ids,
                                              results["engine_under_test"].logprobs, other.token_ids, other.logprobs)
        ctx.record({"kind": "comparison", **cmp, "ok": ok})
    over = {"longer_prompt": (_prompt_ids(ctx.seed + 303, limit - max_tokens + 1, eut.vocab_size), max_tokens),
            "full_prompt_plus_one": (_prompt_ids(ctx.seed + 304, limit, eut.vocab_size), 1)}
    for name, (p, n) in over.items():
        why = _expect_rejection(eut, p, n, limit)
        ctx.record({"kind": "over_limit", "case": name, "prompt_len": len(p), "max_tokens": n,
                    "max_model_len": limit, "rejected_clearly": why is None, "error": why})
    problems = feature_rules.full_context_problems(ctx.recorded)
    metrics = dict(info, max_model_len=limit, prompt_len=len(prompt), max_tokens=max_tokens, **cmp)
    return ctx.verdict(problems, metrics)
