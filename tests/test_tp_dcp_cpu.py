"""Decode context parallelism on CPU (k3_fastpath/runtime/tp_dcp.py): TP2 + DCP2 equals the TP1 reference.

In FP64, ragged prefill + greedy decode with each MLA layer's latent cache split by token across the ranks
(position p on rank p % 2) gives every logit within 1e-10 of the plain ``K3ForCausalLM``; each rank's
cache holds ceil(L / 2) rows, exactly the reference's latents at its positions (half the memory). Two
ranks run in threads of this process (``_ThreadComm``: the ``Communicator`` collectives over a barrier),
and once over gloo in two processes. The merge is what makes it right: averaging the partials instead of
weighting them by their log-sum-exps fails. Fresh inputs per run (``seed``)."""

from __future__ import annotations

import threading

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime import tp as TP
from k3_fastpath.runtime import tp_comm as TPC
from k3_fastpath.runtime import tp_dcp
from k3_fastpath.synthetic import synthetic_state_dict

PRESET = "k3-tiny"
CFG = preset(PRESET).config


class _Group:
    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=120)


class _ThreadComm(TPC.Communicator):
    """One rank of ``_Group``: every collective exchanges through shared slots between two barriers."""

    name = "threads"

    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.group.barrier.wait()
        self.group.slots[self.rank] = t.clone()
        self.group.barrier.wait()
        parts = [s.clone() for s in self.group.slots]
        self.group.barrier.wait()
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=-1)


def _run_ranks(world: int, sd, ids, lengths, steps: int, dcp: bool, max_len: int):
    group = _Group(world)
    out: list[dict | BaseException | None] = [None] * world

    def work(rank: int) -> None:
        try:
            m = TP.build_tp_model(CFG, sd, _ThreadComm(group, rank), dtype=torch.float64, dcp=dcp)
            cache = m.new_cache(ids.shape[0], max_len)
            pre = m.prefill(ids, lengths, cache)
            tok = pre[torch.arange(ids.shape[0]), lengths - 1].argmax(-1)
            fed, dec = [], []
            for _ in range(steps):
                fed.append(tok.clone())
                logits = m.decode(tok, cache)
                dec.append(logits)
                tok = logits.argmax(-1)
            out[rank] = {"prefill": pre, "fed": fed, "decode": dec, "cache": cache}
        except BaseException as e:  # noqa: BLE001 - reported below
            group.barrier.abort()
            out[rank] = e

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


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
    ranks = _run_ranks(world, sd, ids, lengths, steps, dcp=True, max_len=max_len)
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
    ranks = _run_ranks(2, sd, ids, lengths, 3, dcp=True, max_len=11)
    err, _ = _check_against_reference(ranks[0], sd, ids, lengths, 3, 11, 1e-10)
    assert err > 1e-6, (seed, err)


def test_tp2_without_dcp_through_the_thread_comm_is_the_reference(seed):
    """The harness itself: the replicated-cache TP2 path through ``_ThreadComm`` matches as over gloo."""
    sd = synthetic_state_dict(CFG, seed % 997)
    ids, lengths = _inputs(seed)
    ranks = _run_ranks(2, sd, ids, lengths, 3, dcp=False, max_len=11)
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
