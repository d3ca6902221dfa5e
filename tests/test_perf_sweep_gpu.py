"""GPU tests of the decode sweep's pieces and the TP2 fused all-reduce (marked gpu; TP2 needs two GPUs).

* the Triton epilogue (all-reduce tail: residual add + AttnRes mix + RMSNorm) on the GPU against
  ``tp_comm.epilogue_reference`` at K3's hidden size, every source count the model reaches, BF16 rounding bounds;
* one sweep point on k3-tiny: both backends measured on one cache, the fast one by CUDA-graph replay, the
  floor and the records' keys;
* TP2 over NCCL (two GPUs): the symmetric-memory one-shot all-reduce equals NCCL's bitwise on BF16 and FP32,
  the fused op matches the unfused one to BF16 rounding, and a TP2 k3-tiny model equals TP1 in FP32.
"""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.runtime import tp as TP
from k3_fastpath.runtime import tp_comm as TPC

pytestmark = pytest.mark.gpu
KEYS = ("batch", "context", "tp", "backend", "routing", "step_us_median", "step_us_p10", "step_us_p90", "floor_us",
        "pct_of_floor", "tokens_per_s_user", "tokens_per_s_gpu")


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(reason=f"needs 2 GPUs, {torch.cuda.device_count()} visible")


def test_fused_epilogue_on_gpu_matches_the_reference(seed):
    from k3_fastpath.runtime.tp_allreduce import fused_epilogue

    g = torch.Generator(device="cuda").manual_seed(seed)
    h = 7168
    for rows in (1, 8, 64):
        for nb in (0, 1, 8):
            def rnd(*shape, scale=1.0):
                return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

            red, pre, add, blocks = rnd(rows, h), rnd(rows, h), rnd(rows, h), rnd(nb, rows, h)
            pw, nw, ow = rnd(1, h, scale=0.02), 1 + rnd(h, scale=0.1), 1 + rnd(h, scale=0.1)
            new_out = torch.full_like(red, float("nan"))
            normed_out = torch.full_like(red, float("nan"))
            got = fused_epilogue(red, pre, blocks, pw, nw, ow, 1e-5, add, new_out=new_out, normed_out=normed_out)
            want = TPC.epilogue_reference(red, pre, blocks, pw, nw, ow, 1e-5, add)
            assert torch.equal(got[0], want[0]), (seed, rows, nb)  # the same two BF16 roundings
            ref64 = TPC.epilogue_reference(*(t.double() for t in (red, pre)), blocks.double(), pw.double(),
                                          nw.double(), ow.double(), 1e-5, add.double())[1]
            err_fused = (got[1].double() - ref64).abs().max()
            err_torch = (want[1].double() - ref64).abs().max()
            assert err_fused <= 2 * err_torch + 1e-2, (seed, rows, nb, float(err_fused), float(err_torch))


def test_one_sweep_point_on_k3_tiny(seed):
    from k3_fastpath.measure.device_synthetic import device_model
    from k3_fastpath.presets import preset
    from k3_fastpath.runtime.executor import DecodeExecutor
    from verify.checks import perf_sweep as S

    cfg = preset("k3-tiny").config
    model = device_model(cfg, seed % 1000, "cuda")
    fast = DecodeExecutor(model, backend="latency_specialized", max_batch=8, max_len=512)
    std = DecodeExecutor(model, backend="standard", max_batch=8, max_len=512)
    strong = DecodeExecutor(model, backend="standard_graph", max_batch=8, max_len=512, pool_from=fast)
    rows = S.run_point(model, fast, std, 4, 256, "real", bw=4.3e12, iters=5, standard_iters=3, warmup=1, seed=seed,
                       strong=strong)
    assert [r["backend"] for r in rows] == ["fast", "standard", "reference"]
    for r in rows:
        assert all(k in r for k in KEYS), sorted(set(KEYS) - set(r))
        assert r["step_us_p10"] <= r["step_us_median"] <= r["step_us_p90"] and r["floor_us"] > 0
        assert len(r["touched_measured"]) == 7 and all(4 <= t <= 16 for t in r["touched_measured"])
    assert rows[0]["timer"] == rows[1]["timer"] == "cuda_graph_replay", rows[0].get("fallback")
    for r in rows[:2]:  # section graphs: every layer type of the model, each with its % of floor
        assert set(r["per_layer_type_us"]) == {"head", "kda", "mla", "moe", "dense_mlp"}, r.get("per_layer_type_reason")
        assert set(r["pct_of_floor_by_layer_type"]) >= {"kda", "mla", "moe", "dense_mlp"}
        assert 0.5 < r["sections_total_us"] / r["sections_step_graph_us"] < 5
    assert set(rows[2]["per_layer_type_us"]) >= {"kda", "mla", "moe", "dense_mlp", "other"}


def _tp_standard_worker(rank: int, world: int, seed: int) -> dict:
    """The TP standard path (library ops, NCCL all-reduces) captured in a CUDA graph vs the same eagerly."""
    from k3_fastpath.measure.device_synthetic import device_model
    from k3_fastpath.presets import preset
    from k3_fastpath.runtime.tp_comm import TorchComm
    from k3_fastpath.runtime.tp_fast import TPFastDecoder

    cfg = preset("k3-tiny").config
    model = device_model(cfg, seed, "cuda", tp=world, rank=rank, conditioning="stable")
    comm = TorchComm()
    out = {}
    for graphs in (False, True):
        dec = TPFastDecoder(cfg, model, comm, max_batch=4, max_len=16, backend="standard_graph", use_graphs=graphs)
        cache = dec.new_cache(3)
        g = torch.Generator().manual_seed(seed)
        toks = torch.randint(3, cfg.vocab_size, (4, 3), generator=g).cuda()
        out[graphs] = torch.stack([dec.decode(t, cache) for t in toks]).cpu()
        out["ops"] = dec.last_calls.standard_ops() if dec.last_calls is not None else None
    return out


def test_tp2_standard_path_graph_is_eager(seed):
    _two_gpus()
    from k3_fastpath.runtime.tp_launch import launch

    r0, r1 = launch(_tp_standard_worker, 2, (seed % 1000,), backend="nccl", timeout_s=300)
    assert torch.isfinite(r0[False]).all() and torch.isfinite(r0[True]).all()
    assert torch.equal(r0[True], r1[True])  # every rank gathers the same logits
    # graph == eager up to the order of index_add_'s FP32 atomics in the standard experts' combine
    rel = float((r0[True] - r0[False]).double().norm() / r0[False].double().norm())
    assert rel < 1e-2, rel
    assert {"linear", "moe_experts", "kda_step", "mla_attention"} <= {o["op"] for o in r0["ops"]}


def _allreduce_worker(rank: int, world: int, seed: int) -> dict:
    from k3_fastpath.runtime.tp_allreduce import SymmMemComm
    from k3_fastpath.runtime.tp_comm import TorchComm

    fused, plain = SymmMemComm(), TorchComm()
    g = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)  # different partials per rank
    out = {}
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 7168, generator=g, device="cuda").to(dt)
        out[str(dt)] = (fused.all_reduce(x.clone()).cpu(), plain.all_reduce(x.clone()).cpu())
    gs = torch.Generator(device="cuda").manual_seed(seed)  # the same prefix / blocks / weights on every rank
    prefix, blocks = (torch.randn(8, 7168, generator=gs, device="cuda").bfloat16(),
                      torch.randn(3, 8, 7168, generator=gs, device="cuda").bfloat16())
    w = [(1 + 0.1 * torch.randn(7168, generator=gs, device="cuda")).bfloat16() for _ in range(3)]
    part = torch.randn(8, 7168, generator=g, device="cuda").bfloat16()
    a = fused.reduce_add_mix_norm(part.clone(), prefix, blocks, w[0] * 0.02, w[1], w[2], 1e-5)
    b = plain.reduce_add_mix_norm(part.clone(), prefix, blocks, w[0] * 0.02, w[1], w[2], 1e-5)
    out["epilogue"] = (tuple(t.cpu() for t in a), tuple(t.cpu() for t in b))
    return out


def test_tp2_symm_mem_allreduce_and_fused_epilogue(seed):
    _two_gpus()
    from k3_fastpath.runtime.tp_launch import launch

    r0, r1 = launch(_allreduce_worker, 2, (seed % 1000,), backend="nccl", timeout_s=300)
    for key in ("torch.bfloat16", "torch.float32"):
        assert torch.equal(r0[key][0], r0[key][1]), key  # one-shot sum == NCCL sum (2 ranks: one rounding)
        assert torch.equal(r0[key][0], r1[key][0]), key  # every rank holds the same sum
    (fa, fb), (ua, ub) = r0["epilogue"]
    assert torch.equal(fa, ua)
    assert float(((fb.float() - ub.float()).abs() / ub.float().abs().clamp_min(1)).max()) <= 2.0**-6


def test_tp2_model_equals_tp1_on_gpu(seed):
    _two_gpus()
    from k3_fastpath.presets import preset
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.runtime.tp_launch import launch
    from k3_fastpath.synthetic import synthetic_state_dict

    cfg = preset("k3-tiny").config
    s = seed % 997
    for comm in ("unfused", "fused"):
        r0, _ = launch(TP.equivalence_worker, 2, ("k3-tiny", s, 3, 6, 3, "float32", comm), backend="nccl",
                       timeout_s=300)
        ref = load_reference(cfg, synthetic_state_dict(cfg, s), dtype=torch.float32)
        cache = ref.new_cache(3, 10)
        want = ref.prefill(r0["ids"], r0["lengths"], cache)
        scale = want.abs().max()
        assert float((r0["prefill"] - want).abs().max() / scale) < 1e-4, comm
        for k in range(3):
            want = ref.decode(r0["fed"][k], cache)
            assert float((r0["decode"][k] - want).abs().max() / want.abs().max()) < 1e-4, (comm, k)
