"""Serving features under speculative decoding, through engines: ``ctx.engine_under_test(speculative=...)``
against ``ctx.baseline_engine(speculative=...)`` (``builtin:<path>+spec=METHOD:K``; on a CPU both are
``builtin:reference``, which the metrics say: ``same_engine``). ``features.structured_output`` takes the same
``speculative`` parameter (grammars inside speculated tokens).

``features.spec_acceptance``: the acceptance-length gate. Greedy requests from seeded random prompts on
both engines with the same drafter (default ``synthetic:3:p=0.8``: the reference model's own greedy
continuation, each draft token kept with probability 0.8 by a draw that depends on the prompt and position
only), one ``request`` record per request and role (its emitted tokens, verify steps, and per draft
position how often it was examined and accepted). ``spec_rules.spec_acceptance_problems`` fails where the
engine under test accepts less than the baseline at a position by more than ``margin`` and significantly
(one-sided two-proportion z-test, Bonferroni over positions at ``alpha``), and records the minimum drop
detectable with 80% power at these counts. A verify kernel whose rows after the first are wrong keeps
emitting the right tokens (rejection corrects them) while acceptance collapses: this is the check that sees it.

``features.spec_sampling``: temperature sampling under speculative decoding follows the target's
distribution. A cell may name its own drafter (``speculative``, e.g. another draft count: one check covers
k = 1, 3 and 7); the others use the check's. Per (temperature, filter) cell, ``samples`` requests of ``max_tokens`` tokens without a seed
(every token after the first comes from a verify step: accepted drafts, the residual draw after a rejection,
bonus tokens); each token is scored against the baseline's own distribution of its context (the plain
baseline's teacher-forced log-probabilities of the whole sequence, ``softmax(logits / T)`` after top-k /
top-p): its interval ``[F(before), F(before) + p]`` with tokens ordered by falling probability and a
recorded uniform draw ``U`` give the randomized probability integral transform ``u = lo + U p``, which is
uniform and independent from token to token exactly when the emitted tokens follow the distribution
(Rosenblatt). The ``u`` of all tokens go into ``bins`` equal bins, G-tested against uniform at
``alpha / cells``; a bias towards the draft (the correction drawn from ``p`` instead of the residual) piles
up ``u`` near 0. ``spec_rules.spec_sampling_problems`` redoes the test from each token's recorded interval
and draw, and requires the verify rule to have run (drafts accepted and rejected). The intervals come from
the baseline's full distribution at every position, which is not recorded (V floats per token). A token
within its position's logit tolerance of a top-k / top-p boundary is ambiguous and left out, every interval
being taken on the distribution conditioned on the unambiguous tokens (``spec_rules.PIT_RULE``: leaving them
out of unconditional intervals would empty the top bin); the tolerance is the plan's ``logit_tol`` or the
engine's own measured deviation from the baseline at that position, whichever is wider (``TOL_RULE``).

``features.decode_sampling``: the same test without speculative decoding. ``features.temperature_sampling``'s
frequency test samples one-token requests, whose token comes from the prefill, which every engine serves on
the standard path; here every token after the first of a request comes from a decode step (the fast path's
kernels on ``builtin:fast``), so a decode-step numerics bug that changes the sampling distribution shows
(tests/test_spec_features.py: decode logits 1.3x too sharp pass the one and fail this).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verify.checks.feature_rules import BOUNDARY_LOGIT_TOL, TOP_P_RULE
from verify.checks.registry import check
from verify.checks.spec_rules import (
    PIT_RULE,
    acceptance_comparison,
    pit_test,
    spec_acceptance_problems,
    spec_sampling_problems,
    token_interval,
)
from verify.context import CheckContext
from verify.engines.base import SamplingParams


def _spec_engines(ctx: CheckContext, speculative: str) -> tuple[Any, Any, dict[str, Any]]:
    eut = ctx.engine_under_test(speculative=speculative)
    base = ctx.baseline_engine(speculative=speculative)
    info = {"engine_under_test": eut.name, "baseline": base.name, "same_engine": eut is base,
            "speculative": speculative}
    ctx.record({"kind": "engines", "engine_under_test": eut.describe(), "baseline": base.describe(),
                "speculative": speculative})
    return eut, base, info


def verify_steps_served(ctx: CheckContext, eut: Any) -> dict[str, Any] | None:
    """After the requests: how the engine under test served its verify steps, from its own description
    (a builtin fast engine's trace): verify steps the generator ran, those the executor ran as one fused step,
    and why the others ran as decode steps (``verify_splits``). Recorded (``engine_after``) and returned for
    the metrics (information: which verify path the sampling / acceptance numbers rest on); None for an
    engine that does not say."""
    d = eut.describe()
    trace = d.get("fast_path_trace")
    if trace is None:
        return None
    out = {"verify_steps": (d.get("steps") or {}).get("verify_steps"),
           "fused_verify_steps": (trace.get("kinds") or {}).get("verify", 0),
           "split_reasons": d.get("verify_splits") or {}}
    ctx.record({"kind": "engine_after", "engine_under_test": d, **out})
    return out


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, size=length)] for _ in range(n)]


@check("features.spec_acceptance",
       "speculative decoding's per-position acceptance: engine under test not below the baseline (same drafter, "
       "same prompts)")
def spec_acceptance(ctx: CheckContext, speculative: str = "synthetic:3:p=0.8", prompts: int = 16,
                    prompt_len: int = 12, max_tokens: int = 32, margin: float = 0.05, alpha: float = 0.01,
                    min_examined: int = 50) -> Any:
    """The check (module docstring)."""
    if prompts < 1 or max_tokens < 2 or not 0 < alpha < 1 or margin < 0:
        raise ValueError("spec_acceptance needs prompts >= 1, max_tokens >= 2, 0 < alpha < 1, margin >= 0")
    eut, base, info = _spec_engines(ctx, speculative)
    ctx.record({"kind": "plan", "prompts": prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
                "margin": margin, "alpha": alpha, "min_examined": min_examined, "speculative": speculative,
                "same_engine": eut is base})
    ids = _prompts(ctx.seed + 7, prompts, prompt_len, eut.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for role, engine in [("engine_under_test", eut)] + ([] if eut is base else [("baseline", base)]):
        for i, c in enumerate(engine.generate(ids, params)):
            acc = c.extra.get("acceptance") or {}
            ctx.record({"kind": "request", "role": role, "prompt": i, "tokens": c.token_ids,
                        "steps": acc.get("steps"), "examined": acc.get("examined"), "accepted": acc.get("accepted")})
    served = verify_steps_served(ctx, eut)
    cmp = acceptance_comparison(ctx.recorded)
    metrics = dict(info, positions=cmp["positions"], mean_acceptance_length=cmp["mean_acceptance_length"],
                   margin=margin, alpha=alpha, test="one-sided two-proportion z-test per draft position, "
                   "Bonferroni", min_detectable_drop=[p.get("min_detectable_drop") for p in cmp["positions"]])
    if served is not None:
        metrics["verify_steps_served"] = served
    return ctx.verdict(spec_acceptance_problems(ctx.recorded), metrics)


SCORE_CHUNK = 16  # sequences scored per teacher-forced forward batch (k3-mini: 16 x 16 x 163840 FP32 = 168 MB)
# Each position's logit tolerance: the plan's ``logit_tol`` or, when wider, how far the engine under test's own
# raw log-probabilities of its ``LOGPROB_WIDTH`` most likely tokens (returned with the sample) spread around the
# baseline's for the same tokens (``logit_spread``: half the range of the differences, a common shift being
# irrelevant to any filter). A token within that of a filter boundary is one the two engines' numerics may
# legitimately put on different sides; a filter bug puts tokens far outside. Everything ambiguous leaves too few
# tokens tested (``min_tokens``), which fails.
LOGPROB_WIDTH = 20  # vLLM's default max_logprobs; covers a top-k of 20 and the top-p boundary of the cells
TOL_RULE = "max(logit_tol, measured spread)"


def logit_spread(engine_top: dict[int, float] | None, baseline: Any) -> float:
    """Half the range of ``engine_top[t] - baseline[t]`` over the engine's reported tokens (0 when it reported
    none): the smallest bound on how far each of those logits moved once a common shift is taken out."""
    if not engine_top:
        return 0.0
    d = [float(v) - float(baseline[int(t)]) for t, v in engine_top.items()]
    return 0.5 * (max(d) - min(d))


DEFAULT_CELLS = [{"temperature": 1.0, "top_k": 0, "top_p": 1.0}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9}]


@check("features.spec_sampling",
       "under speculative decoding every sampled token follows softmax(logits/T) with top-k/top-p given its "
       "context (randomized PIT, G-test)")
def spec_sampling(ctx: CheckContext, speculative: str = "synthetic:3:p=1.0", cells: list[dict] | None = None,
                  samples: int = 300, max_tokens: int = 8, prompt_len: int = 8, bins: int = 20, alpha: float = 1e-3,
                  min_tokens: int = 200, logit_tol: float = BOUNDARY_LOGIT_TOL, mass_tol: float = 0.005) -> Any:
    """The check (module docstring)."""
    return _pit_sampling(ctx, speculative, cells, samples, max_tokens, prompt_len, bins, alpha, min_tokens,
                         logit_tol, mass_tol)


@check("features.decode_sampling",
       "every token sampled at decode positions follows softmax(logits/T) with top-k/top-p given its context "
       "(randomized PIT, G-test): the decode step's logits, not only the prefill's")
def decode_sampling(ctx: CheckContext, cells: list[dict] | None = None, samples: int = 300, max_tokens: int = 8,
                    prompt_len: int = 8, bins: int = 20, alpha: float = 1e-3, min_tokens: int = 200,
                    logit_tol: float = BOUNDARY_LOGIT_TOL, mass_tol: float = 0.005) -> Any:
    """``features.spec_sampling``'s test without speculative decoding: the tokens after the first of each
    request come from decode steps (the fast path's, on builtin:fast), which ``features.temperature_sampling``'s
    one-token requests never reach (their token comes from the prefill, the standard path on every engine)."""
    return _pit_sampling(ctx, None, cells, samples, max_tokens, prompt_len, bins, alpha, min_tokens, logit_tol,
                         mass_tol)


def _pit_sampling(ctx: CheckContext, speculative: str | None, cells: list[dict] | None, samples: int,
                  max_tokens: int, prompt_len: int, bins: int, alpha: float, min_tokens: int, logit_tol: float,
                  mass_tol: float) -> Any:
    """The randomized-PIT sampling test (module docstring), under ``speculative`` or (None) plain decoding."""
    cells = DEFAULT_CELLS if cells is None else [dict(c) for c in cells]
    if not cells or samples < 1 or max_tokens < 2 or any(float(c.get("temperature", 0)) <= 0 for c in cells):
        raise ValueError(f"{ctx.check_id} needs cells with temperature > 0, samples >= 1 and max_tokens >= 2")
    if speculative is None and any(c.get("speculative") for c in cells):
        raise ValueError(f"{ctx.check_id} samples without speculative decoding: a cell cannot name a drafter")
    for c in cells:  # a cell's drafter: its own "speculative" (e.g. another draft count), else the check's
        c["speculative"] = c.get("speculative") or speculative
    engines: dict[Any, tuple[Any, Any]] = {}
    for spec in dict.fromkeys(c["speculative"] for c in cells):
        if spec is None:
            eut, base = ctx.engine_under_test(), ctx.baseline_engine()
            info = {"engine_under_test": eut.name, "baseline": base.name, "same_engine": eut is base,
                    "speculative": None}
            ctx.record({"kind": "engines", "engine_under_test": eut.describe(), "baseline": base.describe(),
                        "speculative": None})
        else:
            eut, base, info = _spec_engines(ctx, spec)
        engines[spec] = (eut, base)
    same = all(e is b for e, b in engines.values())
    info = dict(info, same_engine=same, speculative=speculative,
                drafters=[s for s in engines if s is not None] or None)
    plain = ctx.baseline_engine()  # the reference distributions: the baseline without speculative decoding
    if not hasattr(plain, "sequence_logprobs"):
        from verify.engines.base import EngineError

        raise EngineError(f"{ctx.check_id} scores every position with the baseline's teacher-forced "
                          f"log-probabilities; {plain.name} has none (use a builtin baseline)")
    if same:
        logit_tol, mass_tol = 1e-6, 1e-6
    prompt = _prompts(ctx.seed + 211, 1, prompt_len, eut.vocab_size)[0]
    ctx.record({"kind": "plan", "cells": cells, "samples": samples, "max_tokens": max_tokens, "prompt": prompt,
                "bins": bins, "alpha": alpha, "min_tokens": min_tokens, "logit_tol": logit_tol, "top_p_rule": TOP_P_RULE,
                "pit_rule": PIT_RULE, "tol_rule": TOL_RULE, "logprob_width": LOGPROB_WIDTH,
                "mass_tol": mass_tol, "speculative": speculative, "reference_engine": plain.name})
    rng = np.random.default_rng(ctx.seed + 223)
    worst = 1.0
    for i, cell in enumerate(cells):
        eut = engines[cell["speculative"]][0]
        t, k, tp = float(cell["temperature"]), int(cell.get("top_k", 0)), float(cell.get("top_p", 1.0))
        params = SamplingParams(max_tokens=max_tokens, temperature=t, top_k=k, top_p=tp, seed=None, ignore_eos=True,
                                logprobs=LOGPROB_WIDTH)
        seqs = []
        outs = eut.generate([prompt] * samples, params)
        for c0 in range(0, len(outs), SCORE_CHUNK):  # [T, V] per sequence: a chunk at a time in host memory
            chunk = outs[c0: c0 + SCORE_CHUNK]
            for c, full in zip(chunk, plain.sequence_logprobs([prompt + list(c.token_ids) for c in chunk]),
                               strict=True):
                lp = full[len(prompt) - 1: -1].double().numpy()
                tols = [max(logit_tol, logit_spread(c.logprobs[j] if c.logprobs else None, lp[j]))
                        for j in range(len(c.token_ids))]
                iv = [token_interval(lp[j], tok, t, k, tp, tols[j], mass_tol) for j, tok in enumerate(c.token_ids)]
                acc = c.extra.get("acceptance") or {}
                # a token the filters remove: both engines' view of that position (engine top-N, baseline top-N)
                evidence = [{"position": j, "engine_top": {str(a): float(b) for a, b in (c.logprobs[j] or {}).items()}
                             if c.logprobs else None,
                             "baseline_top": {str(a): float(lp[j][a]) for a in np.argsort(-lp[j])[:LOGPROB_WIDTH + 5]}}
                            for j, x in enumerate(iv) if x[1] <= 0.0 and not x[2]]
                seqs.append({"kind": "sequence", "cell": i, "tokens": list(c.token_ids), "lo": [x[0] for x in iv],
                             "p": [x[1] for x in iv], "ambiguous": [x[2] for x in iv], "tol": tols,
                             **({"forbidden_evidence": evidence} if evidence else {}),
                             "U": rng.random(len(iv)).tolist(), "examined": sum(acc.get("examined") or []),
                             "accepted": sum(acc.get("accepted") or [])})
        for s in seqs:
            ctx.record(s)
        res = pit_test(seqs, bins)
        worst = min(worst, res["p_value"])
        ctx.record({"kind": "cell", "temperature": t, "top_k": k, "top_p": tp, "speculative": cell["speculative"], **res,
                    "max_tol": max((x for s in seqs for x in s["tol"]), default=logit_tol),
                    "examined": sum(s["examined"] for s in seqs), "accepted": sum(s["accepted"] for s in seqs),
                    "alpha_per_test": alpha / len(cells)})
    served = ({spec: verify_steps_served(ctx, e) for spec, (e, _) in engines.items()}
              if speculative is not None else None)
    if served is not None and len(served) == 1:
        served = next(iter(served.values()))
    metrics = dict(info, cells=len(cells), samples_per_cell=samples, tokens_per_sample=max_tokens,
                   alpha_family=alpha, alpha_per_test=alpha / len(cells), min_p_value=worst,
                   reference_engine=plain.name, test=f"randomized PIT of every token, {bins} bins, G-test")
    if served is not None:
        metrics["verify_steps_served"] = served
    return ctx.verdict(spec_sampling_problems(ctx.recorded), metrics)
