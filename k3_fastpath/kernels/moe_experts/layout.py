"""The routed experts of one MoE layer as the kernels read them: stacked over experts, and for MXFP4 the
checkpoint's bytes permuted (not re-quantised) so one 16-byte load per lane feeds an mma.sync fragment.

Checkpoint layout (compressed-tensors ``mxfp4-pack-quantized``, ``k3_fastpath.mxfp4``): a weight
``W [rows, K]`` is ``packed [rows, K/2]`` (element 2i in the low nibble of byte i) and ``scale [rows, K/32]``.

Fragment layout (``pack_mxfp4``), per expert e, 16-row tile rt and 64-wide K step gp (two MX groups
G = 2gp, 2gp+1), lane l = 4g + q of a warp (g = l // 4, q = l % 4):

    q_frag[e, rt, gp, l, :16] = [row 16rt+g,   group 2gp,   packed bytes 4q..4q+3 of the group,
                                 row 16rt+g+8, group 2gp,   bytes 4q..4q+3,
                                 row 16rt+g,   group 2gp+1, bytes 4q..4q+3,
                                 row 16rt+g+8, group 2gp+1, bytes 4q..4q+3]
    s_frag[e, rt, gp, g, :4]   = [scale(row g, group 2gp), scale(row g+8, group 2gp),
                                  scale(row g, group 2gp+1), scale(row g+8, group 2gp+1)]

Lane (g, q) thus holds elements 8q..8q+7 of each group for rows g and g+8: the A operand of two m16n8k16
steps whose K order is permuted the same way for the activations (elements 8q..8q+7 of the same group,
one 16-byte load), so the dot products are exact; each mma step stays inside one MX group, so the group
scale multiplies the step's FP32 result (per row) instead of every weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import mxfp4
from .config import GP, MX_GROUP


def pack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed [E, rows, K/2]`` / ``scale [E, rows, K/32]`` uint8 -> (q_frag [E, rows/16, K/64, 32, 16],
    s_frag [E, rows/16, K/64, 8, 4]) uint8 (contiguous)."""
    E, rows, half = packed.shape
    K = 2 * half
    if rows % 16 or K % GP or scale.shape != (E, rows, K // MX_GROUP):
        raise ValueError(f"MXFP4 [E={E}, rows={rows}, K={K}] needs rows % 16 == 0, K % {GP} == 0 and scales "
                         f"[E, rows, K/32], got {tuple(scale.shape)}")
    q = packed.reshape(E, rows // 16, 2, 8, K // GP, 2, 4, 4)  # e, rt, h, g, gp, G, q, byte
    q = q.permute(0, 1, 4, 3, 6, 5, 2, 7)  # e, rt, gp, g, q, G, h, byte
    s = scale.reshape(E, rows // 16, 2, 8, K // GP, 2)  # e, rt, h, g, gp, G
    s = s.permute(0, 1, 4, 3, 5, 2)  # e, rt, gp, g, G, h
    return (q.reshape(E, rows // 16, K // GP, 32, 16).contiguous(),
            s.reshape(E, rows // 16, K // GP, 8, 4).contiguous())


def unpack_mxfp4(q_frag: torch.Tensor, s_frag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_mxfp4`` (tests)."""
    E, rt, gps = q_frag.shape[:3]
    q = q_frag.reshape(E, rt, gps, 8, 4, 2, 2, 4).permute(0, 1, 6, 3, 2, 5, 4, 7)
    s = s_frag.reshape(E, rt, gps, 8, 2, 2).permute(0, 1, 5, 3, 2, 4)
    return q.reshape(E, rt * 16, gps * GP // 2).contiguous(), s.reshape(E, rt * 16, gps * 2).contiguous()


@dataclass
class ExpertWeights:
    """Stacked routed experts of one layer (one TP rank's slices): ``fmt`` "mxfp4" or "bf16".

    mxfp4: ``w1``/``w3`` = (packed [E, I, L/2], scale [E, I, L/32]), ``w2`` = (packed [E, L, I/2],
    scale [E, L, I/32]) as the checkpoint stores them, plus their fragment layouts (``frag``).
    bf16: ``w1``/``w3`` = [E, I, L], ``w2`` = [E, L, I].

    ``compact()`` (MXFP4) keeps the experts once: the fragment layout only, the checkpoint-layout stacks
    dropped (``w1 = w3 = w2 = None``); ``checkpoint(name, e)`` / ``dense(name, e)`` then rebuild one expert's
    checkpoint bytes from its fragments (``unpack_mxfp4``: exact, a per-call copy of that expert only).
    """

    fmt: str
    w1: object
    w3: object
    w2: object
    frag: dict | None = None

    @property
    def compacted(self) -> bool:
        """True once ``compact()`` dropped the checkpoint-layout stacks (the experts live in ``frag`` only)."""
        return self.w1 is None

    def _rows(self, name: str) -> torch.Tensor:
        """A tensor whose dims 0 and 1 are (experts, rows) of matrix ``name`` in whichever layout is held (the
        fragment layout has rows / 16 in dim 1)."""
        if self.compacted:
            return self.frag[name][0]
        return getattr(self, name)[0] if self.fmt == "mxfp4" else getattr(self, name)

    @property
    def num_experts(self) -> int:
        return self._rows("w1").shape[0]

    @property
    def inter(self) -> int:
        return self._rows("w1").shape[1] * (16 if self.compacted else 1)

    @property
    def latent(self) -> int:
        return self._rows("w2").shape[1] * (16 if self.compacted else 1)

    @property
    def device(self) -> torch.device:
        return self._rows("w1").device

    def checkpoint(self, name: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's matrix ``name`` in the checkpoint layout, (packed [rows, K/2], scale [rows, K/32]) uint8:
        views of the stacks, or (compacted) rebuilt from the fragments (a copy of this expert's bytes)."""
        if self.fmt != "mxfp4":
            raise ValueError("checkpoint() is for MXFP4 experts")
        if self.compacted:
            q, sc = self.frag[name]
            p, s = unpack_mxfp4(q[e:e + 1], sc[e:e + 1])
            return p[0], s[0]
        w = getattr(self, name)
        return w[0][e], w[1][e]

    def dense(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's matrix ``name`` ("w1", "w3", "w2") dequantised to ``dtype`` (the reference's view)."""
        if self.fmt == "mxfp4":
            return mxfp4.dequantize(*self.checkpoint(name, e), dtype)
        return getattr(self, name)[e].to(dtype)

    def compact(self) -> int:
        """Keep the experts once, in the fragment layout (MXFP4): builds the fragments if needed, then drops
        the checkpoint-layout stacks. Returns the bytes the stacks held (freed once nothing else holds them:
        ``step_plan.ExpertBank`` re-points the reference modules at ``checkpoint`` first)."""
        if self.fmt != "mxfp4":
            raise ValueError("compact() is for MXFP4 experts (BF16 experts have no second layout)")
        if self.compacted:
            return 0
        self.fragments()
        freed = sum(t.numel() * t.element_size() for n in ("w1", "w3", "w2") for t in getattr(self, n))
        self.w1 = self.w3 = self.w2 = None
        return freed

    def fragments(self) -> dict:
        """{"w1": (q, s), "w3": (q, s), "w2": (q, s)} in the fragment layout (computed once, cached)."""
        if self.fmt != "mxfp4":
            raise ValueError("fragments() is for MXFP4 experts")
        if self.frag is None:
            self.frag = {n: pack_mxfp4(*getattr(self, n)) for n in ("w1", "w3", "w2")}
        return self.frag

    @classmethod
    def from_modules(cls, experts, fmt: str) -> ExpertWeights:
        """Stack ``reference.moe.RoutedExpert`` modules (``LatentMoE.experts``)."""
        if fmt == "mxfp4":
            def stack(n):
                return (torch.stack([getattr(e, n).weight_packed for e in experts]),
                        torch.stack([getattr(e, n).weight_scale for e in experts]))
        else:
            def stack(n):
                return torch.stack([getattr(e, n).weight.detach() for e in experts])
        return cls(fmt, stack("w1"), stack("w3"), stack("w2"))


__all__ = ["ExpertWeights", "pack_mxfp4", "unpack_mxfp4"]
