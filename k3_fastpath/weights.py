"""The checkpoint layer: write a seeded synthetic K3 checkpoint, validate and load one (a TP rank's share).

A checkpoint is a Hugging Face directory: ``config.json``, ``model.safetensors.index.json`` (``metadata.
total_size`` + ``weight_map``) and ``model-0000X-of-0000N.safetensors`` shards (or one ``model.safetensors``).
Tensor names are ``language_model.`` + the manifest name (``manifest.tensor_specs``); names without the
prefix are accepted too. Loading goes in steps:

1. read ``config.json`` (``config.load_config``) and, if given, compare it with ``expect_config``;
2. parse every shard's safetensors header ourselves (8-byte length, JSON, offsets that must tile the data
   section exactly), so a truncated or garbled file is reported by name before any tensor is read;
3. match the stored names against the manifest: every expected tensor present, with its shape and dtype
   (FP32 stays FP32: a BF16 ``A_log`` is rejected, K3.md failure mode 6); ``vision_tower.*``,
   ``mm_projector.*`` and ``*.mtp*`` are ignored with a log note, anything else unknown is an error. All
   problems are collected into one ``CheckpointError``, each line naming the tensor and its file;
4. read only this rank's slice of each tensor (safetensors ``get_slice``), cut by the spec's TP rule
   (``slice_tensor`` applies the same cut to an in-memory tensor), optionally dequantizing MXFP4 experts.

TP rules (manifest): COL splits dim 0 (heads, channels, vocab), ROW dim 1, REP copies, HEAD_VEC takes the
rank's ``num_heads / tp`` real heads of the zero-padded ``A_log``, EXPERT_COL splits the rows of w1/w3 (packed
bytes and scales alike), EXPERT_ROW splits the intermediate of w2: packed bytes ``inter/tp/2`` and scale
columns ``inter/tp/32`` per rank, so ``inter/tp`` must be a multiple of 32. ``tp_size == 1`` returns every
tensor unchanged (``A_log`` keeps its padding).

A checkpoint written with ``tp_size > 1`` holds one rank's slices only; its index metadata records
``k3_tp_size`` / ``k3_tp_rank`` and it loads only as that rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import mxfp4, synthetic
from .config import ConfigError, K3Config, load_config
from .manifest import (
    CHECKPOINT_PREFIX,
    COL,
    EXPERT_COL,
    EXPERT_ROW,
    HEAD_VEC,
    REP,
    ROW,
    TensorSpec,
    tensor_specs,
)

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # the HF default shard size ("5GB")
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")  # the multimodal towers: not part of the text model
_MTP = re.compile(r"(^|\.)mtp")  # multi-token-prediction heads: not used by the decode path
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_SHOWN = 25


class CheckpointError(ValueError):
    """A checkpoint that does not hold this config's K3 model; ``problems`` has one line per finding."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        msg = "\n".join(self.problems[:_MAX_SHOWN])
        if len(self.problems) > _MAX_SHOWN:
            msg += f"\n... and {len(self.problems) - _MAX_SHOWN} more problems"
        super().__init__(msg)


# ---------------------------------------------------------------------------------------------- TP slicing
@dataclass(frozen=True)
class _Cut:
    dim: int
    start: int
    length: int


def _check_tp(tp_size: int, rank: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise CheckpointError(f"tp_size must be a positive integer, got {tp_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise CheckpointError(f"rank must be in 0..{tp_size - 1} for tp_size {tp_size}, got {rank!r}")


def _cut(spec: TensorSpec, tp_size: int, rank: int, num_heads: int | None) -> _Cut | None:
    """Where rank ``rank``'s share of ``spec`` lies in the full tensor; ``None`` for the whole tensor."""
    _check_tp(tp_size, rank)
    if tp_size == 1 or spec.tp == REP:
        return None
    if spec.tp == HEAD_VEC:
        if num_heads is None:
            raise CheckpointError(f"{spec.name}: the {HEAD_VEC} rule needs the KDA head count (pass cfg=)")
        if num_heads > spec.shape[0] or num_heads % tp_size:
            raise CheckpointError(f"{spec.name}: {num_heads} heads (of {spec.shape[0]} padded entries) cannot be "
                                  f"split over tp_size {tp_size}")
        per = num_heads // tp_size
        return _Cut(0, rank * per, per)
    dims = {COL: 0, EXPERT_COL: 0, ROW: 1, EXPERT_ROW: 1}
    if spec.tp not in dims:
        raise CheckpointError(f"{spec.name}: unknown TP rule {spec.tp!r}")
    dim = dims[spec.tp]
    size = spec.shape[dim]
    if spec.tp == EXPERT_ROW and spec.kind in ("packed", "scale"):
        inter = size * (2 if spec.kind == "packed" else mxfp4.GROUP)
        if inter % tp_size or (inter // tp_size) % mxfp4.GROUP:
            raise CheckpointError(
                f"{spec.name}: cannot split MXFP4 w2 over tp_size {tp_size}: intermediate {inter} / {tp_size} = "
                f"{inter / tp_size:g} is not a multiple of {mxfp4.GROUP} (a rank's slice would cut a scale group)")
    if size % tp_size:
        raise CheckpointError(f"{spec.name}: dim {dim} of size {size} is not divisible by tp_size {tp_size} "
                              f"(rule {spec.tp})")
    per = size // tp_size
    return _Cut(dim, rank * per, per)


def _heads(cfg: K3Config | None) -> int | None:
    return None if cfg is None else cfg.linear_attn_config.num_heads


def tp_split_problem(cfg: K3Config, tp_size: int) -> str | None:
    """Why ``cfg``'s checkpoint cannot be split over ``tp_size`` ranks (the first tensor that cannot), or
    None when every tensor splits."""
    for spec in tensor_specs(cfg):
        try:
            _cut(spec, tp_size, 0, _heads(cfg))
        except CheckpointError as e:
            return str(e)
    return None


def rank_shape(spec: TensorSpec, tp_size: int, cfg: K3Config | None = None) -> tuple[int, ...]:
    """The shape of one rank's share of ``spec`` (the same for every rank)."""
    c = _cut(spec, tp_size, 0, _heads(cfg))
    if c is None:
        return spec.shape
    return spec.shape[:c.dim] + (c.length,) + spec.shape[c.dim + 1:]


def slice_tensor(spec: TensorSpec, tensor: torch.Tensor, tp_size: int, rank: int, *,
                 cfg: K3Config | None = None) -> torch.Tensor:
    """Rank ``rank``'s share of the full in-memory ``tensor`` under ``spec``'s TP rule.

    ``cfg`` is needed for HEAD_VEC (the real head count of the padded ``A_log``). The tensor must have the
    spec's shape and dtype. REP tensors and ``tp_size == 1`` return ``tensor`` itself; a dim-0 cut is a view.
    """
    if tuple(tensor.shape) != spec.shape:
        raise CheckpointError(f"{spec.name}: shape {tuple(tensor.shape)}, expected {spec.shape}")
    if tensor.dtype != synthetic.torch_dtype(spec.dtype):
        raise CheckpointError(f"{spec.name}: dtype {tensor.dtype}, expected {spec.dtype}")
    c = _cut(spec, tp_size, rank, _heads(cfg))
    if c is None:
        return tensor
    return tensor.narrow(c.dim, c.start, c.length).contiguous()


# ---------------------------------------------------------------------------------------------- writing
def _plan_shards(items: list[tuple[TensorSpec, int]], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, in manifest order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec, nbytes in items:
        if not shards or (size + nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_synthetic_checkpoint(cfg: K3Config, out_dir: str | Path, seed: int = 0,
                               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tp_size: int = 1, rank: int = 0,
                               *, prefix: str = CHECKPOINT_PREFIX, overwrite: bool = False) -> Path:
    """Write the seeded synthetic checkpoint of ``cfg`` (``synthetic.synthetic_tensor``) to ``out_dir``
    with ``write_checkpoint``; the same arguments give byte-identical files."""
    return write_checkpoint(cfg, out_dir, lambda spec: synthetic.synthetic_tensor(cfg, spec, seed),
                            max_shard_bytes, tp_size, rank, prefix=prefix, overwrite=overwrite)


def write_checkpoint(cfg: K3Config, out_dir: str | Path, tensor_of: Callable[[TensorSpec], torch.Tensor],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tp_size: int = 1, rank: int = 0,
                     *, prefix: str = CHECKPOINT_PREFIX, overwrite: bool = False) -> Path:
    """Write the checkpoint of ``cfg`` whose full (unsliced) tensors ``tensor_of(spec)`` gives, in the
    manifest's names, shapes and dtypes (a tensor that is not raises ``CheckpointError`` naming it).

    Deterministic in ``tensor_of``'s values. Only one shard's tensors are in memory at a time. Atomic:
    everything is written into a temporary sibling directory renamed into place at the end; on any failure
    nothing is left behind. ``tp_size > 1`` writes rank ``rank``'s slices only (recorded in the index
    metadata). ``prefix`` is prepended to every manifest name. Returns ``out_dir``.
    """
    out = Path(out_dir)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    specs = tensor_specs(cfg)
    heads = _heads(cfg)
    cuts = {s.name: _cut(s, tp_size, rank, heads) for s in specs}  # raises before anything is written
    items = []
    for s in specs:
        shape = rank_shape(s, tp_size, cfg)
        n = _DTYPE_BYTES[s.dtype]
        for d in shape:
            n *= d
        items.append((s, n))
    plan = _plan_shards(items, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        weight_map: dict[str, str] = {}
        total = 0
        for i, group in enumerate(plan):
            fname = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for spec in group:
                t = tensor_of(spec)
                if tuple(t.shape) != spec.shape or t.dtype != synthetic.torch_dtype(spec.dtype):
                    raise CheckpointError(f"tensor {spec.name}: {t.dtype} {tuple(t.shape)} given, the manifest "
                                          f"says {spec.dtype} {spec.shape}")
                c = cuts[spec.name]
                if c is not None:
                    t = t.narrow(c.dim, c.start, c.length).clone()
                tensors[prefix + spec.name] = t.contiguous()
                weight_map[prefix + spec.name] = fname
                total += t.numel() * t.element_size()
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o644)  # safetensors writes 0600; the other files are readable by all
            del tensors
        meta: dict[str, Any] = {"total_size": total}
        if tp_size > 1:
            meta.update(k3_tp_size=tp_size, k3_tp_rank=rank)
        index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if out.exists():  # overwrite: move the old one aside, swap, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "ckpt")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------- scanning
@dataclass(frozen=True)
class _Entry:
    name: str  # as stored in the file
    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _read_header(path: Path) -> dict[str, _Entry]:
    """Parse and check a safetensors header without reading tensor data; errors name the file."""
    f_name = path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{f_name}: corrupt: {size} bytes is too short to be a safetensors file")
        n = struct.unpack("<Q", head)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{f_name}: bad header: declares a {n}-byte header but the file holds {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f_name}: bad header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f_name}: bad header: not a JSON object")
    out: dict[str, _Entry] = {}
    spans: list[tuple[int, int, str]] = []
    for key, v in header.items():
        if key == "__metadata__":
            continue
        ok = (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in v["shape"]) and isinstance(v.get("data_offsets"), list)
              and len(v["data_offsets"]) == 2 and all(isinstance(o, int) and o >= 0 for o in v["data_offsets"]))
        if not ok:
            raise CheckpointError(f"{f_name}: bad header: entry {key} lacks a valid dtype, shape or data_offsets")
        if v["dtype"] not in _DTYPE_BYTES:
            raise CheckpointError(f"{f_name}: bad header: {key} has unknown dtype {v['dtype']!r}")
        e = _Entry(key, f_name, v["dtype"], tuple(v["shape"]))
        b, end = v["data_offsets"]
        if end - b != e.nbytes:
            raise CheckpointError(f"{f_name}: bad header: {key} spans {end - b} bytes but shape {e.shape} "
                                  f"{e.dtype} needs {e.nbytes}")
        out[key] = e
        spans.append((b, end, key))
    data = size - 8 - n
    pos = 0
    for b, end, key in sorted(spans):
        if b != pos:
            raise CheckpointError(f"{f_name}: bad header: {key} starts at byte {b} of the data section, expected "
                                  f"{pos} (overlapping or gapped tensors)")
        if end > data:
            raise CheckpointError(f"{f_name}: truncated: {key} needs bytes [{b}, {end}) of the data section but "
                                  f"the file holds only {data} bytes after its header")
        pos = end
    if pos != data:
        raise CheckpointError(f"{f_name}: corrupt: {data - pos} trailing bytes after the last tensor")
    return out


def _is_ignored(name: str) -> bool:
    return name.startswith(IGNORED_PREFIXES) or _MTP.search(name) is not None


@dataclass
class _Layout:
    files: list[str]
    entries: dict[str, _Entry]  # manifest name -> stored entry
    ignored: list[_Entry]
    tp_size: int = 1  # > 1: the checkpoint holds one rank's slices only
    rank: int = 0


def _scan(root: Path, cfg: K3Config) -> _Layout:
    """Headers of every file, matched against the manifest; raises one CheckpointError with all problems."""
    problems: list[str] = []
    meta: dict[str, Any] = {}
    wm: dict[str, str] | None = None
    if (root / INDEX_NAME).is_file():
        try:
            index = json.loads((root / INDEX_NAME).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{INDEX_NAME}: not valid JSON ({e})") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{INDEX_NAME}: no 'weight_map' object of tensor name -> file name")
        meta = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
        files = sorted(set(wm.values()))
    elif (root / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        raise CheckpointError(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
    headers: dict[str, dict[str, _Entry]] = {}
    for fname in files:
        listed = sorted(k for k, v in wm.items() if v == fname) if wm is not None else []
        what = ", ".join(listed[:1]) + (f" and {len(listed) - 1} more" if len(listed) > 1 else "")
        if Path(fname).name != fname or fname in ("", ".", ".."):
            problems.append(f"{INDEX_NAME}: weight_map sends {what} to {fname!r}, not a file name in the checkpoint")
        elif not (root / fname).is_file():
            problems.append(f"{INDEX_NAME}: weight_map sends {what} to {fname}, which does not exist")
        else:
            try:
                headers[fname] = _read_header(root / fname)
            except CheckpointError as e:
                problems.extend(e.problems)
    stored: list[_Entry] = []
    if wm is not None:
        for name, fname in sorted(wm.items()):
            if fname in headers:
                if name in headers[fname]:
                    stored.append(headers[fname][name])
                else:
                    problems.append(f"{name}: {INDEX_NAME} places it in {fname}, which does not hold it")
        for fname, h in headers.items():
            for name in h:
                if wm.get(name) != fname and not _is_ignored(_strip(name)):
                    problems.append(f"{name} in {fname}: not listed in {INDEX_NAME}'s weight_map")
    else:
        stored = list(headers.get(SINGLE_NAME, {}).values())
    unreadable = {_strip(k) for k, v in (wm or {}).items() if v not in headers}
    if wm is None and SINGLE_NAME not in headers:
        raise CheckpointError(problems)

    tp, rank = meta.get("k3_tp_size", 1), meta.get("k3_tp_rank", 0)
    try:
        _check_tp(tp, rank)
    except CheckpointError as e:
        raise CheckpointError(f"{INDEX_NAME}: metadata k3_tp_size/k3_tp_rank: {e}") from None
    specs = tensor_specs(cfg)
    by_name = {s.name: s for s in specs}
    entries: dict[str, _Entry] = {}
    ignored: list[_Entry] = []
    for e in stored:
        name = _strip(e.name)
        if name in by_name:
            if name in entries:
                problems.append(f"{e.name}: stored twice ({entries[name].name} in {entries[name].file}, "
                                f"{e.name} in {e.file})")
            else:
                entries[name] = e
        elif _is_ignored(name):
            ignored.append(e)
        else:
            problems.append(f"{e.name} in {e.file}: unexpected tensor, not in the K3 manifest of this config")
    where = f"{files[0]}" if len(files) == 1 else f"any of the {len(files)} shards"
    for s in specs:
        e = entries.get(s.name)
        if e is None:
            if s.name not in unreadable:
                problems.append(f"{s.checkpoint_name}: missing (expected shape {rank_shape(s, tp, cfg)}, {s.dtype}; "
                                f"not in {where})")
            continue
        want = rank_shape(s, tp, cfg)
        if e.shape != want:
            problems.append(f"{e.name}: shape {e.shape} in {e.file}, expected {want}")
        if e.dtype != s.dtype:
            why = " (FP32 parameters must stay FP32: a cast changes the model)" if s.dtype == "F32" else ""
            problems.append(f"{e.name}: dtype {e.dtype} in {e.file}, expected {s.dtype}{why}")
    if problems:
        raise CheckpointError(problems)
    if ignored:
        kinds = Counter(_ignored_kind(_strip(e.name)) for e in ignored)
        logger.info("%s: ignored %d tensors outside the text model: %s", root, len(ignored),
                    ", ".join(f"{k} ({n})" for k, n in sorted(kinds.items())))
    return _Layout(files=sorted(headers), entries=entries, ignored=ignored, tp_size=tp, rank=rank)


def _strip(name: str) -> str:
    return name[len(CHECKPOINT_PREFIX):] if name.startswith(CHECKPOINT_PREFIX) else name


def _ignored_kind(name: str) -> str:
    for p in IGNORED_PREFIXES:
        if name.startswith(p):
            return p + "*"
    return "*.mtp*"


def _load_cfg(root: Path) -> K3Config:
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    try:
        return load_config(root)
    except ConfigError as e:
        raise CheckpointError(f"{CONFIG_NAME}: {e}") from e


def _check_expected(cfg: K3Config, expect: K3Config) -> None:
    diffs = [f"{f.name} {getattr(cfg, f.name)!r} != expected {getattr(expect, f.name)!r}"
             for f in dataclasses.fields(K3Config)
             if f.compare and f.name != "name" and getattr(cfg, f.name) != getattr(expect, f.name)]
    if diffs:
        raise CheckpointError(f"{CONFIG_NAME}: differs from the expected config: " + "; ".join(diffs))


# ---------------------------------------------------------------------------------------------- loading
def load_checkpoint(path: str | Path, tp_size: int = 1, rank: int = 0, device: str | torch.device = "cpu",
                    expect_config: K3Config | None = None,
                    dequantize_experts: bool = False) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """Validate the checkpoint at ``path`` against its manifest and load rank ``rank``'s share.

    Returns the config and ``{manifest name: tensor}`` in manifest order, each in its checkpoint dtype
    (never cast). Only the rank's slices are read from disk. ``dequantize_experts`` replaces each MXFP4
    ``experts.{e}.w{1,2,3}.weight_packed`` / ``weight_scale`` pair by a BF16 ``...weight``. Raises
    ``CheckpointError`` (naming the tensor and file) on any mismatch or corrupt file.
    """
    root = Path(path)
    cfg = _load_cfg(root)
    if expect_config is not None:
        _check_expected(cfg, expect_config)
    _check_tp(tp_size, rank)
    layout = _scan(root, cfg)
    specs = tensor_specs(cfg)
    if layout.tp_size > 1:
        if (tp_size, rank) != (layout.tp_size, layout.rank):
            raise CheckpointError(f"{root}: holds only rank {layout.rank} of tp_size {layout.tp_size} "
                                  f"({INDEX_NAME} metadata); load it with tp_size={layout.tp_size}, "
                                  f"rank={layout.rank}, not tp_size={tp_size}, rank={rank}")
        cuts: dict[str, _Cut | None] = {}
    else:
        cuts = {s.name: _cut(s, tp_size, rank, _heads(cfg)) for s in specs}
    by_file: dict[str, list[str]] = {}
    for s in specs:
        by_file.setdefault(layout.entries[s.name].file, []).append(s.name)
    loaded: dict[str, torch.Tensor] = {}
    for fname, names in by_file.items():
        stored = None  # the tensor being read when a read fails (None: opening the file failed)
        try:
            with safe_open(str(root / fname), framework="pt", device="cpu") as f:
                for name in names:
                    stored = layout.entries[name].name
                    c = cuts.get(name)
                    if c is None:
                        t = f.get_tensor(stored)
                    else:
                        idx = (slice(None),) * c.dim + (slice(c.start, c.start + c.length),)
                        t = f.get_slice(stored)[idx]
                    loaded[name] = t.to(device)
        except (SafetensorError, OSError) as e:
            why = " ".join(str(e).split())
            what = f"{stored} in {fname}" if stored else fname
            raise CheckpointError(f"{what}: truncated or corrupt: cannot read {'it' if stored else 'the file'} "
                                  f"({why})") from e
    out: dict[str, torch.Tensor] = {}
    for s in specs:
        if dequantize_experts and s.kind == "packed":
            base = s.name[: -len("weight_packed")]
            out[base + "weight"] = mxfp4.dequantize(loaded[s.name], loaded[base + "weight_scale"], torch.bfloat16)
        elif not (dequantize_experts and s.kind == "scale"):
            out[s.name] = loaded[s.name]
    return cfg, out


# ---------------------------------------------------------------------------------------------- summaries
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(path: str | Path) -> list[str]:
    """The files that make up the checkpoint: config.json, the index (if any) and every shard."""
    root = Path(path)
    if (root / INDEX_NAME).is_file():
        try:
            wm = json.loads((root / INDEX_NAME).read_text())["weight_map"]
            shards = sorted(set(wm.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{INDEX_NAME}: unreadable weight_map ({e})") from None
        return [CONFIG_NAME, INDEX_NAME, *shards]
    return [CONFIG_NAME, SINGLE_NAME]


@dataclass(frozen=True)
class FileDigest:
    name: str  # as in checkpoint_files
    bytes: int
    sha256: str


def checkpoint_file_digests(path: str | Path) -> list[FileDigest]:
    """Name, size and sha256 of each of ``checkpoint_files(path)``, in that order."""
    root = Path(path)
    out = []
    for name in checkpoint_files(root):
        if not (root / name).is_file():
            raise CheckpointError(f"{name}: missing from {root}")
        out.append(FileDigest(name, (root / name).stat().st_size, _file_sha256(root / name)))
    return out


def combined_digest(files: list[FileDigest]) -> str:
    """``checkpoint_digest``'s combination of per-file digests: sha256 over ``name sha256`` lines."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name} {f.sha256}\n".encode())
    return h.hexdigest()


def checkpoint_digest(path: str | Path) -> str:
    """sha256 over ``name sha256`` lines of config.json, the index and every shard (for bundles)."""
    return combined_digest(checkpoint_file_digests(path))


@dataclass(frozen=True)
class CheckpointSummary:
    path: str
    config_name: str
    expert_format: str  # "mxfp4" (packed + ue8m0 scale pairs) or "bf16"
    num_files: int
    num_tensors: int  # manifest tensors (ignored ones not counted)
    total_bytes: int
    bytes_by_dtype: dict[str, int]
    num_experts: int  # routed experts per MoE layer
    ignored: dict[str, int] = field(default_factory=dict)  # e.g. {"vision_tower.*": 12}
    tp_size: int = 1  # > 1: the checkpoint holds one rank's slices
    rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tensor_locations(path: str | Path) -> dict[str, tuple[str, str]]:
    """``{manifest name: (name as stored, file)}`` of the checkpoint at ``path`` (headers only, validated)."""
    root = Path(path)
    layout = _scan(root, _load_cfg(root))
    return {name: (e.name, e.file) for name, e in layout.entries.items()}


def describe(path: str | Path) -> CheckpointSummary:
    """Validate the headers (no tensor data is read) and summarise the checkpoint."""
    root = Path(path)
    cfg = _load_cfg(root)
    layout = _scan(root, cfg)
    by_dtype: Counter[str] = Counter()
    for e in layout.entries.values():
        by_dtype[e.dtype] += e.nbytes
    return CheckpointSummary(
        path=str(root), config_name=cfg.name, expert_format=cfg.expert_format, num_files=len(layout.files),
        num_tensors=len(layout.entries), total_bytes=sum(by_dtype.values()), bytes_by_dtype=dict(sorted(by_dtype.items())),
        num_experts=cfg.num_experts, ignored=dict(Counter(_ignored_kind(_strip(e.name)) for e in layout.ignored)),
        tp_size=layout.tp_size, rank=layout.rank,
    )
