"""The LatentMoE front split across TP ranks on CPU (k3_fastpath/runtime/tp_moe_front.py): each rank reads its
rows of the router, the latent down and the latent up projection, the shares all-gathered.

FP64, ragged prefill + greedy decode, ranks in threads (tests/tp_tools.py) and once over gloo: every logit
within 1e-10 of the plain TP1 ``K3ForCausalLM``, all ranks identical, each rank's shards exactly its rows of
the full tensors (1/tp of them). Selection is the reference's on exact ties: two experts with identical router
rows and correction bias, on different ranks, are chosen lower index first as on one GPU. A split that
gathers the router shares in the wrong order (rank 1's experts first) misroutes and fails the same comparison.
Fresh inputs per run (``seed``)."""

from __future__ import annotations

import pytest
import torch
from tp_tools import rel, run_ranks

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime import tp as TP
from k3_fastpath.runtime import tp_moe_front
from k3_fastpath.runtime.tp_comm import LocalComm
from k3_fastpath.runtime.tp_launch import launch
from k3_fastpath.synthetic import synthetic_state_dict

PRESET = "k3-tiny"
CFG = preset(PRESET).config
MOE = [i for i in range(CFG.num_hidden_layers) if CFG.is_moe_layer(i)]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CFG.vocab_size, (3, 7), generator=g), torch.tensor([7, 4, 1])


def _worst_error(res: dict, sd: dict, ids, lengths, steps: int, max_len: int) -> float:
    ref = load_reference(CFG, sd, dtype=torch.float64)
    cache = ref.new_cache(ids.shape[0], max_len)
    errs = [rel(res["prefill"], ref.prefill(ids, lengths, cache))]
    for k in range(steps):
        errs.append(rel(res["decode"][k], ref.decode(res["fed"][k], cache)))
    return max(errs)


@pytest.mark.parametrize("world", [2, 4])
def test_split_front_equals_the_tp1_reference_and_reads_only_its_rows(seed, world):
    sd = synthetic_state_dict(CFG, seed % 997)
    ids, lengths = _inputs(seed)
    ranks = run_ranks(CFG, world, sd, ids, lengths, 4, 12, moe_front="split")
    err = _worst_error(ranks[0], sd, ids, lengths, 4, 12)
    assert err < 1e-10, (seed, world, err)
    for r in ranks[1:]:
        assert torch.equal(r["prefill"], ranks[0]["prefill"])
    for rank, r in enumerate(ranks):
        for i in MOE:
            shard, p = r["model"].fronts[i], f"model.layers.{i}.block_sparse_moe."
            for got, name in ((shard.router, "gate.weight"), (shard.down, "routed_expert_down_proj.weight"),
                              (shard.up, "routed_expert_up_proj.weight")):
                full = sd[p + name]
                n = full.shape[0] // world
                assert torch.equal(got, full[rank * n:(rank + 1) * n].to(got.dtype)), (rank, i, name)


def test_an_exact_tie_across_ranks_goes_to_the_lower_expert(seed):
    """In every MoE layer experts 1 (rank 0) and 9 (rank 1 of 2) get identical router rows and correction bias,
    and three others a bias that always selects them: the last of the 4 slots is the tie, which the replicated
    router gives to expert 1 (stable sort, lower index first). The split run equals TP1, so it chose expert 1
    too (experts 1 and 9 have different weights: choosing 9 would move the logits)."""
    sd = synthetic_state_dict(CFG, seed % 997)
    half = CFG.num_experts // 2
    assert CFG.num_experts_per_token == 4
    for i in MOE:
        p = f"model.layers.{i}.block_sparse_moe.gate."
        sd[p + "weight"][1 + half] = sd[p + "weight"][1]
        bias = torch.zeros(CFG.num_experts)
        bias[[0, 2, 3]] = 10.0
        bias[[1, 1 + half]] = 5.0
        sd[p + "e_score_correction_bias"] = bias
    ids, lengths = _inputs(seed)
    ranks = run_ranks(CFG, 2, sd, ids, lengths, 3, 11, moe_front="split")
    assert _worst_error(ranks[0], sd, ids, lengths, 3, 11) < 1e-10


def test_gathering_the_router_shares_out_of_order_fails(seed, monkeypatch):
    real = tp_moe_front.FrontShard.route_and_down

    def swapped(self, moe, x, comm):
        class Reversed:
            def __getattr__(self, name):
                return getattr(comm, name)

            def all_gather_last(self, t):
                g = comm.all_gather_last(t)
                return torch.cat(g.chunk(comm.world, dim=-1)[::-1], dim=-1) if g.shape[-1] == CFG.num_experts else g

        return real(self, moe, x, Reversed())

    monkeypatch.setattr(tp_moe_front.FrontShard, "route_and_down", swapped)
    sd = synthetic_state_dict(CFG, seed % 997)
    ids, lengths = _inputs(seed)
    ranks = run_ranks(CFG, 2, sd, ids, lengths, 3, 11, moe_front="split")
    assert _worst_error(ranks[0], sd, ids, lengths, 3, 11) > 1e-3


def test_split_front_over_gloo_equals_tp1(seed):
    s = seed % 997
    r0, r1 = launch(TP.equivalence_worker, 2, (PRESET, s, 3, 6, 3, "float64", "unfused", False, "split"),
                    backend="gloo", timeout_s=240)
    assert torch.equal(r0["decode"], r1["decode"])
    ref = load_reference(CFG, synthetic_state_dict(CFG, s), dtype=torch.float64)
    cache = ref.new_cache(3, 10)
    assert rel(r0["prefill"], ref.prefill(r0["ids"], r0["lengths"], cache)) < 1e-10
    for k in range(3):
        assert rel(r0["decode"][k], ref.decode(r0["fed"][k], cache)) < 1e-10


def test_a_front_that_does_not_divide_is_refused():
    sd = synthetic_state_dict(CFG, 1)
    model = TP.rank_model(CFG, sd, 1, 0, dtype=torch.float32)
    moe = model.model.layers[MOE[0]].block_sparse_moe
    with pytest.raises(ValueError, match="the router \\(num_experts\\) has 16 rows, not divisible by tp 3"):
        tp_moe_front.FrontShard.of(moe, 3, 0)
    with pytest.raises(ValueError, match="moe_front must be one of replicated, split"):
        TP.TPModel(CFG, model, LocalComm(), moe_front="sharded")
