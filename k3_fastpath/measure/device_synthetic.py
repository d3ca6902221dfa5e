"""Seeded synthetic weights drawn on the GPU, for perf runs and GPU TP checks of k3-mini-sized models.

``synthetic.synthetic_state_dict`` draws every tensor on the CPU and quantizes each MXFP4 expert twice (once
per half of its packed/scale pair): for k3-mini's ~23 B values that is many minutes of a GPU host's
device time. Here each tensor of at least ``BIG`` elements is drawn on ``device`` from a CUDA generator
seeded by (seed, tensor name), with the same distribution rule as ``synthetic.py`` (N(0, 1) embedding,
N(0, 1/fan_in) linear layers, 2/sqrt(fan_in) for the router, the ``conditioning="stable"`` factors; routed
experts drawn in BF16, in blocks along the TP dim, and quantized to MXFP4 once per expert matrix: a TP rank
draws and quantizes only its share, see ``_expert_weight``). Smaller tensors (norms, A_log,
conv weights, biases, the AttnRes projections) ARE ``synthetic.synthetic_tensor``'s, moved to the device.
Deterministic for a (seed, device type); not bitwise the CPU checkpoint.

``tp > 1`` keeps only rank ``rank``'s share (``tp.shard_state_dict``'s cut), drawing one full tensor at a
time, so a rank never holds more than its share plus one tensor.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import torch

from .. import mxfp4, synthetic
from ..config import K3Config
from ..manifest import EXPERT_ROW, HEAD_VEC, tensor_specs

BIG = 1 << 22  # elements: at and above this a tensor is drawn on the device
EXPERT_BLOCKS = 16  # a routed expert matrix is drawn in up to this many blocks along its TP dim (TP <= 16)


def _device_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{name}:device".encode()).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    return g


def _linear_std(name: str, fan_in: int, conditioning: str) -> float:
    """``synthetic.synthetic_tensor``'s std for a linear weight (kept in step with it: see that module)."""
    std = 1.0 / math.sqrt(fan_in)
    if name.endswith("_res_proj.weight") or name.endswith("block_sparse_moe.gate.weight"):
        std = 2.0 / math.sqrt(fan_in)
    if conditioning == "stable":
        factors = getattr(synthetic, "_STABLE_STD", {})
        std *= next((f for suffix, f in factors.items() if name.endswith(suffix)), 1.0)
    return std


def _expert_blocks(size: int, cols: bool) -> int:
    """How many generator blocks a routed expert matrix is drawn in along its TP dim: the most of
    EXPERT_BLOCKS that divide it (column blocks also in whole MXFP4 scale groups)."""
    for nb in (EXPERT_BLOCKS, 8, 4, 2):
        if size % nb == 0 and (not cols or (size // nb) % mxfp4.GROUP == 0):
            return nb
    return 1


def _expert_weight(spec, seed: int, device: torch.device, tp: int, rank: int, cfg: K3Config) -> torch.Tensor:
    """Rank ``rank``'s BF16 share (before MXFP4 quantization) of the routed expert matrix behind the
    packed / scale ``spec``: N(0, 1/fan_in), drawn in ``_expert_blocks`` blocks along the matrix's TP dim
    (w1 / w3 rows, w2 columns), each block from its own generator, so a rank draws only the blocks of its
    share (at TP16 1/16 of the matrix, instead of all of it and a slice) and the shares of every TP size are
    cuts of one full draw. Quantizing a share gives the same bytes as cutting the quantized full matrix:
    MXFP4 groups run along rows, and column blocks hold whole groups."""
    from ..weights import _cut, _heads

    base = spec.name.rsplit(".", 1)[0]
    n = spec.shape[0]
    k = spec.shape[1] * (2 if spec.kind == "packed" else mxfp4.GROUP)
    c = _cut(spec, tp, rank, _heads(cfg))
    dim = 1 if spec.tp == EXPERT_ROW else 0  # w2 is cut along its columns, w1 / w3 along rows
    size = (n, k)[dim]
    unit = 1 if dim == 0 else (2 if spec.kind == "packed" else mxfp4.GROUP)  # spec units -> weight units
    lo, hi = (0, size) if c is None else (c.start * unit, (c.start + c.length) * unit)
    nb = _expert_blocks(size, cols=dim == 1)
    step = size // nb
    parts = []
    for b in range(lo // step, -(-hi // step)):
        g = _device_generator(seed, f"{base}.weight[{b}/{nb}]", device)
        shape = (step, k) if dim == 0 else (n, step)
        parts.append(torch.randn(shape, generator=g, device=device) / math.sqrt(k))
    w = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
    w = w.narrow(dim, lo - (lo // step) * step, hi - lo)
    return w.to(torch.bfloat16).contiguous()


def device_state_dict(cfg: K3Config, seed: int, device: Any, *, tp: int = 1, rank: int = 0,
                      conditioning: str = "default") -> dict[str, torch.Tensor]:
    """``{manifest name: tensor}`` on ``device`` (rank ``rank``'s share when ``tp > 1``, shaped for
    ``tp.rank_config``)."""
    from ..runtime.tp import rank_config
    from ..weights import slice_tensor

    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    ready: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # expert matrix -> its quantized (packed, scale)
    lac = rank_config(cfg, tp).linear_attn_config
    specs = tensor_specs(cfg)
    groups, where = _expert_groups(specs)
    for spec in specs:
        if spec.numel < BIG and spec.kind not in ("packed", "scale"):
            t = synthetic.synthetic_tensor(cfg, spec, seed, conditioning).to(device) if conditioning != "default" \
                else synthetic.synthetic_tensor(cfg, spec, seed).to(device)
        elif spec.kind in ("packed", "scale"):
            base = spec.name.rsplit(".", 1)[0]
            if base not in ready:
                key, i = where[base]
                ready.update(_quantize_chunk(groups[key][i: i + _chunk_experts(tp)], seed, device, tp, rank,
                                             cfg))
            pair = ready[base] if spec.kind == "packed" else ready.pop(base)  # scale comes second
            out[spec.name] = pair[0 if spec.kind == "packed" else 1]
            continue
        else:
            g = _device_generator(seed, spec.name, device)
            std = 1.0 if spec.kind == "embedding" else _linear_std(spec.name, spec.shape[-1], conditioning)
            t = (torch.randn(spec.shape, generator=g, device=device) * std).to(synthetic.torch_dtype(spec.dtype))
        if tp > 1:
            t = slice_tensor(spec, t, tp, rank, cfg=cfg)
            if spec.tp == HEAD_VEC:
                padded = torch.zeros(max(lac.head_dim, lac.num_heads), dtype=t.dtype, device=t.device)
                padded[: t.shape[0]] = t
                t = padded
            elif t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t = t.clone()  # a view would keep the whole tensor alive
        out[spec.name] = t
    return out


def _expert_groups(specs) -> tuple[dict[str, list], dict[str, tuple[str, int]]]:
    """Routed expert matrices grouped by layer and matrix (``...experts.*.w1``), in expert order:
    (group -> the packed specs, matrix base name -> (its group, its index there))."""
    groups: dict[str, list] = {}
    where: dict[str, tuple[str, int]] = {}
    for spec in specs:
        if spec.kind == "packed":
            base = spec.name.rsplit(".", 1)[0]
            key = re.sub(r"\.experts\.\d+\.", ".experts.*.", base)
            where[base] = (key, len(groups.setdefault(key, [])))
            groups[key].append(spec)
    return groups, where


def _chunk_experts(tp: int) -> int:
    """Experts quantized in one ``mxfp4.quantize`` call: as many rank shares as one full matrix holds (``tp``),
    so the call's temporaries stay those of one full matrix (``rank_emulation._draw_transient``)."""
    return max(1, tp)


def _quantize_chunk(chunk: list, seed: int, device: torch.device, tp: int, rank: int, cfg: K3Config
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive experts' same matrix (``chunk``: their packed specs): each share drawn by
    ``_expert_weight``, all quantized in one call (MXFP4 is per row group: the same bytes as one call each),
    each result cloned into its own allocation (the chunk's buffers are freed)."""
    w = torch.stack([_expert_weight(s, seed, device, tp, rank, cfg) for s in chunk])
    packed, scale = mxfp4.quantize(w)
    return {s.name.rsplit(".", 1)[0]: (packed[j].clone(), scale[j].clone()) for j, s in enumerate(chunk)}


def assign_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(sd, strict=True, assign=True)`` in time linear in the tensors: torch's walks
    every submodule and filters the parent's whole dict by prefix for each child, quadratic in a layer's
    experts (the full k3-tp16-rank's build went from 274 to 238 s with this). Each tensor replaces the
    (meta) parameter or buffer of its name, as a Parameter with that parameter's ``requires_grad``; names
    must match the model's state dict exactly and shapes its tensors'."""
    expected = model.state_dict(keep_vars=True)
    missing, unexpected = expected.keys() - sd.keys(), sd.keys() - expected.keys()
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {sorted(missing)[:3]} ({len(missing)}), "
                           f"unexpected {sorted(unexpected)[:3]} ({len(unexpected)})")
    modules = dict(model.named_modules())
    for name, t in sd.items():
        prefix, _, leaf = name.rpartition(".")
        m = modules[prefix]
        old = expected[name]
        if tuple(old.shape) != tuple(t.shape):
            raise RuntimeError(f"{name}: shape {tuple(t.shape)}, the model expects {tuple(old.shape)}")
        if leaf in m._parameters:
            m._parameters[leaf] = torch.nn.Parameter(t, requires_grad=old.requires_grad)
        else:
            m._buffers[leaf] = t


def device_model(cfg: K3Config, seed: int, device: Any, *, tp: int = 1, rank: int = 0, conditioning: str = "default",
                 dtype: torch.dtype = torch.bfloat16):
    """A reference ``K3ForCausalLM`` (of ``tp.rank_config(cfg, tp)``) on ``device`` with these weights."""
    from ..reference.model import K3ForCausalLM
    from ..runtime.tp import rank_config

    rcfg = rank_config(cfg, tp)
    sd = device_state_dict(cfg, seed, device, tp=tp, rank=rank, conditioning=conditioning)
    want = {s.name: synthetic.torch_dtype(s.dtype) for s in tensor_specs(rcfg)}
    for name, t in sd.items():
        if want.get(name) != t.dtype:
            raise TypeError(f"tensor {name}: dtype {t.dtype}, the manifest says {want.get(name)}")
    if dtype != torch.bfloat16:
        sd = {k: (v.to(dtype) if v.dtype == torch.bfloat16 else v) for k, v in sd.items()}
    with torch.device("meta"):  # no CPU allocation or default init of ~24 GB of parameters
        model = K3ForCausalLM(rcfg, dtype=dtype)
    assign_state_dict(model, sd)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"device_model: {len(left)} tensors were not assigned, e.g. {left[0]}")
    return model
