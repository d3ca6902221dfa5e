"""Slot-indexed cache pools of the fast decode executor, and the ``K3Cache`` views handed to callers.

CUDA graphs bake tensor addresses in, so every sequence's decode state must live in memory the executor
allocated before capture. ``CachePool`` holds, per layer, one pool of ``slots`` sequences: KDA conv state
``[N, W-1, C]`` (model dtype) and recurrent state ``[N, h, D, D]`` (FP32), MLA latents ``[N, Lp, rank +
rope]`` (model dtype or FP8 with a per-tensor scale fixed at creation), ``Lp`` = ``max_len`` rounded up to a
multiple of 64 (``MLA_PAGE``): the pool is then a paged cache of 64-position pages, the layout
``kernels/mla_decode`` takes (a slot's page p is page ``slot * Lp / 64 + p``); positions past ``max_len``
are never handed out. Slot 0 is the empty slot: the
``kda_decode`` kernel leaves it untouched and gives its rows output 0; the step sends padded and inactive
rows there (their MLA latent writes land in slot 0's scratch row, never in a sequence's).

The KDA pools of all layers are views of four stacked tensors (``kda_stacks``: conv q / k / v ``[L, N + S,
W-1, C]``, state ``[L, N + S, h, D, D]``), where ``S = scratch`` extra slots past the sequences' ones hold
the per-token states of a speculative verify step (``kernels/kda_decode`` with ``slot_out``; verify row r
keeps its state at ``scratch_base + r``); ``commit_scratch`` copies the accepted ones back into the
sequences' slots for every layer at once (one gather / scatter per stacked tensor).

``allocate(batch, max_len)`` returns a ``PooledCache``: a ``K3Cache`` whose per-layer caches are views of
the contiguous slot range ``[first, first + batch)``, so the reference model's ``prefill`` / ``decode`` run
on it unchanged (the standard path writes through the views into the pools). The range goes back to the
pool when the cache is garbage-collected or released explicitly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..reference.kda import KDACache
from ..reference.mla import FP8, MLACache
from ..reference.model import K3Cache


@dataclass
class PooledCache(K3Cache):
    """A ``K3Cache`` living in an executor's pool. ``slots`` [B] int32 (device): the pool slot of each
    sequence; ``length_bound``: a host-side upper bound of ``max(lengths)`` (so a step can check its
    context without reading the GPU)."""

    first_slot: int = 1
    slots: torch.Tensor | None = None
    length_bound: int = 0
    pool_id: int = 0
    _finalizer: Any = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Give the slots back now (the cache must not be used afterwards)."""
        if self._finalizer is not None:
            self._finalizer()

    def select(self, rows: torch.Tensor, lengths: torch.Tensor, length_bound: int) -> PooledCache:
        """A cache over this cache's sequences ``rows`` (device long, distinct, any order) holding ``lengths``
        tokens, for one decode step of the executor (which reads only ``slots`` / ``lengths``; ``layers`` stay
        this cache's views). It borrows this cache's slots: valid while this cache is, never released itself."""
        return PooledCache(layers=list(self.layers), lengths=lengths.clone(), max_len=self.max_len,
                           first_slot=self.first_slot, slots=self.slots.index_select(0, rows),
                           length_bound=int(length_bound), pool_id=self.pool_id, _finalizer=self._finalizer)


MLA_PAGE = 64  # kernels/mla_decode's page size (api.PAGE_SIZE): MLA pool lengths are multiples of it


class CachePool:
    """Every layer's decode state for ``slots`` sequences (slot 0 included, never allocated), plus ``scratch``
    KDA slots for verify steps (module docstring)."""

    def __init__(self, cfg: Any, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: torch.dtype | None = None, kv_scale: float | None = None, scratch: int = 0) -> None:
        if slots < 2:
            raise ValueError(f"a cache pool needs at least 2 slots (slot 0 is the empty one), got {slots}")
        if scratch < 0:
            raise ValueError(f"scratch slots must be >= 0, got {scratch}")
        self.cfg = cfg
        self.slots = slots
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.scratch = scratch
        self.scratch_base = slots  # KDA slots [slots, slots + scratch): verify rows' per-token states
        n_kda = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i))
        one = KDACache.empty(cfg, 1, device="meta", conv_dtype=dtype, state_dtype=state_dtype)
        self.kda_stacks = tuple(torch.zeros(n_kda, slots + scratch, *t.shape[1:], dtype=t.dtype, device=self.device)
                                for t in one.tensors())
        self.layers: list[KDACache | MLACache] = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda_layer(i):
                n = sum(1 for c in self.layers if isinstance(c, KDACache))
                self.layers.append(KDACache(*(t[n] for t in self.kda_stacks)))
            else:
                self.layers.append(MLACache.empty(cfg, slots, self.latent_length(max_len), self.kv_dtype,
                                                  self.device, scale=kv_scale))
        self._free: list[tuple[int, int]] = [(1, slots)]  # half-open free ranges, sorted
        self.id = id(self)

    @staticmethod
    def latent_length(max_len: int) -> int:
        """Positions per slot of the MLA latent pools: ``max_len`` rounded up to a multiple of ``MLA_PAGE``."""
        return -(-int(max_len) // MLA_PAGE) * MLA_PAGE

    # ------------------------------------------------------------------ slots
    @property
    def free_slots(self) -> int:
        return sum(b - a for a, b in self._free)

    def _take(self, n: int) -> int:
        for i, (a, b) in enumerate(self._free):
            if b - a >= n:
                self._free[i:i + 1] = [(a + n, b)] if b - a > n else []
                return a
        raise RuntimeError(f"cache pool has no {n} contiguous free slots ({self.free_slots} free of "
                           f"{self.slots - 1}); release caches or build the executor with a larger max_batch")

    def _give(self, first: int, n: int) -> None:
        ranges = sorted(self._free + [(first, first + n)])
        merged: list[tuple[int, int]] = []
        for a, b in ranges:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self._free = merged

    def allocate(self, batch: int, max_len: int | None = None) -> PooledCache:
        """Empty caches for ``batch`` sequences of up to ``max_len`` (<= the pool's) tokens."""
        max_len = self.max_len if max_len is None else int(max_len)
        if not 1 <= max_len <= self.max_len:
            raise ValueError(f"max_len {max_len} outside 1..{self.max_len} (the executor's max_len)")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        first = self._take(batch)
        sl = slice(first, first + batch)
        layers: list[KDACache | MLACache] = []
        for pool in self.layers:
            if isinstance(pool, KDACache):
                view = KDACache(*(t[sl] for t in pool.tensors()))
                for t in view.tensors():
                    t.zero_()
            else:
                view = MLACache(latent=pool.latent[sl, :max_len], scale=pool.scale)
                view.latent.zero_()
            layers.append(view)
        slots = torch.arange(first, first + batch, dtype=torch.int32, device=self.device)
        cache = PooledCache(layers=layers, lengths=torch.zeros(batch, dtype=torch.long, device=self.device),
                            max_len=max_len, first_slot=first, slots=slots, length_bound=0, pool_id=self.id)
        cache._finalizer = weakref.finalize(cache, self._give, first, batch)
        return cache

    def commit_scratch(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Every KDA layer's slots ``dst`` (device int) <- its scratch slots ``src`` (the states a verify step
        kept after each sequence's accepted tokens)."""
        for t in self.kda_stacks:
            t.index_copy_(1, dst.long(), t.index_select(1, src.long()))

    def owns(self, cache: Any) -> bool:
        return isinstance(cache, PooledCache) and cache.pool_id == self.id and cache._finalizer is not None \
            and cache._finalizer.alive


def copy_cache(dst: K3Cache, src: K3Cache) -> K3Cache:
    """Overwrite ``dst`` (any ``K3Cache``, pooled or not) with ``src``'s state: lengths, KDA conv/recurrent
    state, MLA latents (positions ``[0, min(max_len))``; FP8 scales must agree). Same batch and config."""
    if dst.batch != src.batch or len(dst.layers) != len(src.layers):
        raise ValueError(f"cache shapes differ: batch {dst.batch} vs {src.batch}, {len(dst.layers)} vs "
                         f"{len(src.layers)} layers")
    for d, s in zip(dst.layers, src.layers, strict=True):
        if isinstance(d, KDACache):
            d.copy_(s)
            continue
        n = min(d.max_len, s.max_len)
        if d.latent.dtype == s.latent.dtype and (d.latent.dtype != FP8 or torch.equal(d.scale.cpu(), s.scale.cpu())):
            d.latent[:, :n].copy_(s.latent[:, :n])
        else:  # re-encode through the model dtype (an FP8 <-> BF16 copy rounds, like a cache write)
            d.latent[:, :n].copy_(d.encode(s.read(n, torch.float32)))
    dst.lengths = src.lengths.to(dst.lengths.device).clone()
    if isinstance(dst, PooledCache):
        dst.length_bound = int(src.lengths.max()) if src.batch else 0
    return dst
