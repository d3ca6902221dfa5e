"""``equivalence.vllm_route``'s rule (``bundle verify``'s rescorer): its status re-derived from its records. The
check itself is ``vllm_route.py``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verify.checks.feature_rules import compare_greedy


def vllm_route_problems(records: list[Mapping[str, Any]], metrics: Mapping[str, Any] | None = None) -> list[str]:
    """The plan's pairs all recorded, each routed / stock pair equal or within each other's top-n at the first
    divergence (``compare_greedy``), at least ``min_routed_fraction`` of the traced decode steps routed (and
    at least one)."""
    plans = [r for r in records if r.get("kind") == "plan"]
    pairs = [r for r in records if r.get("kind") == "pair"]
    traces = [r for r in records if r.get("kind") == "trace"]
    if len(plans) != 1 or len(traces) != 1:
        return [f"{len(plans)} plan and {len(traces)} trace records (expected one each)"]
    plan, tr = plans[0], traces[0]
    problems = []
    if not pairs or len(pairs) != plan.get("prompts"):
        problems.append(f"{len(pairs)} generation pairs recorded of {plan.get('prompts')} planned (none compared "
                        "proves nothing)" if not pairs else f"{len(pairs)} pairs of {plan.get('prompts')} planned")
    for r in pairs:
        a, b = r["engine_under_test"], r["baseline"]
        ok, cmp = compare_greedy(a["token_ids"], a["logprobs"], b["token_ids"], b["logprobs"])
        if not ok:
            problems.append(f"prompt {r['prompt']}: routed and stock greedy outputs diverge at position "
                            f"{cmp['first_divergence']} beyond each other's top-{plan.get('top_logprobs')}")
    decode, routed = int(tr.get("decode_steps", 0)), int(tr.get("routed_steps", 0))
    if routed == 0:
        problems.append(f"no decode step was routed ({decode} traced; fallbacks {tr.get('fallbacks')}): the fast "
                        "path never ran")
    elif routed < plan.get("min_routed_fraction", 0.5) * decode:
        problems.append(f"{routed} of {decode} traced decode steps routed, under the plan's "
                        f"{plan.get('min_routed_fraction')} (fallbacks {tr.get('fallbacks')})")
    return problems
