"""The model a run verifies, resolved once before any check runs: a preset or a checkpoint directory.

``resolve(preset, seed)`` turns the CLI's choice into a frozen ``ModelSource``:

- a preset name or spec (``k3-tiny``, ``k3-tiny:experts=8``; ``auto`` = ``k3-tiny``) or a ``config.json``
  path: the config's seeded synthetic weights (``k3_fastpath.synthetic``), drawn by each check from the seed
  it names; no checkpoint digest is claimed;
- a directory (``--checkpoint DIR``, or ``--preset DIR`` as its alias): a Hugging Face K3 checkpoint, read in
  full here: ``weights.load_checkpoint`` validates every header against the manifest and reads every
  tensor, each floating-point tensor must be finite, and the digest (``weights.checkpoint_digest``: sha256
  over ``name sha256`` lines) is taken over exactly the files the loader reads (``checkpoint_files``:
  config.json, the index, the shards). A file that changes while it is read is an error. The tensors stay
  in host memory for the run, so every check and builtin engine uses these tensors, the ones the digest
  describes. Any problem raises ``ModelSourceError`` (exit 2): one line naming the file and, where there is
  one, the tensor.

Checks get the source as ``ctx.model_source`` (``ctx.state_dict(seed=...)``: the checkpoint's tensors or
the synthetic ones); the bundle manifest records ``manifest()`` under ``config.model``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from verify.output import UserError

KINDS = ("preset", "checkpoint")
DIGEST_RULE = ("sha256 over one 'name sha256' line per file, in the order listed "
               "(k3_fastpath.weights.checkpoint_digest)")
_HASH_OTHER_MAX = 256 << 20  # other files in the directory (tokenizer, README) are hashed up to this size


class ModelSourceError(UserError):
    """The model the run was asked to verify cannot be used: one line, exit 2."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "preset" | "checkpoint"
    name: str  # the preset name/spec (or config.json path); for a checkpoint its config's name
    path: str | None  # the checkpoint directory (absolute); None for a preset
    config: Any  # k3_fastpath.config.K3Config
    digest: str | None  # checkpoint_digest over files_read; None for a preset (no digest claimed)
    files_read: tuple[Any, ...] = ()  # k3_fastpath.weights.FileDigest of each file the loader read
    seed: int | None = None  # a preset: the run's weight seed
    other_files: tuple[dict[str, Any], ...] = ()  # the directory's other files (not read by the loader)
    tensors: Any = field(default=None, repr=False, compare=False)  # a checkpoint: {manifest name: tensor}, read-only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ModelSource kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "checkpoint") != (self.tensors is not None and self.digest is not None):
            raise ValueError("a checkpoint ModelSource has tensors and a digest; a preset has neither")

    @property
    def is_checkpoint(self) -> bool:
        return self.kind == "checkpoint"

    @property
    def preset(self) -> str:
        """What ``ctx.preset`` and the engines' ``preset`` option carry: the preset, or the checkpoint path."""
        return self.path if self.kind == "checkpoint" else self.name  # type: ignore[return-value]

    def weights(self, seed: int | None = None) -> str:
        """``checkpoint <digest>``, or ``synthetic (seed N)`` for the weights of ``state_dict(seed)``."""
        if self.kind == "checkpoint":
            return f"checkpoint {self.digest}"
        return f"synthetic (seed {self.seed if seed is None else seed})"

    def state_dict(self, seed: int | None = None, conditioning: str = "default") -> dict[str, Any]:
        """``{manifest name: tensor}``: the checkpoint's tensors (``seed`` and ``conditioning`` do not apply;
        shared, never modify them in place), or the seeded synthetic ones of the preset."""
        if self.kind == "checkpoint":
            return dict(self.tensors)
        from k3_fastpath.synthetic import synthetic_state_dict

        s = int(self.seed or 0) if seed is None else int(seed)
        return synthetic_state_dict(self.config, s, conditioning=conditioning)

    def manifest(self) -> dict[str, Any]:
        """What the bundle manifest records (``config.model``)."""
        if self.kind == "preset":
            return {"kind": "preset", "name": self.name, "config": self.config.name, "weights": self.weights(),
                    "seed": self.seed, "digest": None, "files": []}
        tensor_bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return {"kind": "checkpoint", "name": self.name, "path": self.path, "config": self.config.name,
                "weights": self.weights(), "digest": self.digest, "digest_rule": DIGEST_RULE,
                "files": [{"name": f.name, "bytes": f.bytes, "sha256": f.sha256} for f in self.files_read],
                "tensors": len(self.tensors), "tensor_bytes": tensor_bytes,
                "other_files": [dict(f) for f in self.other_files]}


def resolve(preset: str, seed: int = 0) -> ModelSource:
    """The run's model: ``preset`` is ``auto``, a preset name/spec, a config.json path or a checkpoint dir."""
    from k3_fastpath.config import ConfigError
    from k3_fastpath.presets import get_config

    name = "k3-tiny" if preset == "auto" else str(preset)
    if Path(name).is_dir():
        return read_checkpoint(name)
    try:
        cfg = get_config(name)
    except ConfigError as e:
        raise ModelSourceError(" ".join(str(e).split())) from None
    return ModelSource(kind="preset", name=name, path=None, config=cfg, digest=None, seed=int(seed))


def _stat(root: Path, names: list[str]) -> dict[str, tuple[int, int] | None]:
    out: dict[str, tuple[int, int] | None] = {}
    for n in names:
        try:
            st = (root / n).stat()
            out[n] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            out[n] = None
    return out


def _nonfinite(root: Path, tensors: dict[str, Any]) -> list[str]:
    """One line per floating-point tensor holding NaN or Inf, naming it as stored and its file (the headers
    are read again only when there is something to name)."""
    import torch

    from k3_fastpath.weights import tensor_locations

    bad = {name: int((~torch.isfinite(t)).sum()) for name, t in tensors.items() if t.is_floating_point()}
    bad = {name: n for name, n in bad.items() if n}
    if not bad:
        return []
    locations = tensor_locations(root)
    problems = []
    for name, n in bad.items():
        stored, fname = locations.get(name, (name, "?"))
        problems.append(f"{stored} in {fname}: corrupt: {n} of {tensors[name].numel()} values are NaN or Inf")
    return problems


def _other_files(root: Path, read: set[str]) -> tuple[dict[str, Any], ...]:
    out = []
    for p in sorted(root.iterdir()):
        if p.name in read or not p.is_file() or p.name.startswith("."):
            continue
        size = p.stat().st_size
        digest = None
        if size <= _HASH_OTHER_MAX:
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
        out.append({"name": p.name, "bytes": size, "sha256": digest})
    return tuple(out)


def _one_line(root: Path, problems: list[str]) -> str:
    first = " ".join(str(problems[0]).split()) if problems else "unreadable"
    more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return f"checkpoint {root}: {first}{more}"


def read_checkpoint(path: str | Path) -> ModelSource:
    """Validate the checkpoint directory by reading every tensor; its digest over the files read."""
    from k3_fastpath import weights as W

    root = Path(path).resolve()
    if not (root / W.INDEX_NAME).is_file() and not (root / W.SINGLE_NAME).is_file():
        raise ModelSourceError(f"checkpoint {root}: neither {W.INDEX_NAME} nor {W.SINGLE_NAME} found (not a "
                               f"checkpoint; for synthetic weights of its config pass --preset {root / W.CONFIG_NAME})")
    try:
        names = W.checkpoint_files(root)
        before = _stat(root, names)
        cfg, sd = W.load_checkpoint(root)
        problems = _nonfinite(root, sd)
        if problems:
            raise W.CheckpointError(problems)
        files = W.checkpoint_file_digests(root)
        after = _stat(root, names)
    except W.CheckpointError as e:
        raise ModelSourceError(_one_line(root, e.problems)) from e
    except OSError as e:
        where = Path(e.filename).name if e.filename else str(root)
        raise ModelSourceError(f"checkpoint {root}: {where}: cannot read ({e.strerror or e})") from e
    changed = [n for n in names if before[n] != after[n]]
    if changed:
        raise ModelSourceError(f"checkpoint {root}: {changed[0]} changed while it was being read; verify a "
                               "checkpoint nothing is writing to")
    return ModelSource(kind="checkpoint", name=cfg.name, path=str(root), config=cfg,
                       digest=W.combined_digest(files), files_read=tuple(files),
                       other_files=_other_files(root, set(names)), tensors=MappingProxyType(sd))


# ---------------------------------------------------------------------------------------------- models
def build_reference_model(cfg: Any, state_dict: dict[str, Any], device: Any, *, copy: bool = True) -> Any:
    """A BF16 ``K3ForCausalLM`` of ``cfg`` holding ``state_dict`` on ``device``: a copy (the source's tensors
    are never aliased), or with ``copy=False`` the tensors themselves (already on ``device``, owned by the
    caller); made on the meta device, so nothing else is allocated."""
    import torch

    from k3_fastpath.measure.device_synthetic import assign_state_dict
    from k3_fastpath.reference.model import K3ForCausalLM

    device = torch.device(device)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, dtype=torch.bfloat16)
    assign_state_dict(model, {k: v.to(device, copy=copy) for k, v in state_dict.items()})
    return model.eval()


def checkpoint_rank_state_dict(path: str | Path, cfg: Any, tp: int, rank: int, device: Any) -> dict[str, Any]:
    """Rank ``rank``'s share of the checkpoint at ``path`` read from disk (only that slice), shaped for
    ``runtime.tp.rank_config(cfg, tp)`` like ``tp.shard_state_dict`` (the KDA ``A_log`` re-padded)."""
    import torch

    from k3_fastpath.manifest import HEAD_VEC, tensor_specs
    from k3_fastpath.runtime.tp import rank_config
    from k3_fastpath.weights import load_checkpoint

    _, sd = load_checkpoint(path, tp_size=tp, rank=rank, device=device, expect_config=cfg)
    if tp > 1:
        lac = rank_config(cfg, tp).linear_attn_config
        for spec in tensor_specs(cfg):
            if spec.tp == HEAD_VEC:
                t = sd[spec.name]
                padded = torch.zeros(max(lac.head_dim, lac.num_heads), dtype=t.dtype, device=t.device)
                padded[: t.shape[0]] = t
                sd[spec.name] = padded
    return sd


def model_argument(preset: str, checkpoint: str | Path | None) -> str:
    """``k3-verify run``'s ``--preset`` and ``--checkpoint`` as the one model argument ``resolve`` takes:
    ``--checkpoint DIR`` must name a directory and excludes any ``--preset`` but ``auto`` (exit 2); ``--preset
    DIR`` is its alias."""
    if checkpoint is None:
        return preset
    if preset != "auto":
        raise ModelSourceError(f"--preset {preset} and --checkpoint {checkpoint}: give one model, not both")
    if not Path(checkpoint).is_dir():
        raise ModelSourceError(f"--checkpoint {checkpoint}: not a directory (a Hugging Face K3 checkpoint: "
                               "config.json + safetensors shards)")
    return str(checkpoint)
