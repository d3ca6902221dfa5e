"""``weights.roundtrip``: the checkpoint layer, tested on real files.

1. On a preset: write its seeded synthetic checkpoint (safetensors shards + index + config.json). On a
   checkpoint run (``--checkpoint DIR``): take DIR itself, whose tensors the run read before any check
   (``ctx.model_source``), and check its digest still is the one the run recorded.
2. Load it back: every tensor bitwise identical to the in-memory one (the synthetic tensor, or the
   checkpoint's tensor as the run read it), FP32 stays FP32.
3. MXFP4: dequantise routed experts with ``k3_fastpath.mxfp4`` and with the independent slow decoder
   below (bit arithmetic per element, no lookup table); they must agree exactly.
4. TP: for each tp size, load every rank's slice from disk and reassemble; it must equal the full tensor
   (packed experts compared after dequantisation).
"""

from __future__ import annotations

from typing import Any

import torch

from verify.checks import status_rules as rules
from verify.checks.registry import check
from verify.context import CheckContext


def slow_mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Independent MXFP4 decoder: e2m1 from its bits (sign | 2-bit exponent | 1-bit mantissa), float64."""
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    p = packed.tolist()
    s = scale.tolist()
    for r in range(rows):
        for j in range(half * 2):
            byte = p[r][j // 2]
            code = (byte >> 4) if j % 2 else (byte & 0xF)
            sign = -1.0 if code & 0x8 else 1.0
            exp = (code >> 1) & 0x3
            man = code & 0x1
            mag = (man * 0.5) if exp == 0 else (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
            out[r, j] = sign * mag * 2.0 ** (s[r][j // 32] - 127)
    return out


def _reassemble(parts: list[torch.Tensor], rule: str) -> torch.Tensor:
    from k3_fastpath import manifest as mf

    if rule in (mf.COL, mf.EXPERT_COL, mf.HEAD_VEC):
        return torch.cat(parts, 0)
    if rule in (mf.ROW, mf.EXPERT_ROW):
        return torch.cat(parts, 1)
    return parts[0]


@check("weights.roundtrip",
       "checkpoint -> load -> identical tensors; MXFP4 against an independent decoder; TP slices reassemble")
def roundtrip(ctx: CheckContext, tp_sizes: list[int] = [2, 4]) -> Any:
    from pathlib import Path

    from k3_fastpath import manifest as mf
    from k3_fastpath import mxfp4
    from k3_fastpath.weights import (
        checkpoint_digest,
        load_checkpoint,
        tp_split_problem,
        write_synthetic_checkpoint,
    )

    cfg = ctx.config
    source = ctx.model_source
    if source.is_checkpoint:  # the checkpoint under verification, as the run read it
        ckpt = Path(source.path)
        written = "the one the run read"
    else:
        ckpt = ctx.tmp_dir / f"ckpt-{ctx.preset}-{ctx.seed}"
        write_synthetic_checkpoint(cfg, ckpt, seed=ctx.seed)
        written = "the written one"
    digest = checkpoint_digest(ckpt)
    want = ctx.state_dict()
    specs = {s.name: s for s in mf.tensor_specs(cfg)}
    _, got = load_checkpoint(ckpt)
    mismatched = [n for n in want if n in got and (got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n]))]
    ctx.record({"step": "load", "source": source.kind, "checkpoint": str(ckpt) if source.is_checkpoint else None,
                "weights": ctx.weights(), "tensors": len(got), "digest": digest,
                "digest_expected": source.digest if source.is_checkpoint else None,
                "names_missing": sorted(set(want) - set(got))[:3], "names_extra": sorted(set(got) - set(want))[:3],
                "mismatched": len(mismatched), "mismatched_names": mismatched[:10], "compared_with": written,
                "fp32_violations": [[n, str(got[n].dtype)] for n, s in specs.items()
                                    if s.dtype == "F32" and n in got and got[n].dtype != torch.float32]})

    # MXFP4: fast codec vs the independent decoder, on the first expert of every MoE layer (w1, w2, w3)
    packed_names = sorted(n for n, s in specs.items() if s.kind == "packed" and ".experts.0." in n)
    errs = {}
    for name in packed_names:
        sname = name.replace("weight_packed", "weight_scale")
        fast = mxfp4.dequantize(got[name], got[sname], torch.float64)
        slow = slow_mxfp4_decode(got[name], got[sname])
        errs[name] = float((fast - slow).abs().max())
    ctx.record({"step": "mxfp4", "tensors_checked": len(packed_names), "max_abs_diff": max(errs.values(), default=0.0),
                "differing": [[n, e] for n, e in errs.items() if e != 0.0]})

    # TP slices from disk reassemble to the full tensors, at every size the model can be split by
    not_applicable: dict[int, str] = {}
    for tp in tp_sizes:
        why = tp_split_problem(cfg, tp)
        if why:  # e.g. k3-tiny's 4 KDA heads over 8 ranks: a size this model is never served at
            not_applicable[tp] = why
            ctx.record({"step": "tp", "tp_size": tp, "applicable": False, "reason": why})
            continue
        try:
            ranks = [load_checkpoint(ckpt, tp_size=tp, rank=r)[1] for r in range(tp)]
        except Exception as e:
            ctx.record({"step": "tp", "tp_size": tp, "applicable": True, "load_error": str(e)})
            continue
        bad = []
        for name, spec in specs.items():
            parts = [rk[name] for rk in ranks]
            if spec.kind in ("packed", "scale"):
                if spec.kind == "scale":
                    continue
                sname = name.replace("weight_packed", "weight_scale")
                deq = [mxfp4.dequantize(rk[name], rk[sname]) for rk in ranks]
                whole = _reassemble(deq, spec.tp)
                full = mxfp4.dequantize(want[name], want[sname])
            elif spec.tp == mf.HEAD_VEC:
                heads = cfg.linear_attn_config.num_heads
                whole, full = _reassemble(parts, spec.tp), want[name][:heads]
            else:
                whole, full = _reassemble(parts, spec.tp), want[name]
                if spec.tp == mf.REP and not all(torch.equal(p, full) for p in parts):
                    bad.append(name)
                    continue
            if whole.shape != full.shape or not torch.equal(whole, full):
                bad.append(name)
        ctx.record({"step": "tp", "tp_size": tp, "applicable": True, "tensors": len(specs), "mismatched": bad[:20]})
    problems = rules.roundtrip_problems(ctx.recorded)
    metrics = {"preset": ctx.preset, "source": source.kind, "weights": ctx.weights(), "tensors": len(want),
               "checkpoint_digest": digest, "checkpoint": str(ckpt) if source.is_checkpoint else None,
               "mxfp4_tensors_checked": len(packed_names), "tp_sizes": [t for t in tp_sizes if t not in not_applicable],
               "tp_sizes_not_applicable": {str(t): why for t, why in not_applicable.items()}}
    return ctx.verdict(problems, metrics)
