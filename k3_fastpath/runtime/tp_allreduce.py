"""The fused all-reduce + residual add + AttnRes mix + RMSNorm of a TP rank on GPUs (never NVLink multicast).

What follows every row-parallel projection of K3 (``tp_comm.epilogue_reference``): sum the ranks' partials,
add the sum to the residual prefix, mix the AttnRes sources (closed blocks + the new prefix), RMSNorm the
mix. Unfused that is an NCCL all-reduce and ~15 small PyTorch kernels per sublayer; here it is two:

1. **one-shot all-reduce over torch symmetric memory**: ``torch.ops.symm_mem.one_shot_all_reduce_copy_out``
   copies the local partial into this rank's symmetric buffer, waits on a signal-pad barrier, then every
   rank loads all peers' buffers directly over NVLink (P2P loads, no multimem / NVLS) and sums them in rank
   order (so every rank gets bitwise the same sum), and a closing barrier makes the buffer reusable. The
   symmetric buffers are allocated with ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (no multicast object is
   ever created) and NCCL runs with ``NCCL_NVLS_ENABLE=0``;
2. **one Triton kernel** (``fused_epilogue``), one program per token row: ``addend + reduced`` (the MoE's
   routed output), ``+ prefix`` (each sum rounded to BF16 as the reference rounds it), store the new
   prefix, an online softmax over the AttnRes sources read in place from the stacked block buffer (logit
   = ``<v, norm_w * proj_w> * rsqrt(mean(v^2) + eps)``), the mix rounded to BF16, RMSNorm in FP32, store.

Messages larger than ``ONE_SHOT_MAX_BYTES`` (prefill) take NCCL for the sum and the same epilogue kernel.
``fused_epilogue`` also runs on CPU tensors under ``TRITON_INTERPRET=1`` (tests/test_tp_cpu.py checks it
against ``tp_comm.epilogue_reference``); without Triton it raises, naming what is missing.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from .tp_comm import Blocks, TorchComm

ONE_SHOT_MAX_BYTES = 2 << 20  # 64 rows x 7168 x BF16 = 0.9 MB is the largest decode message
NO_MULTICAST_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}


@functools.lru_cache(maxsize=2)
def _epilogue_kernel(interpret: bool) -> Any:
    """The Triton kernel, built on first use (``interpret`` keys the cache: TRITON_INTERPRET is read when
    a kernel is decorated)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise RuntimeError(f"the fused TP epilogue needs Triton ({e}); install torch with CUDA (it ships Triton)") from e

    @triton.jit
    def epilogue(red, add, pre, blocks, new_out, normed_out, proj_w, rnorm_w, norm_w, n_blocks, block_stride, H,
                 eps, HAS_ADD: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_H)
        mask = offs < H
        base = row * H
        odt = new_out.dtype.element_ty
        f = tl.load(red + base + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_ADD:  # the reference's `routed + shared`, rounded
            f = (tl.load(add + base + offs, mask=mask, other=0.0).to(tl.float32) + f).to(odt).to(tl.float32)
        if HAS_PREFIX:  # `prefix + f`, rounded
            f = (tl.load(pre + base + offs, mask=mask, other=0.0).to(tl.float32) + f).to(odt).to(tl.float32)
        tl.store(new_out + base + offs, f.to(odt), mask=mask)
        mix = f
        if n_blocks > 0:
            w = tl.load(rnorm_w + offs, mask=mask, other=0.0).to(tl.float32) * \
                tl.load(proj_w + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.sum(f * w, axis=0) / tl.sqrt(tl.sum(f * f, axis=0) / H + eps)  # the new prefix's logit
            denom = m * 0.0 + 1.0
            acc = f
            for i in range(n_blocks):
                v = tl.load(blocks + i * block_stride + base + offs, mask=mask, other=0.0).to(tl.float32)
                s = tl.sum(v * w, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
                m_new = tl.maximum(m, s)
                c = tl.exp(m - m_new)
                e = tl.exp(s - m_new)
                acc = acc * c + v * e
                denom = denom * c + e
                m = m_new
            mix = (acc / denom).to(odt).to(tl.float32)  # apply_attn_res returns the model dtype
        rstd = 1.0 / tl.sqrt(tl.sum(mix * mix, axis=0) / H + eps)
        y = mix * rstd * tl.load(norm_w + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(normed_out + base + offs, y.to(normed_out.dtype.element_ty), mask=mask)

    return epilogue


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_epilogue(reduced: torch.Tensor, prefix: torch.Tensor | None, blocks: Blocks, res_proj_w: torch.Tensor,
                   res_norm_w: torch.Tensor, norm_w: torch.Tensor, eps: float, addend: torch.Tensor | None = None,
                   *, new_out: torch.Tensor | None = None, normed_out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``tp_comm.epilogue_reference`` in one Triton kernel. ``blocks``: stacked ``[nb, ..., H]`` (read in place
    when contiguous) or a list. Returns ``(new prefix, normed)`` shaped like ``reduced``."""
    h = reduced.shape[-1]
    rows = reduced.numel() // h
    red = reduced.contiguous()
    add = addend.contiguous() if addend is not None else red
    pre = prefix.contiguous() if prefix is not None else red
    if isinstance(blocks, torch.Tensor):
        stacked = blocks if blocks.is_contiguous() else blocks.contiguous()
    else:
        stacked = torch.stack(list(blocks)) if len(blocks) else red[None, :0]
    nb = int(stacked.shape[0]) if stacked.numel() else 0
    if nb and stacked[0].numel() != red.numel():
        raise ValueError(f"AttnRes blocks {tuple(stacked.shape)} do not match the rows {tuple(reduced.shape)}")
    new_out = torch.empty_like(red) if new_out is None else new_out
    normed_out = torch.empty_like(red) if normed_out is None else normed_out
    if rows == 0:
        return new_out, normed_out
    kernel = _epilogue_kernel(_interpreting())
    block_h = 1 << max(0, (h - 1).bit_length())
    num_warps = 8 if block_h >= 4096 else 4
    kernel[(rows,)](red, add, pre, stacked if nb else red, new_out, normed_out, res_proj_w.reshape(-1),
                    res_norm_w, norm_w, nb, rows * h, h, float(eps), HAS_ADD=addend is not None,
                    HAS_PREFIX=prefix is not None, BLOCK_H=block_h, num_warps=num_warps)
    return new_out, normed_out


class SymmMemComm(TorchComm):
    """GPU TP collectives: one-shot symmetric-memory all-reduce (P2P loads, no multicast) for decode-sized
    messages, NCCL beyond ``ONE_SHOT_MAX_BYTES``, and the Triton epilogue after every reduce."""

    def __init__(self, group: Any = None, buffer_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        os.environ.update(NO_MULTICAST_ENV)  # before the first symmetric allocation of this process
        super().__init__(group)
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        if not torch.cuda.is_available():
            raise RuntimeError("SymmMemComm needs CUDA devices (use TorchComm on CPU)")
        op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
        if op is None:
            raise RuntimeError(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out "
                               "(needs torch >= 2.9)")
        self._one_shot = op
        pg = self.group if self.group is not None else dist.group.WORLD
        self.group_name = pg.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required before torch 2.9, a no-op or deprecated after
            try:
                enable(self.group_name)
            except Exception:
                pass
        self.buffer_bytes = int(buffer_bytes)
        self.buf = symm_mem.empty(self.buffer_bytes, dtype=torch.uint8, device=torch.device("cuda",
                                                                                           torch.cuda.current_device()))
        self.handle = symm_mem.rendezvous(self.buf, self.group_name)
        self.name = "symm_mem one-shot (P2P) + Triton epilogue"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if t.dtype not in (torch.bfloat16, torch.float32) or nbytes > self.buffer_bytes or nbytes % 16:
            return super().all_reduce(t)
        src = t.contiguous()
        view = self.buf[:nbytes].view(t.dtype).view(t.shape)
        out = torch.empty_like(src)
        self._one_shot(view, src, "sum", self.group_name, out)
        return out

    def reduce_add_mix_norm(self, partial: torch.Tensor, prefix: torch.Tensor | None, blocks: Blocks,
                            res_proj_w: torch.Tensor, res_norm_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                            addend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_epilogue(self.all_reduce(partial), prefix, blocks, res_proj_w, res_norm_w, norm_w, eps, addend)


def make_comm(kind: str, group: Any = None) -> TorchComm:
    """``"fused"`` (SymmMemComm) or ``"unfused"`` (TorchComm: NCCL / gloo + separate PyTorch ops)."""
    if kind == "fused":
        return SymmMemComm(group)
    if kind == "unfused":
        return TorchComm(group)
    raise ValueError(f"comm kind must be 'fused' or 'unfused', got {kind!r}")
