"""Read a bundle for display: ``load_bundle`` (manifest, results, record counts) and ``show_bundle``
(a plain dict the CLI renders as tables or prints as JSON). Display only: ``verify_bundle`` decides
whether a bundle can be trusted; this reads what is there, including a running bundle's unsealed lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verify.bundle.schema import (
    MANIFEST,
    RECORDS_DIR,
    RESULTS,
    BundleError,
    manifest_header_problem,
    read_state,
    walk_bundle,
)
from verify.bundle.verify import open_bundle
from verify.result import STATUSES, CheckResult

_ESSENTIALS = ("schema_version", "tool", "argv", "tier", "planned_checks", "engines", "config", "seeds", "env",
               "started_at", "ended_at", "state", "verdict", "verdict_reasons")


@dataclass(frozen=True)
class LoadedBundle:
    manifest: dict[str, Any]
    results: tuple[CheckResult, ...]
    result_errors: tuple[str, ...]  # results.jsonl lines that did not parse (line number: why)
    records: dict[str, int]  # stream -> number of complete lines
    files: tuple[str, ...]


def _complete_lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    return data.split(b"\n")[:-1]  # a trailing partial line (a killed run) is not a line yet


def load_bundle(path: str | Path) -> LoadedBundle:
    """Manifest, results and record counts of a bundle directory or .tar.gz. BundleError (exit 2) when
    the input is not a bundle; everything else is read best-effort."""
    with open_bundle(path) as root:
        try:
            manifest = json.loads((root / MANIFEST).read_bytes())
        except ValueError as e:
            raise BundleError(f"{MANIFEST} is not valid JSON ({' '.join(str(e).split())[:120]})") from None
        header = manifest_header_problem(manifest)
        if header:
            raise BundleError(header)
        results, errors = [], []
        if (root / RESULTS).is_file():
            for i, line in enumerate(_complete_lines(root / RESULTS), start=1):
                try:
                    results.append(CheckResult.from_dict(json.loads(line)))
                except ValueError as e:
                    errors.append(f"line {i}: {' '.join(str(e).split())[:160]}")
        files, _ = walk_bundle(root)
        records = {}
        for rel in files:
            if rel.startswith(RECORDS_DIR + "/") and rel.endswith(".jsonl"):
                records[rel[len(RECORDS_DIR) + 1:-6]] = len(_complete_lines(root / rel))
        return LoadedBundle(manifest=read_state(manifest, results), results=tuple(results), result_errors=tuple(errors),
                            records=records, files=tuple(files))


def show_bundle(path: str | Path | LoadedBundle) -> dict[str, Any]:
    """{"manifest": essentials, "results": [...], "counts": {...}, "records": {...}, "result_errors": [...]}.

    ``results`` lists each result's dict in plan order, then unplanned ones; a planned check without a
    result appears as ``{"id", "status": "missing", "reason": "no result recorded", ...}``.
    """
    b = path if isinstance(path, LoadedBundle) else load_bundle(path)
    m = b.manifest
    manifest = {k: m.get(k) for k in _ESSENTIALS}
    planned = m.get("planned_checks") if isinstance(m.get("planned_checks"), list) else []
    by_id: dict[str, CheckResult] = {}
    for r in b.results:
        by_id.setdefault(r.id, r)
    rows = []
    for cid in planned:
        r = by_id.get(cid)
        rows.append(r.to_dict() if r else {"id": cid, "status": "missing", "reason": "no result recorded",
                                           "metrics": {}, "artifacts": [], "duration_s": None,
                                           "started_at": None, "ended_at": None})
    rows += [r.to_dict() for r in b.results if r.id not in planned]
    counts = {s: sum(1 for row in rows if row["status"] == s) for s in (*STATUSES, "missing")}
    return {"manifest": manifest, "results": rows, "counts": counts, "records": dict(b.records),
            "result_errors": list(b.result_errors)}
