"""Decode context parallelism on CPU (k3_fastpath/runtime/tp_dcp.py): TP2 + DCP2 equals the TP1 reference.

In FP64, ragged prefill + greedy decode with each MLA layer's latent cache split by token across the ranks
(position p on rank p % 2) gives every logit within 1e-10 of the plain ``K3ForCausalLM``; each rank's
cache holds ceil(L / 2) rows, exactly the reference's latents at its positions (half the memory). Two
ranks run in threads of this process (``tp_tools.ThreadComm``: the ``Communicator`` collectives over a barrier),
and once over gloo in two processes. The merge is what makes it right: averaging the partials instead of
weighting them by their log-sum-exps fails. Fresh inputs per run (``seed``)."""

from __future__ import annotations

import pytest
import torch
from tp_tools import rel as _rel
from tp_tools import run_ranks

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime import tp as TP
from k3_fastpath.runtime import tp_dcp
from k3_fastpath.synthetic import synthetic_state_dict

PRESET = "k3-tiny"
CFG = preset(PRESET).config


def _inputs(seed: int, batch: int = 3, prompt_len: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size, (batch, prompt_len), generator=g)
    lengths = torch.tensor([prompt_len, 4, 1])[:batch]
    return ids, lengths


def _check_against_reference(res, sd, ids, lengths, steps, max_len, tol):
    ref = load_reference(CFG, sd, dtype=torch.float64)
    cache = ref.new_cache(ids.shape[0], max_len)
    want = ref.prefill(ids, lengths, cache)
    errs = [_rel(res["prefill"], want)]
    for k in range(steps):
        errs.append(_rel(res["decode"][k], ref.decode(res["fed"][k], cache)))
    return max(errs), cache


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_equals_the_tp1_reference_and_each_rank_holds_its_token_share(seed, world):
    sd = synthetic_state_dict(CFG, seed % 997)
    ids, lengths = _inputs(seed)
    steps, max_len = 5, 13
    ranks = run_ranks(CFG, world, sd, ids, lengths, steps, max_len, dcp=True)
    err, ref_cache = _check_against_reference(ranks[0], sd, ids, lengths, steps, max_len, 1e-10)
    assert err < 1e-10, (seed, world, err)
    for r in ranks[1:]:
        assert torch.equal(r["prefill"], ranks[0]["prefill"]) and all(
            torch.equal(a, b) for a, b in zip(r["decode"], ranks[0]["decode"], strict=True))
    rows = tp_dcp.local_rows(max_len, world)
    mla = [i for i in range(CFG.num_hidden_layers) if not CFG.is_kda_layer(i)]
    for rank, r in enumerate(ranks):
        for i in mla:
            local, full = r["cache"].layers[i].latent, ref_cache.layers[i].latent
            assert local.shape[1] == rows  # 1/world of the positions
            for b, n in enumerate(ref_cache.lengths.tolist()):
                mine = torch.arange(rank, n, world)
                assert torch.allclose(local[b, mine // world], full[b, mine], rtol=1e-12, atol=1e-12)


def test_averaging_the_partials_instead_of_weighting_by_lse_fails(seed, monkeypatch):
    def plain_mean(o_parts, lse_parts, *args, **kwargs):
        has = torch.isfinite(lse_parts).unsqueeze(-1).to(o_parts.dtype)
        return (o_parts * has).sum(0) / has.sum(0).clamp_min(1), None

    monkeypatch.setattr(tp_dcp, "mla_merge_ref", plain_mean)
    sd = synthetic_state_dict(CFG, seed % 997)
    ids, lengths = _inputs(seed)
    ranks = run_ranks(CFG, 2, sd, ids, lengths, 3, 11, dcp=True)
    err, _ = _check_against_reference(ranks[0], sd, ids, lengths, 3, 11, 1e-10)
    assert err > 1e-6, (seed, err)


def test_tp2_without_dcp_through_the_thread_comm_is_the_reference(seed):
    """The harness itself: the replicated-cache TP2 path through ``tp_tools.ThreadComm`` matches as over gloo."""
    sd = synthetic_state_dict(CFG, seed % 997)
    ids, lengths = _inputs(seed)
    ranks = run_ranks(CFG, 2, sd, ids, lengths, 3, 11, dcp=False)
    err, _ = _check_against_reference(ranks[0], sd, ids, lengths, 3, 11, 1e-10)
    first_mla = next(i for i in range(CFG.num_hidden_layers) if not CFG.is_kda_layer(i))
    assert err < 1e-10 and ranks[0]["cache"].layers[first_mla].latent.shape[1] == 11


@pytest.mark.slow  # two spawned processes each import torch
def test_dcp2_over_gloo_equals_tp1_in_fp64(seed):
    from k3_fastpath.runtime.tp_launch import launch

    s = seed % 997
    batch, prompt_len, steps = 3, 6, 3
    r0, r1 = launch(TP.equivalence_worker, 2, (PRESET, s, batch, prompt_len, steps, "float64", "unfused", True),
                    backend="gloo", timeout_s=240)
    assert torch.equal(r0["decode"], r1["decode"])
    ref = load_reference(CFG, synthetic_state_dict(CFG, s), dtype=torch.float64)
    cache = ref.new_cache(batch, prompt_len + steps + 1)
    assert _rel(r0["prefill"], ref.prefill(r0["ids"], r0["lengths"], cache)) < 1e-10
    for k in range(steps):
        assert _rel(r0["decode"][k], ref.decode(r0["fed"][k], cache)) < 1e-10, (s, k)
    rows = tp_dcp.local_rows(prompt_len + steps + 1, 2)
    assert all(lat.shape[1] == rows for lat in r0["mla_latents"] + r1["mla_latents"])
