"""The LatentMoE front split across the tensor-parallel ranks (``TPModel(moe_front="split")``).

With the manifest's TP rules the router (``gate.weight`` [E, H], FP32 logits), the latent down projection
(``routed_expert_down_proj`` [L, H]) and the latent up projection (``routed_expert_up_proj`` [H, L]) are
replicated: every rank reads all of them every step, 12.2 of the 19.3 GB a batch-1 step of a K3 TP16 rank
reads (K3.md). Split, rank ``r`` of ``tp`` reads only its rows of each (``FrontShard``):

1. router logits of its experts ``[r E/tp, (r+1) E/tp)`` (FP32, as the reference computes them), all-gathered
   in expert order, then the reference's selection on the gathered ``[N, E]`` (``fast_ops.route_from_logits``:
   sigmoid, + correction bias, stable descending sort, so on an exact tie the lower expert index wins, as on
   one GPU);
2. its latent channels ``[r L/tp, (r+1) L/tp)`` of the down projection, all-gathered to ``z [N, L]``;
3. the routed experts as before (each rank its intermediate slice of every touched expert, the FP32 latent
   sums all-reduced, the latent RMSNorm on every rank);
4. its hidden channels ``[r H/tp, (r+1) H/tp)`` of the up projection, all-gathered to the routed output
   ``[N, H]``, which then joins the shared experts in the fused reduce as the ``addend`` (unchanged).

Every logit, latent channel and output channel is computed whole on one rank from the same operands as on
one GPU, so the result is the replicated design's up to the GEMM's summation order (tests/
test_tp_moe_front_cpu.py: TP2 / TP4 in FP64 within 1e-10 of the TP1 reference; an engineered exact tie
between experts on two ranks selects the lower index). The exchange adds three all-gathers per MoE layer:
``N x E`` FP32, ``N x L`` and ``N x H`` in the model dtype. The shards are copies taken from the rank
model's replicated tensors (a loader that cuts them from the checkpoint directly would also free the
replicated ones). The fast TP step (``tp_fast.TPFastDecoder(moe_front="split")``) runs the same split with its
kernels: the router rows through the skinny GEMM with FP32 output, the selection ``route_from_logits`` (PyTorch
glue) on the gathered logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..reference.common import compute_dtype
from .fast_ops import route_from_logits
from .tp_comm import Communicator

MOE_FRONTS = ("replicated", "split")


@dataclass(frozen=True)
class FrontShard:
    """Rank ``rank``'s rows of one LatentMoE layer's router, latent down and latent up projections."""

    router: torch.Tensor  # [E/tp, H]
    down: torch.Tensor  # [L/tp, H]
    up: torch.Tensor  # [H/tp, L]

    @classmethod
    def of(cls, moe: Any, world: int, rank: int) -> FrontShard:
        def rows(w: torch.Tensor, what: str) -> torch.Tensor:
            n = w.shape[0]
            if n % world:
                raise ValueError(f"moe_front='split': {what} has {n} rows, not divisible by tp {world}")
            return w.detach()[rank * n // world:(rank + 1) * n // world].clone()

        return cls(router=rows(moe.gate.weight, "the router (num_experts)"),
                   down=rows(moe.routed_expert_down_proj.weight, "the latent down projection (latent size)"),
                   up=rows(moe.routed_expert_up_proj.weight, "the latent up projection (hidden size)"))

    def route_and_down(self, moe: Any, x: torch.Tensor, comm: Communicator
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], weights [N, k], z [N, L]) from this rank's router and down-projection rows."""
        cdt = compute_dtype(x.dtype)
        logits = comm.all_gather_last(x.to(cdt) @ self.router.to(cdt).T)
        g = moe.gate
        ids, weights = route_from_logits(logits, g.e_score_correction_bias, g.top_k, g.renormalize, g.scale)
        return ids, weights, comm.all_gather_last(F.linear(x, self.down.to(x.dtype)))

    def up_proj(self, zr: torch.Tensor, comm: Communicator) -> torch.Tensor:
        """The routed output ``[N, H]`` from this rank's rows of the up projection."""
        return comm.all_gather_last(F.linear(zr, self.up.to(zr.dtype)))
