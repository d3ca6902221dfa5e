"""Checks of the PyTorch reference (the standard path) itself: consistency and determinism.

``reference.prefill_decode_consistency``: the same tokens fed step by step through the decode path
must give the logits the prefill path gives at every position. Run for one KDA layer, one MLA layer
(absorbed decode vs plain prefill) and the whole model, for several batch sizes with ragged lengths.
The comparison runs in float64, where both paths are the same mathematics and must agree to ~1e-9;
a bf16 pass records the error seen in the serving dtype (bounded, not bitwise).

``reference.determinism``: two runs from the same seed give bitwise identical logits and greedy tokens;
weights from another seed give different ones (so the check can fail).

Both run on the run's model (``ctx.model_source``): a preset's seeded synthetic weights, or a checkpoint's
own tensors (determinism's control is then the checkpoint with ``lm_head.weight`` perturbed).
"""

from __future__ import annotations

from typing import Any

import torch

from verify.checks import status_rules as rules
from verify.checks.registry import check
from verify.checks.status_rules import BF16_MEDIAN_TOL, F64_TOL
from verify.context import CheckContext


def _model(cfg, sd: dict, dtype: torch.dtype, device: str):
    from k3_fastpath.reference.model import load_reference

    return load_reference(cfg, sd, dtype=dtype, device=device)  # copies: ``sd`` is never modified


def _control_weights(ctx: CheckContext) -> tuple[dict, str]:
    """Weights that must give different logits: the next seed's synthetic ones, or on a checkpoint its own
    tensors with ``lm_head.weight`` perturbed by 5% of its std (seeded)."""
    if not ctx.on_checkpoint:
        return ctx.state_dict(seed=ctx.seed + 1), ctx.weights(ctx.seed + 1)
    sd = ctx.state_dict()
    name = "lm_head.weight"
    t = sd[name]
    gen = torch.Generator().manual_seed(ctx.seed + 11)
    noise = torch.randn(t.shape, generator=gen) * (0.05 * float(t.float().std()) + 1e-3)
    sd[name] = (t.float() + noise.to(t.device)).to(t.dtype)
    return sd, f"{ctx.weights()} with {name} perturbed (seed {ctx.seed + 11})"


def _lengths(batch: int, prompt_len: int, ragged: bool) -> list[int]:
    if not ragged or batch == 1:
        return [prompt_len] * batch
    # spread over [1, prompt_len]: the shortest prompt is a single token
    return [max(1, prompt_len - (i * (prompt_len - 1)) // (batch - 1)) for i in range(batch)]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().clamp_min(1e-30)
    return float((a - b).abs().max() / scale)


@torch.no_grad()
def _whole_model_case(model, cfg, batch: int, lengths: list[int], steps: int, gen: torch.Generator, device: str,
                      kv_dtype: torch.dtype) -> dict[str, Any]:
    """Prefill of prompt+continuation vs prefill(prompt) then ``steps`` teacher-forced decode steps."""
    total = [n + steps for n in lengths]
    tmax = max(total)
    ids = torch.randint(3, cfg.vocab_size, (batch, tmax), generator=gen).to(device)
    full_cache = model.new_cache(batch, tmax + 1, kv_dtype=kv_dtype, device=device)
    full = model.prefill(ids, torch.tensor(total, device=device), full_cache)  # [B, T, V]
    cache = model.new_cache(batch, tmax + 1, kv_dtype=kv_dtype, device=device)
    plen = torch.tensor(lengths, device=device)
    pre = model.prefill(ids[:, : max(lengths)], plen, cache)
    errs = [_rel_err(pre[b, t], full[b, t]) for b in range(batch) for t in range(lengths[b])]
    for s in range(steps):
        tok = torch.stack([ids[b, lengths[b] + s] for b in range(batch)])
        step_logits = model.decode(tok, cache)
        errs += [_rel_err(step_logits[b], full[b, lengths[b] + s]) for b in range(batch)]
    e = torch.tensor(errs)
    return {"max_rel_err": float(e.max()), "median_rel_err": float(e.median()), "positions": len(errs)}


def _attention_layer(cls, cfg, layer: int, sd: dict, device: str):
    """One layer's attention module (KDA or MLA) in float64 with its synthetic weights, strictly loaded."""
    m = cls(cfg, layer, dtype=torch.float64)
    prefix = f"model.layers.{layer}.self_attn."
    m.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=True)
    return m.to(device=device, dtype=torch.float64)


@torch.no_grad()
def _kda_case(cfg, layer: int, sd: dict, batch: int, lengths: list[int], steps: int, gen: torch.Generator,
              device: str) -> dict[str, Any]:
    from k3_fastpath.reference.kda import KDACache, KimiDeltaAttention

    m = _attention_layer(KimiDeltaAttention, cfg, layer, sd, device)
    total = [n + steps for n in lengths]
    x = torch.randn(batch, max(total), cfg.hidden_size, generator=gen, dtype=torch.float64).to(device)
    c_full = KDACache.empty(cfg, batch, device=device, conv_dtype=torch.float64, state_dtype=torch.float64)
    y_full = m(x, c_full, torch.tensor(total, device=device))
    c = KDACache.empty(cfg, batch, device=device, conv_dtype=torch.float64, state_dtype=torch.float64)
    y_pre = m(x[:, : max(lengths)], c, torch.tensor(lengths, device=device))
    worst = max(_rel_err(y_pre[b, : lengths[b]], y_full[b, : lengths[b]]) for b in range(batch))
    for s in range(steps):
        xs = torch.stack([x[b, lengths[b] + s] for b in range(batch)]).unsqueeze(1)
        ys = m(xs, c)[:, 0]
        want = torch.stack([y_full[b, lengths[b] + s] for b in range(batch)])
        worst = max(worst, _rel_err(ys, want))
    worst = max(worst, _rel_err(c.state, c_full.state))
    return {"max_rel_err": worst}


@torch.no_grad()
def _mla_case(cfg, layer: int, sd: dict, batch: int, lengths: list[int], steps: int, gen: torch.Generator,
              device: str) -> dict[str, Any]:
    from k3_fastpath.reference.mla import GatedMLA, MLACache

    m = _attention_layer(GatedMLA, cfg, layer, sd, device)
    total = [n + steps for n in lengths]
    tmax = max(total)
    x = torch.randn(batch, tmax, cfg.hidden_size, generator=gen, dtype=torch.float64).to(device)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    c_full = MLACache.empty(cfg, batch, tmax, torch.float64, device)
    y_full = m(x, c_full, zeros, torch.tensor(total, device=device), mode="plain")
    c = MLACache.empty(cfg, batch, tmax, torch.float64, device)
    y_pre = m(x[:, : max(lengths)], c, zeros, torch.tensor(lengths, device=device), mode="plain")
    worst = max(_rel_err(y_pre[b, : lengths[b]], y_full[b, : lengths[b]]) for b in range(batch))
    for s in range(steps):
        xs = torch.stack([x[b, lengths[b] + s] for b in range(batch)]).unsqueeze(1)
        pos = torch.tensor([lengths[b] + s for b in range(batch)], device=device)
        ys = m(xs, c, pos, None, mode="absorbed")[:, 0]
        want = torch.stack([y_full[b, lengths[b] + s] for b in range(batch)])
        worst = max(worst, _rel_err(ys, want))
    return {"max_rel_err": worst}


@check("reference.prefill_decode_consistency",
       "step-by-step decode logits equal prefill logits at every position (KDA, MLA, whole model; ragged batches)")
def prefill_decode_consistency(ctx: CheckContext, batches: list[int] = [1, 3], ragged: bool = True,
                               decode_steps: int = 6, prompt_len: int = 12) -> Any:
    cfg = ctx.config
    device = ctx.device
    sd = ctx.state_dict()
    metrics: dict[str, Any] = {"preset": ctx.preset, "weights": ctx.weights(), "f64_max_rel_tolerance": F64_TOL,
                               "bf16_median_rel_tolerance": BF16_MEDIAN_TOL}
    gen = torch.Generator().manual_seed(ctx.seed + 1)
    kda_layer = cfg.kda_layer_ids[0]
    mla_layer = cfg.mla_layer_ids[0]
    model64 = _model(cfg, sd, torch.float64, device)
    model16 = _model(cfg, sd, torch.bfloat16, device)
    worst = {"kda": 0.0, "mla": 0.0, "model_f64": 0.0, "model_bf16": 0.0}
    for batch in batches:
        lengths = _lengths(batch, prompt_len, ragged)
        cases = {
            "kda": (_kda_case, (cfg, kda_layer, sd)),
            "mla": (_mla_case, (cfg, mla_layer, sd)),
            "model_f64": (_whole_model_case, (model64, cfg)),
            "model_bf16": (_whole_model_case, (model16, cfg)),
        }
        for name, (fn, head) in cases.items():
            tail = (torch.float64,) if name == "model_f64" else (torch.bfloat16,) if name == "model_bf16" else ()
            r = fn(*head, batch, lengths, decode_steps, gen, device, *tail)
            stat = "median_rel_err" if name == "model_bf16" else "max_rel_err"
            tol = BF16_MEDIAN_TOL if name == "model_bf16" else F64_TOL
            rec = {"case": name, "batch": batch, "lengths": lengths, "decode_steps": decode_steps, **r,
                   "statistic": stat, "tolerance": tol, "ok": r[stat] <= tol}
            ctx.record(rec)
            worst[name] = max(worst[name], r[stat])
    metrics.update({f"worst_{'median' if k == 'model_bf16' else 'max'}_rel_err_{k}": v for k, v in worst.items()})
    metrics["batches"] = list(batches)
    return ctx.verdict(rules.prefill_decode_problems(ctx.recorded), metrics)


@torch.no_grad()
def _greedy(model, cfg, batch: int, prompt_len: int, steps: int, seed: int, device: str):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), generator=gen).to(device)
    cache = model.new_cache(batch, prompt_len + steps + 1, device=device)
    logits = model.prefill(ids, torch.full((batch,), prompt_len, device=device), cache)[:, -1]
    all_logits = [logits]
    tokens = []
    for _ in range(steps):
        tok = logits.argmax(-1)
        tokens.append(tok)
        logits = model.decode(tok, cache)
        all_logits.append(logits)
    return torch.stack(all_logits, 1), torch.stack(tokens, 1)


@check("reference.determinism",
       "two identical runs give bitwise identical logits and tokens; another seed gives different ones")
def determinism(ctx: CheckContext, batch: int = 2, prompt_len: int = 10, decode_steps: int = 4) -> Any:
    cfg = ctx.config
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    runs = []
    control, control_desc = _control_weights(ctx)
    for sd in (ctx.state_dict(), ctx.state_dict(), control):  # a preset's weights are drawn anew each time
        model = _model(cfg, sd, dtype, ctx.device)
        runs.append(_greedy(model, cfg, batch, prompt_len, decode_steps, ctx.seed + 7, ctx.device))
        del model, sd
    (l1, t1), (l2, t2), (l3, _) = runs
    same = torch.equal(l1, l2) and torch.equal(t1, t2)
    rec = {"dtype": str(dtype), "batch": batch, "prompt_len": prompt_len, "decode_steps": decode_steps,
           "weights": ctx.weights(), "control": control_desc, "bitwise_equal": same,
           "max_logit_diff": float((l1.float() - l2.float()).abs().max()), "control_differs": not torch.equal(l1, l3),
           "tokens": t1.tolist()}
    ctx.record(rec)
    return ctx.verdict(rules.determinism_problems([rec]), {"dtype": str(dtype), "weights": ctx.weights(), "bitwise_equal": same,
                                  "tokens_checked": t1.numel()})
