"""Start one process per TP rank and collect what each returns: ``launch(fn, world, args)``.

Processes are spawned (``torch.multiprocessing``, start method ``spawn``: CUDA cannot survive a fork), each
initialises ``torch.distributed`` (``nccl`` with one GPU per rank, ``gloo`` on CPU) on a free localhost
port, calls ``fn(rank, world, *args)`` and sends the result back pickled with ``torch.save`` (tensors
included). A rank that raises reports its traceback; ``launch`` then terminates the others and raises
``TPLaunchError`` with the first traceback. A run past ``timeout_s`` is killed the same way (a hung
collective never hangs the caller).

NVLink multicast (NVLS) is never used: every rank sets ``NCCL_NVLS_ENABLE=0`` before NCCL initialises, and
the fused all-reduce reads peer buffers directly (``tp_allreduce.py``), never through multimem.

Under ``torchrun`` use ``init_from_env()`` instead (it reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

NO_NVLS_ENV = {"NCCL_NVLS_ENABLE": "0"}


class TPLaunchError(RuntimeError):
    """A rank failed or the group timed out; the message holds the rank and its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(backend: str, rank: int, world: int, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.update(NO_NVLS_ENV)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _child(rank: int, world: int, port: int, backend: str, fn: Callable[..., Any], args: tuple,
           results: Any, env: dict[str, str], timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(max(1, int(os.environ.get("K3_CPU_THREADS", "1"))))
    try:
        _init(backend, rank, world, timeout_s)
        out = fn(rank, world, *args)
        results.put((rank, "ok", _pack(out)))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch(fn: Callable[..., Any], world: int, args: tuple = (), *, backend: str = "gloo",
           timeout_s: float = 600.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; returns their results in rank order.

    ``fn`` must be importable (a module-level function). ``backend="nccl"`` needs ``world`` visible GPUs.
    """
    import torch.multiprocessing as mp

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise TPLaunchError(f"nccl with {world} ranks needs {world} GPUs; {torch.cuda.device_count()} visible")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    child_env = {**NO_NVLS_ENV, **(env or {})}
    procs = [ctx.Process(target=_child, args=(r, world, port, backend, fn, args, results, child_env, timeout_s),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TPLaunchError(f"{world} ranks timed out after {timeout_s:.0f}s; finished: {sorted(got)}")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got and p.exitcode]
                if dead:
                    raise TPLaunchError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                        f"before reporting") from None
                continue
            if status != "ok":
                raise TPLaunchError(f"rank {rank} failed:\n{payload}")
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [got[r] for r in range(world)]


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise ``torch.distributed`` from torchrun's environment; returns ``(rank, world)``."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        os.environ.update(NO_NVLS_ENV)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return rank, world
