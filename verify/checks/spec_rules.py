"""The pass/fail rules of the speculative-decoding checks as functions of their records (``bundle verify``
applies them again): ``equivalence.spec_decode`` (below), ``features.spec_acceptance`` and
``features.spec_sampling`` (``spec_acceptance_problems``, ``spec_sampling_problems``; their records are
described in ``verify/checks/spec_features.py``).

``equivalence.spec_decode``.

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

A fused point (``verify: "fused"``, the plan's default since fused verify steps exist; records without the
field are column-by-column points) instead rests on its ``verify_step`` records (one per verify step, from
``equivalence_spec.ShadowVerify``): as many as the point's verify steps, with compared rows, the mean KL
over the point's rows within ``kl_tol``, every row's logit error within ``logit_tol`` of its largest logit,
every argmax mismatch a near-tie by ``equivalence.decode``'s rule (each side's token in the other's top
``TOP_K`` = 5), and after each commit the KDA state and MLA latent differences within ``state_tol`` of their
scale; every verify step a fused fast step (``fused_steps`` = ``verify_steps``, their rows =
``positions``, no fallback, none split into decode steps). The tokens against plain greedy are information.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import Any

from verify.checks.feature_rules import first_divergence

Records = Sequence[Mapping[str, Any]]
TOP_K = 5  # a fused row's argmax may differ from the decode steps' only within each other's top 5 (equivalence.decode)


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
        if r.get("verify") == "fused":
            problems += _fused_point_problems(records, plan, r, batch, k, where)
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


def _fused_point_problems(records: Records, plan: Mapping[str, Any], r: Mapping[str, Any], batch: int, k: int,
                          where: str) -> list[str]:
    """A fused point's problems (module docstring)."""
    problems: list[str] = []
    steps = r.get("verify_steps")
    if not isinstance(steps, int) or steps < 1:
        return [f"{where}: {steps!r} verify steps ran"]
    if r.get("fused_steps") != steps or r.get("fast_positions") != r.get("positions") \
            or r.get("fallback_positions") != 0 or r.get("verify_splits"):
        problems.append(f"{where}: {r.get('fused_steps')} fused fast steps of {r.get('fast_positions')} rows for "
                        f"{steps} verify steps of {r.get('positions')} positions, {r.get('fallback_positions')} "
                        f"fallbacks, split into decode steps: {r.get('verify_splits') or 'none'}")
    logit_tol, state_tol = plan.get("logit_tol"), plan.get("state_tol")
    if not isinstance(logit_tol, (int, float)) or logit_tol < 0:
        return problems + [f"{where}: logit_tol {logit_tol!r} is not a number >= 0"]
    vs = [v for v in records if v.get("kind") == "verify_step" and v.get("batch") == batch and v.get("k") == k]
    if len(vs) != steps:
        problems.append(f"{where}: {len(vs)} verify_step records for {steps} verify steps")
    n_rows = sum(int(v.get("rows") or 0) for v in vs)
    if not n_rows:
        problems.append(f"{where}: no verify row was compared")
    kl_tol = plan.get("kl_tol")
    if isinstance(kl_tol, (int, float)) and n_rows:  # plans before the KL rule have none
        kl_mean = sum(float(v.get("kl_sum") or 0.0) for v in vs) / n_rows
        if not kl_mean <= kl_tol:
            problems.append(f"{where}: mean KL(decode steps || fused) {kl_mean:.3g} over {n_rows} rows > {kl_tol}")
    for v in vs:
        at = f"{where} verify step {v.get('step')}"
        err = v.get("max_rel_err")
        if v.get("rows") and not (isinstance(err, (int, float)) and err <= logit_tol):
            problems.append(f"{at}: logit error {err!r} > {logit_tol} of the row's largest logit")
        for m in v.get("argmax_mismatches") or []:
            ranks = (m.get("ref_token_rank_in_fast"), m.get("fast_token_rank_in_ref"))
            if not all(isinstance(r, int) and r <= TOP_K for r in ranks):
                problems.append(f"{at}: request {m.get('seq')} row {m.get('row')}: fused argmax {m.get('fused_token')} "
                                f"!= decode steps' {m.get('ref_token')} beyond a near-tie (ranks {ranks[0]} / "
                                f"{ranks[1]} in the other's logits, top {TOP_K} allowed)")
        for name, scale in (("state_max_abs_diff", "state_scale"), ("latent_max_abs_diff", "latent_scale")):
            d, sc = v.get(name), v.get(scale)
            if not (isinstance(d, (int, float)) and isinstance(sc, (int, float)) and d <= state_tol * max(sc, 1e-30)):
                problems.append(f"{at}: {name} {d!r} > {state_tol} x {scale} {sc!r} (the committed state is not "
                                "the decode steps')")
    acc = r.get("acceptance") or {}
    if not acc.get("steps") or len(acc.get("accepted") or []) != k:
        problems.append(f"{where}: no acceptance counts for {k} draft positions")
    return problems


# ---------------------------------------------------------------------------------------------- features
def _position_sums(requests: Records) -> tuple[list[int], list[int]]:
    examined: list[int] = []
    accepted: list[int] = []
    for r in requests:
        for i, (e, a) in enumerate(zip(r.get("examined") or [], r.get("accepted") or [], strict=False)):
            while len(examined) <= i:
                examined.append(0)
                accepted.append(0)
            examined[i] += int(e)
            accepted[i] += int(a)
    return examined, accepted


def acceptance_comparison(records: Records) -> dict[str, Any]:
    """Per draft position, each role's acceptance (summed over its requests) and the one-sided test of the
    engine under test accepting less than the baseline: drop = baseline rate - engine rate, se the pooled
    two-proportion standard error, ``z_crit`` at ``alpha / positions`` (Bonferroni), the minimum drop
    detectable with 80% power at these counts; the mean acceptance length (1 + accepted per verify step)."""

    plan = next((r for r in records if r.get("kind") == "plan"), {})
    reqs = [r for r in records if r.get("kind") == "request"]
    by_role = {role: [r for r in reqs if r.get("role") == role] for role in ("engine_under_test", "baseline")}
    if not by_role["baseline"] and plan.get("same_engine"):
        by_role["baseline"] = by_role["engine_under_test"]
    sums = {role: _position_sums(rs) for role, rs in by_role.items()}
    steps = {role: sum(int(r.get("steps") or 0) for r in rs) for role, rs in by_role.items()}
    n_pos = max((len(s[0]) for s in sums.values()), default=0)
    alpha = float(plan.get("alpha", 0.01))
    z_crit = NormalDist().inv_cdf(1.0 - alpha / max(n_pos, 1))
    z_power = NormalDist().inv_cdf(0.8)
    positions = []
    for i in range(n_pos):
        (ee, ea), (be, ba) = [(s[0][i] if i < len(s[0]) else 0, s[1][i] if i < len(s[1]) else 0)
                              for s in (sums["engine_under_test"], sums["baseline"])]
        row: dict[str, Any] = {"position": i, "engine_examined": ee, "engine_accepted": ea, "baseline_examined": be,
                               "baseline_accepted": ba}
        if ee and be:
            re_, rb = ea / ee, ba / be
            pooled = (ea + ba) / (ee + be)
            se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / ee + 1 / be))
            row.update(engine_rate=re_, baseline_rate=rb, drop=rb - re_, se=se, z=(rb - re_) / se,
                       min_detectable_drop=(z_crit + z_power) * se)
        positions.append(row)
    mal = {role: (1.0 + sum(sums[role][1]) / steps[role]) if steps[role] else None for role in sums}
    return {"positions": positions, "z_crit": z_crit, "mean_acceptance_length": mal,
            "verify_steps": steps}


def spec_acceptance_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """features.spec_acceptance: the same drafter and prompts on both engines (greedy); fails where the
    engine under test accepts less than the baseline at some draft position by more than ``margin`` and
    significantly (``acceptance_comparison``), or where there is nothing to compare: a role without
    requests, or a baseline position 0 examined fewer than ``min_examined`` times or never accepted."""
    plans = [r for r in records if r.get("kind") == "plan"]
    if len(plans) != 1:
        return [f"{len(plans)} plan records (expected 1)"]
    plan = plans[0]
    reqs = [r for r in records if r.get("kind") == "request"]
    want = plan.get("prompts")
    problems = []
    for role in ("engine_under_test",) + (() if plan.get("same_engine") else ("baseline",)):
        got = sum(1 for r in reqs if r.get("role") == role)
        if got != want:
            problems.append(f"{role}: {got} requests recorded, {want} planned")
    cmp = acceptance_comparison(records)
    pos = cmp["positions"]
    min_examined = int(plan.get("min_examined", 1))
    if not pos or pos[0]["baseline_examined"] < min_examined:
        problems.append(f"the baseline examined position 0 {pos[0]['baseline_examined'] if pos else 0} times "
                        f"(< {min_examined}): too few drafts to compare acceptance")
    elif not pos[0]["baseline_accepted"]:
        problems.append("the baseline accepted no draft: acceptance has nothing to compare (a drafter that "
                        "matches the model, e.g. synthetic with p > 0)")
    margin = float(plan.get("margin", 0.05))
    for row in pos:
        if "drop" in row and row["drop"] > margin and row["z"] > cmp["z_crit"]:
            problems.append(f"position {row['position']}: the engine under test accepts {row['engine_rate']:.3f} "
                            f"({row['engine_accepted']}/{row['engine_examined']}), the baseline "
                            f"{row['baseline_rate']:.3f} ({row['baseline_accepted']}/{row['baseline_examined']}): "
                            f"drop {row['drop']:.3f} > margin {margin} (z {row['z']:.1f} > {cmp['z_crit']:.2f})")
    return problems


# How ``token_interval`` places a token (the plan records it): on the reference distribution conditioned on the
# tokens no filter boundary makes ambiguous. Leaving ambiguous tokens out of an unconditional PIT would bias it:
# they are the least likely kept tokens, the top of the [0, 1) range, so that bin empties.
PIT_RULE = "conditional_on_unambiguous"


def token_interval(logprobs: Sequence[float], token: int, temperature: float, top_k: int, top_p: float,
                   logit_tol: float, mass_tol: float) -> tuple[float, float, bool]:
    """``token``'s interval under the reference sampling distribution (``feature_rules.reference_distribution``
    of the log-probabilities at ``temperature`` after top-k / top-p) conditioned on the tokens whose membership
    in the kept set no engine within ``logit_tol`` could decide otherwise (``PIT_RULE``), tokens ordered by
    falling probability (ties by id): (F(before token), p(token), whether the token is ambiguous: then
    (0, 0, True), left out of the test, which the conditioning makes unbiased). A token of probability 0
    that is not ambiguous is one the filters remove."""
    import numpy as np

    from verify.checks.feature_rules import reference_distribution

    p, amb = reference_distribution(np.array(logprobs, dtype=np.float64), temperature, top_k, top_p, logit_tol,
                                    mass_tol)
    if amb[token]:
        return 0.0, 0.0, True
    q = np.where(amb, 0.0, p)
    total = q.sum()
    q = q / total if total > 0 else q
    qt = q[token]
    before = (q > qt) | ((q == qt) & (np.arange(len(q)) < token))  # ahead of it in falling probability
    return float(q[before].sum()), float(qt), False


def pit_test(sequences: Sequence[Mapping[str, Any]], bins: int) -> dict[str, Any]:
    """The randomized probability integral transform of every tested token, ``u = lo + U p`` (``lo``, ``p``
    its interval, ``U`` its recorded uniform draw): uniform on [0, 1) exactly when the tokens follow the
    reference distribution, independently from token to token (each given its context). A G-test of the
    ``bins`` equal-width counts against uniform; tokens near a filter boundary (``ambiguous``) are left
    out, tokens of probability 0 are ``forbidden``."""
    import numpy as np

    from verify.checks.feature_rules import g_test

    counts = np.zeros(bins, dtype=np.int64)
    forbidden = ambiguous = 0
    for s in sequences:
        for lo, pt, u, amb in zip(s["lo"], s["p"], s["U"], s["ambiguous"], strict=True):
            if amb:
                ambiguous += 1
            elif pt <= 0.0:
                forbidden += 1
            else:
                counts[min(int((lo + u * pt) * bins), bins - 1)] += 1
    n = int(counts.sum())
    g, df, pval = g_test(counts.astype(np.float64), np.full(bins, n / bins)) if n else (0.0, 0, 1.0)
    return {"tested": n, "forbidden": forbidden, "ambiguous": ambiguous, "counts": counts.tolist(), "G": g,
            "df": df, "p_value": pval}


def spec_sampling_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """features.spec_sampling and features.decode_sampling: per (temperature, filter) cell, ``pit_test`` of the
    recorded tokens redone from their recorded intervals and draws, at ``alpha / cells``: its p-value and counts
    as recorded, no token the filters remove, at least ``min_tokens`` tested; under speculative decoding (the
    plan names a drafter, or a cell its own), per drafter over its cells, drafts examined and both accepted
    and rejected (each branch of the verify rule ran)."""
    plans = [r for r in records if r.get("kind") == "plan"]
    if len(plans) != 1:
        return [f"{len(plans)} plan records (expected 1)"]
    plan = plans[0]
    cells = [r for r in records if r.get("kind") == "cell"]
    if len(cells) != len(plan.get("cells") or []) or not cells:
        return [f"{len(cells)} cells recorded, {len(plan.get('cells') or [])} planned"]
    alpha_cell = float(plan["alpha"]) / len(cells)
    problems = []
    examined: dict[Any, int] = {}  # per drafter (a cell's own, else the plan's): drafts examined / accepted
    accepted: dict[Any, int] = {}
    for i, r in enumerate(cells):
        drafter = r.get("speculative", plan.get("speculative"))
        where = f"T={r.get('temperature')} top_k={r.get('top_k')} top_p={r.get('top_p')}"
        seqs = [s for s in records if s.get("kind") == "sequence" and s.get("cell") == i]
        if len(seqs) != plan.get("samples"):
            problems.append(f"{where}: {len(seqs)} sequences recorded, {plan.get('samples')} planned")
        t = pit_test(seqs, int(plan["bins"]))
        if t["counts"] != r.get("counts") or not math.isclose(t["p_value"], r.get("p_value", -1.0), rel_tol=1e-6,
                                                                abs_tol=1e-12):
            problems.append(f"{where}: the cell records counts {r.get('counts')}, p={r.get('p_value')}; its tokens "
                            f"give {t['counts']}, p={t['p_value']:.6g}")
        if t["forbidden"]:
            problems.append(f"{where}: {t['forbidden']} tokens the filters remove")
        if t["tested"] < int(plan.get("min_tokens", 1)):
            problems.append(f"{where}: {t['tested']} tokens tested (< {plan.get('min_tokens')})")
        elif t["p_value"] < alpha_cell:
            problems.append(f"{where}: sampled tokens differ from the reference distribution (randomized PIT "
                            f"G={t['G']:.1f}, df={t['df']}, p={t['p_value']:.2g} < {alpha_cell:.2g})")
        examined[drafter] = examined.get(drafter, 0) + sum(int(s.get("examined") or 0) for s in seqs)
        accepted[drafter] = accepted.get(drafter, 0) + sum(int(s.get("accepted") or 0) for s in seqs)
    for drafter, n in examined.items():  # features.decode_sampling: no drafter
        if drafter and (not accepted[drafter] or n <= accepted[drafter]):
            problems.append(f"{drafter}: drafts examined {n} times, accepted {accepted[drafter]}: both branches of "
                            "the verify rule (accept, and the residual draw after a rejection) must run")
    return problems
