"""The sentinel's training glue through ``torch.compile`` (``TrainPlan.compile_glue``, off by default).

The reference model computes its elementwise glue in FP32 as chains of PyTorch ops: the KDA short conv is
four shifted multiply-adds and a SiLU per projection, each RMSNorm about eight kernels, SiTU-GLU six. On the
H100 a training step's GPU time was ~90% elementwise and copy kernels (session 22's profile) and its host
time ~0.67 s of launches. ``compiled_glue`` swaps these pure functions, where the reference's modules look
them up, for ``torch.compile``'d versions (inductor fuses each chain into a few kernels, forward and
backward) for the duration of a training run, and puts the originals back after: the same math, so the
model the fast path is compared against is untouched outside training. Dynamic shapes (the packed rows'
length and the experts' capacity change between steps) compile once per function and dtype.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

# (module, name): each pure glue function where the modules that call it look it up
GLUE = (
    ("k3_fastpath.reference.kda", "conv_update"),
    ("k3_fastpath.reference.kda", "l2_normalize"),
    ("k3_fastpath.reference.kda", "kda_gate"),
    ("k3_fastpath.reference.common", "rms_norm"),
    ("k3_fastpath.reference.moe", "situ_glu"),
    ("k3_fastpath.sentinel.moe_grouped", "situ_glu"),
    ("k3_fastpath.reference.model", "apply_attn_res"),
)
BACKEND = "inductor"  # the tests trace with "aot_eager" (dynamo + autograd graphs, no code generation)


@contextlib.contextmanager
def compiled_glue(enabled: bool = True, backend: str | None = None) -> Iterator[list[str]]:
    """Within the block, ``GLUE``'s functions are compiled (``backend``, default ``BACKEND``); yields the
    ``module.name`` swapped (empty when not ``enabled``)."""
    swapped: list[tuple[object, str, object]] = []
    try:
        if enabled:
            from ..runtime.compiled_glue import raise_recompile_limits

            raise_recompile_limits()  # past dynamo's default 8 variants a function would run eagerly for good
            compiled: dict[int, object] = {}  # one compiled wrapper per function, shared by its aliases
            for mod_name, name in GLUE:
                mod = importlib.import_module(mod_name)
                fn = getattr(mod, name)
                if id(fn) not in compiled:
                    compiled[id(fn)] = torch.compile(fn, dynamic=True, backend=backend or BACKEND)
                swapped.append((mod, name, fn))
                setattr(mod, name, compiled[id(fn)])
        yield [f"{m.__name__}.{n}" for m, n, _ in swapped]
    finally:
        for mod, name, fn in reversed(swapped):
            setattr(mod, name, fn)
