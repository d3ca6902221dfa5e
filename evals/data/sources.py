"""Where each eval's data comes from: a local directory, or a pre-filled Hugging Face cache (offline).

Nothing here downloads. A run either names a local directory (``data_dir``, e.g. what
``python -m evals.data.make_synthetic --out DIR`` writes, or the real files copied there), or finds the
real datasets already in the HF hub cache with ``HF_HUB_OFFLINE=1`` (fill it beforehand on a machine with
network: ``hf download openai/gsm8k --repo-type dataset`` etc.). Either way the exact files read are
listed with their SHA-256, so the bundle records which data produced the scores.

Local layout (JSONL, or the parquet files of the HF repos under the same names)::

    DIR/gsm8k/test.jsonl        {"question": str, "answer": "...#### 72"}           (openai/gsm8k, main)
    DIR/aime25/test.jsonl       {"id": str, "problem": str, "answer": "70"}        (math-ai/aime25)
    DIR/mrcr/2needle.jsonl      {"prompt": "<JSON list of chat messages>", "answer": str,
    DIR/mrcr/4needle.jsonl       "random_string_to_prepend": str, "n_needles": int,
    DIR/mrcr/8needle.jsonl       "desired_msg_index": int, "total_messages": int, "n_chars": int} (openai/mrcr)

A file may also be ``*.parquet`` (``gsm8k/test-*.parquet``, ``mrcr/2needle/2needle_*.parquet``: the HF repos'
own paths), so the real datasets can be copied in as downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# dataset kind -> (HF repo id, the files of the evaluated split inside that repo)
HF_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gsm8k": ("openai/gsm8k", ("main/test-*.parquet",)),
    "aime25": ("math-ai/aime25", ("test.jsonl", "test-*.parquet", "data/test-*.parquet")),
    "mrcr2": ("openai/mrcr", ("2needle/*.parquet",)),
    "mrcr4": ("openai/mrcr", ("4needle/*.parquet",)),
    "mrcr8": ("openai/mrcr", ("8needle/*.parquet",)),
}
# dataset kind -> file patterns inside a local data directory (first pattern that matches wins)
LOCAL_PATTERNS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("gsm8k/test.jsonl", "gsm8k/test-*.parquet", "gsm8k/main/test-*.parquet"),
    "aime25": ("aime25/test.jsonl", "aime25/test-*.parquet"),
    "mrcr2": ("mrcr/2needle.jsonl", "mrcr/2needle/*.parquet", "mrcr/2needle_*.parquet"),
    "mrcr4": ("mrcr/4needle.jsonl", "mrcr/4needle/*.parquet", "mrcr/4needle_*.parquet"),
    "mrcr8": ("mrcr/8needle.jsonl", "mrcr/8needle/*.parquet", "mrcr/8needle_*.parquet"),
}
DATA_DIR_ENV = "K3_EVAL_DATA_DIR"  # the default data_dir when a run names none


class DataError(RuntimeError):
    """The dataset could not be found or read (one line: what was looked for, where)."""


class NoDataError(DataError):
    """No data was given and none is on this machine: the eval is skipped, not failed (the reason says
    where it looked and the command that provides data)."""


PROVIDE_DATA = ("pass data_dir (a local copy, see evals/README.md), or `python -m evals.data.make_synthetic "
                "--out DIR` and data_dir: DIR (seeded stand-ins), or data_dir: synthetic")


def kind_for(dataset: str, n_needles: int | None = None) -> str:
    if dataset == "mrcr":
        if n_needles not in (2, 4, 8):
            raise DataError(f"MRCR has 2, 4 or 8 needles, got {n_needles!r}")
        return f"mrcr{n_needles}"
    if dataset not in HF_SOURCES:
        raise DataError(f"unknown dataset {dataset!r} (known: gsm8k, aime25, mrcr)")
    return dataset


@dataclass(frozen=True)
class DataSource:
    kind: str  # gsm8k, aime25, mrcr2, mrcr4, mrcr8
    origin: str  # "local:<dir>" or "hf-cache:<repo>@<revision>"
    files: tuple[Path, ...]

    def describe(self) -> dict[str, Any]:
        """What the bundle records: where the data came from and each file's SHA-256 and size."""
        return {"kind": self.kind, "origin": self.origin,
                "files": [{"path": str(p), "name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                          for p in self.files]}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve(kind: str, data_dir: str | Path | None = None) -> DataSource:
    """The files of dataset ``kind``: from ``data_dir`` (or $K3_EVAL_DATA_DIR) when given, else from the
    HF hub cache without network. DataError naming both places when neither has it."""
    data_dir = data_dir or os.environ.get(DATA_DIR_ENV) or None
    if data_dir:
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise DataError(f"eval data directory {root} does not exist")
        for pattern in LOCAL_PATTERNS[kind]:
            files = tuple(sorted(root.glob(pattern)))
            if files:
                return DataSource(kind, f"local:{root.resolve()}", files)
        raise DataError(f"{kind}: none of {', '.join(LOCAL_PATTERNS[kind])} under {root} "
                        f"(make synthetic data with: python -m evals.data.make_synthetic --out {root})")
    return _from_hf_cache(kind)


def _from_hf_cache(kind: str) -> DataSource:
    repo, patterns = HF_SOURCES[kind]
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - huggingface_hub comes with the eval extra
        raise NoDataError(f"{kind}: no data_dir given and huggingface_hub is not installed ({e}); "
                          f"{PROVIDE_DATA}") from None
    try:
        snap = Path(snapshot_download(repo_id=repo, repo_type="dataset", local_files_only=True,
                                      allow_patterns=list(patterns)))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise NoDataError(f"{kind}: no data_dir given and {repo} is not in the HF cache "
                          f"({type(e).__name__}); fill it with `hf download {repo} --repo-type dataset`, or "
                          f"{PROVIDE_DATA}") from None
    for pattern in patterns:
        files = tuple(sorted(p for p in snap.glob(pattern) if p.is_file()))
        if files:
            return DataSource(kind, f"hf-cache:{repo}@{snap.name}", files)
    raise DataError(f"{kind}: {repo} is in the HF cache at {snap} but holds none of {', '.join(patterns)}")


def read_rows(source: DataSource) -> list[dict[str, Any]]:
    """Every row of the source's files, in file order (JSONL line by line; parquet through pyarrow)."""
    rows: list[dict[str, Any]] = []
    for path in source.files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
                    if not isinstance(row, dict):
                        raise DataError(f"{path}:{n}: a row must be a JSON object")
                    rows.append(row)
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows += pq.read_table(path).to_pylist()
        else:
            raise DataError(f"{path}: unsupported data file (use .jsonl or .parquet)")
    if not rows:
        raise DataError(f"{source.kind}: no rows in {', '.join(str(p) for p in source.files)}")
    return rows
