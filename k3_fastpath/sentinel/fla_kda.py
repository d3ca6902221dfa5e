"""The sentinel's training recurrence on CUDA: fla's ``chunk_kda`` (Triton forward and backward) under the
contract of ``reference.kda.kda_chunked``.

The reference's chunked form builds a ``[B, h, L, L, K]`` decay tensor per chunk and autograd keeps
several of them per layer (at 16 rows of 1,024 tokens, 6 heads of 128: ~200 MB each, 16 chunks, 5 KDA
layers); fla computes the same recurrence in fused kernels. ``fla_kda_chunked`` takes what
``kda_chunked`` takes (``q``/``k`` normalised, ``q`` already scaled, ``g_log`` the per-channel log decay,
``beta`` after its sigmoid, FP32) and returns ``(o [B, T, h, V], final_state [B, h, K, V])``; its outputs and
gradients are held to the reference's on a GPU (``tests/test_sentinel_fla_kda_gpu.py``) and on the CPU through
Triton's interpreter at the configs training pins on Hopper (``tests/test_sentinel_fla_kda_interpreted.py``). Only training
uses it (``TrainPlan.kda``): the reference model the fast path is compared against keeps its own
formulation.

fla's kernels are autotuned by Triton: the first call of each compiles and times every config (534 configs
over the ~30 kernels ``chunk_kda`` forward and backward launch; the backward alone did not finish within
270 s on a fresh H200). ``pin_fla_configs`` makes each of them take one config, chosen by a fixed rule
from those Triton's own pruning keeps for the call (``PinnedConfigs.choose``): every kernel compiles once
and no timing decides anything, so a training run is also bit-reproducible across runs on one GPU model
(autotuning picks by measured time, which can differ between runs and change the rounding). The configs
used are recorded (``training.json``'s ``fla_configs``).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import Tensor

FLA_MODULES = ("fla.ops", "fla.modules")  # the packages whose autotuned kernels ``pin_fla_configs`` pins


def fla_unavailable_reason(device: str) -> str | None:
    """Why ``fla_kda_chunked`` cannot run on ``device`` (None when it can)."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return f"fla's chunk_kda runs on a CUDA device, not {device!r}"
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except ImportError as e:
        return f"fla is not importable ({e}): install fla-core (the gpu extra)"
    return None


def fla_kda_chunked(q: Tensor, k: Tensor, v: Tensor, g_log: Tensor, beta: Tensor, state: Tensor | None = None,
                    chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """``kda_chunked(q, k, v, g_log, beta, state, chunk_size)`` through fla (chunk size 32 or 64)."""
    from fla.ops.kda import chunk_kda

    b, _, h, dk = q.shape
    if state is None:
        state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=q.device)
    f32 = torch.float32
    # fla saves ``initial_state`` for its backward: a copy, because the caller's state is often a cache the
    # layer then updates in place (``cache.state.copy_``), which would invalidate the saved tensor
    o, final = chunk_kda(q.to(f32), k.to(f32), v.to(f32), g_log.to(f32), beta.to(f32), scale=1.0,
                         initial_state=state.to(f32).clone(), output_final_state=True,
                         chunk_size=64 if chunk_size >= 64 else 32)
    return o, final.to(state.dtype)


class PinnedConfigs:
    """The config each pinned fla kernel took (kernel name -> its config as Triton prints it; a config that
    did not fit the GPU's shared memory or registers is listed under ``skipped``)."""

    def __init__(self) -> None:
        self.used: dict[str, str] = {}
        self.skipped: dict[str, list[str]] = {}
        self.tuners: list[Any] = []

    @staticmethod
    def choose(configs: list) -> Any:
        """The rule: block sizes nearest 64, then 2 pipeline stages, then 4 warps (the middle of fla's
        lists: moderate registers and shared memory), the earliest config on a tie."""
        def cost(i_cfg):
            i, c = i_cfg
            blocks = sum(abs(math.log2(v) - 6) for n, v in c.kwargs.items()
                         if n.startswith("B") and isinstance(v, int) and v > 0)
            return (blocks, abs(c.num_stages - 2), abs(c.num_warps - 4), i)
        return min(enumerate(configs), key=cost)[1]

    def pin(self, tuner: Any) -> None:
        """Make ``tuner`` (a Triton ``Autotuner``) run the config ``choose`` picks among those its own
        pruning keeps for each call (shape-dependent pruning still applies; one config left: no timing).
        A pick the GPU cannot launch (Triton's ``OutOfResources``, raised when the kernel is loaded,
        before it runs) is dropped, with every config of the same block sizes and warps at more pipeline
        stages (they need at least its shared memory), and the rule picks again, as autotuning skips such a
        config (on Hopper 4 warps may take wgmma's larger shared-memory tiles where 2 warps fit)."""
        if getattr(tuner, "_k3_pinned", False):
            return
        from triton.runtime.errors import OutOfResources

        prune, run, name, dropped = tuner.prune_configs, tuner.run, _kernel_name(tuner), []

        def fits(c) -> bool:  # not ruled out by a dropped config: same blocks and warps, no fewer stages
            return not any(c.kwargs == d.kwargs and c.num_warps == d.num_warps and c.num_stages >= d.num_stages
                           for d in dropped)

        def prune_to_one(kwargs, *args, **kw):
            left = [c for c in prune(kwargs, *args, **kw) if fits(c)]
            if not left:
                raise RuntimeError(f"fla kernel {name}: none of its configs fits this GPU "
                                   f"(dropped {[str(d) for d in dropped]})")
            cfg = self.choose(left)
            self.used[name] = str(cfg)
            return [cfg]

        def run_pinned(*args, **kwargs):
            while True:
                try:
                    return run(*args, **kwargs)
                except OutOfResources:
                    dropped.append(tuner.best_config)  # the config this call just tried
                    self.skipped[name] = [str(d) for d in dropped]
                    tuner.cache.clear()  # every key picks again, without it

        tuner.prune_configs, tuner.run, tuner._k3_pinned = prune_to_one, run_pinned, True
        self.tuners.append(tuner)

    def unpin_all(self) -> None:
        """Give every pinned tuner back its own autotuning (its cached picks dropped)."""
        for tuner in self.tuners:
            for attr in ("prune_configs", "run", "_k3_pinned"):
                tuner.__dict__.pop(attr, None)
            tuner.cache.clear()
        self.tuners.clear()


PINNED = PinnedConfigs()


def _kernel_name(tuner: Any) -> str:
    fn = tuner.fn
    while hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", repr(fn))


def autotuners(module_prefixes: tuple[str, ...] = FLA_MODULES) -> list[Any]:
    """Every Triton ``Autotuner`` (also under ``triton.heuristics``) of the imported modules under
    ``module_prefixes``, once each."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no Triton: nothing of fla can run either
        return []
    found, seen = [], set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not any(name == p or name.startswith(p + ".") for p in module_prefixes):
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # Heuristics -> Autotuner -> JITFunction
                if isinstance(obj, Autotuner) or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if isinstance(obj, Autotuner) and id(obj) not in seen:
                seen.add(id(obj))
                found.append(obj)
    return found


def pin_fla_configs(module_prefixes: tuple[str, ...] = FLA_MODULES) -> int:
    """Pin every autotuned kernel of the imported fla modules (``PinnedConfigs.pin``) for the rest of the
    process (training runs in its own; ``PINNED.unpin_all()`` undoes it); returns how many. Import what
    will run first (``fla.ops.kda`` imports all that ``chunk_kda`` launches)."""
    tuners = autotuners(module_prefixes)
    for t in tuners:
        PINNED.pin(t)
    return len(tuners)
