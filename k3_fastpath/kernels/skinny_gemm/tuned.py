"""Measured configs for the skinny GEMM: the winners of an H200 sweep, consulted before the heuristic.

``tuned_h200.json`` maps ``"N,K,M"`` to the fields of the fastest ``SkinnyGemmConfig`` found by
``bench.kernels`` with ``sweep: true`` (one factor at a time around the heuristic's pick, CUDA-graph medians,
cold L2), and names the bundle it came from. ``SkinnyGemmConfig.from_heuristic`` returns the tuned config
for an exact (N, K, M) when the table has one and its epilogue flags match; every other shape keeps the
heuristic. A tuned entry is only taken when it beat the heuristic by more than ``MIN_GAIN`` (run-to-run
spread of these medians on the H200 was up to ~4%), so the table holds measured wins, not noise.

Regenerate from a sweep bundle (e.g. ``k3-verify run --tier scripts/gpu/gemm-sweep.yaml`` on an H200):

    python -m k3_fastpath.kernels.skinny_gemm.tuned BUNDLE_DIR [--out tuned_h200.json]
"""

from __future__ import annotations

import argparse
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("tuned_h200.json")
MIN_GAIN = 0.05
FIELDS = ("variant", "m_max", "rows_per_warp", "warps_n", "warps_k", "split_k", "k_unroll", "min_ctas_per_sm")


@lru_cache(maxsize=1)
def _table() -> dict[str, dict[str, Any]]:
    if not TABLE.is_file():
        return {}
    return json.loads(TABLE.read_text())["configs"]


def lookup(N: int, K: int, M: int) -> dict[str, Any] | None:
    """The tuned config fields for exactly (N, K, M), or None."""
    return _table().get(f"{N},{K},{M}")


def parse_config_repr(text: str) -> dict[str, Any]:
    """``SkinnyGemmConfig(variant='fma', m_max=2, ...)`` -> its launch fields."""
    out: dict[str, Any] = {}
    for key, val in re.findall(r"(\w+)=('[^']*'|\w+)", text):
        if key in FIELDS:
            out[key] = val.strip("'") if val.startswith("'") else int(val)
    missing = [f for f in FIELDS if f not in out]
    if missing:
        raise ValueError(f"config repr lacks {missing}: {text[:120]}")
    return out


def table_from_records(records: list[dict[str, Any]], source: str) -> dict[str, Any]:
    configs: dict[str, dict[str, Any]] = {}
    evidence: dict[str, str] = {}
    for r in records:
        if r.get("kernel") != "skinny_gemm" or "best" not in r:
            continue
        gain = 1.0 - r["best_us"] / r["heuristic_us"]
        if gain <= MIN_GAIN:
            continue
        key = f"{r['N']},{r['K']},{r['M']}"
        configs[key] = parse_config_repr(r["best"])
        evidence[key] = (f"{r['shape']}: {r['heuristic_us']:.1f} -> {r['best_us']:.1f} us "
                         f"(cuBLAS {r['cublas_us']:.1f}) changing {r.get('best_changes')}")
    return {"source": source, "min_gain": MIN_GAIN, "configs": dict(sorted(configs.items())),
            "evidence": dict(sorted(evidence.items()))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a bundle directory with bench.kernels sweep records")
    ap.add_argument("--out", type=Path, default=TABLE)
    a = ap.parse_args(argv)
    rec = a.bundle / "records" / "bench.kernels.jsonl"
    if not rec.is_file():
        raise SystemExit(f"{rec}: no bench.kernels records in that bundle")
    records = [json.loads(line) for line in rec.read_text().splitlines() if line.strip()]
    table = table_from_records(records, source=a.bundle.name)
    a.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table['configs'])} tuned configs -> {a.out}")


if __name__ == "__main__":
    main()
