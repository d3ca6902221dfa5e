"""The sentinel's training MoE (``sentinel.moe_grouped``): the routed path as batched GEMMs over all experts
computes the reference's function, outputs and every gradient (experts, projections, the router through the
combine weights), on fresh random inputs with a skewed routing (an expert untouched)."""

from __future__ import annotations

import copy

import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.moe import LatentMoE
from k3_fastpath.sentinel.checkpoint import training_config
from k3_fastpath.sentinel.moe_grouped import use_grouped_routed


def _moe(seed: int) -> LatentMoE:
    torch.manual_seed(seed)
    cfg = training_config(preset("k3-tiny").config)
    return LatentMoE(cfg, dtype=torch.float64)


def _grads(moe: LatentMoE, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = moe(x)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    return out.detach(), {"x": x.grad, **grads}


def test_grouped_routed_is_the_reference_function_and_gradient():
    ref = _moe(3)
    with torch.no_grad():  # skew the routing: expert 5 is never selected, expert 0 often
        ref.gate.e_score_correction_bias[5] = -10.0
        ref.gate.e_score_correction_bias[0] = 0.5
    grouped = copy.deepcopy(ref)
    assert use_grouped_routed(torch.nn.Sequential(grouped)) == 1
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(37, ref.cfg.hidden_size, generator=gen, dtype=torch.float64)
    w = torch.randn(37, ref.cfg.hidden_size, generator=gen, dtype=torch.float64)
    out_r, g_r = _grads(ref, x, w)
    out_g, g_g = _grads(grouped, x, w)
    ids, _ = ref.gate(x)
    assert 5 not in ids and out_r.abs().max() > 0.1
    torch.testing.assert_close(out_g, out_r, rtol=1e-12, atol=1e-12)
    assert "gate.weight" in g_r and "experts.0.w1.weight" in g_r
    # the untouched expert: no gradient in the reference, an exact zero one in the batched GEMMs
    assert set(g_g) - set(g_r) == {f"experts.5.{w}.weight" for w in ("w1", "w2", "w3")}
    assert all(not g_g[f"experts.5.{w}.weight"].any() for w in ("w1", "w2", "w3"))
    for name in g_r:
        torch.testing.assert_close(g_g[name], g_r[name], rtol=1e-10, atol=1e-12, msg=name)


def test_a_wrong_grouping_is_caught():
    """The control: pairing each expert's outputs with the wrong token rows changes the output."""
    ref = _moe(4)
    bad = copy.deepcopy(ref)
    use_grouped_routed(torch.nn.Sequential(bad))
    real = bad.routed

    def shifted(x, ids, weights):
        return real(x, ids.roll(1, dims=0), weights)

    bad.routed = shifted
    x = torch.randn(16, ref.cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        assert (bad(x) - ref(x)).abs().max() > 1e-3
