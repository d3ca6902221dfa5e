"""``perf.serving``: requests through a real OpenAI-compatible server, driven by AIPerf: TTFT, inter-token
latency and interactivity per user, throughput, for the baseline engine and the engine under test in the
same run, on the same sessions and seeds (``verify/aiperf.py``: workloads and the AIPerf calls;
``verify/checks/serving_rules.py``: the metrics, the comparison and the rule, re-derived by ``bundle
verify`` from the per-request records).

Every point -- (role, workload, concurrency, repeat) -- is one ``aiperf profile`` run against that role's
server; its profiled requests (AIPerf's warm-up excluded) are recorded one per line with every inter-chunk
gap, then the point's metrics. The repeats give the run-to-run spread that the comparison's noise rule
uses. Both roles must be OpenAI-compatible servers (``--engine openai:URL`` / ``vllm`` /
``vllm+latency_specialized`` and the same for ``--baseline-engine``); a builtin engine has no endpoint and
is refused with that reason. This measures serving, which mixes prefill and decode: its numbers are
never decode-only (``perf.decode_sweep`` is).
"""

from __future__ import annotations

from typing import Any

from verify.checks.registry import check
from verify.checks.serving_rules import ROLES, comparisons, point_metrics, serving_problems
from verify.context import CheckContext

DEFAULT_WORKLOADS = [{"name": "agentic", "kind": "agentic", "sessions": 8},
                     {"name": "isl128-osl32", "kind": "fixed", "isl": 128, "osl": 32, "requests": 24}]


def _server(ctx: CheckContext, role: str) -> Any:
    get = ctx.engine_under_test if role == "engine_under_test" else ctx.baseline_engine
    eng = get()
    if not getattr(eng, "base_url", None) or not getattr(eng, "tokenizer_dir", None):
        raise ValueError(f"perf.serving drives an OpenAI-compatible server with a local tokenizer; the {role} "
                         f"engine {getattr(eng, 'name', eng)!r} is not one (use openai:URL, vllm or "
                         "vllm+latency_specialized)")
    return eng


@check("perf.serving",
       "serving through AIPerf: TTFT, ITL, P90 interactivity, throughput; engine under test vs baseline",
       tools=("aiperf",))
def serving(ctx: CheckContext, workloads: list[dict] = DEFAULT_WORKLOADS, concurrency: list[int] = [1, 4, 16],
            repeats: int = 2, warmup_requests: int = 2, min_requests: int = 20, max_error_rate: float = 0.0,
            min_speedup: float | None = None, noise_floor: float = 0.05, gpus: int | None = None,
            request_timeout_s: float = 300.0, point_timeout_s: float = 600.0, client_workers: int | None = None,
            max_burst_share: float = 0.1) -> Any:
    from verify import aiperf

    loads = [aiperf.Workload.from_dict(dict(w)) for w in workloads]
    if len({w.name for w in loads}) != len(loads) or repeats < 1 or not concurrency:
        raise ValueError("perf.serving needs distinct workload names, repeats >= 1 and a concurrency list")
    servers = {role: _server(ctx, role) for role in ROLES}
    if servers["baseline"].base_url == servers["engine_under_test"].base_url:
        ctx.note("baseline and engine under test are the same server: the comparison measures run-to-run noise")
    plan = {"kind": "plan", "roles": list(ROLES), "workloads": [w.name for w in loads],
            "concurrency": [int(c) for c in concurrency], "repeats": int(repeats), "min_requests": int(min_requests),
            "max_error_rate": float(max_error_rate), "min_speedup": min_speedup, "noise_floor": float(noise_floor),
            "max_burst_share": float(max_burst_share),
            "gpus": gpus, "decode_only": False, "client_workers": client_workers, "driver": f"aiperf {aiperf.AIPERF_VERSION}",
            "servers": {r: {"url": s.base_url, "model": s.model, "name": s.name} for r, s in servers.items()},
            "workload_specs": [dict(w.__dict__) for w in loads]}
    ctx.record(plan)
    work = ctx.tmp_dir / "serving"
    cache = work / "hf-cache"
    log = ctx.writer.root / "logs" / "aiperf.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    repos = {r: aiperf.local_tokenizer_repo(s.tokenizer_dir, cache) for r, s in servers.items()}
    datasets = {}
    for w in loads:  # one session set per workload: both roles replay the same sessions
        if w.kind == "agentic":
            max_len = min(s.max_model_len for s in servers.values())
            datasets[w.name] = aiperf.synthesize_agentic(w, work / f"sessions-{w.name}", ctx.seed, max_len, log,
                                                         point_timeout_s)
    by_point: dict[tuple, dict] = {}
    for w in loads:
        for c in plan["concurrency"]:
            for i in range(repeats):
                for role in ROLES:  # interleaved, so a drifting machine hits both sides alike
                    key = {"role": role, "workload": w.name, "concurrency": c, "repeat": i}
                    s = servers[role]
                    try:
                        reqs = aiperf.profile(url=s.root_url, model=s.model, tokenizer_repo=repos[role], cache=cache,
                                              workload=w, dataset=datasets.get(w.name), concurrency=c,
                                              seed=ctx.seed + i, warmup_requests=warmup_requests,
                                              artifact_dir=work / f"{role}-{w.name}-c{c}-r{i}", log=log,
                                              timeout_s=point_timeout_s, request_timeout_s=request_timeout_s,
                                              client_workers=client_workers)
                    except aiperf.AIPerfError as e:
                        ctx.record({"kind": "not_run", **key, "why": str(e)})
                        continue
                    for r in reqs:
                        ctx.record({**r, **key})
                    m = point_metrics([{**r, **key} for r in reqs], gpus)
                    ctx.record({"kind": "point", **key, "metrics": m})
                    by_point[(role, w.name, c, i)] = m
                    ctx.note(f"{role} {w.name} c={c} r{i}: {m['succeeded']}/{m['requests']} ok, P90 interactivity "
                             f"{_fmt(m.get('interactivity_p90'))} tok/s/user, TTFT p50 {_fmt(m.get('ttft_ms_p50'))} ms")
    compared = {}
    for (w, c), cmp in comparisons(plan, by_point).items():
        ctx.record({"kind": "comparison", "workload": w, "concurrency": c, **cmp})
        compared[f"{w}_c{c}"] = cmp
    problems = serving_problems(ctx.recorded)
    metrics = {"points": len(by_point), "requests": sum(m["requests"] for m in by_point.values()),
               "decode_only": False,
               "interactivity_p90": {f"{r}_{w}_c{c}_r{i}": m.get("interactivity_p90")
                                     for (r, w, c, i), m in by_point.items()},
               "ttft_ms_p50": {f"{r}_{w}_c{c}_r{i}": m.get("ttft_ms_p50") for (r, w, c, i), m in by_point.items()},
               "comparison": {k: {x: v[x] for x in ("interactivity_p90_ratio", "ttft_p50_ratio", "noise", "outcome")}
                              for k, v in compared.items()}}
    return ctx.verdict(problems, metrics)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
