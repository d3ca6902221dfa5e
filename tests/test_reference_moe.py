"""LatentMoE reference (k3_fastpath.reference.moe): router, SiTU-GLU, expert formats, the whole block.

Contracts:
* ``route`` selects exactly what a sort-free oracle (repeated arg-max, lowest index on equal keys) selects;
  exact ties go to the lower expert index, a 1-ulp lead wins regardless of index; weights are the
  UNBIASED sigmoid scores, renormalised to sum 1, times the routed scaling factor;
* the block matches a per-token FP64 oracle to 1e-10; the MXFP4 expert path equals the BF16 path on the
  dequantized weights bit for bit; only the experts some token routes to are dequantized, each once.
Fresh random inputs each run; the seed is printed.
"""

from __future__ import annotations

import math
import secrets

import pytest
import torch

import k3_fastpath.mxfp4 as mxfp4
from k3_fastpath.manifest import tensor_specs
from k3_fastpath.presets import preset
from k3_fastpath.reference.common import situ_glu
from k3_fastpath.reference.moe import LatentMoE, dense_mlp, route
from k3_fastpath.synthetic import synthetic_tensor

CFG = preset("k3-tiny").config
LAYER = 1
PFX = f"model.layers.{LAYER}.block_sparse_moe."
MLP_PFX = "model.layers.0.mlp."


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """Synthetic tensors of the two layers used here (one thread: the small quantize ops contend otherwise)."""
    seed = secrets.randbits(31)
    print(f"weights seed={seed}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {s.name: synthetic_tensor(CFG, s, seed) for s in tensor_specs(CFG)
                if s.name.startswith((PFX, MLP_PFX))}
    finally:
        torch.set_num_threads(threads)


def _block(weights, cfg=CFG, dtype=torch.float64) -> LatentMoE:
    m = LatentMoE(cfg, torch.bfloat16)
    sd = {k[len(PFX):]: v for k, v in weights.items() if k.startswith(PFX)}
    if cfg.expert_format == "bf16":  # same model, experts stored dequantized
        for e in range(cfg.num_experts):
            for w in ("w1", "w2", "w3"):
                base = f"experts.{e}.{w}."
                sd[base + "weight"] = mxfp4.dequantize(sd.pop(base + "weight_packed"), sd.pop(base + "weight_scale"),
                                                       torch.bfloat16)
    m.load_state_dict(sd, strict=True)
    return m.to(dtype)


def _oracle_route(sel: torch.Tensor, k: int) -> list[list[int]]:
    """Sort-free: k times, the largest remaining key, the lowest index among equal keys."""
    out = []
    for row in sel.tolist():
        chosen: list[int] = []
        for _ in range(k):
            best = None
            for e, v in enumerate(row):
                if e in chosen:
                    continue
                if best is None or v > row[best]:  # strict: an equal later index never replaces
                    best = e
            chosen.append(best)
        out.append(chosen)
    return out


def test_route_matches_sort_free_oracle(gen):
    n, e, h, k = 64, 32, 24, 6
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(e, h, generator=gen).bfloat16()
    bias = torch.randn(e, generator=gen) * 0.05
    ids, wts = route(x.bfloat16(), w, bias, k, True, 1.0)
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32 and ids.shape == (n, k)
    scores = torch.sigmoid(x.bfloat16().float() @ w.float().T)
    assert ids.tolist() == _oracle_route(scores + bias, k)
    expect = scores.gather(1, ids)
    torch.testing.assert_close(wts, expect / expect.sum(1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_route_exact_ties_lowest_index(gen):
    """Zero router weights give every logit 0 (score 0.5): the selection key is 0.5 + bias, exact ties when
    biases repeat. Biases from a 3-value set make ties straddle the top-k boundary in most rows."""
    n, e, k = 200, 16, 4
    levels = torch.tensor([0.0, 0.125, 0.25])
    bias = levels[torch.randint(0, 3, (n, e), generator=gen)]
    for r in range(n):
        ids, wts = route(torch.randn(1, 8, generator=gen), torch.zeros(e, 8), bias[r], k, True, 1.0)
        assert ids[0].tolist() == _oracle_route((0.5 + bias[r]).unsqueeze(0), k)[0]
        torch.testing.assert_close(wts, torch.full((1, k), 1.0 / k))  # unbiased scores: all 0.5
    b = torch.zeros(e)
    b[[3, 5, 9, 12]] = 0.25
    ids, _ = route(torch.randn(1, 8, generator=gen), torch.zeros(e, 8), b, 2, True, 1.0)
    assert ids.tolist() == [[3, 5]]


def test_route_near_ties_one_ulp_wins(gen):
    e, k = 16, 3
    for _ in range(20):
        perm = torch.randperm(e, generator=gen)
        lo, hi = int(perm[0]), int(perm[1])
        if lo < hi:
            lo, hi = hi, lo  # lo: the HIGHER index gets the 1-ulp lead
        base = torch.full((e,), -0.5)
        base[[lo, hi]] = 0.25
        # one ulp of the KEY (0.5 + 0.75 = 0.75 + 2^-24 in FP32), not of the bias
        base[lo] = torch.nextafter(torch.tensor(0.75), torch.tensor(1.0)) - 0.5
        ids, _ = route(torch.randn(1, 8, generator=gen), torch.zeros(e, 8), base, 1, True, 1.0)
        assert ids.tolist() == [[lo]]
        ids, _ = route(torch.randn(1, 8, generator=gen), torch.zeros(e, 8), base, k, True, 1.0)
        assert ids[0, :2].tolist() == [lo, hi]


def test_route_weights_unbiased_renormalised_scaled(gen):
    n, e, h, k = 16, 24, 12, 5
    x = torch.randn(n, h, generator=gen, dtype=torch.float64)
    w = torch.randn(e, h, generator=gen, dtype=torch.float64)
    bias = torch.randn(e, generator=gen, dtype=torch.float64)  # large: selection differs from score order
    scale = 2.5
    ids, wts = route(x, w, bias, k, True, scale)
    assert wts.dtype == torch.float64  # FP64 oracle runs keep FP64 routing
    torch.testing.assert_close(wts.sum(-1), torch.full((n,), scale, dtype=torch.float64), rtol=1e-14, atol=1e-14)
    s = torch.sigmoid(x @ w.T)
    torch.testing.assert_close(wts, scale * s.gather(1, ids) / s.gather(1, ids).sum(1, keepdim=True))
    assert not torch.equal(ids, torch.sort(s, descending=True, stable=True).indices[:, :k]), "bias must matter"
    ids2, raw = route(x, w, bias, k, False, 1.0)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(raw, s.gather(1, ids))


def test_situ_glu_matches_formula(gen):
    g = torch.randn(300, generator=gen, dtype=torch.float64) * 8
    u = torch.randn(300, generator=gen, dtype=torch.float64) * 40
    beta, lb = CFG.activation_situ_beta, CFG.activation_situ_linear_beta
    ref = torch.tensor([beta * math.tanh(a / beta) / (1 + math.exp(-a)) * lb * math.tanh(c / lb)
                        for a, c in zip(g.tolist(), u.tolist(), strict=True)], dtype=torch.float64)
    torch.testing.assert_close(situ_glu(g, u, beta, lb), ref, rtol=1e-13, atol=1e-13)
    out = situ_glu(g.bfloat16(), u.bfloat16(), beta, lb)
    assert out.dtype == torch.float32  # computed in FP32 for BF16 inputs, not rounded to BF16
    ref16 = situ_glu(g.bfloat16().double(), u.bfloat16().double(), beta, lb)
    torch.testing.assert_close(out.double(), ref16, rtol=1e-5, atol=1e-5)


def _oracle_block(weights, x: torch.Tensor) -> torch.Tensor:
    """Per-token FP64 LatentMoE from the formulas and the raw checkpoint tensors."""
    w = {k[len(PFX):]: v for k, v in weights.items() if k.startswith(PFX)}
    f = {k: v.double() for k, v in w.items() if v.dtype != torch.uint8}
    beta, lb, eps = CFG.activation_situ_beta, CFG.activation_situ_linear_beta, CFG.rms_norm_eps

    def act(a, c):
        return beta * torch.tanh(a / beta) * torch.sigmoid(a) * lb * torch.tanh(c / lb)

    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        s = torch.sigmoid(f["gate.weight"] @ xt)
        chosen = _oracle_route((s + f["gate.e_score_correction_bias"]).unsqueeze(0), CFG.num_experts_per_token)[0]
        gw = s[chosen] / s[chosen].sum() * CFG.routed_scaling_factor
        z = f["routed_expert_down_proj.weight"] @ xt
        acc = torch.zeros_like(z)
        for j, e in enumerate(chosen):
            m = {n: mxfp4.dequantize(w[f"experts.{e}.{n}.weight_packed"], w[f"experts.{e}.{n}.weight_scale"],
                                     torch.float64) for n in ("w1", "w2", "w3")}
            acc += gw[j] * (m["w2"] @ act(m["w1"] @ z, m["w3"] @ z))
        acc = acc / torch.sqrt((acc * acc).mean() + eps) * f["routed_expert_norm.weight"]
        sh = f["shared_experts.down_proj.weight"] @ act(f["shared_experts.gate_proj.weight"] @ xt,
                                                         f["shared_experts.up_proj.weight"] @ xt)
        out[t] = f["routed_expert_up_proj.weight"] @ acc + sh
    return out


def test_block_matches_per_token_oracle_fp64(gen, weights):
    x = torch.randn(9, CFG.hidden_size, generator=gen, dtype=torch.float64)
    out = _block(weights)(x)
    torch.testing.assert_close(out, _oracle_block(weights, x), rtol=1e-10, atol=1e-10)
    assert out.abs().max() > 1e-2


def test_block_bf16_close_to_fp64(gen, weights):
    x = torch.randn(2, 5, CFG.hidden_size, generator=gen).bfloat16()
    ref = _block(weights)(x.double())
    out = _block(weights, dtype=torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < 3e-2, err


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_mxfp4_experts_equal_bf16_experts(gen, weights, dtype):
    x = torch.randn(11, CFG.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    a = _block(weights, CFG, dtype)(x)
    b = _block(weights, CFG.replace(expert_format="bf16"), dtype)(x)
    assert torch.equal(a, b)


def test_only_touched_experts_are_dequantized(gen, weights, monkeypatch):
    m = _block(weights)
    owner = {}
    for e, ex in enumerate(m.experts):
        for n in ("w1", "w2", "w3"):
            owner[getattr(ex, n).weight_packed.data_ptr()] = (e, n)
    calls: list[tuple[int, str]] = []
    real = mxfp4.dequantize

    def counting(packed, scale, dtype=torch.float32):
        calls.append(owner[packed.data_ptr()])
        return real(packed, scale, dtype)

    monkeypatch.setattr(mxfp4, "dequantize", counting)
    x = torch.randn(2, CFG.hidden_size, generator=gen, dtype=torch.float64)
    ids, _ = m.gate(x)
    touched = set(ids.unique().tolist())
    assert len(touched) < CFG.num_experts  # 2 tokens x top-4 of 16: some experts stay cold
    m(x)
    assert sorted(calls) == sorted((e, n) for e in touched for n in ("w1", "w2", "w3"))


def test_dense_mlp_matches_formula(gen, weights):
    m = dense_mlp(CFG, torch.bfloat16)
    m.load_state_dict({k[len(MLP_PFX):]: v for k, v in weights.items() if k.startswith(MLP_PFX)}, strict=True)
    m = m.double()
    x = torch.randn(4, CFG.hidden_size, generator=gen, dtype=torch.float64)
    g, u = x @ m.gate_proj.weight.T, x @ m.up_proj.weight.T
    beta, lb = CFG.activation_situ_beta, CFG.activation_situ_linear_beta
    ref = (beta * torch.tanh(g / beta) * torch.sigmoid(g) * lb * torch.tanh(u / lb)) @ m.down_proj.weight.T
    torch.testing.assert_close(m(x), ref, rtol=1e-12, atol=1e-12)


def test_state_dict_names_and_dtypes():
    names = {k: (tuple(v.shape), v.dtype) for k, v in LatentMoE(CFG).state_dict().items()}
    assert names["experts.0.w1.weight_packed"] == ((CFG.moe_intermediate_size, CFG.routed_expert_hidden_size // 2),
                                                    torch.uint8)
    assert names["gate.e_score_correction_bias"][1] == torch.float32
    assert names["gate.weight"][1] == torch.bfloat16
    bf = LatentMoE(CFG.replace(expert_format="bf16")).state_dict()
    assert bf["experts.3.w2.weight"].shape == (CFG.routed_expert_hidden_size, CFG.moe_intermediate_size)


def test_cache_dense_experts_is_bitwise_and_invalidates(seed):
    """``cache_dense_experts``: the reference decodes bitwise the same with its experts kept dequantised, and a
    packed weight modified in place (or re-pointed) is dequantised afresh, never served stale."""
    from k3_fastpath.reference.model import load_reference
    from k3_fastpath.reference.moe import MXFP4Weight, cache_dense_experts, mxfp4_expert_dense_bytes
    from k3_fastpath.synthetic import synthetic_state_dict

    cfg = preset("k3-tiny").config
    m = load_reference(cfg, synthetic_state_dict(cfg, seed % 1000), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (3, 5), generator=g)

    def run() -> torch.Tensor:
        c = m.new_cache(3, 8)
        return m.prefill(ids, None, c)

    want = run()
    kept = cache_dense_experts(m)
    assert kept == mxfp4_expert_dense_bytes(m) > 0
    assert torch.equal(run(), want)
    w = next(x for x in m.modules() if isinstance(x, MXFP4Weight))
    before = w.dense(torch.bfloat16).clone()
    w.weight_packed.bitwise_xor_(0x11)  # in place: the kept copy is stale now
    assert not torch.equal(w.dense(torch.bfloat16), before)
    w.weight_packed.bitwise_xor_(0x11)
    assert torch.equal(w.dense(torch.bfloat16), before)
