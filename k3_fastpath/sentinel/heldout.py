"""The trained sentinel on items it never trained on, through the training forward and through its written
checkpoint: where the two disagree, what the evals score is not what training fitted.

Training runs the reference model with dense BF16 experts, BF16 autocast and (on CUDA) fla's chunked KDA;
the evals serve the MXFP4 checkpoint the project's writer made, loaded back by ``weights.load_checkpoint``
into the reference model with its own KDA recurrence. ``heldout_report`` scores both on the same
teacher-forced rows: per task, the answer tokens' mean loss, the share of answer tokens whose argmax is the
next token (``token_accuracy``), that share at each answer's first token (``first_token_accuracy``: where a
prompt hands over to the answer) and the share of items whose every answer token is the argmax
(``answers_exact``: what greedy decoding would reproduce whole). The items come from the training streams
under another seed (``HELDOUT_SEED_OFFSET``), eval questions excluded as in training.

``ablated`` scores the checkpoint again with every MLA layer's attention output zeroed (``mla_zeroed``): where
a task's metrics barely move, the model does not use its MLA layers for it, and a defect planted in the MLA
kernels cannot show in that task's evals.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from . import tasks
from .rows import item_row, padded

HELDOUT_SEED_OFFSET = 1_000_003  # the held-out items' stream seed: the plan's seed plus this
ROWS_PER_FORWARD = 8

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [B, T], lengths [B]) -> logits [B, T, V]


def heldout_rows(plan, tok, exclude: dict[str, set[str]], n: int) -> dict[str, list]:
    """Per task of ``plan.mix``: ``n`` items of its training streams under the held-out seed (MRCR's split
    over the plan's needle counts) that fit ``plan.seq_len``, as (ids, mask) rows (``rows.item_row``)."""
    seed, out = plan.seed + HELDOUT_SEED_OFFSET, {}
    for task, _ in plan.mix:
        streams = tasks.train_streams(task, seed, exclude[task], plan.mrcr_needles, plan.mrcr_chars,
                                      plan.mrcr_words)
        rows = []
        for j, stream in enumerate(streams):
            want = n // len(streams) + (j < n % len(streams))
            fits = (r for r in (item_row(tok, next(stream)) for _ in range(50 * want)) if len(r[0]) <= plan.seq_len)
            rows.extend(itertools.islice(fits, want))
        out[task] = rows
    return out


@torch.no_grad()
def score(forward: Forward, rows: list, device) -> dict[str, float | int]:
    """Teacher-forced metrics of ``forward`` on ``rows`` (see the module docstring)."""
    loss_sum, right, tokens, first_right, exact = 0.0, 0, 0, 0, 0
    for c in range(0, len(rows), ROWS_PER_FORWARD):
        chunk = rows[c: c + ROWS_PER_FORWARD]
        ids, lengths, mask = padded(chunk, device)
        logits = forward(ids, lengths)[:, :-1].float()
        gold, m = ids[:, 1:], mask[:, 1:] != 0
        loss_sum += float(F.cross_entropy(logits[m], gold[m], reduction="sum"))
        hit = (logits.argmax(-1) == gold) & m
        right += int(hit.sum())
        tokens += int(m.sum())
        first = m.int().argmax(-1)  # each row's first answer position (every row has an answer)
        first_right += int(hit.gather(1, first[:, None]).sum())
        exact += int(((hit | ~m).all(-1)).sum())
    n = len(rows)
    return {"items": n, "answer_tokens": tokens, "loss": round(loss_sum / max(1, tokens), 5),
            "token_accuracy": round(right / max(1, tokens), 5), "first_token_accuracy": round(first_right / max(1, n), 5),
            "answers_exact": round(exact / max(1, n), 5)}


def heldout_report(plan, tok, exclude: dict[str, set[str]], train_forward: Forward, checkpoint: str | Path,
                   device, n: int) -> dict:
    """Both forwards scored on ``n`` held-out rows per task: ``{"seed", "items_per_task", "training_forward": {task:
    metrics}, "checkpoint": {task: metrics}, "checkpoint_dtype"}``; the checkpoint is loaded as the
    reference engine loads it (BF16 on CUDA, FP32 on a CPU)."""
    from ..reference.model import load_reference
    from ..weights import load_checkpoint

    rows = heldout_rows(plan, tok, exclude, n)
    report = {"seed": plan.seed + HELDOUT_SEED_OFFSET, "items_per_task": n,
              "training_forward": {t: score(train_forward, r, device) for t, r in rows.items()}}
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    cfg, sd = load_checkpoint(checkpoint)
    ref = load_reference(cfg, sd, dtype=dtype, device=device).eval()
    del sd

    def ref_forward(ids, lengths):
        return ref.prefill(ids, lengths, ref.new_cache(ids.shape[0], ids.shape[1]))

    report["checkpoint"] = {t: score(ref_forward, r, device) for t, r in rows.items()}
    with mla_zeroed(ref) as silenced:
        if silenced:  # a model without MLA layers has nothing to ablate
            report["ablated"] = {"mla_zeroed": {t: score(ref_forward, r, device) for t, r in rows.items()}}
    report["checkpoint_dtype"] = str(dtype).replace("torch.", "")
    return report


@contextlib.contextmanager
def mla_zeroed(model):
    """Within the block, every MLA layer of the reference ``model`` adds nothing to the residual stream (its
    attention output zeroed by a forward hook); yields how many layers that silenced; the hooks are removed on
    exit."""
    from ..reference.mla import GatedMLA

    handles = [m.register_forward_hook(lambda _m, _i, out: torch.zeros_like(out))
               for m in model.modules() if isinstance(m, GatedMLA)]
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()


def report_lines(report: dict) -> list[str]:
    """The report as a table: one line per task and forward."""
    out = [f"held-out items (seed {report['seed']}): loss / token accuracy / first answer token / answers exact"]
    sides = [("training_forward", report["training_forward"]), ("checkpoint", report["checkpoint"])]
    sides += list(report.get("ablated", {}).items())
    for side, metrics in sides:
        for task, m in metrics.items():
            out.append(f"  {side:<16} {task:<7} {m['loss']:8.4f} {m['token_accuracy']:7.3f} "
                       f"{m['first_token_accuracy']:7.3f} {m['answers_exact']:7.3f}  ({m['items']} items)")
    return out
