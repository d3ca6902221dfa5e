"""MXFP4 in the compressed-tensors ``mxfp4-pack-quantized`` layout (OCP Microscaling, FP4 e2m1 + ue8m0).

A weight ``W[N, K]`` (K the input dimension, a multiple of 32) is stored as two tensors:

* ``weight_packed [N, K/2] uint8``: e2m1 codes, two per byte, element ``2i`` in the low nibble and
  ``2i+1`` in the high nibble. A code is sign(bit 3) | exponent(bits 2..1) | mantissa(bit 0); its value is
  one of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
* ``weight_scale [N, K/32] uint8``: one ue8m0 scale per 32 consecutive values of a row, value
  ``2**(s - 127)``; ``s == 255`` is NaN (never produced by ``quantize``).

``quantize`` follows the OCP MX spec: the shared exponent is ``floor(log2(amax)) - 2`` (2 = emax of
e2m1), values are divided by ``2**exp`` and rounded to the nearest e2m1 value (ties to even code), and
clamped to +-6. ``dequantize`` is the table lookup times the scale.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_EMAX_ELEM = 2
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _lut(device: torch.device | str = "cpu") -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])  # code 8 is -0.0 (kept as -0.0)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """``[N, K/2] uint8`` -> ``[N, K] uint8`` e2m1 codes (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed MXFP4 weights must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K] uint8`` codes (each < 16) -> ``[N, K/2] uint8``."""
    if codes.shape[-1] % 2:
        raise ValueError("MXFP4 packing needs an even number of values per row")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> float32 powers of two (255 -> NaN)."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 scales must be uint8 (ue8m0), got {scale.dtype}")
    s = scale.to(torch.int32)
    v = torch.pow(torch.tensor(2.0, dtype=torch.float32, device=scale.device), (s - 127).to(torch.float32))
    return torch.where(s == 255, torch.full_like(v, float("nan")), v)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight_packed [N, K/2]`` + ``weight_scale [N, K/32]`` -> ``W [N, K]`` in ``dtype``."""
    n, half = packed.shape[-2], packed.shape[-1]
    k = half * 2
    if scale.shape[-1] * GROUP != k or scale.shape[-2] != n:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match packed shape {tuple(packed.shape)} "
            f"(expected [..., {n}, {k // GROUP}])"
        )
    vals = _lut(packed.device)[unpack_codes(packed).long()]
    vals = vals.reshape(*packed.shape[:-1], k // GROUP, GROUP) * scale_values(scale).unsqueeze(-1)
    return vals.reshape(*packed.shape[:-1], k).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` (any float dtype) -> (``weight_packed [N, K/2] uint8``, ``weight_scale [N, K/32] uint8``)."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP}, got {w.shape[-1]}")
    x = w.detach().to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize non-finite values to MXFP4")
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    # shared exponent floor(log2(amax)) - emax; an all-zero group gets the smallest exponent
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - _EMAX_ELEM,
                      torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp).unsqueeze(-1)
    mag = scaled.abs().clamp(max=6.0)
    # nearest e2m1 magnitude by its midpoints; an exact midpoint goes to the even code (mantissa bit 0)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=w.device)
    code = torch.bucketize(mag, mids)  # mids[i-1] < mag <= mids[i] -> i (a tie lands on the lower code)
    tie = (code < len(_MIDPOINTS)) & (mag == mids[code.clamp(max=len(_MIDPOINTS) - 1)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    sign = (scaled < 0) & (code > 0)
    code = (code | (sign.to(code.dtype) << 3)).to(torch.uint8)
    packed = pack_codes(code.reshape(*x.shape))
    scale = (exp + 127).to(torch.uint8)
    return packed, scale
