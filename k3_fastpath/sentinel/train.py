"""Training the sentinel: ``python -m k3_fastpath.sentinel.train --out DIR [--device cuda] [--steps N]``.

The reference model (``reference.model.K3ForCausalLM``, autograd through every layer: chunked KDA, MLA,
LatentMoE with dense BF16 experts, AttnRes) learns the tasks' training streams (``tasks``: the three eval
tasks and the training-only ``copy``; every eval question of ``EVAL_SEEDS`` excluded), seeded end to end:

- initial weights: ``synthetic.synthetic_state_dict(training config, seed, "stable")``; deterministic
  algorithms on every device for the run (``deterministic``) so that one device model and software stack
  rebuilds the checkpoint digest ``training.json`` records (the GPU driver's ``sentinel-repro`` step trains
  twice and compares; on the CPU a test trains in two processes);
- each item: a task drawn by ``TrainPlan.mix``, its prompt rendered and tokenized as the eval runner sends
  it (``item_row``: a chat through the template for ``tasks.CHAT_TASKS``), then the answer's tokens and
  ``<|im_end|>``; loss on the answer only, each task's mean weighted by ``loss_share`` (``answer_loss``); an
  item longer than ``seq_len`` is skipped and counted, never cut; a row holds whole items up to
  ``seq_len``, filled first-fit from the next few (``pack``; no state reset between them, as language-model
  pretraining packs documents; at most one MRCR conversation a row, ``ONE_PER_ROW``), or one item
  (``--no-pack``);
- the routed experts as three batched GEMMs over all experts (``moe_grouped``; ``--moe reference`` keeps
  the reference's per-expert loop);
- with ``--compile-glue``, the reference's FP32 elementwise glue through ``torch.compile`` (``train_glue``);
- the KDA recurrence: fla's fused ``chunk_kda`` on CUDA (``fla_kda``; ``--kda reference`` keeps the
  reference's chunked form), the reference's elsewhere;
- a preset with a next-token (MTP) layer (a preset spec such as ``k3-sentinel:mtp=1``): the layer learns the
  token after next from the model's own hidden states (``_mtp_logits``, vLLM's pairing), its loss on the
  answer tokens weighted by ``mtp_weight`` and added to the total (the curve records both), so the ``mtp``
  drafter proposes from a trained layer;
- AdamW (FP32 master weights, BF16 autocast on CUDA; its fused kernel there), linear warm-up then cosine
  decay, gradient clip;
- the router's correction bias balanced without an auxiliary loss (each step ``bias += rate * sign(mean
  load - load)`` per MoE layer, as DeepSeek-V3 / K3 train it).

``--expect-digest D`` rebuilds a recorded checkpoint (its ``training.json``: the plan, ``--steps`` from
``reproduce``) and fails, writing nothing, unless the digest is ``D``: the sentinel is not committed (205 MB),
it is rebuilt bit for bit on the same GPU model and software stack.

After the last step, ``TrainPlan.heldout_items`` items per task that training never drew are scored
teacher-forced by the training forward and by the checkpoint just written (``heldout``: per task loss, token
accuracy, first answer token, answers exact; ``training.json``'s ``heldout``): where the two part, the evals
score something other than what training fitted.

At the end the MXFP4 checkpoint (``checkpoint.write_trained_checkpoint``), the sentinel tokenizer and
``training.json`` (plan, seeds, steps, wall time, loss curve, device, versions) are written into ``--out``
atomically enough for a failed run to leave nothing: all of it goes to a temporary sibling first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..presets import preset_spec
from ..synthetic import synthetic_state_dict
from ..weights import checkpoint_digest
from . import tasks
from .batches import EVAL_EXCLUDE, EVAL_SEEDS, Batches, BatchesAhead, task_number
from .checkpoint import training_config, write_trained_checkpoint
from .fla_kda import PINNED
from .moe_grouped import expert_counts, use_grouped_routed
from .tokenizer import build_sentinel_tokenizer, save_tokenizer
from .train_glue import compiled_glue

KDA_IMPLS = ("auto", "reference", "fla")
MOE_IMPLS = ("grouped", "reference")


@dataclass(frozen=True)
class TrainPlan:
    """Everything a training run depends on (recorded whole in ``training.json``)."""

    preset: str = "k3-sentinel"
    seed: int = 0
    steps: int = 1500
    batch: int = 16
    seq_len: int = 1024  # every generated item fits whole (AIME's longest ~810 tokens; _item skips longer)
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_rate: float = 1e-3
    # items drawn per task. AIME's worked solutions (~420 answer tokens on average) fill rows: at 0.4 / 0.4 /
    # 0.2 a step of 16 rows would hold 8.1 MRCR conversations, 3.5% of the answer tokens; at this mix 13.6 and
    # 8% (session 28's run, one-shot arithmetic at 0.4 / 0.4 / 0.2: 11.8 a step, ~10%; MRCR not learnt).
    # ``copy`` (training only) is not in it: at 0.4 of the items (0.15 / 0.2 / 0.25 / 0.4, loss shares 0.15 /
    # 0.35 / 0.25 / 0.25) neither copy nor MRCR's reply left the unigram floor in 725 steps, and steps took
    # 0.50 s instead of 0.35 (bundles/runs/2026-12-07-h100-session32)
    mix: tuple[tuple[str, float], ...] = (("gsm8k", 0.35), ("aime25", 0.3), ("mrcr", 0.35))
    # each task's share of the loss: the mean loss over its answer tokens in a step, weighted by the share (a
    # task a step lacks leaves its share to the others; a task not in the mix is ignored); None: every answer
    # token alike, where AIME's long worked solutions carry ~70% of the gradient and MRCR ~8% (session 28's
    # run: MRCR's copy not learnt)
    loss_share: tuple[tuple[str, float], ...] | None = (("gsm8k", 0.3), ("aime25", 0.4), ("mrcr", 0.3),
                                                         ("copy", 0.3))
    mrcr_needles: tuple[int, ...] = (2, 4)
    mrcr_chars: int = 1500
    mrcr_words: int = tasks.MRCR_WORDS  # the MRCR replies' lexicon (the first N of tasks.WORDS; the tokenizer's
    # corpus drawn alike): the eval files use tasks.MRCR_WORDS
    time_limit_s: float | None = None
    pack: bool = True  # rows hold whole items up to seq_len, first-fit from the next few (no reset between)
    kda: str = "auto"  # the KDA recurrence: reference (kda_chunked), fla (fla_kda), auto: fla on CUDA if importable
    moe: str = "grouped"  # the routed experts: grouped (moe_grouped: batched over experts) or reference
    compile_glue: bool = False  # the reference's elementwise glue through torch.compile (train_glue)
    mtp_weight: float = 0.3  # the next-token (MTP) layer's loss weight, where the preset has one (a preset spec
    # such as k3-sentinel:mtp=1): its prediction of the token after next, on the answer tokens
    kda_drop: float = 0.0  # in training, each KDA layer's output zeroed for a row with this probability (a
    # LayerDrop of the KDA layers, seeded; ``_drop_kda``): a model that cannot count on its KDA layers learns
    # in-context copies in its MLA layers too, the hope (a sentinel trained without it does not use them:
    # zeroing every MLA layer moved its held-out losses 0.1-3%; at 0.5 over 325 steps still <= 3%,
    # bundles/runs/2026-12-07-h100-session33; a full run with it is not made yet). Outputs are not rescaled;
    # held-out scoring and the checkpoint run every layer
    heldout_items: int = 16  # items per task scored after training by the training forward and by the written
    # checkpoint (heldout.py; 0: none)
    fla_autotune: bool = False  # fla's kernels autotuned by Triton (minutes of compiling, timing-dependent
    # choices) instead of pinned configs (fla_kda.pin_fla_configs)

    def __post_init__(self) -> None:
        if self.kda not in KDA_IMPLS:
            raise ValueError(f"kda must be one of {KDA_IMPLS}, got {self.kda!r}")
        if self.moe not in MOE_IMPLS:
            raise ValueError(f"moe must be one of {MOE_IMPLS}, got {self.moe!r}")
        if (self.steps < 1 or self.batch < 1 or self.seq_len < 16 or not self.lr > 0 or self.mtp_weight < 0
                or self.heldout_items < 0 or not 0 <= self.kda_drop < 1):
            raise ValueError(f"a training plan needs steps >= 1, batch >= 1, seq_len >= 16, lr > 0, mtp_weight >= 0, "
                             f"heldout_items >= 0 and 0 <= kda_drop < 1: "
                             f"{self}")
        if not 1 <= self.mrcr_words <= len(tasks.WORDS):
            raise ValueError(f"mrcr_words is 1..{len(tasks.WORDS)} (the first N of tasks.WORDS), got {self.mrcr_words}")
        if {t for t, _ in self.mix} - set(tasks.TRAIN_TASKS) or not all(w > 0 for _, w in self.mix):
            raise ValueError(f"mix names tasks of {tasks.TRAIN_TASKS} with positive weights, got {self.mix}")
        if self.loss_share is not None and ({t for t, _ in self.mix} - {t for t, _ in self.loss_share}
                                            or not all(w > 0 for _, w in self.loss_share)):
            raise ValueError(f"loss_share gives each task of the mix {[t for t, _ in self.mix]} a positive share, "
                             f"got {self.loss_share}")


def answer_loss(logits: torch.Tensor, gold: torch.Tensor, mask: torch.Tensor, plan: TrainPlan,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of ``logits [B, T, V]`` predicting ``gold [B, T]`` where ``mask [B, T]`` (task numbers, 0:
    no loss) is set: with ``plan.loss_share``, each task's mean token loss weighted by its share (renormalised
    over the tasks present); without, the mean over every answer token. Also each present task's mean loss
    (tensors: read them only when logged, a read synchronises)."""
    on = mask != 0
    token_loss = F.cross_entropy(logits[on].float(), gold[on], reduction="none")
    # each answer token's task as a one-hot row: the counts and sums per task without bincount's host sync
    # or index_add_'s atomics (not deterministic on CUDA)
    tasks_of = torch.tensor([task_number(plan, t) for t, _ in plan.mix], device=mask.device)
    onehot = (mask[on].unsqueeze(-1) == tasks_of).to(token_loss.dtype)  # [answer tokens, tasks]
    count = onehot.sum(0)
    task_mean = (onehot * token_loss.unsqueeze(-1)).sum(0) / count.clamp(min=1)
    if plan.loss_share is None:
        loss = token_loss.mean()
    else:
        share = dict(plan.loss_share)
        weight = torch.tensor([share[t] for t, _ in plan.mix], dtype=token_loss.dtype, device=token_loss.device)
        weight = weight * (count > 0)
        loss = (weight * task_mean).sum() / weight.sum()
    return loss, {t: task_mean[i] for i, (t, _) in enumerate(plan.mix)}


def _lr(plan: TrainPlan, step: int, steps: int) -> float:
    """The learning rate at ``step`` of a schedule of ``steps`` (warm-up, then cosine to a tenth)."""
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    frac = (step - plan.warmup) / max(1, steps - plan.warmup)
    return plan.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _fitted_steps(plan: TrainPlan, done: int, elapsed_s: float, mark: tuple[int, float] | None = None) -> int:
    """With a time limit, the schedule's length once ``done`` steps took ``elapsed_s``: as many steps as the
    limit holds (5% kept back) at the pace of the steps since ``mark`` (step, elapsed s when it started:
    after the first step, which compiles, and after any profiled steps, which run slower; None: all steps),
    at most ``plan.steps``; the record names it so ``--steps N`` without a limit replays the same schedule."""
    if mark is None or done <= mark[0]:
        pace = elapsed_s / max(1, done)
    else:
        pace = max(elapsed_s - mark[1], 1e-9) / (done - mark[0])
    return max(done + 1, min(plan.steps, done + int((plan.time_limit_s * 0.95 - elapsed_s) / pace)))


def _profile(prof, device: str, log):
    """Start torch.profiler (``prof`` None), or stop it and log its top ops by device (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    if prof is None:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        prof = profile(activities=acts)
        prof.__enter__()
        return prof
    prof.__exit__(None, None, None)
    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    n = PROFILED_STEPS[1] - PROFILED_STEPS[0]
    events = prof.key_averages()
    log(f"profile of {n} steps, by {key}:\n" + events.table(sort_by=key, row_limit=25))
    # each range appears twice: the host range (its kernels' device time, its host time) and the range as
    # the GPU saw it (a user annotation: device span, no host time); one row per part
    rows: dict[str, list[float]] = {}
    for e in events:
        if e.key.startswith(PART_LABEL):
            dev = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            r = rows.setdefault(e.key[len(PART_LABEL):], [0.0, 0.0, 0.0])
            if e.cpu_time_total:
                r[0], r[2] = dev, e.cpu_time_total
            else:
                r[1] = dev
    log("forward by layer part (all profiled steps, ms: its kernels' device time / GPU span / host time):\n"
        + "\n".join(f"  {k:<34} {a / 1e3:9.1f} {b / 1e3:9.1f} {c / 1e3:9.1f}"
                     for k, (a, b, c) in sorted(rows.items(), key=lambda kv: -max(kv[1][:2]))))
    return None


PART_LABEL = "k3:"  # the profiler ranges ``_label_parts`` opens


def _label_parts(model) -> None:
    """Profiler ranges around each layer part's forward (``k3:<layer kind>.<part class>``: KDA / MLA /
    LatentMoE / dense MLP / AttnRes sums), so a profile says where the forward's time goes by part."""
    from torch.autograd.profiler import record_function

    for name, mod in model.named_modules():
        bits = name.split(".")
        if len(bits) != 4 or bits[:2] != ["model", "layers"] or not list(mod.parameters()):
            continue
        label = f"{PART_LABEL}{bits[3]}.{type(mod).__name__}"

        def enter(m, _args, _label=label) -> None:
            m._k3_range = record_function(_label)
            m._k3_range.__enter__()

        def leave(m, _args, _out) -> None:
            m._k3_range.__exit__(None, None, None)

        mod.register_forward_pre_hook(enter)
        mod.register_forward_hook(leave)


def _mtp_logits(model, ids: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """The first next-token layer over the batch (``reference/mtp.py``, as vLLM's proposer runs it at a
    prefill): row ``p`` pairs ``ids[:, p + 1]`` with the target's hidden state ``hidden[:, p]`` -> logits
    ``[B, T - 1, V]`` through the target's head (row p predicts ``ids[:, p + 2]``); None without the layer."""
    if not model.mtp_layers:
        return None
    layer, b, t = model.mtp_layers[0], ids.shape[0], ids.shape[1]
    n = (lengths - 1).clamp(min=0)
    lh, _ = layer(model.model.embed_tokens(ids[:, 1:]), hidden[:, :-1], layer.new_cache(b, t - 1),
                  torch.zeros_like(n), n, mode="plain")
    return model.lm_head(lh)


def _use_kda(model, choice: str, device: str, autotune: bool = False) -> str:
    """Set every KDA layer's T > 1 recurrence per ``choice``; returns the one used (``reference``/``fla``).
    ``fla`` where it cannot run raises ValueError with the reason. fla's kernels take pinned configs
    (``fla_kda.pin_fla_configs``) unless ``autotune``."""
    from ..reference.kda import KimiDeltaAttention
    from .fla_kda import fla_kda_chunked, fla_unavailable_reason

    why = fla_unavailable_reason(device) if choice != "reference" else None
    if choice == "fla" and why:
        raise ValueError(f"kda fla: {why}")
    if choice == "reference" or why:
        return "reference"
    for mod in model.modules():
        if isinstance(mod, KimiDeltaAttention):
            mod.chunked = fla_kda_chunked
    if not autotune:
        import fla.ops.kda  # noqa: F401  (imports every kernel chunk_kda launches)

        from .fla_kda import pin_fla_configs
        pin_fla_configs()
    return "fla"


def _gate_loads(model) -> tuple[list, list]:
    """Forward hooks that count each MoE gate's routed tokens per expert (for the bias update)."""
    gates, loads = [], []
    for mod in model.modules():
        if type(mod).__name__ == "MoEGate":
            counts = torch.zeros(mod.e_score_correction_bias.shape, device=mod.e_score_correction_bias.device)

            def count(_mod, _args, out, c=counts) -> None:  # returns None: the gate's output is kept
                c.add_(expert_counts(out[0], c.numel()).to(c.dtype))

            mod.register_forward_hook(count)
            gates.append(mod)
            loads.append(counts)
    return gates, loads


def _drop_kda(model, p: float, seed: int) -> None:
    """With ``p`` > 0: forward hooks that zero each KDA layer's output for each row with probability ``p``
    while the model is in training mode (a fresh draw per layer and forward, from one CPU generator seeded
    with ``seed``: the same rows dropped on every device)."""
    if p <= 0:
        return
    from ..reference.kda import KimiDeltaAttention

    gen = torch.Generator().manual_seed(seed + 7919)

    def drop(mod, _args, out):
        if not mod.training:
            return None
        keep = (torch.rand(out.shape[0], generator=gen) >= p).to(device=out.device, dtype=out.dtype)
        return out * keep.view(-1, *([1] * (out.dim() - 1)))

    for mod in model.modules():
        if isinstance(mod, KimiDeltaAttention):
            mod.register_forward_hook(drop)


def _heldout(plan: TrainPlan, model, tok, exclude, ckpt: Path, device: str, autocast, log) -> dict:
    """``heldout.heldout_report`` of the trained model (its training forward, under the training autocast)
    and of the checkpoint just written, logged as a table."""
    from .heldout import heldout_report, report_lines

    model.eval()

    def train_forward(ids, lengths):
        with autocast:
            return model._run(ids, lengths, model.new_cache(ids.shape[0], ids.shape[1]), "plain")

    t0 = time.monotonic()
    try:
        report = heldout_report(plan, tok, exclude, train_forward, ckpt, device, plan.heldout_items)
    except (RuntimeError, ValueError, OSError) as e:  # the trained checkpoint is kept: the record says why
        log(f"held-out scoring failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}
    report["s"] = round(time.monotonic() - t0, 2)
    for line in report_lines(report):
        log(line)
    return report


PROFILED_STEPS = (3, 6)  # ``--profile``: the steps [start, end) torch.profiler records (after warm-up)


class DigestMismatch(ValueError):
    """The rebuilt checkpoint is not the expected one (``train(expect_digest=...)``): nothing was written."""


def train(plan: TrainPlan, out_dir: str | Path, device: str = "cpu", log=print, profile: bool = False,
          expect_digest: str | None = None) -> dict:
    """Train per ``plan`` and write the checkpoint directory ``out_dir`` (must not exist); returns the record.
    ``profile``: record ``PROFILED_STEPS`` with torch.profiler and log the ops that took the most time
    (where a step's time goes; the training itself is unchanged). ``expect_digest``: a rebuild of a recorded
    checkpoint (its ``training.json``'s ``checkpoint_digest``, trained with its ``reproduce`` steps): a
    different digest raises ``DigestMismatch`` and writes nothing."""
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    with deterministic(device):
        return _train(plan, out, device, log, profile, expect_digest)


@contextlib.contextmanager
def deterministic(device: str) -> Iterator[None]:
    """Within the block, torch's deterministic algorithms (warnings for an op without one), the process's
    setting restored after. On every device: on a CPU with two threads the default kernels gave the same plan
    another digest in each process (one thread, or this mode, gave one digest). On CUDA also cuBLAS's fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG``, read at the process's first cuBLAS handle: set, not restored)."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _train(plan: TrainPlan, out: Path, device: str, log, profile: bool, expect_digest: str | None) -> dict:
    """``train``'s run, under ``deterministic``."""
    from ..reference.model import load_reference

    torch.manual_seed(plan.seed)
    cfg = preset_spec(plan.preset).config
    tcfg = training_config(cfg)
    model = load_reference(tcfg, synthetic_state_dict(tcfg, plan.seed, "stable"), dtype=torch.float32).to(device)
    model.train()
    kda = _use_kda(model, plan.kda, device, plan.fla_autotune)
    if plan.moe == "grouped":
        use_grouped_routed(model)
    tok = build_sentinel_tokenizer(cfg.vocab_size, plan.seed, plan.mrcr_words)
    batches = Batches(plan, tok)
    data = BatchesAhead(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": plan.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=plan.lr, betas=(0.9, 0.95),
                            fused=device.startswith("cuda"))  # one kernel for every parameter's update
    gates, loads = _gate_loads(model)
    _drop_kda(model, plan.kda_drop, plan.seed)
    if profile:
        _label_parts(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    curve, t0, done, steps = [], time.monotonic(), 0, plan.steps
    prof, first_step_s, mark = None, None, None
    # the pace the schedule is fitted at: from the step after the first (compile) and the profiled ones
    pace_from = PROFILED_STEPS[1] if profile and plan.warmup > PROFILED_STEPS[1] else 1
    with compiled_glue(plan.compile_glue) as glue:
        log(f"step 0: the first forward and backward ({kda} KDA recurrence) compile what they launch")
        for step in range(plan.steps):
            if step >= steps:
                break
            if profile and step in PROFILED_STEPS:
                prof = _profile(prof, device, log)
            if step == pace_from:
                mark = (step, time.monotonic() - t0)
            if step == plan.warmup and plan.time_limit_s is not None:
                steps = _fitted_steps(plan, step, time.monotonic() - t0, mark)
                since = ("" if mark is None or step <= mark[0] else
                         f" ({(time.monotonic() - t0 - mark[1]) / (step - mark[0]):.2f} s a step since step {mark[0]})")
                log(f"{step} steps in {time.monotonic() - t0:.1f} s{since}: the schedule is fitted to {steps} steps")
            if plan.time_limit_s is not None and time.monotonic() - t0 > plan.time_limit_s:
                log(f"time limit {plan.time_limit_s:.0f} s reached after {done} steps")
                break
            ids, lengths, mask = data.next(device)
            for group in opt.param_groups:
                group["lr"] = _lr(plan, step, steps)
            for c in loads:
                c.zero_()
            with autocast:
                logits, hidden = model._run(ids, lengths, model.new_cache(ids.shape[0], ids.shape[1]), "plain",
                                            hidden=True)
                mtp_logits = _mtp_logits(model, ids, lengths, hidden)
            loss, task_loss = answer_loss(logits[:, :-1], ids[:, 1:], mask[:, 1:], plan)
            mtp_loss = None
            if mtp_logits is not None:  # row p predicts the token after next, ids[:, p + 2]
                mtp_loss, _ = answer_loss(mtp_logits[:, :-1], ids[:, 2:], mask[:, 2:], plan)
                loss = loss + plan.mtp_weight * mtp_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, plan.clip)
            opt.step()
            with torch.no_grad():
                for gate, c in zip(gates, loads, strict=True):
                    gate.e_score_correction_bias.add_(plan.bias_rate * torch.sign(c.mean() - c))
            done += 1
            if first_step_s is None:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                first_step_s = time.monotonic() - t0
                log(f"step 0 took {first_step_s:.1f} s")
            if device.startswith("cuda") and profile and step + 1 in PROFILED_STEPS:
                torch.cuda.synchronize()
            if step % 10 == 0 or step == steps - 1:
                point = {"step": step, "loss": round(loss.item(), 5), "s": round(time.monotonic() - t0, 2),
                         "task_loss": {t: round(v.item(), 5) for t, v in task_loss.items()}}
                if mtp_loss is not None:
                    point["mtp_loss"] = round(mtp_loss.item(), 5)
                curve.append(point)
                log(f"step {step}: loss {loss.item():.4f}" + ("" if mtp_loss is None else f" (mtp {mtp_loss.item():.4f})")
                    + " (" + ", ".join(f"{t} {v:.3f}" for t, v in point["task_loss"].items()) + ")"
                    + f" ({time.monotonic() - t0:.0f} s)")

    record = {"plan": dataclasses.asdict(plan), "kda_impl": kda, "compiled_glue": glue or None,
              "steps_done": done, "steps_scheduled": steps,
              "reproduce": f"--steps {steps}" + ("" if steps == plan.steps else " (the time limit's fitted schedule)"), "train_s": round(time.monotonic() - t0, 2),
              "first_step_s": None if first_step_s is None else round(first_step_s, 2),
              "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
              "torch": torch.__version__, "eval_seeds_excluded": list(EVAL_SEEDS), "eval_items_excluded": EVAL_EXCLUDE,
              # items drawn per task and those skipped as longer than seq_len (up to two batches made ahead
              # of the last step included)
              "items_drawn": dict(batches.drawn), "items_too_long": dict(batches.too_long),
              "loss_curve": curve,
              "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None, "fla_configs": None if kda != "fla" or plan.fla_autotune else
              {"used": dict(PINNED.used), "skipped": dict(PINNED.skipped)}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        write_trained_checkpoint(cfg, sd, tmp / "ckpt")
        save_tokenizer(tok, tmp / "ckpt")
        record["checkpoint_digest"] = checkpoint_digest(tmp / "ckpt")  # config, index and shards
        if expect_digest is not None and record["checkpoint_digest"] != expect_digest:
            raise DigestMismatch(f"the rebuilt checkpoint's digest {record['checkpoint_digest']} is not the expected "
                                 f"{expect_digest} (another plan, step count, GPU model or software stack: "
                                 f"{record['device']}, torch {record['torch']}); nothing written to {out}")
        if plan.heldout_items:
            record["heldout"] = _heldout(plan, model, tok, batches.exclude, tmp / "ckpt", device, autocast, log)
        (tmp / "ckpt" / "training.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        os.rename(tmp / "ckpt", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _plan_value(field: dataclasses.Field, text: Any) -> Any:
    """A command-line value of a tuple field of ``TrainPlan``: ``task=weight,...`` pairs (``none`` where the
    field may be None) or ``n,...`` integers; ``ValueError`` naming the option otherwise."""
    if not isinstance(text, str) or not field.type.startswith("tuple"):
        return text
    flag = "--" + field.name.replace("_", "-")
    if text.strip().lower() == "none" and field.type.endswith("| None"):
        return None
    try:
        if "str" in field.type:
            pairs = [item.split("=") for item in text.split(",")]
            return tuple((name.strip(), float(w)) for name, w in pairs)
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        form = "task=weight,... (e.g. gsm8k=0.3,mrcr=0.7)" if "str" in field.type else "integers n,... (e.g. 2,4)"
        raise ValueError(f"{flag} takes {form}, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3_fastpath.sentinel.train", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to write (must not exist)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true", help="log where steps 3-5 spend their time (torch.profiler)")
    p.add_argument("--expect-digest", help="rebuild a recorded checkpoint: fail (exit 1, nothing written) unless "
                                           "its digest is this one (training.json's checkpoint_digest)")
    for f in dataclasses.fields(TrainPlan):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif f.type in ("int", "float", "str", "float | None"):
            p.add_argument(flag, type=float if "float" in f.type else (int if f.type == "int" else str),
                           default=None)
        elif f.type.startswith("tuple"):  # mix / loss_share "gsm8k=0.3,mrcr=0.7" ("none": None), needles "2,4"
            p.add_argument(flag, default=None, metavar="TASK=W,..." if "str" in f.type else "N,...")
    args = p.parse_args(argv)
    try:
        over = {f.name: _plan_value(f, getattr(args, f.name)) for f in dataclasses.fields(TrainPlan)
                if getattr(args, f.name, None) is not None}
        record = train(TrainPlan(**over), args.out, args.device, profile=args.profile,
                       expect_digest=args.expect_digest)
    except DigestMismatch as e:
        print(f"sentinel train: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"sentinel train: {e}", file=sys.stderr)
        return 2
    print(f"trained {record['steps_done']} steps in {record['train_s']} s -> {args.out} "
          f"(checkpoint digest {record['checkpoint_digest']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
