"""The routed-expert kernels' oracle and MXFP4 fragment layout (``kernels/moe_experts``), on a CPU.

Contracts:
* ``moe_experts_ref`` + the latent up projection equals ``LatentMoE.routed`` bit for bit (bf16, k3-tiny,
  MXFP4 and BF16 experts), and the FP64 oracle matches it to bf16 rounding;
* ``pack_mxfp4`` moves bytes only (``unpack_mxfp4`` inverts it) and puts every weight where the kernel's
  lane mapping reads it: rebuilding W from the fragments with the kernel's index arithmetic (lane
  (g, q) -> rows g / g+8, elements 8q..8q+7 of each group, byte b -> elements 2b, 2b+1, scale per
  (row, group)) and the kernel's e2m1 -> bf16 table formula gives ``mxfp4.dequantize`` exactly;
* the support gate names its reasons. Fresh random inputs each run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from k3_fastpath import mxfp4
from k3_fastpath.kernels import moe_experts as k
from k3_fastpath.presets import preset
from k3_fastpath.reference.moe import LatentMoE

CFG = preset("k3-tiny").config


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _moe(gen, fmt: str) -> LatentMoE:
    m = LatentMoE(CFG.replace(expert_format=fmt), dtype=torch.bfloat16)
    for p in m.parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    if fmt == "mxfp4":
        for e in m.experts:
            for n in ("w1", "w3", "w2"):
                mod = getattr(e, n)
                w = torch.randn(mod.out_features, mod.in_features, generator=gen) / mod.in_features ** 0.5
                mod.weight_packed.copy_(mxfp4.quantize(w)[0])
                mod.weight_scale.copy_(mxfp4.quantize(w)[1])
    return m


@pytest.mark.parametrize("fmt", ("mxfp4", "bf16"))
def test_reference_equals_latent_moe_routed(gen, fmt):
    m = _moe(gen, fmt)
    x = torch.randn(5, CFG.hidden_size, generator=gen).bfloat16()
    ids, w = m.gate(x)
    want = m.routed(x, ids, w)
    experts = k.ExpertWeights.from_modules(m.experts, fmt)
    z = m.routed_expert_down_proj(x)
    zn = k.moe_experts_ref(z, ids.int(), w, experts, beta=CFG.activation_situ_beta,
                           linear_beta=CFG.activation_situ_linear_beta, norm_weight=m.routed_expert_norm.weight,
                           eps=CFG.rms_norm_eps)
    assert torch.equal(m.routed_expert_up_proj(zn), want)
    z64 = k.moe_experts_ref(z, ids, w, experts, norm_weight=m.routed_expert_norm.weight, eps=CFG.rms_norm_eps,
                            compute_dtype=torch.float64, rounding=False)
    err = (zn.double() - z64).abs().max() / z64.abs().max()
    assert err < 2e-2, err


def _lut_value(byte: int) -> int:
    """The kernel's table formula (kernel.ExpertGemmKernel.lut_value), in Python."""
    res = 0
    for h in range(2):
        n = (byte >> (4 * h)) & 15
        ex, m = (n >> 1) & 3, n & 1
        bits = ((0x3F00 if m else 0) if ex == 0 else ((ex + 126) << 7) | (m << 6)) | ((n & 8) << 12)
        res |= bits << (16 * h)
    return res


def test_lut_formula_is_e2m1():
    for byte in range(256):
        v = _lut_value(byte)
        halves = torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        codes = torch.tensor([[byte]], dtype=torch.uint8)
        want = mxfp4.dequantize(codes.repeat(1, 16), torch.full((1, 1), 127, dtype=torch.uint8))[0, :2]
        assert torch.equal(halves.float(), want), (byte, halves, want)


def _rebuild(q_frag: torch.Tensor, s_frag: torch.Tensor, rows: int, K: int) -> torch.Tensor:
    """W [rows, K] for one expert from its fragments, with the kernel's index arithmetic."""
    lut = torch.tensor([_lut_value(b) for b in range(256)], dtype=torch.int64)
    W = torch.full((rows, K), float("nan"))
    for rt in range(rows // 16):
        for gp in range(K // 64):
            for lane in range(32):
                g, q = lane // 4, lane % 4
                byts = q_frag[rt, gp, lane].tolist()
                for G in range(2):
                    for h in range(2):
                        row = rt * 16 + g + 8 * h
                        scale = 2.0 ** (int(s_frag[rt, gp, g, 2 * G + h]) - 127)
                        for b in range(4):
                            v = int(lut[byts[(2 * G + h) * 4 + b]])
                            pair = torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16)
                            vals = pair.view(torch.bfloat16).float() * scale
                            k0 = gp * 64 + 32 * G + 8 * q + 2 * b
                            W[row, k0: k0 + 2] = vals
    return W


def test_fragment_layout_matches_kernel_mapping(gen):
    E, rows, K = 2, 32, 128
    w = torch.randn(E * rows, K, generator=gen)
    packed, scale = mxfp4.quantize(w)
    packed, scale = packed.view(E, rows, K // 2), scale.view(E, rows, K // 32)
    qf, sf = k.pack_mxfp4(packed, scale)
    assert qf.shape == (E, rows // 16, K // 64, 32, 16) and sf.shape == (E, rows // 16, K // 64, 8, 4)
    up, us = k.unpack_mxfp4(qf, sf)
    assert torch.equal(up, packed) and torch.equal(us, scale)
    for e in range(E):
        assert torch.equal(_rebuild(qf[e], sf[e], rows, K), mxfp4.dequantize(packed[e], scale[e]))


def test_support_gate_reasons(gen):
    experts = k.ExpertWeights.from_modules(_moe(gen, "mxfp4").experts, "mxfp4")
    L = CFG.routed_expert_hidden_size
    z = torch.zeros(2, L, dtype=torch.bfloat16)
    ids, w = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    assert "N=65" in k.is_supported(torch.zeros(65, L, dtype=torch.bfloat16), ids.repeat(33, 1)[:65],
                                    w.repeat(33, 1)[:65], experts).reason
    assert "top-k" in k.is_supported(z, torch.zeros(2, 17, dtype=torch.int32), torch.zeros(2, 17), experts).reason
    assert "latent" in k.is_supported(torch.zeros(2, 2 * L, dtype=torch.bfloat16), ids, w, experts).reason
    assert not k.is_supported(z, ids, w, experts)  # CPU tensors never reach the kernel
    out = k.moe_experts(z, ids, w, experts)  # served by the reference
    assert out.shape == (2, L) and out.dtype == torch.float32
