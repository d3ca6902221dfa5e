"""``equivalence.spec_decode``: speculative decoding in the fast path emits what plain decoding emits and
commits what plain decoding would have.

Per point (batch x k draft tokens), on one fast executor (``DecodeExecutor``, captured) over the BF16 model
of ``equivalence.decode`` (k3-mini on a GPU, the run's preset on a CPU; or the run's checkpoint):

1. plain greedy decoding of ``steps`` tokens from seeded random prompts;
2. greedy speculative decoding of the same prompts (``k3_fastpath.runtime.spec_decode``): verify steps of
   ``1 + k`` positions, drafts from ``SyntheticDrafter`` (the plain tokens with probability ``p``, another
   token otherwise, so steps accept some drafts and reject others);
3. the committed cache against plain decoding of exactly the tokens it holds (a fresh cache fed row by row
   to the same lengths): the largest KDA conv / recurrent state difference and MLA latent difference (the
   latents up to each length).

Greedy speculative decoding must be token-identical to plain greedy decoding with the same kernels: each
verify position is a decode step of the same bucket, so ``state_tol`` is 0 (bitwise) by default. The status
is ``spec_rules.spec_decode_problems`` of the records; ``bundle verify`` applies it again. Temperature
sampling under speculative decoding is the rule of ``k3_fastpath.runtime.spec_sampler`` (its distribution
test runs in the CPU suite, ``tests/test_spec_sampler.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from verify.checks.equivalence import check_model
from verify.checks.registry import check
from verify.checks.spec_rules import spec_decode_problems
from verify.context import CheckContext


def _plain(ex: Any, ids: torch.Tensor, lens: torch.Tensor, steps: int, feed_to: list[int] | None = None
           ) -> tuple[list[list[int]], Any]:
    """Plain greedy decoding on a fresh executor cache: ``steps`` tokens per request, or (``feed_to``) each
    request fed its ``feed_to[b]`` tokens of ``feed`` only (rows past it inactive); returns (tokens, cache)."""
    bsz = ids.shape[0]
    cache = ex.new_cache(bsz)
    out = [[int(t)] for t in ex.prefill(ids, lens, cache)[torch.arange(bsz), lens - 1].argmax(-1)]
    n = steps - 1 if feed_to is None else max(feed_to)
    for j in range(n):
        active = torch.tensor([feed_to is None or j < feed_to[b] for b in range(bsz)])
        logits = ex.decode(torch.tensor([o[j] for o in out]), cache, active.to(ids.device))
        for b, t in enumerate(logits.argmax(-1).tolist()):
            if bool(active[b]) and len(out[b]) == j + 1:
                out[b].append(t)
    return out, cache


def _max_diff(a: Any, b: Any) -> tuple[float, float]:
    """(KDA conv/state, MLA latents up to each length) largest absolute differences of two caches."""
    kda = mla = 0.0
    for x, y in zip(a.layers, b.layers, strict=True):
        if hasattr(x, "tensors"):
            for s, t in zip(x.tensors(), y.tensors(), strict=True):
                kda = max(kda, float((s.float() - t.float()).abs().max()))
        else:
            for r, n in enumerate(b.lengths.tolist()):
                if n:
                    mla = max(mla, float((x.latent[r, :n].float() - y.latent[r, :n].float()).abs().max()))
    return kda, mla


@check("equivalence.spec_decode",
       "speculative decoding in the fast path: token-identical to plain greedy, the committed state plain decoding's",
       requires=("cuda", "sm90", "cutlass"))
def spec_decode(ctx: CheckContext, batches: list[int] = [1, 8], ks: list[int] = [1, 3, 7], steps: int = 32,
                p: float = 0.7, prompt_len: int = 16, preset: str = "auto", conditioning: str = "stable",
                state_tol: float = 0.0, use_graphs: bool = True, emulate: bool = False) -> Any:
    """The check (module docstring)."""
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.runtime.spec_decode import SyntheticDrafter, speculative_generate

    if not 0.0 < p < 1.0 or steps < 2 or any(not 1 <= k <= 7 for k in ks):
        return ctx.failed(f"p {p} must lie in (0, 1), steps {steps} >= 2, every k in 1..7 (got {ks})")
    model, preset, conditioning, weights = check_model(ctx, preset, conditioning)
    points = [(b, k) for b in batches for k in ks]
    ctx.record({"kind": "plan", "points": [list(x) for x in points], "steps": steps, "p": p, "state_tol": state_tol,
                "emulated": emulate})
    summaries = []
    for i, (batch, k) in enumerate(points):
        if ctx.elapsed() > 0.9 * ctx.budget_s:
            ctx.record({"kind": "not_run", "batch": batch, "k": k,
                        "why": f"not run, the check is past 90% of its {ctx.budget_s:.0f}s budget"})
            continue
        t0 = time.monotonic()
        g = torch.Generator().manual_seed(ctx.seed * 1000 + i)
        ids = torch.randint(3, model.cfg.vocab_size, (batch, prompt_len), generator=g).to(model.device)
        lens = torch.full((batch,), prompt_len, dtype=torch.long, device=model.device)
        ex = DecodeExecutor(model, max_batch=2 * batch, max_len=prompt_len + steps + k + 2, buckets=[batch],
                            use_graphs=use_graphs, envelope=Envelope(emulate=emulate))
        try:
            ex.warmup_and_capture()
            plain, cache = _plain(ex, ids, lens, steps)
            cache.release()
            begin = len(ex.trace)
            res = speculative_generate(ex, ids, lens, SyntheticDrafter(plain, p, model.cfg.vocab_size, ctx.seed + i),
                                       k, steps)
            spec_steps = ex.trace.since(begin)
            fed = (res.cache.lengths - lens).tolist()
            ref, ref_cache = _plain(ex, ids, lens, steps, feed_to=fed)
            kda, mla = _max_diff(res.cache, ref_cache)
        finally:
            ex.close()
        row = {"kind": "point", "batch": batch, "k": k, "plain_tokens": plain, "spec_tokens": res.tokens,
               "verify_steps": res.verify_steps, "positions": res.positions,
               "fast_positions": sum(1 for r in spec_steps if r.fallback is None and r.kind == "decode"),
               "fallback_positions": sum(1 for r in spec_steps if r.fallback is not None and r.kind == "decode"),
               "state_max_abs_diff": kda, "latent_max_abs_diff": mla, "acceptance": res.stats.record(),
               "seconds": round(time.monotonic() - t0, 2)}
        ctx.record(row)
        summaries.append({"batch": batch, "k": k, "mean_acceptance_length": res.stats.mean_acceptance_length(),
                          "verify_steps": res.verify_steps})
    metrics = {"preset": preset, "weights": weights, "conditioning": conditioning, "steps": steps, "p": p,
               "state_tol": state_tol, "points": summaries, "emulated": emulate}
    return ctx.verdict(spec_decode_problems(ctx.recorded), metrics)
