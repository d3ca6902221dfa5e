"""Copy a bundle and fabricate one raw record in it the way a forger would, then re-seal it: the copy must
still pass ``k3-verify bundle verify`` (the rescorers cannot tell) and ``k3-verify bundle audit`` must find
the record (the re-execution disagrees). Used on the GPU host after a tier run (scripts/gpu/
h200_smoke_and_bench.sh ``auditplant``); tests/test_bundle_audit.py does the same on a CPU bundle.

    python scripts/gpu/plant_record.py SRC DST

The fabrication: ``weights.roundtrip``'s load-step digest with its last hex digit changed (well-formed, no
rule reads it), and ``equivalence.decode``'s largest absolute logit error of one step row scaled by 0.5
(within the point's maximum, which is what the rule checks). Exit 1 when the copy no longer verifies.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from verify.bundle import schema
from verify.bundle.schema import SumEntry, format_sums, sha256_file, walk_bundle
from verify.bundle.verify import verify_bundle


def _edit(root: Path, check_id: str, fn) -> str:
    path = root / schema.RECORDS_DIR / f"{check_id}.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    what = fn(rows)
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    return f"{check_id}: {what}"


def _digest(rows: list[dict]) -> str:
    i, load = next((i, r) for i, r in enumerate(rows) if r.get("step") == "load")
    old = load["digest"]
    load["digest"] = old[:-1] + ("0" if old[-1] != "0" else "1")
    return f"record {i} digest {old[-6:]} -> {load['digest'][-6:]}"


def _logit_err(rows: list[dict]) -> str:
    i, step = next((i, r) for i, r in enumerate(rows) if r.get("kind") == "step" and r.get("max_abs_err"))
    old = step["max_abs_err"]
    step["max_abs_err"] = old * 0.5
    return f"record {i} max_abs_err {old:.6g} -> {step['max_abs_err']:.6g}"


PLANTS = {"weights.roundtrip": _digest, "equivalence.decode": _logit_err}


def main(src: str, dst: str) -> int:
    root = Path(dst)
    shutil.copytree(src, root)
    done = [_edit(root, cid, fn) for cid, fn in PLANTS.items() if (root / schema.RECORDS_DIR / f"{cid}.jsonl").is_file()]
    files, _ = walk_bundle(root)
    entries = [SumEntry(f, sha256_file(root / f)[0]) for f in files if f != schema.SUMS]
    (root / schema.SUMS).write_bytes(format_sums(entries, sealed=False))
    report = verify_bundle(root)
    print("planted:", "; ".join(done) or "nothing (no check to plant in)")
    print("verify of the forged copy:", "OK" if report.ok else f"FAILS ({report.problems[:2]})")
    return 0 if report.ok and done else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
