"""The training rows of the sentinel: seeded items of the plan's task mix (eval questions excluded) as rows of
token ids and a per-task loss mask, packed whole up to ``seq_len``, and made ahead on a thread. ``plan`` is
a ``train.TrainPlan`` (not imported: train imports this module)."""

from __future__ import annotations

import queue
import random
import threading
from typing import Any

import torch

from . import tasks
from .rows import item_row, padded

EVAL_SEEDS = (0,)  # the eval files' seeds the tiers use (verify/checks/evals.py)
EVAL_EXCLUDE = {"gsm8k": 2000, "aime25": 2000, "mrcr": 200}  # eval items per file and seed kept out of
# training (the tiers score far fewer)


PACK_LOOKAHEAD = 16  # packed rows: how many waiting items a row's free space may be filled from
ONE_PER_ROW = frozenset({"mrcr"})  # tasks of which a packed row holds at most one item: MRCR asks for the k-th
# message of a kind, and an earlier conversation in the same row (nothing resets between items) may hold more
TOO_LONG_SLACK = 20  # items of a task longer than seq_len skipped before "most do not fit" is an error


class Batches:
    """Seeded rows of (token ids, loss mask) from the training streams, eval questions excluded; the mask
    holds each answer token's task number (``task_number``), 0 elsewhere."""

    def __init__(self, plan: Any, tokenizer) -> None:
        self.plan, self.tok = plan, tokenizer
        self._waiting: list[tuple[list[int], list[int], str]] = []  # items drawn (ids, mask, task), not yet in
        # a row (oldest first)
        self.drawn = {task: 0 for task, _ in plan.mix}  # items drawn per task, and of them those longer than
        self.too_long = {task: 0 for task, _ in plan.mix}  # seq_len (skipped: never cut, see _item)
        self.rng = random.Random(f"k3-sentinel-mix:{plan.seed}")
        self.streams = {}
        self.exclude = {task: tasks.eval_prompt_keys(task, EVAL_SEEDS, EVAL_EXCLUDE.get(task, 0)) for task, _ in plan.mix}
        for task, _ in plan.mix:
            self.streams[task] = tasks.train_streams(task, plan.seed, self.exclude[task], plan.mrcr_needles,
                                                     plan.mrcr_chars, plan.mrcr_words)

    def row(self) -> tuple[list[int], list[int]]:
        """One training row: an item, or with ``plan.pack`` whole items up to ``seq_len``: the oldest waiting
        item first (none waits for ever), then, while one fits, the oldest of the next ``PACK_LOOKAHEAD``
        items that fits the space left (first fit: ~95% of a row filled where taking items strictly in
        order filled ~73%), never a second item of a task in ``ONE_PER_ROW``. Every item of the stream is used
        once; only their order changes."""
        if not self.plan.pack:
            return self._item()[:2]
        while len(self._waiting) < PACK_LOOKAHEAD:
            self._waiting.append(self._item())
        ids, mask, task = self._waiting.pop(0)
        held = {task}
        while True:
            room = self.plan.seq_len - len(ids)
            fit = next((i for i, (w, _, t) in enumerate(self._waiting)
                        if len(w) <= room and not (t in ONE_PER_ROW and t in held)), None)
            if fit is None:
                return ids, mask
            w_ids, w_mask, w_task = self._waiting.pop(fit)
            ids, mask = ids + w_ids, mask + w_mask
            held.add(w_task)
            self._waiting.append(self._item())

    def _item(self) -> tuple[list[int], list[int], str]:
        """The next item that fits ``seq_len`` whole. A longer one is skipped and counted: cut to its end it
        would teach an answer without its question (AIME's repeated squaring runs to ~800 tokens) or an
        MRCR answer without the message it repeats. A task whose items mostly do not fit is an error."""
        while True:
            task = self.rng.choices([t for t, _ in self.plan.mix], weights=[w for _, w in self.plan.mix])[0]
            ids, mask = item_row(self.tok, next(self.rng.choice(self.streams[task])))
            self.drawn[task] += 1
            if len(ids) <= self.plan.seq_len:
                number = task_number(self.plan, task)
                return ids, [number * m for m in mask], task
            self.too_long[task] += 1
            if self.too_long[task] > max(TOO_LONG_SLACK, self.drawn[task] // 2):
                raise ValueError(f"seq_len {self.plan.seq_len} is too short for {task}: {self.too_long[task]} of "
                                 f"{self.drawn[task]} items drawn do not fit (raise --seq-len"
                                 f"{' or lower --mrcr-chars' if task == 'mrcr' else ''})")

    def batch(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return padded([self.row() for _ in range(self.plan.batch)], device)


class BatchesAhead:
    """``Batches`` made ahead on a thread while the GPU runs a step: one producer in order, so the sequence
    of batches is exactly ``Batches``' own; an error there is raised by the ``next`` that would have got
    the batch."""

    def __init__(self, batches: Batches, depth: int = 2) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._fill, args=(batches,), daemon=True)
        self.thread.start()

    def _fill(self, batches: Batches) -> None:
        while True:
            try:
                item = batches.batch("cpu")
            except BaseException as e:  # handed to the consumer, which raises it
                self.q.put(e)
                return
            self.q.put(item)

    def next(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        item = self.q.get()
        if isinstance(item, BaseException):
            raise item
        return tuple(t.to(device) for t in item)


def task_number(plan: Any, task: str) -> int:
    """The mask value of ``task``'s answer tokens in a training row: 1 + its place in ``plan.mix``."""
    return 1 + [t for t, _ in plan.mix].index(task)
