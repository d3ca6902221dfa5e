"""Read what ``bundle compare`` and ``bundle render`` need from a bundle: checks, sweep points, kernel
bench rows and eval samples, each as a small named record with a tested schema (``bundles/COMPARE.md``).

Why a separate reader: the raw records are written by several checks (``perf.decode_sweep``,
``bench.kernels``, ``evals.*``) and a bundle may hold any subset of them, or records from an older writer.
Everything here is tolerant: a record that is not a sweep point / bench row / eval sample is skipped, a
record that claims to be one but breaks the schema becomes a note, and a missing check is reported as
absent by the callers, never as an error. Statistics (exact McNemar, bootstrap CIs, a two-sample z-test)
are here too, in plain Python + numpy, so compare and render state the same numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
from verify.result import CheckResult
from verify.stats import percentile

SWEEP_CHECK = "perf.decode_sweep"
BENCH_CHECK = "bench.kernels"
EVAL_PREFIX = "evals."
BACKENDS = ("fast", "standard", "reference")  # reference: the eager PyTorch model (since session 3)
VARIANT_PREFIX = "fast_"  # fast variants timed beside fast (decode_sweep fast_variants, e.g. fast_pdl; session 5)


# ---------------------------------------------------------------- the bundle as data
@dataclass(frozen=True)
class BundleData:
    path: str
    name: str
    manifest: dict[str, Any]
    results: dict[str, CheckResult]  # the first result of each check id
    order: tuple[str, ...]  # planned checks, then unplanned results
    records: dict[str, list[dict[str, Any]]]  # stream -> records (complete JSON-object lines)
    notes: tuple[str, ...] = ()  # lines that could not be read

    def status(self, check_id: str) -> str:
        """passed / failed / skipped / error, ``missing`` (planned, no result) or ``absent`` (not planned)."""
        r = self.results.get(check_id)
        if r is not None:
            return r.status
        return "missing" if check_id in (self.manifest.get("planned_checks") or []) else "absent"

    def streams(self, check_id: str) -> dict[str, list[dict[str, Any]]]:
        """The check's own stream and its ``<check id>.<part>`` streams."""
        return {s: recs for s, recs in self.records.items() if s == check_id or s.startswith(check_id + ".")}

    @property
    def gpu(self) -> str:
        env = self.manifest.get("env") or {}
        gpus = env.get("gpus") if isinstance(env, dict) else None
        if isinstance(gpus, list) and gpus and isinstance(gpus[0], dict):
            names = sorted({str(g.get("name")) for g in gpus if isinstance(g, dict)})
            return f"{len(gpus)}x {', '.join(names)}"
        gpu = env.get("gpu") if isinstance(env, dict) else None
        return str(gpu.get("name")) if isinstance(gpu, dict) and gpu.get("name") else "no GPU recorded"


def _json_lines(data: bytes, where: str, notes: list[str]) -> list[dict[str, Any]]:
    out = []
    for i, line in enumerate(data.split(b"\n")[:-1], start=1):  # a trailing partial line is not a line yet
        try:
            obj = json.loads(line)
        except ValueError:
            notes.append(f"{where} line {i}: not JSON, skipped")
            continue
        if isinstance(obj, dict):
            out.append(obj)
        else:
            notes.append(f"{where} line {i}: not a JSON object, skipped")
    return out


def read_bundle(path: str | Path) -> BundleData:
    """Manifest, results and all records of a bundle directory or .tar.gz (BundleError, exit 2, when the
    input is not a readable bundle). Reads what is there; ``verify_bundle`` decides whether to trust it."""
    p = Path(path)
    with open_bundle(p) as root:
        try:
            manifest = json.loads((root / MANIFEST).read_bytes())
        except ValueError as e:
            raise BundleError(
                f"{p}: {MANIFEST} is not valid JSON ({' '.join(str(e).split())[:120]})"
            ) from None
        header = manifest_header_problem(manifest)
        if header:
            raise BundleError(f"{p}: {header}")
        notes: list[str] = []
        results: dict[str, CheckResult] = {}
        if (root / RESULTS).is_file():
            for obj in _json_lines((root / RESULTS).read_bytes(), RESULTS, notes):
                try:
                    r = CheckResult.from_dict(obj)
                except ValueError as e:
                    notes.append(f"{RESULTS}: {' '.join(str(e).split())[:160]}")
                    continue
                results.setdefault(r.id, r)
        records: dict[str, list[dict[str, Any]]] = {}
        for rel in walk_bundle(root)[0]:
            if rel.startswith(RECORDS_DIR + "/") and rel.endswith(".jsonl"):
                records[rel[len(RECORDS_DIR) + 1 : -6]] = _json_lines((root / rel).read_bytes(), rel, notes)
    manifest = read_state(manifest, list(results.values()))
    planned = [c for c in manifest.get("planned_checks") or [] if isinstance(c, str)]
    order = tuple(dict.fromkeys(planned + list(results)))
    name = p.name[:-7] if p.name.endswith(".tar.gz") else p.name
    return BundleData(
        path=str(p),
        name=name,
        manifest=manifest,
        results=results,
        order=order,
        records=records,
        notes=tuple(notes),
    )


# ---------------------------------------------------------------- small numeric helpers
def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


# ---------------------------------------------------------------- perf.decode_sweep points
@dataclass(frozen=True)
class SweepPoint:
    """One record of ``perf.decode_sweep``: a decode step at (batch, context, tp, routing) on one backend."""

    variant: str  # "decode"; "mixed" (prefill + decode) or another part name from the stream / record
    tp: int
    routing: str
    batch: int
    context: int
    backend: str  # fast | standard | reference | fast_<variant>
    median_us: float
    p10_us: float | None = None
    p90_us: float | None = None
    samples_n: int | None = None
    floor_us: float | None = None
    tokens_per_s_user: float | None = None
    tokens_per_s_gpu: float | None = None

    @property
    def key(self) -> tuple[str, int, str, int, int]:
        return (self.variant, self.tp, self.routing, self.batch, self.context)

    @property
    def spread(self) -> float | None:
        """Run-to-run spread as a fraction of the median: (p90 - p10) / median, None when not recorded."""
        if self.p10_us is None or self.p90_us is None:
            return None
        return max(0.0, self.p90_us - self.p10_us) / self.median_us

    @property
    def pct_of_floor(self) -> float | None:
        """floor / measured step time (1.0 = at the HBM floor), derived here, never read from the record."""
        return None if self.floor_us is None else self.floor_us / self.median_us

    @property
    def label(self) -> str:
        head = "" if self.variant == "decode" else f"{self.variant} "
        return f"{head}tp={self.tp} {self.routing} batch={self.batch} ctx={self.context}"


_SAMPLE_KEYS = ("step_us_samples", "samples_us")


def sweep_points(data: BundleData) -> tuple[list[SweepPoint], list[str]]:
    """(points, notes) from ``records/perf.decode_sweep*.jsonl``. A record is a point when it has
    ``batch``, ``context`` and ``backend``; other records (probes, summaries) are skipped silently.
    Percentiles come from ``step_us_p10/p90`` or, when absent, from the replay samples."""
    points, notes = [], []
    for stream, recs in sorted(data.streams(SWEEP_CHECK).items()):
        part = stream[len(SWEEP_CHECK) + 1 :] if stream != SWEEP_CHECK else ""
        for i, r in enumerate(recs, start=1):
            if not all(k in r for k in ("batch", "context", "backend")):
                continue
            where = f"records/{stream}.jsonl record {i}"
            samples = next((r[k] for k in _SAMPLE_KEYS if isinstance(r.get(k), list)), None)
            samples = [x for x in (_num(v) for v in samples or []) if x is not None and x > 0]
            median = _num(r.get("step_us_median"))
            if median is None and samples:
                median = percentile(samples, 50)
            p10, p90 = _num(r.get("step_us_p10")), _num(r.get("step_us_p90"))
            if (p10 is None or p90 is None) and len(samples) >= 2:
                p10, p90 = percentile(samples, 10), percentile(samples, 90)
            if r["backend"] not in BACKENDS and not str(r["backend"]).startswith(VARIANT_PREFIX):
                notes.append(
                    f"{where}: backend {r['backend']!r} is not one of {', '.join(BACKENDS)} "
                    f"or {VARIANT_PREFIX}*; skipped"
                )
                continue
            if median is None or median <= 0:
                notes.append(f"{where}: no positive step_us_median (or samples); skipped")
                continue
            try:
                batch, context, tp = int(r["batch"]), int(r["context"]), int(r.get("tp", 1))
            except (TypeError, ValueError):
                notes.append(f"{where}: batch/context/tp are not integers; skipped")
                continue
            variant = str(
                r.get("variant")
                or r.get("mode")
                or ("mixed" if r.get("mixed") is True else "")
                or part
                or "decode"
            )
            n = r.get("samples_n")
            points.append(
                SweepPoint(
                    variant=variant,
                    tp=tp,
                    routing=str(r.get("routing") or "uniform"),
                    batch=batch,
                    context=context,
                    backend=r["backend"],
                    median_us=median,
                    p10_us=p10,
                    p90_us=p90,
                    samples_n=int(n) if _num(n) is not None else (len(samples) or None),
                    floor_us=_num(r.get("floor_us")),
                    tokens_per_s_user=_num(r.get("tokens_per_s_user")),
                    tokens_per_s_gpu=_num(r.get("tokens_per_s_gpu")),
                )
            )
    return points, notes


def speedups(points: Iterable[SweepPoint]) -> dict[tuple, float]:
    """point key -> standard median / fast median, where both backends were measured."""
    by: dict[tuple, dict[str, SweepPoint]] = {}
    for p in points:
        by.setdefault(p.key, {})[p.backend] = p
    return {k: v["standard"].median_us / v["fast"].median_us for k, v in by.items() if "standard" in v and "fast" in v}


# ---------------------------------------------------------------- bench.kernels rows
# per kernel: id fields in label order, our time field, baseline (time field, name) in order of preference
# (verify/checks/bench.py: kda_decode compares to fla's whole step composition when it was measured)
_BENCH_KINDS = {
    "skinny_gemm": (("shape", "N", "K", "M"), "heuristic_us", (("cublas_us", "cuBLAS"),)),
    "kda_decode": (("H", "B"), "ours_us", (("fla_full_us", "fla"), ("fla_us", "fla recurrence"))),
    "kda_layer": (("H", "B"), "ours_us", (("cublas_fla_us", "cuBLAS+fla"),)),
    "rmsnorm_residual": (("M",), "ours_us", (("torch_us", "torch"),)),
    "attn_res_mix": (("sources", "M"), "ours_us", (("torch_us", "torch"),)),
}
_GENERIC_KIND = (("shape", "N", "K", "H", "sources", "M", "B"), "ours_us", (("baseline_us", "baseline"),))


@dataclass(frozen=True)
class BenchRow:
    """One timed kernel shape of ``bench.kernels``: ours vs the baseline measured in the same process."""

    kernel: str
    ids: tuple[
        tuple[str, Any], ...
    ]  # (field, value) that identify the shape, e.g. (("shape", "kda_in_proj"), ...)
    ours_us: float
    baseline: str  # cuBLAS | fla | torch
    baseline_us: float | None
    floor_us: float | None
    p10_us: float | None = None
    p90_us: float | None = None

    @property
    def key(self) -> tuple:
        return (self.kernel, *self.ids)

    @property
    def label(self) -> str:
        d = dict(self.ids)
        parts = [self.kernel]
        if "shape" in d:
            parts.append(str(d.pop("shape")))
        if "N" in d and "K" in d:
            parts.append(f"{d.pop('N')}x{d.pop('K')}")
        parts += [f"{k}={v}" for k, v in d.items()]
        return " ".join(parts)

    @property
    def vs_baseline(self) -> float | None:
        return None if self.baseline_us is None else self.baseline_us / self.ours_us

    @property
    def pct_of_floor(self) -> float | None:
        return None if self.floor_us is None else self.floor_us / self.ours_us

    @property
    def spread(self) -> float | None:
        if self.p10_us is None or self.p90_us is None:
            return None
        return max(0.0, self.p90_us - self.p10_us) / self.ours_us


def bench_rows(data: BundleData) -> tuple[list[BenchRow], list[str]]:
    """(rows, notes) from ``records/bench.kernels*.jsonl``: records with a ``kernel`` and a time; rows that
    recorded an ``error`` instead of a time become notes. A shape timed twice keeps its first row."""
    rows, notes, seen = [], [], set()
    for _stream, recs in sorted(data.streams(BENCH_CHECK).items()):
        for r in recs:
            kernel = r.get("kernel")
            if not isinstance(kernel, str):
                continue
            fields, tkey, baselines = _BENCH_KINDS.get(kernel, _GENERIC_KIND)
            bkey, bname = next(((k, n) for k, n in baselines if _num(r.get(k)) is not None), baselines[0])
            ids = tuple((f, r[f]) for f in fields if f in r and isinstance(r[f], (int, str)))
            ours = _num(r.get(tkey))
            if ours is None or ours <= 0:
                if "error" in r:
                    notes.append(f"{kernel} {' '.join(f'{k}={v}' for k, v in ids)}: not timed: {r['error']}")
                continue
            row = BenchRow(
                kernel=kernel,
                ids=ids,
                ours_us=ours,
                baseline=bname,
                baseline_us=_num(r.get(bkey)),
                floor_us=_num(r.get("floor_us")),
                p10_us=_num(r.get(tkey[:-3] + "_p10_us")),
                p90_us=_num(r.get(tkey[:-3] + "_p90_us")),
            )
            if row.key in seen:
                continue
            seen.add(row.key)
            rows.append(row)
    return rows, notes


# ---------------------------------------------------------------- evals.* samples
UNDER_TEST, BASELINE = "under_test", "baseline"
_SIDE_WORDS = {
    UNDER_TEST: ("under_test", "engine_under_test", "fast", "candidate", "test", "eut"),
    BASELINE: ("baseline", "reference", "standard", "base"),
}
_SIDE_KEYS = ("side", "role", "engine_role", "engine")
_ITEM_KEYS = ("doc_hash", "doc_id", "item_id", "item", "id")
_SCORE_KEYS = ("correct", "score", "acc", "exact_match")


def _side(r: Mapping[str, Any]) -> str | None:
    for k in _SIDE_KEYS:
        v = r.get(k)
        if isinstance(v, str):
            low = v.lower()
            for side, words in _SIDE_WORDS.items():
                if low in words or any(low.startswith(w + ":") or low.endswith(":" + w) for w in words):
                    return side
    return None


@dataclass(frozen=True)
class EvalSamples:
    """Per-item scores of one eval check on both sides; repeats (AIME) are averaged per item first."""

    check_id: str  # the check id, or "<check id>[<task>]" when the check ran several lm-eval tasks
    scores: dict[str, dict[str, float]]  # side -> item -> score in [0, 1]
    binary: bool  # every score 0 or 1 (McNemar applies)
    stats: dict[str, Any] = field(default_factory=dict)  # the check's own stats record, as written

    def accuracy(self, side: str) -> float | None:
        s = self.scores.get(side) or {}
        return sum(s.values()) / len(s) if s else None

    def n(self, side: str) -> int:
        return len(self.scores.get(side) or {})


def eval_checks(data: BundleData) -> list[str]:
    """Eval check ids with a result or records in the bundle."""
    ids = {c for c in data.order if c.startswith(EVAL_PREFIX)}
    ids |= {
        s.split(".")[0] + "." + s.split(".")[1]
        for s in data.records
        if s.startswith(EVAL_PREFIX) and len(s.split(".")) >= 2
    }
    return sorted(ids)


def eval_samples(data: BundleData, check_id: str) -> tuple[dict[str, EvalSamples], list[str]]:
    """({label: samples}, notes) of eval check ``check_id``: one entry per lm-eval task when the samples
    name several (``evals.mrcr[k3_mrcr_2needle]``), else one entry labelled with the check id. Items are
    keyed by ``doc_hash`` (or another item id); a ``type: task_stats`` / ``kind: stats`` record is kept as
    that task's ``stats``. Empty when the records hold no samples."""
    raw: dict[str, dict[str, dict[str, list[float]]]] = {}  # task -> side -> item -> scores
    stats: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for stream, recs in sorted(data.streams(check_id).items()):
        for r in recs:
            task = str(r.get("task") or "")
            if r.get("type") == "task_stats" or r.get("kind") == "stats" or isinstance(r.get("stats"), dict):
                stats[task] = dict(r.get("stats") if isinstance(r.get("stats"), dict) else r)
                continue
            item_key = next((k for k in _ITEM_KEYS if k in r), None)
            if isinstance(r.get("scores"), list):  # one score per repeat (verify/evals/runner.py)
                vals = list(r["scores"])
            else:
                score_key = next((k for k in _SCORE_KEYS if k in r), None)
                vals = None if score_key is None else [r[score_key]]
            if vals is None or item_key is None:
                continue  # config, data and other records
            side = _side(r)
            scores = [float(v) if isinstance(v, bool) else _num(v) for v in vals]
            if side is None or not scores or any(x is None or not 0.0 <= x <= 1.0 for x in scores):
                notes.append(f"records/{stream}.jsonl: a sample without a known side or a score in [0, 1]; skipped")
                continue
            by_side = raw.setdefault(task, {UNDER_TEST: {}, BASELINE: {}})
            by_side[side].setdefault(str(r[item_key]), []).extend(scores)
    out = {}
    for task, by_side in sorted(raw.items()):
        label = check_id if len(raw) == 1 else f"{check_id}[{task or '-'}]"
        scores = {side: {item: sum(v) / len(v) for item, v in items.items()} for side, items in by_side.items()}
        binary = all(x in (0.0, 1.0) for items in scores.values() for x in items.values())
        out[label] = EvalSamples(check_id=label, scores=scores, binary=binary, stats=stats.get(task, {}))
    return out, notes


# ---------------------------------------------------------------- statistics
def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs:
    2 * P(X <= min(b, c)) with X ~ Bin(b + c, 1/2), at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1))  # exact integers: 2.0**n overflows past n = 1023
    return min(1.0, 2 * tail / (1 << n))


def bootstrap_ci(
    diffs: Sequence[float],
    *,
    seed: int = 0,
    n_boot: int = 4000,
    alpha: float = 0.05,
    other: Sequence[float] | None = None,
) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(diffs) (paired), or of mean(other) - mean(diffs) when ``other`` is
    given (unpaired: each side resampled on its own). Seeded: the same input gives the same interval."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = np.asarray(diffs, dtype=np.float64)
    if a.size == 0 or (other is not None and len(other) == 0):
        raise ValueError("bootstrap of an empty sample")
    means = a[rng.integers(0, a.size, size=(n_boot, a.size))].mean(axis=1)
    if other is not None:
        b = np.asarray(other, dtype=np.float64)
        means = b[rng.integers(0, b.size, size=(n_boot, b.size))].mean(axis=1) - means
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def two_sample_z_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p of the unpooled two-sample z-test on the means (the two-proportion test for 0/1 scores)."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / max(na - 1, 1)
    vb = sum((x - mb) ** 2 for x in b) / max(nb - 1, 1)
    se = math.sqrt(va / na + vb / nb)
    if se == 0:
        return 1.0 if ma == mb else 0.0
    return math.erfc(abs(mb - ma) / se / math.sqrt(2.0))
