"""``equivalence.spec_decode``'s pass/fail rule as a function of its records (no torch: ``bundle verify``
applies it again).

Records: one ``plan`` (``points`` [[batch, k], ...], ``steps``, ``p``, ``state_tol``, ``emulated``), then per
point a ``point`` record (or ``not_run`` with the reason): the plain greedy tokens and the speculative ones
per request, ``verify_steps`` and ``positions`` (the decode steps they ran: one per verify row, at most
``k + 1`` per verify step, fewer where the drafts were capped by the tokens left to emit), the fast steps
and fallbacks the trace counted while the verify steps ran, the largest differences between the committed KDA state / MLA latents and those of plain decoding of the
same tokens, and the acceptance counts per draft position.

A point passes when the speculative tokens are the plain tokens (request by request, every token), both
state differences are within ``state_tol``, every verify position ran as a fast step (``positions`` fast
steps, no fallback, ``verify_steps <= positions <= (k + 1) verify_steps``) and at least one verify step
ran. The check passes when every planned point passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verify.checks.feature_rules import first_divergence

Records = Sequence[Mapping[str, Any]]


def spec_decode_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    plans = [r for r in records if r.get("kind") == "plan"]
    if len(plans) != 1:
        return [f"{len(plans)} plan records (expected 1)"]
    plan = plans[0]
    tol = plan.get("state_tol")
    if not isinstance(tol, (int, float)) or tol < 0:
        return [f"state_tol {tol!r} is not a number >= 0"]
    by_key = {(r.get("batch"), r.get("k")): r for r in records if r.get("kind") in ("point", "not_run")}
    problems = [] if plan.get("points") else ["no point was planned"]
    for batch, k in plan.get("points") or []:
        where = f"batch {batch} k {k}"
        r = by_key.get((batch, k))
        if r is None:
            problems.append(f"{where}: no record of this planned point")
            continue
        if r["kind"] == "not_run":
            problems.append(f"{where}: not run ({r.get('why')})")
            continue
        plain, spec = r.get("plain_tokens") or [], r.get("spec_tokens") or []
        if len(plain) != batch or len(spec) != batch:
            problems.append(f"{where}: {len(plain)} plain and {len(spec)} speculative requests for batch {batch}")
            continue
        for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
            m = first_divergence(a, b)
            if m is not None or len(a) != plan.get("steps"):
                problems.append(f"{where}: request {i}: speculative tokens differ from plain greedy at token {m} "
                                f"(of {len(a)}, {plan.get('steps')} planned)")
                break
        for name in ("state_max_abs_diff", "latent_max_abs_diff"):
            v = r.get(name)
            if not isinstance(v, (int, float)) or not v <= tol:
                problems.append(f"{where}: {name} {v!r} > {tol} (the committed state is not plain decoding's)")
        steps = r.get("verify_steps")
        if not isinstance(steps, int) or steps < 1:
            problems.append(f"{where}: {steps!r} verify steps ran")
        elif (not isinstance(r.get("positions"), int) or not steps <= r["positions"] <= (k + 1) * steps
              or r.get("fast_positions") != r["positions"] or r.get("fallback_positions") != 0):
            problems.append(f"{where}: {r.get('fast_positions')} fast steps and {r.get('fallback_positions')} "
                            f"fallbacks for {steps} verify steps of {r.get('positions')!r} positions "
                            f"(at most {k + 1} each)")
        acc = r.get("acceptance") or {}
        if not acc.get("steps") or len(acc.get("accepted") or []) != k:
            problems.append(f"{where}: no acceptance counts for {k} draft positions")
    return problems
