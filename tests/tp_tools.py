"""Tensor-parallel ranks in threads of one process, for the CPU TP tests: ``ThreadComm`` (the
``Communicator`` collectives over a barrier and shared slots), ``run_threads`` (any per-rank work) and
``run_ranks`` (a ragged prefill then greedy decode steps on every rank of a ``TPModel`` built with the given
options)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from k3_fastpath.runtime import tp as TP
from k3_fastpath.runtime import tp_comm as TPC


class Group:
    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=120)


class ThreadComm(TPC.Communicator):
    """One rank of ``Group``: every collective exchanges through shared slots between two barriers."""

    name = "threads"

    def __init__(self, group: Group, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.group.barrier.wait()
        self.group.slots[self.rank] = t.clone()
        self.group.barrier.wait()
        parts = [s.clone() for s in self.group.slots]
        self.group.barrier.wait()
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=-1)


def run_threads(world: int, work: Any) -> list[Any]:
    """``work(rank, comm)`` on ``world`` thread ranks sharing one ``Group``; returns each rank's result. A rank
    that raises breaks the barrier (so the others stop too) and its error, not a broken barrier's, is raised."""
    group = Group(world)
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank, ThreadComm(group, rank))
        except BaseException as e:  # noqa: BLE001 - reported below
            group.barrier.abort()
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in out if isinstance(o, BaseException)]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return out


def run_ranks(cfg: Any, world: int, sd: dict, ids: torch.Tensor, lengths: torch.Tensor, steps: int, max_len: int,
              **build: Any) -> list[dict]:
    """Every rank's prefill logits, fed tokens, decode logits and cache (``build``: ``build_tp_model``'s
    options, e.g. ``dcp=True`` or ``moe_front="split"``), FP64."""

    def work(rank: int, comm: ThreadComm) -> dict:
        m = TP.build_tp_model(cfg, sd, comm, dtype=torch.float64, **build)
        cache = m.new_cache(ids.shape[0], max_len)
        pre = m.prefill(ids, lengths, cache)
        tok = pre[torch.arange(ids.shape[0]), lengths - 1].argmax(-1)
        fed, dec = [], []
        for _ in range(steps):
            fed.append(tok.clone())
            logits = m.decode(tok, cache)
            dec.append(logits)
            tok = logits.argmax(-1)
        return {"prefill": pre, "fed": fed, "decode": dec, "cache": cache, "model": m}

    return run_threads(world, work)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
