"""``equivalence.spec_decode``: speculative decoding in the fast path emits what plain decoding emits and
commits what plain decoding would have.

Per point (batch x k draft tokens), on one fast executor (``DecodeExecutor``, captured) over the BF16 model
of ``equivalence.decode`` (k3-mini on a GPU, the run's preset on a CPU; or the run's checkpoint):

1. plain greedy decoding of ``steps`` tokens from seeded random prompts;
2. greedy speculative decoding of the same prompts (``k3_fastpath.runtime.spec_decode``): verify steps of
   ``1 + k`` positions, drafts from ``SyntheticDrafter`` (the plain tokens with probability ``p``, another
   token otherwise, so steps accept some drafts and reject others). With fused steps a request's tokens may
   leave plain greedy's at a near-tie; its drafts are then mostly rejected (every row is still compared and
   committed; ``DraftModelDrafter``, which would follow the request's own context, costs an eager reference
   prefill per verify step: 240 s were not enough for the six k3-mini points on an H100).

``fused`` (default): the executor is built with ``spec_tokens = k + 1``, so each verify step is ONE fused
step of ``batch (k + 1)`` rows (``k3_fastpath/runtime/verify_step.py``: GEMMs at that M, the KDA recurrence
over each request's rows in one launch, MLA causal inside the draft). ``ShadowVerify`` runs every verify
step a second time as plain decode steps on a copy of the cache (``spec_decode.verify_step(fused=False)``)
and records, per verify step, each active row's KL(decode steps || fused) and logit error (the largest over
the vocabulary, relative to the row's largest logit), the argmax of each side with ``tie_margins`` where they
differ, and after the commit the largest difference between the committed KDA conv / recurrent state and MLA
latents (up to each length) and the shadow's (the decode steps' state after the same kept tokens, committed
by restoring copies), with the states' scale. A fused step computes each row at another M than a decode
step (other GEMM tiles; a router near-tie may pick another expert), so the two agree to BF16 rounding, not
bitwise: the rule holds the point's mean KL to ``kl_tol`` (``equivalence.decode``'s 0.01), every row's logit
error to ``logit_tol`` (a bound for gross errors: k3-mini on an H100 showed up to 7% at one row of 64), the
states to ``state_tol`` (relative), and an argmax mismatch passes only as a near-tie (each side's token in the
other's top 5, ``equivalence.decode``'s rule; every one seen on k3-mini was a swap of the top two).
The speculative tokens against plain greedy are recorded for information (a near-tie changes the rest of
a request).

``fused=False``: the verify steps run as decode steps of the same bucket, so greedy speculative decoding
must be token-identical to plain greedy decoding and the committed cache equal, bitwise by default
(``state_tol`` 0), to plain decoding of exactly the tokens it holds (a fresh cache fed row by row to the
same lengths).

The status is ``spec_rules.spec_decode_problems`` of the records; ``bundle verify`` applies it again.
Temperature sampling under speculative decoding is the rule of ``k3_fastpath.runtime.spec_sampler`` (its
distribution test runs in the CPU suite, ``tests/test_spec_sampler.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from verify.checks.equivalence import check_model, tie_margins
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
    """(KDA conv/state, MLA latents up to ``b``'s lengths) largest absolute differences of two caches."""
    kda, _, mla, _ = _state_diff(a, b, b.lengths.tolist())
    return kda, mla


def _state_diff(a: Any, b: Any, lengths: list[int]) -> tuple[float, float, float, float]:
    """(KDA max |a - b|, KDA max |b|, MLA latent max |a - b| up to each length, MLA max |b|) of two caches."""
    kda = kda_scale = mla = mla_scale = 0.0
    for x, y in zip(a.layers, b.layers, strict=True):
        if hasattr(x, "tensors"):
            for s, t in zip(x.tensors(), y.tensors(), strict=True):
                kda = max(kda, float((s.float() - t.float()).abs().max()))
                kda_scale = max(kda_scale, float(t.float().abs().max()))
        else:
            for r, n in enumerate(lengths):
                if n:
                    xs, ys = x.latent[r, :n].float(), y.latent[r, :n].float()
                    mla = max(mla, float((xs - ys).abs().max()))
                    mla_scale = max(mla_scale, float(ys.abs().max()))
    return kda, kda_scale, mla, mla_scale


class ShadowVerify:
    """A ``DecodeExecutor`` whose fused verify steps are each run again as decode steps on a shadow copy of
    the cache, the two compared (module docstring); everything else is the executor's. ``records``: one
    ``verify_step`` record per verify step."""

    def __init__(self, ex: Any, batch: int, max_len: int) -> None:
        self.ex = ex
        self.shadow = ex.new_cache(batch, max_len)
        self.records: list[dict[str, Any]] = []
        self._pending: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ex, name)

    def verify(self, feed: torch.Tensor, cache: Any, active: torch.Tensor) -> torch.Tensor:
        from k3_fastpath.runtime.cache_pool import copy_cache
        from k3_fastpath.runtime.spec_decode import verify_step

        copy_cache(self.shadow, cache)
        start = cache.lengths.clone()
        ref, states = verify_step(self.ex, self.shadow, feed, active, fused=False)
        got = self.ex.verify(feed, cache, active)
        rows = []
        for b, t in active.nonzero().tolist():
            lr, lf = ref[b, t].double(), got[b, t].double()
            err = float((lr - lf).abs().max() / lr.abs().max().clamp_min(1e-30))
            pr, pf = torch.log_softmax(lr, -1), torch.log_softmax(lf, -1)
            row = {"seq": b, "row": t, "position": int(start[b]) + t, "rel_err": err,
                   "kl": float((pr.exp() * (pr - pf)).sum()), "ref_token": int(lr.argmax()),
                   "fused_token": int(lf.argmax())}
            if row["ref_token"] != row["fused_token"]:
                row.update(tie_margins(lr, lf, row["ref_token"], row["fused_token"]))
            rows.append(row)
        self.records.append({"kind": "verify_step", "step": len(self.records), "rows": len(rows),
                             "max_rel_err": max((r["rel_err"] for r in rows), default=None),
                             "kl_sum": sum(r["kl"] for r in rows), "max_kl": max((r["kl"] for r in rows), default=None),
                             "argmax_mismatches": [r for r in rows if r["ref_token"] != r["fused_token"]]})
        self._pending = (start, states)
        return got

    def commit_verify(self, cache: Any, keep: torch.Tensor) -> None:
        from k3_fastpath.runtime.spec_decode import commit

        start, states = self._pending
        self.ex.commit_verify(cache, keep)
        commit(self.shadow, start, states, keep)
        kda, kda_scale, mla, mla_scale = _state_diff(cache, self.shadow, cache.lengths.tolist())
        self.records[-1].update(kept=keep.tolist(), state_max_abs_diff=kda, state_scale=kda_scale,
                                latent_max_abs_diff=mla, latent_scale=mla_scale)


@check("equivalence.spec_decode",
       "speculative decoding in the fast path: token-identical to plain greedy, the committed state plain decoding's",
       requires=("cuda", "sm90", "cutlass"))
def spec_decode(ctx: CheckContext, batches: list[int] = [1, 8], ks: list[int] = [1, 3, 7], steps: int = 32,
                p: float = 0.7, prompt_len: int = 16, preset: str = "auto", conditioning: str = "stable",
                state_tol: float | None = None, logit_tol: float = 0.25, kl_tol: float = 0.01, fused: bool = True,
                use_graphs: bool = True, emulate: bool = False) -> Any:
    """The check (module docstring). ``state_tol``: bitwise (0) for column-by-column verify steps, 0.05 of the
    states' scale for fused ones unless given."""
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.runtime.spec_decode import SyntheticDrafter, speculative_generate

    if not 0.0 < p < 1.0 or steps < 2 or any(not 1 <= k <= 7 for k in ks):
        return ctx.failed(f"p {p} must lie in (0, 1), steps {steps} >= 2, every k in 1..7 (got {ks})")
    model, preset, conditioning, weights = check_model(ctx, preset, conditioning)
    points = [(b, k) for b in batches for k in ks]
    if state_tol is None:
        state_tol = 0.05 if fused else 0.0
    ctx.record({"kind": "plan", "points": [list(x) for x in points], "steps": steps, "p": p, "state_tol": state_tol,
                "logit_tol": logit_tol, "kl_tol": kl_tol, "verify": "fused" if fused else "decode_steps",
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
        max_len = prompt_len + steps + k + 2
        ex = DecodeExecutor(model, max_batch=2 * batch, max_len=max_len, buckets=[batch], use_graphs=use_graphs,
                            envelope=Envelope(emulate=emulate), spec_tokens=k + 1 if fused else 0)
        try:
            ex.warmup_and_capture()
            plain, cache = _plain(ex, ids, lens, steps)
            cache.release()
            stepper = ShadowVerify(ex, batch, max_len) if fused else ex
            begin = len(ex.trace)
            res = speculative_generate(stepper, ids, lens,
                                       SyntheticDrafter(plain, p, model.cfg.vocab_size, ctx.seed + i), k, steps)
            spec_steps = ex.trace.since(begin)
            if fused:
                kda = mla = None
            else:
                fed = (res.cache.lengths - lens).tolist()
                ref, ref_cache = _plain(ex, ids, lens, steps, feed_to=fed)
                kda, mla = _max_diff(res.cache, ref_cache)
        finally:
            ex.close()
        kind = "verify" if fused else "decode"
        row = {"kind": "point", "batch": batch, "k": k, "plain_tokens": plain, "spec_tokens": res.tokens,
               "verify": "fused" if fused else "decode_steps",
               "verify_steps": res.verify_steps, "positions": res.positions,
               "fast_positions": sum(1 for r in spec_steps if r.fallback is None and r.kind == kind
                                     and r.backend == "latency_specialized"),
               "fallback_positions": sum(1 for r in spec_steps if r.fallback is not None and r.kind == kind),
               "verify_splits": dict(ex.verify_splits), "acceptance": res.stats.record(),
               "seconds": round(time.monotonic() - t0, 2)}
        if fused:
            row["fast_positions"] = sum(r.tokens for r in spec_steps if r.kind == "verify" and r.fallback is None)
            row["fused_steps"] = sum(1 for r in spec_steps if r.kind == "verify" and r.fallback is None)
            row["graph_steps"] = sum(1 for r in spec_steps if r.kind == "verify" and r.graph)
            for rec in stepper.records:
                ctx.record({**rec, "batch": batch, "k": k})
        else:
            row.update(state_max_abs_diff=kda, latent_max_abs_diff=mla)
        ctx.record(row)
        summaries.append({"batch": batch, "k": k, "mean_acceptance_length": res.stats.mean_acceptance_length(),
                          "verify_steps": res.verify_steps})
    metrics = {"preset": preset, "weights": weights, "conditioning": conditioning, "steps": steps, "p": p,
               "state_tol": state_tol, "points": summaries, "emulated": emulate}
    return ctx.verdict(spec_decode_problems(ctx.recorded), metrics)
