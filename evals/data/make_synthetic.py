"""Small seeded datasets in the real formats: ``python -m evals.data.make_synthetic --out DIR``.

Tests and CPU runs cannot fetch GSM8K, AIME25 or MRCR; these generators make stand-ins whose *format*
is the real one (field names, the ``#### <int>`` answer line, MRCR's JSON message list with its prefix
rule), so the same task YAMLs, loaders and scorers run on both. The items are the eval split of
``k3_fastpath.sentinel.tasks`` (the sentinel trains on that module's disjoint training split):

- GSM8K: arithmetic word problems (2-3 steps) with GSM8K-style worked answers ending ``#### <int>``;
- AIME25: number-theory/counting problems whose answer is an integer in 0..999 (as a string, like
  math-ai/aime25);
- MRCR: multi-turn conversations in openai/mrcr's format: ``prompt`` is a JSON list of chat messages in
  which the same request ("write a poem about tapirs") appears ``n_needles`` times among distractors, the
  last user turn asks for the i-th one with a random prefix; ``answer`` = prefix + that response. The
  conversation grows to ``--mrcr-chars`` characters, so needles sit at any length.

The same ``--seed`` gives byte-identical files (``random.Random`` seeded with a string, no hash()
randomisation); ``DIR/MANIFEST.json`` lists each file's SHA-256.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from evals.data.sources import sha256_file
from k3_fastpath.sentinel import tasks


# ---------------------------------------------------------------- writing
def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


DEFAULT_COUNTS = {"gsm8k": 50, "aime": 30, "mrcr": 20}  # items per file (MRCR: per needle count), by argument
COUNT_ARG = {"gsm8k": "gsm8k", "aime25": "aime", "mrcr": "mrcr"}  # dataset -> make_all's count argument


def make_all(out: Path, seed: int = 0, gsm8k: int = DEFAULT_COUNTS["gsm8k"], aime: int = DEFAULT_COUNTS["aime"],
             mrcr: int = DEFAULT_COUNTS["mrcr"],
             mrcr_chars: int = tasks.EVAL_MRCR_CHARS, needles: tuple[int, ...] = tasks.EVAL_NEEDLES) -> dict[str, Any]:
    """Write every dataset under ``out``; returns the manifest (also written to ``out/MANIFEST.json``)."""
    if min(gsm8k, aime, mrcr) < 1 or mrcr_chars < 1:
        raise ValueError("every dataset needs at least one item and --mrcr-chars must be positive")
    out = Path(out)
    files: dict[str, list[dict[str, Any]]] = {
        "gsm8k/test.jsonl": [t.record for t in tasks.items("gsm8k", "eval", seed, gsm8k)],
        "aime25/test.jsonl": [t.record for t in tasks.items("aime25", "eval", seed, aime)],
    }
    for n in needles:
        files[f"mrcr/{n}needle.jsonl"] = [t.record for t in tasks.items("mrcr", "eval", seed, mrcr, n_needles=n,
                                                                          mrcr_chars=mrcr_chars)]
    for rel, rows in files.items():
        _write_jsonl(out / rel, rows)
    manifest = {"generator": "evals.data.make_synthetic", "seed": seed,
                "params": {"gsm8k": gsm8k, "aime": aime, "mrcr": mrcr, "mrcr_chars": mrcr_chars,
                           "needles": list(needles)},
                "files": {rel: {"rows": len(rows), "sha256": sha256_file(out / rel)} for rel, rows in files.items()}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.data.make_synthetic", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="directory to write (gsm8k/, aime25/, mrcr/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gsm8k", type=int, default=DEFAULT_COUNTS["gsm8k"], help="GSM8K-style items")
    p.add_argument("--aime", type=int, default=DEFAULT_COUNTS["aime"], help="AIME-style items")
    p.add_argument("--mrcr", type=int, default=DEFAULT_COUNTS["mrcr"], help="MRCR conversations per needle count")
    p.add_argument("--mrcr-chars", type=int, default=tasks.EVAL_MRCR_CHARS, help="MRCR conversation length in characters")
    args = p.parse_args(argv)
    try:
        m = make_all(args.out, args.seed, args.gsm8k, args.aime, args.mrcr, args.mrcr_chars)
    except (ValueError, OSError) as e:
        print(f"make_synthetic: {e}", file=sys.stderr)
        return 2
    for rel, info in sorted(m["files"].items()):
        print(f"{info['sha256']}  {info['rows']:>5} rows  {args.out / rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
