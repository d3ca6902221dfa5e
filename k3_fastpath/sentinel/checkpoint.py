"""The sentinel's checkpoint: a model trained with BF16 routed experts written in the real format.

Training runs the reference model with ``expert_format: bf16`` (``training_config``: every weight a
parameter autograd reaches); the checkpoint is the MXFP4 one the fast path serves, written by
``weights.write_checkpoint``: each routed expert's ``w1``/``w3``/``w2`` quantized with ``mxfp4.quantize``
(``weight_packed`` + ``weight_scale``), every other tensor cast to its manifest dtype (FP32 KDA
parameters, BF16 elsewhere). The accuracy to report is that of the written checkpoint, loaded back through
``weights.load_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from .. import mxfp4
from ..config import K3Config
from ..manifest import TensorSpec
from ..synthetic import torch_dtype
from ..weights import CheckpointError, write_checkpoint

_QUANTIZED = {"weight_packed": 0, "weight_scale": 1}
DIR_ENV = "K3_SENTINEL_DIR"  # where the evals' `model: sentinel` looks (default below)
DEFAULT_DIR = Path("~/.cache/k3-verify/sentinel")


def sentinel_dir() -> Path:
    """The sentinel checkpoint directory the evals score: ``$K3_SENTINEL_DIR``, else ``DEFAULT_DIR``."""
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR).expanduser()


def missing_reason(root: Path) -> str | None:
    """Why ``root`` holds no sentinel checkpoint to score (the whole line, with the command that makes
    one), or None when it has one (its config.json: the loader validates the rest)."""
    if (root / "config.json").is_file():
        return None
    return (f"no sentinel checkpoint at {root} (${DIR_ENV}, default {DEFAULT_DIR}): train it on a GPU with "
            f"`python -m k3_fastpath.sentinel.train --out {root}` (about 6 minutes on one H200; far too slow on a "
            f"CPU) or point ${DIR_ENV} at a trained one")


def training_config(cfg: K3Config) -> K3Config:
    """``cfg`` with dense BF16 routed experts (what the optimizer updates)."""
    return dataclasses.replace(cfg, expert_format="bf16")


def write_trained_checkpoint(cfg: K3Config, state_dict: dict[str, torch.Tensor], out_dir: str | Path, *,
                             overwrite: bool = False) -> Path:
    """Write ``state_dict`` (the training model's, ``training_config(cfg)`` names) as ``cfg``'s checkpoint
    (``cfg.expert_format`` says whether the experts are quantized to MXFP4). A tensor the checkpoint needs
    and the state dict lacks raises ``CheckpointError`` naming it; nothing is left half-written."""
    sd = {k: v.detach() for k, v in state_dict.items()}
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def tensor_of(spec: TensorSpec) -> torch.Tensor:
        base, _, leaf = spec.name.rpartition(".")
        if cfg.expert_format == "mxfp4" and leaf in _QUANTIZED:
            dense = base + ".weight"
            if dense not in sd:
                raise CheckpointError(f"the trained state has no {dense} to quantize into {spec.name}")
            if dense not in quantized:
                quantized.clear()  # w1/w3/w2 of one expert are asked for one after the other
                quantized[dense] = mxfp4.quantize(sd[dense].to(torch.float32))
            return quantized[dense][_QUANTIZED[leaf]]
        if spec.name not in sd:
            raise CheckpointError(f"the trained state has no tensor {spec.name}")
        return sd[spec.name].to(torch_dtype(spec.dtype)).contiguous()

    return write_checkpoint(cfg, out_dir, tensor_of, overwrite=overwrite)
