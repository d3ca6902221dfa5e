"""The MXFP4 standard experts' CPU-side parts (``runtime/standard_mxfp4.py``): the indexed GEMM's row map
(``align``) checked against its contract on random routings, the padded byte count, and the option refused
with its reason where humming cannot run (a CPU), never served by the BF16 experts instead."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.runtime.options import DecodeOptions, resolve
from k3_fastpath.runtime.standard_mxfp4 import align, humming_expert_bytes


@pytest.mark.parametrize("M, k, E, block", [(1, 16, 896, 16), (8, 16, 128, 16), (64, 16, 128, 64), (5, 4, 16, 8),
                                            (64, 16, 8, 64)])
def test_align_groups_every_pair_once_by_expert_in_padded_blocks(M, k, E, block, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]) if E >= k else \
        torch.randint(0, E, (M, k), generator=g)
    a = align(ids, E, block)
    T = M * k
    sid, eid, n = a["sorted_ids"], a["expert_ids"], int(a["num_tokens_padded"])
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    assert n == int(((counts + block - 1) // block * block).sum()), f"seed {seed}"
    assert sid.dtype == eid.dtype == torch.int32 and sid.numel() % block == 0 and eid.numel() == sid.numel() // block
    assert n <= sid.numel()
    used = sid[:n]
    real = used[used < T]
    assert sorted(real.tolist()) == list(range(T)), f"seed {seed}: every pair exactly once"
    assert (sid[n:] == T).all() and (used >= 0).all() and (used <= T).all()
    for b in range(n // block):
        rows = sid[b * block:(b + 1) * block]
        rows = rows[rows < T].long()
        assert rows.numel() > 0, f"seed {seed}: block {b} holds no pair"
        assert (flat[rows] == eid[b]).all(), f"seed {seed}: block {b} mixes experts"
        assert torch.equal(rows, rows.sort().values), "pairs of one expert in pair order"


def test_align_fails_on_a_wrong_map():
    """The contract test above can fail: one pair moved to another expert's block is caught."""
    ids = torch.tensor([[0, 1], [1, 2]])
    a = align(ids, 3, 2)
    sid = a["sorted_ids"].clone()
    flat = ids.reshape(-1)
    i, j = 0, 2  # expert 0's block and expert 1's first block: swap their first rows
    sid[i], sid[j] = sid[j].clone(), sid[i].clone()
    block0 = sid[:2][sid[:2] < 4].long()
    assert not (flat[block0] == a["expert_ids"][0]).all()


def test_humming_bytes_pad_a_tp16_slice():
    E, I, L = 896, 192, 3584
    raw = E * (2 * I * L + L * I) * (1 / 2 + 1 / 32)
    got = humming_expert_bytes(E, I, L)
    w13 = E * 512 * 3584 * (1 / 2 + 1 / 32)  # 2I = 384 -> 512
    w2 = E * 3584 * 256 * (1 / 2 + 1 / 32)  # K = 192 -> 256
    assert got == int(w13 + w2) and got > raw


def test_the_option_is_refused_on_a_cpu_with_its_reason():
    from k3_fastpath.presets import preset
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.synthetic import synthetic_state_dict

    cfg = preset("k3-tiny").config
    model = load_reference(cfg, synthetic_state_dict(cfg, 0), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^decode option standard_mxfp4_experts: humming-kernels needs a CUDA "
                                         r"device, got cpu$"):
        DecodeExecutor(model, backend="standard_graph", max_len=32, max_batch=2,
                       options=DecodeOptions(pdl=False, standard_mxfp4_experts=True))
    with pytest.raises(ValueError, match="cannot honour decode option.*standard_mxfp4_experts=True"):
        resolve(DecodeOptions(standard_mxfp4_experts=True), "latency_specialized")
