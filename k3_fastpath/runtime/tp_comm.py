"""The collectives a tensor-parallel K3 rank needs (``runtime/tp.py``): ``Communicator`` and its reference
epilogue (all-reduce, residual add, AttnRes mix, RMSNorm in the reference's rounding order), ``LocalComm``
(TP1) and ``TorchComm`` (torch.distributed); the fused GPU one is ``tp_allreduce.SymmMemComm``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..reference.attn_res import apply_attn_res
from ..reference.common import rms_norm

Blocks = torch.Tensor | Sequence[torch.Tensor]  # the closed AttnRes snapshots: [nb, ..., H] stacked, or a list


def epilogue_reference(reduced: torch.Tensor, prefix: torch.Tensor | None, blocks: Blocks,
                       res_proj_w: torch.Tensor, res_norm_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                       addend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What follows an all-reduce in a K3 layer, in the reference's rounding order:
    ``f = addend + reduced``; ``new = prefix + f`` (``f`` itself when the layer just closed a block);
    ``normed = RMSNorm(AttnRes(blocks, new)) * norm_w`` (no mix while there is no block yet).
    Returns ``(new prefix, normed)`` in the input dtype."""
    f = reduced if addend is None else addend + reduced
    new = f if prefix is None else prefix + f
    h = apply_attn_res(new, list(blocks), res_proj_w, res_norm_w, eps) if len(blocks) else new
    return new, rms_norm(h, norm_w, eps)



class Communicator:
    """Collectives a TP rank needs. Subclasses: ``LocalComm`` (TP1), ``TorchComm`` (torch.distributed: gloo
    on CPU, NCCL on GPU; the epilogue as separate ops), ``tp_allreduce.SymmMemComm`` (GPU, fused)."""

    rank: int = 0
    world: int = 1
    name: str = "local"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place when possible); returns the summed tensor."""
        raise NotImplementedError

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` along the last dim, in rank order."""
        raise NotImplementedError

    def reduce_add_mix_norm(self, partial: torch.Tensor, prefix: torch.Tensor | None,
                            blocks: Blocks, res_proj_w: torch.Tensor, res_norm_w: torch.Tensor,
                            norm_w: torch.Tensor, eps: float, addend: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-reduce ``partial``, then ``epilogue_reference``'s residual add, AttnRes mix and RMSNorm."""
        return epilogue_reference(self.all_reduce(partial), prefix, blocks, res_proj_w, res_norm_w, norm_w, eps,
                                  addend)

    def barrier(self) -> None:
        pass


class LocalComm(Communicator):
    """TP1: every collective is the identity."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        return t


class TorchComm(Communicator):
    """``torch.distributed`` on the default (or given) process group: gloo for CPU tensors, NCCL for CUDA
    ones. The epilogue runs as separate PyTorch ops after the all-reduce (the unfused baseline)."""

    name = "torch.distributed"

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (use tp_launch.launch or torchrun)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.name = f"torch.distributed/{dist.get_backend(group)}"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)
