"""kernels/situ_glu on an H100/H200 (sm_90a): the SiTU-GLU activation of the shared experts and the dense MLP.

Numerics against an FP64 oracle (error at most twice the same-dtype PyTorch path's, plus 1e-3 of the
output's scale) at the widths a k3-mini / TP8 / TP16 step activates and M 1..64, with inputs spread past
tanh's saturation (gate ~ 3 sigma of 4, up ~ 30); outputs poisoned with NaN before each call; the launch
counter moves once per call and nothing falls back; deterministic; the PDL build is bitwise the same; an
output aliasing g is safe; a CUDA-graph replay gives the eager bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3_fastpath._lib import counters
from k3_fastpath.kernels import situ_glu as k
from k3_fastpath.reference.common import situ_glu as situ_glu_formula

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

BETA, LBETA = 4.0, 25.0
WIDTHS = (256, 384, 768, 2112, 4224, 6144)  # k3-tiny; TP16 / TP8 shared experts; TP16 / TP8 dense; k3-mini shared


def _inputs(M: int, I: int):  # noqa: E741
    g = (3.0 * torch.randn(M, I, device="cuda")).bfloat16()
    u = (30.0 * torch.randn(M, I, device="cuda")).bfloat16()
    return g, u


def _launched_once():
    before = counters.snapshot()

    def check():
        after = counters.snapshot()
        assert after["fallbacks"].get(k.NAME, {}) == before["fallbacks"].get(k.NAME, {}), "situ_glu fell back"
        assert after["launches"].get(k.NAME, 0) == before["launches"].get(k.NAME, 0) + 1, "kernel did not launch"
    return check


@pytest.mark.parametrize("M", (1, 3, 8, 64))
@pytest.mark.parametrize("I", WIDTHS)
def test_numerics(I, M, seed):  # noqa: E741
    g, u = _inputs(M, I)
    outs = []
    for _ in range(2):
        out = torch.full_like(g, float("nan"))
        check = _launched_once()
        k.situ_glu(g, u, BETA, LBETA, out=out)
        check()
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), f"not deterministic seed={seed}"
    fast = outs[0]
    assert not torch.isnan(fast).any(), f"NaN left in the output seed={seed}"
    ref64 = situ_glu_formula(g.double(), u.double(), BETA, LBETA)
    same = k.reference(g, u, BETA, LBETA)  # FP32 PyTorch, rounded to bf16 once
    e_fast, e_torch = (fast.double() - ref64).abs().max().item(), (same.double() - ref64).abs().max().item()
    atol = 1e-3 * ref64.abs().max().item()
    assert e_fast <= 2 * e_torch + atol, f"I={I} M={M}: err {e_fast:.3g} > 2 x {e_torch:.3g} + {atol:.3g} seed={seed}"


def test_pdl_build_alias_and_graph_replay(seed):
    g, u = _inputs(64, 2112)
    plain = k.situ_glu(g, u, BETA, LBETA)
    pdl = k.situ_glu(g, u, BETA, LBETA, pdl=True)
    assert torch.equal(plain, pdl), f"PDL build differs seed={seed}"
    cfg = k.SituGluConfig.from_heuristic(2112, BETA, LBETA)
    assert k.situ_glu(g, u, BETA, LBETA, config=dataclasses.replace(cfg, pdl=True)).equal(plain)
    g2 = g.clone()
    k.situ_glu(g2, u, BETA, LBETA, out=g2)
    assert torch.equal(g2, plain), f"in place over g differs seed={seed}"
    out = torch.full_like(g, float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.situ_glu(g, u, BETA, LBETA, out=out, pdl=True)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain), f"graph replay differs seed={seed}"


def test_refuses_with_reasons():
    g, u = _inputs(4, 384)
    with pytest.raises(ValueError, match="compiled for beta"):
        k.situ_glu(g, u, BETA, LBETA, config=k.SituGluConfig.from_heuristic(384, 2.0, LBETA))
    before = counters.snapshot()["fallbacks"].get(k.NAME, {})
    h = k.situ_glu(g[:, :100].contiguous(), u[:, :100].contiguous(), BETA, LBETA)  # I % 8 != 0
    after = counters.snapshot()["fallbacks"].get(k.NAME, {})
    assert sum(after.values()) == sum(before.values()) + 1 and h.shape == (4, 100)
