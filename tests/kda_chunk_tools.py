"""Inputs and the comparison of the tests that hold fla's ``chunk_kda`` to ``reference.kda.kda_chunked``
(``test_sentinel_fla_kda_gpu.py`` on a GPU, ``fla_interpreted.py`` through Triton's interpreter on the CPU)."""

from __future__ import annotations

import torch

from k3_fastpath.reference.kda import l2_normalize


def chunk_inputs(b: int, t: int, h: int, d: int, seed: int, pad: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """(q, k, v, g_log, beta, state) as the sentinel's layers feed them, seeded, each requiring grad: q / k
    normalised (q scaled), K3's gate (lower bound -5, mostly mild decays), beta after its sigmoid; the last
    ``pad`` tokens padding as the model feeds it (alpha 1, beta 0, zero q / k / v)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    q = l2_normalize(rnd(b, t, h, d)) * d ** -0.5
    k = l2_normalize(rnd(b, t, h, d))
    v = rnd(b, t, h, d)
    g_log = -5.0 * torch.sigmoid(rnd(b, t, h, d) - 2.0)
    beta = torch.sigmoid(rnd(b, t, h))
    if pad:
        q[:, -pad:], k[:, -pad:], v[:, -pad:], g_log[:, -pad:], beta[:, -pad:] = 0, 0, 0, 0, 0
    state = 0.1 * rnd(b, h, d, d)
    return [x.contiguous().requires_grad_(True) for x in (q, k, v, g_log, beta, state)]


def run_with_grads(fn, inputs: list[torch.Tensor], weights: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """[o, final_state, and the gradient of every input] of ``fn(*inputs)`` under a weighted sum of both outputs."""
    o, s = fn(*inputs)
    loss = (o * weights[0]).sum() + (s * weights[1]).sum()
    return [o.detach(), s.detach(), *torch.autograd.grad(loss, inputs)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (in FP64)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
