"""The standard path's routed experts in MXFP4, as vLLM runs them on Hopper: humming-kernels' W4A16 MoE GEMMs.

vLLM 0.33 serves an MXFP4 MoE on sm_90 through humming-kernels (its oracle ranks it ahead of Marlin there:
``model_executor/layers/quantization/utils/humming/priority.py``), so ``DecodeOptions(standard_mxfp4_experts=True)``
gives ``backend="standard_graph"`` the same expert bytes as the fast path, read by the library a Hopper user has.
What runs per MoE layer and step (``standard_ops.moe_experts_humming``), following vLLM's ``HummingIndexedExperts.apply``:

1. ``align``: the Bk x k (row, expert) pairs grouped by expert, each group padded to the GEMM's M block
   (``sorted_ids`` holding flat pair ids ``t * k + j``, sentinel ``Bk * k``; ``expert_ids`` per block;
   ``num_tokens_padded``), in PyTorch on the device with static shapes (vLLM's ``moe_align_block_size`` is a
   CUDA op of its own; this is the same contract, capturable);
2. ``humming_forward`` over w13 (gate rows ``[0, I)``, up rows ``[I, 2I)``, as vLLM stacks w1 / w3): BF16
   ``[Bk * k, 2I]``, one row per pair;
3. SiTU-GLU in FP32 rounded to BF16 (the standard path's glue, ``experts_glu``; vLLM runs the same formula
   as a humming ``process_input`` expression);
4. ``humming_forward`` over w2 (``top_k=1``): BF16 ``[Bk * k, L]``;
5. the FP32 weighted sum per row (``experts_combine``), optionally the routed latent RMSNorm.

Weights: ``HummingExperts.of(bank)`` stacks a layer's checkpoint bytes (MXFP4 E2M1 + E8M0 scales, group 32)
and transforms them once with ``humming.transform.prepare_and_transform_humming_tensors`` (N padded to 256
and K to 128, as vLLM pads: a TP16 slice of I = 192 becomes 256), kept per LatentMoE module like
``StandardExperts``. Its bytes are ``humming_expert_bytes``. The GEMM kernels JIT-compile (NVRTC) at their
first call per layer shape; every layer of a model shares them, and the executor's eager warm-up runs before
capture.

The op itself is ``standard_ops.moe_experts_humming``. Needs CUDA sm_90 and ``humming`` importable (``humming_unavailable`` says why not); elsewhere the option is
refused with that reason, never replaced by the BF16 experts.
"""

from __future__ import annotations

import functools
import json
import weakref
from typing import Any

import torch

HUMMING_LIB = ("standard path: humming-kernels W4A16 MoE GEMMs over MXFP4 experts (vLLM's sm_90 MXFP4 backend), "
               "FP32 SiTU-GLU and combine")
PAD_N, PAD_K = 256, 128  # vLLM's padding of the humming MoE weights (quantization/utils/humming/moe.py)
GEMM_TYPE = "indexed"  # vLLM's default humming MoE GEMM (grouped_contiguous under expert parallelism)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def humming_expert_bytes(num_experts: int, inter: int, latent: int) -> int:
    """Bytes of one layer's experts in humming's layout: w13 ``[E, 2I, L]`` and w2 ``[E, L, I]`` at 4 bits plus
    one E8M0 scale per 32, each padded (N to 256, K to 128)."""
    def mat(n: int, k: int) -> int:
        n, k = _round_up(n, PAD_N), _round_up(k, PAD_K)
        return num_experts * (n * k // 2 + n * k // 32)

    return mat(2 * inter, latent) + mat(latent, inter)


@functools.lru_cache(maxsize=8)
def humming_unavailable(device: str) -> str | None:
    """Why humming's MXFP4 MoE cannot serve ``device`` (None: it can)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"humming-kernels needs a CUDA device, got {dev}"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) != (9, 0):
        return f"humming's sm_90 MXFP4 MoE is what vLLM runs on Hopper; this device is sm_{major}{minor}"
    try:
        import humming.forward  # noqa: F401
        import humming.transform  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure is the reason)
        return f"humming-kernels is not importable ({type(e).__name__}: {e}; stage humming-kernels==0.1.20)"
    return None


def align(ids: torch.Tensor, num_experts: int, block: int) -> dict[str, torch.Tensor]:
    """The indexed MoE GEMM's row map of ``ids [M, k]``: pairs ``t * k + j`` grouped by expert (stable: by pair
    id within an expert), each group padded with the sentinel ``M * k`` to a multiple of ``block``. Returns
    ``sorted_ids [L] i32`` (L = the most any routing needs), ``expert_ids [L / block] i32`` (blocks past
    ``num_tokens_padded`` name expert 0 and are never read) and ``num_tokens_padded [1] i32``. Static
    shapes, no host synchronisation."""
    T = ids.numel()
    flat = ids.reshape(-1).long()
    dev = flat.device
    order = torch.sort(flat, stable=True).indices
    e_sorted = flat.index_select(0, order)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    pad_end = torch.cumsum(padded, 0)
    rank = torch.arange(T, device=dev) - (torch.cumsum(counts, 0) - counts).index_select(0, e_sorted)
    dest = (pad_end - padded).index_select(0, e_sorted) + rank
    length = _round_up(min(T * block, T + num_experts * (block - 1)), block)
    sorted_ids = torch.full((length,), T, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, length, block, device=dev)
    expert_ids = torch.searchsorted(pad_end, starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, torch.zeros_like(expert_ids)).to(torch.int32)
    return {"sorted_ids": sorted_ids, "expert_ids": expert_ids, "num_tokens_padded": pad_end[-1:].to(torch.int32)}


class HummingExperts:
    """One LatentMoE layer's routed experts transformed for humming (see the module docstring); shared by every
    standard executor over the same module."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, bank: Any) -> None:
        from humming import dtypes
        from humming.schema import HummingWeightSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config

        w = bank.weights
        if w.fmt != "mxfp4":
            raise ValueError(f"standard_mxfp4_experts: the model's experts are {w.fmt}, not MXFP4")
        E = bank.num_experts
        dev = w.device
        # the bank's own [E, ...] stacks (packed, scale); compacted banks keep only fragments: rebuild them
        stacks = {n: list(getattr(w, n)) if not w.compacted else
                  [torch.stack(t) for t in zip(*(w.checkpoint(n, e) for e in range(E)), strict=True)]
                  for n in ("w1", "w3", "w2")}
        self.num_experts, self.inter, self.latent = E, stacks["w1"][0].shape[1], stacks["w1"][0].shape[2] * 2
        schema = HummingWeightSchema(b_dtype=dtypes.float4e2m1, bs_dtype=dtypes.float8e8m0,
                                     weight_scale_group_size=32)

        def prepare(packed: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
            cfg, t = prepare_and_transform_humming_tensors(
                {"weight": packed.contiguous().view(torch.int32),
                 "weight_scale": scale.contiguous().view(torch.float8_e8m0fnu)},
                shape_n=n, shape_k=k, weight_schema=schema, input_schema=None, num_experts=E,
                pad_n_to_multiple=PAD_N, pad_k_to_multiple=PAD_K, has_bias=False, torch_dtype=torch.bfloat16,
                device=dev)
            return cfg, t["weight"], t["weight_scale"]

        (p1, s1), (p3, s3), (p2, s2) = stacks["w1"], stacks["w3"], stacks["w2"]
        self.c13, self.w13, self.s13 = prepare(torch.cat([p1, p3], 1), torch.cat([s1, s3], 1), 2 * self.inter,
                                               self.latent)
        del stacks, p1, p3, s1, s3
        self.c2, self.w2, self.s2 = prepare(p2, s2, self.latent, self.inter)
        self.compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": GEMM_TYPE})
        self.tuning = {n: get_heuristics_config(c, gemm_type=GEMM_TYPE, device=dev)
                       for n, c in (("w13", self.c13), ("w2", self.c2))}
        self.tuning_str = {n: json.dumps(t) for n, t in self.tuning.items()}
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.locks = torch.zeros(sms * 8, dtype=torch.int32, device=dev)

    @classmethod
    def of(cls, bank: Any) -> HummingExperts:
        hit = cls._cache.get(bank.module)
        if hit is None:
            hit = cls._cache[bank.module] = cls(bank)
        return hit

    def block(self, name: str, rows: int) -> int:
        """The M block of the tuning interval holding ``rows`` pairs (vLLM's rule; 64 outside every interval)."""
        return next((c["block_shape"][0] for lo, hi, c in self.tuning[name] if lo < rows <= hi), 64)

    def gemm(self, name: str, x: torch.Tensor, index: dict[str, torch.Tensor], top_k: int, rows: int) -> torch.Tensor:
        from humming.forward import humming_forward

        cfg, w, s = (self.c13, self.w13, self.s13) if name == "w13" else (self.c2, self.w2, self.s2)
        return humming_forward(cfg, x.contiguous(), w, weight_scale=s, locks=self.locks, top_k=top_k,
                               valid_shape_m=rows, compute_config=self.compute, tuning_config=self.tuning_str[name],
                               **index)

