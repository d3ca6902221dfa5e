"""``k3-verify bundle render``: a bundle as ``summary.md`` sized for a GitHub PR comment, plus PNG plots.

summary.md is at most 65,536 characters (GitHub's comment limit), whatever the bundle holds: the visible
part has the verdict, the machine, the checks, the decode sweep (fast vs standard, speedup, % of the HBM
floor), the kernel bench and the eval deltas, each table capped; everything else (every metric, every
sweep point and bench row) goes into a collapsed ``<details>`` section, cut with a note when the limit
is reached. A bundle holding only some checks renders what it has and says which plots were skipped and
why ("no perf.decode_sweep points: ..."). Deterministic: the same bundle gives the same summary.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verify.bundle import plots as plots_mod
from verify.bundle import serving_plots
from verify.bundle.compare import EvalDelta, eval_delta
from verify.bundle.kernel_profiles import kernel_profiles, profile_section
from verify.bundle.readers import (
    BASELINE,
    BENCH_CHECK,
    SWEEP_CHECK,
    UNDER_TEST,
    BenchRow,
    BundleData,
    SweepPoint,
    bench_rows,
    eval_checks,
    eval_samples,
    read_bundle,
    speedups,
    sweep_points,
)
from verify.bundle.schema import verdict_line
from verify.provenance import commit_label

MAX_CHARS = 65_536  # GitHub's limit for an issue / PR comment body
HEAD_ROWS = 40  # rows per table in the visible part; the rest is in the details section
SUMMARY_NAME = "summary.md"

ImageUrl = Callable[[str], str]  # plot file name -> the link summary.md uses for it


@dataclass(frozen=True)
class RenderResult:
    out_dir: Path
    summary: Path
    plots: tuple[Path, ...]
    skipped: tuple[str, ...]  # "step_time_vs_batch.png: no perf.decode_sweep points (check absent)"
    chars: int
    truncated: bool


# ---------------------------------------------------------------- markdown helpers
def _cell(v: Any, limit: int = 120) -> str:
    if v is None:
        s = "-"
    elif isinstance(v, bool):
        s = json.dumps(v)
    elif isinstance(v, float):
        s = f"{v:.0f}" if 1e4 <= abs(v) < 1e15 else f"{v:.4g}"  # 17441, not 1.744e+04
    elif isinstance(v, (dict, list)):
        s = json.dumps(v, sort_keys=True, separators=(",", ":"))
    else:
        s = str(v)
    s = " ".join(s.split()).replace("|", "\\|").replace("<", "&lt;")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(_cell(c) for c in r) + " |" for r in rows
    ]


def _capped(header: Sequence[str], rows: Sequence[Sequence[Any]], cap: int, where: str) -> list[str]:
    out = _table(header, rows[:cap])
    if len(rows) > cap:
        out.append(f"\n_{len(rows) - cap} more rows in {where}._")
    return out


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v < 1000 else f"{v / 1e3:.3f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


# ---------------------------------------------------------------- sections
def _header(d: BundleData) -> list[str]:
    m, env = d.manifest, d.manifest.get("env") if isinstance(d.manifest.get("env"), dict) else {}
    gpus = env.get("gpus") if isinstance(env.get("gpus"), list) else []
    driver = next((g.get("driver") for g in gpus if isinstance(g, dict) and g.get("driver")), None)
    pk = env.get("packages") if isinstance(env.get("packages"), dict) else env.get("versions") or {}
    torch = env.get("torch") if isinstance(env.get("torch"), dict) else {}
    versions = (
        [f"torch {torch.get('version') or pk.get('torch')}"]
        if (torch.get("version") or pk.get("torch"))
        else []
    )
    versions += [f"{k} {pk[k]}" for k in ("nvidia-cutlass-dsl", "vllm", "lm-eval", "fla-core") if pk.get(k)]
    git = env.get("git") if isinstance(env.get("git"), dict) else {}
    tool = m.get("tool") if isinstance(m.get("tool"), dict) else {}
    rows = [
        ("state", f"{m.get('state')}, {m.get('started_at')} to {m.get('ended_at') or '-'}"),
        ("GPU", d.gpu + (f" (driver {driver})" if driver else "")),
        ("versions", ", ".join(versions) or "-"),
        ("commit", commit_label(git) or "-"),
        ("command", f"`{' '.join(map(str, m.get('argv') or []))}`"),
        ("tool", f"{tool.get('name')} {tool.get('version')}"),
    ]
    return (
        [
            f"## k3-verify bundle `{d.name}`: tier {m.get('tier')}",
            "",
            verdict_line(str(m.get("verdict"))),
            "",
            "| | |",
            "|---|---|",
        ]
        + [f"| {k} | {_cell(v, 200)} |" for k, v in rows]
        + [""]
    )


def _checks(d: BundleData) -> tuple[list[str], list[str]]:
    rows = []
    for cid in d.order:
        r = d.results.get(cid)
        rows.append(
            (cid, d.status(cid), r.reason if r else "no result recorded", f"{r.duration_s:.1f}" if r else "-")
        )
    counts: dict[str, int] = {}
    for _, s, *_ in rows:
        counts[s] = counts.get(s, 0) + 1
    head = ["### Checks", "", ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no checks", ""]
    head += _capped(("check", "status", "reason", "s"), rows, 60, "the details") + [""]
    reasons = d.manifest.get("verdict_reasons") or []
    detail = (["#### Why not pass", ""] + [f"- {_cell(x, 400)}" for x in reasons] + [""]) if reasons else []
    detail += ["#### All checks", ""] + _table(("check", "status", "reason", "duration (s)"), rows) + [""]
    return head, detail


def _sweep(points: list[SweepPoint], status: str) -> tuple[list[str], list[str]]:
    if not points:
        return [
            f"### Decode step sweep ({SWEEP_CHECK})",
            "",
            f"No {SWEEP_CHECK} points in this bundle (check {status}): the step-time, speedup and "
            "% of HBM floor plots of the sweep are skipped.",
            "",
        ], []
    sp = speedups(points)
    by = {(p.key, p.backend): p for p in points}
    keys = sorted({p.key for p in points}, key=lambda k: (k[0] != "decode", k))
    rows = []
    for k in keys:
        f, s = by.get((k, "fast")), by.get((k, "standard"))
        rng = (
            f" ({_us(f.p10_us)}-{_us(f.p90_us)})"
            if f and f.p10_us is not None and f.p90_us is not None
            else ""
        )
        rows.append(
            (
                f"{'' if k[0] == 'decode' else k[0] + ' '}tp={k[1]} {k[2]}",
                k[3],
                k[4],
                (_us(f.median_us) + rng) if f else "-",
                _us(s.median_us) if s else "-",
                f"{sp[k]:.2f}x" if k in sp else "-",
                _pct(f.pct_of_floor) if f else "-",
                _pct(s.pct_of_floor) if s else "-",
                f"{f.tokens_per_s_user:.1f}" if f and f.tokens_per_s_user is not None else "-",
            )
        )
    header = (
        "group",
        "batch",
        "context",
        "fast step (p10-p90)",
        "standard step",
        "speedup",
        "fast % floor",
        "std % floor",
        "fast tok/s/user",
    )
    fast = [sp[k] for k in keys if k in sp]
    head = [
        f"### Decode step sweep ({SWEEP_CHECK})",
        "",
        f"{len(keys)} points; speedup standard/fast: min {min(fast):.2f}x, max {max(fast):.2f}x."
        if fast
        else f"{len(keys)} points; no point has both backends.",
        "",
    ]
    head += _capped(header, rows, HEAD_ROWS, "the details") + [""]
    detail = (
        ["#### All sweep points", ""]
        + _table(
            (
                "backend",
                "point",
                "median us",
                "p10 us",
                "p90 us",
                "samples",
                "floor us",
                "% floor",
                "tok/s/user",
                "tok/s/gpu",
            ),
            [
                (
                    p.backend,
                    p.label,
                    p.median_us,
                    p.p10_us,
                    p.p90_us,
                    p.samples_n,
                    p.floor_us,
                    _pct(p.pct_of_floor),
                    p.tokens_per_s_user,
                    p.tokens_per_s_gpu,
                )
                for p in sorted(points, key=lambda p: (p.key, p.backend))
            ],
        )
        + [""]
    )
    return head, detail


def _grid(rows: list[BenchRow], kernel: str, col: str, fmt: Callable[[BenchRow], str]) -> list[str]:
    sel = [r for r in rows if r.kernel == kernel and col in dict(r.ids)]
    cols = sorted({dict(r.ids)[col] for r in sel})
    names: dict[str, dict[Any, str]] = {}
    for r in sel:
        d = dict(r.ids)
        d.pop(col)
        name = BenchRow(kernel, tuple(d.items()), r.ours_us, r.baseline, None, None).label
        name = name[len(kernel) + 1 :] if name != kernel else kernel
        names.setdefault(name, {})[dict(r.ids)[col]] = fmt(r)
    parts = [
        "us",
        *([f"x {sel[0].baseline}"] if any(r.baseline_us for r in sel) else []),
        *(["% floor"] if any(r.floor_us for r in sel) else []),
    ]
    title = f"{kernel} ({' / '.join(parts)})"
    return _capped(
        [title, *(f"{col}={c}" for c in cols)],
        [(n, *(v.get(c, "-") for c in cols)) for n, v in names.items()],
        HEAD_ROWS,
        "the details",
    )


_GRIDS = (
    ("skinny_gemm", "M"),
    ("kda_decode", "B"),
    ("kda_layer", "B"),
    ("rmsnorm_residual", "M"),
    ("attn_res_mix", "M"),
)


def _bench(d: BundleData, rows: list[BenchRow], notes: list[str]) -> tuple[list[str], list[str]]:
    if not rows:
        return [], []
    bw = next(
        (r.get("gb_per_s") for r in d.records.get(BENCH_CHECK, []) if r.get("probe") == "read_bandwidth"),
        None,
    )
    head = [
        f"### Kernel bench ({BENCH_CHECK})",
        "",
        f"{len(rows)} timed shapes"
        + (
            f"; read bandwidth measured in the same run: {bw / 1e3:.2f} TB/s"
            if isinstance(bw, (int, float))
            else ""
        )
        + ". Cells: our time in us / speedup vs the baseline timed in the same process / % of the HBM floor.",
        "",
    ]
    for kernel, col in _GRIDS:
        if any(r.kernel == kernel for r in rows):
            head += _grid(
                rows,
                kernel,
                col,
                lambda r: (
                    f"{r.ours_us:.1f} / {r.vs_baseline:.2f}x"
                    + (f" / {_pct(r.pct_of_floor)}" if r.floor_us else "")
                    if r.vs_baseline is not None
                    else f"{r.ours_us:.1f}"
                ),
            ) + [""]
    others = sorted({r.kernel for r in rows} - {k for k, _ in _GRIDS})
    for kernel in others:
        head += _capped(
            (kernel, "ours us", "baseline us", "vs baseline", "% floor"),
            [
                (r.label, r.ours_us, r.baseline_us, r.vs_baseline, _pct(r.pct_of_floor))
                for r in rows
                if r.kernel == kernel
            ],
            HEAD_ROWS,
            "the details",
        ) + [""]
    detail = (
        ["#### All bench rows", ""]
        + _table(
            ("kernel shape", "ours us", "baseline", "baseline us", "vs baseline", "floor us", "% floor"),
            [
                (
                    r.label,
                    r.ours_us,
                    r.baseline,
                    r.baseline_us,
                    r.vs_baseline,
                    r.floor_us,
                    _pct(r.pct_of_floor),
                )
                for r in rows
            ],
        )
        + [""]
    )
    if notes:
        detail += ["#### Bench rows not timed", ""] + [f"- {_cell(n, 300)}" for n in notes] + [""]
    return head, detail


def eval_deltas_within(d: BundleData) -> tuple[list[EvalDelta], list[str]]:
    """Engine under test vs the baseline of the same run, per eval check (delta = under test - baseline)."""
    out, absent = [], []
    for cid in eval_checks(d):
        found, _ = eval_samples(d, cid)
        if not found:
            absent.append(f"{cid} ({d.status(cid)}): no samples")
        for label, ev in found.items():
            if not ev.n(UNDER_TEST) or not ev.n(BASELINE):
                absent.append(f"{label} ({d.status(cid)}): no samples of both engines")
                continue
            out.append(eval_delta(label, ev.scores[BASELINE], ev.scores[UNDER_TEST], ev.binary))
    return out, absent


def _evals(deltas: list[EvalDelta], absent: list[str]) -> list[str]:
    if not deltas and not absent:
        return []
    head = ["### Evals (engine under test vs baseline, same run)", ""]
    if deltas:
        head += _capped(
            ("eval", "baseline", "under test", "delta", "test", "p", "95% CI", "items"),
            [
                (
                    e.check_id,
                    f"{e.acc_a:.4f}",
                    f"{e.acc_b:.4f}",
                    f"{e.delta:+.4f}",
                    e.test,
                    "-" if e.p_value is None else f"{e.p_value:.3g}",
                    f"[{e.ci[0]:+.4f}, {e.ci[1]:+.4f}]",
                    e.n_paired if e.paired else f"{e.n_a}/{e.n_b}",
                )
                for e in deltas
            ],
            HEAD_ROWS,
            "the bundle",
        )
    head += [f"- {a}" for a in absent]
    return head + [""]


def _metrics_detail(d: BundleData) -> list[str]:
    rows = []
    for cid in d.order:
        r = d.results.get(cid)
        for k, v in r.metrics.items() if r else ():
            rows.append((cid, k, v))
    out = ["#### Metrics per check", ""] + _table(("check", "metric", "value"), rows) + [""] if rows else []
    if d.records:
        out += (
            ["#### Record streams", ""]
            + _table(("stream", "records"), sorted((s, len(r)) for s, r in d.records.items()))
            + [""]
        )
    return out


def _fit(head: list[str], detail: list[str], max_chars: int) -> tuple[str, bool]:
    """head + a collapsed details section, cut line by line (with a note) to at most ``max_chars``."""
    note = (
        "\n_... {n} more lines cut to stay under {m:,} characters (GitHub's comment limit); "
        "the full data is in the bundle's records._\n"
    )
    open_, close = (
        ["", "<details><summary>Details: every check, metric, sweep point and bench row</summary>", ""],
        ["", "</details>", ""],
    )
    reserve = len("\n".join(close)) + len(note) + 40
    out, size, truncated = [], 0, False
    for i, line in enumerate(head):
        if size + len(line) + 1 > max_chars - reserve:
            out.append(note.format(n=len(head) - i + len(detail), m=max_chars))
            return "\n".join(out)[:max_chars], True
        out.append(line)
        size += len(line) + 1
    if detail:
        out += open_
        size += len("\n".join(open_)) + 1
        for i, line in enumerate(detail):
            if size + len(line) + 1 > max_chars - reserve:
                out.append(note.format(n=len(detail) - i, m=max_chars))
                truncated = True
                break
            out.append(line)
            size += len(line) + 1
        out += close
    text = "\n".join(out).rstrip("\n") + "\n"
    return text, truncated


# ---------------------------------------------------------------- the whole render
def build_summary(
    d: BundleData,
    plot_files: Sequence[tuple[str, str]],
    skipped: Sequence[str],
    *,
    max_chars: int = MAX_CHARS,
    image_url: ImageUrl | None = None,
    preamble: Sequence[str] = (),
) -> tuple[str, bool]:
    """(summary.md text, truncated?). ``plot_files``: (file name, title); ``image_url`` maps a file name to
    its link (default: the name itself, next to summary.md); ``preamble`` lines go first (attach)."""
    points, sweep_notes = sweep_points(d)
    rows, bench_notes = bench_rows(d)
    deltas, eval_absent = eval_deltas_within(d)
    head = list(preamble) + _header(d)
    detail: list[str] = []
    h, dt = _checks(d)
    head += h
    detail += dt
    h, dt = _sweep(points, d.status(SWEEP_CHECK))
    head += h
    detail += dt
    profiles, profile_notes = kernel_profiles(d)
    head += profile_section(profiles)
    h, dt = _bench(d, rows, bench_notes)
    head += h
    detail += dt
    head += _evals(deltas, eval_absent)
    if plot_files or skipped:
        head += ["### Plots", ""]
        link = image_url or (lambda name: name)
        head += [f"![{title}]({link(name)})" for name, title in plot_files]
        head += ([""] if plot_files and skipped else []) + [f"- not drawn: {s}" for s in skipped] + [""]
    detail += _metrics_detail(d)
    notes = list(d.notes) + sweep_notes + profile_notes
    if notes:
        detail += ["#### Records that could not be read", ""] + [f"- {_cell(n, 300)}" for n in notes] + [""]
    return _fit(head, detail, max_chars)


def _draw(d: BundleData, out_dir: Path) -> tuple[list[tuple[str, str]], list[str]]:
    points, _ = sweep_points(d)
    rows, _ = bench_rows(d)
    deltas, _ = eval_deltas_within(d)
    drawn: list[tuple[str, str]] = []
    skipped: list[str] = []
    sweep_why = f"no {SWEEP_CHECK} points in this bundle (check {d.status(SWEEP_CHECK)})"
    jobs: list[tuple[str, str, Callable[[], Path] | None, str]] = [
        (
            "step_time_vs_batch.png",
            "decode step time vs batch per context",
            (lambda: plots_mod.step_time_vs_batch(points, out_dir / "step_time_vs_batch.png"))
            if points
            else None,
            sweep_why,
        ),
        (
            "speedup_heatmap.png",
            "speedup standard / fast, batch x context",
            (lambda: plots_mod.speedup_heatmap(points, out_dir / "speedup_heatmap.png"))
            if speedups(points)
            else None,
            sweep_why if not points else "no sweep point has both backends",
        ),
        (
            "pct_of_floor.png",
            "% of the HBM floor per sweep point",
            (lambda: plots_mod.pct_of_floor(points, out_dir / "pct_of_floor.png"))
            if any(p.floor_us for p in points)
            else None,
            sweep_why if not points else "no sweep point records floor_us",
        ),
        (
            "kernels_pct_of_floor.png",
            "kernel bench: % of the HBM floor",
            (lambda: plots_mod.kernels_pct_of_floor(rows, out_dir / "kernels_pct_of_floor.png"))
            if any(r.floor_us for r in rows)
            else None,
            f"no {BENCH_CHECK} rows with floor_us (check {d.status(BENCH_CHECK)})",
        ),
        (
            "kernels_vs_baseline.png",
            "kernel bench: speedup vs cuBLAS / fla / torch",
            (lambda: plots_mod.kernels_vs_baseline(rows, out_dir / "kernels_vs_baseline.png"))
            if any(r.baseline_us for r in rows)
            else None,
            f"no {BENCH_CHECK} rows with a baseline time (check {d.status(BENCH_CHECK)})",
        ),
        (
            "eval_deltas.png",
            "eval deltas, engine under test - baseline",
            (
                lambda: plots_mod.eval_deltas(
                    [(e.check_id, e.delta, e.ci[0], e.ci[1], e.test) for e in deltas],
                    out_dir / "eval_deltas.png",
                )
            )
            if deltas
            else None,
            "no evals.* check with samples of both engines",
        ),
    ]
    serving = d.records.get("perf.serving", [])
    serving_why = f"no perf.serving points in this bundle (check {d.status('perf.serving')})"
    has_points = any(r.get("kind") == "point" for r in serving)
    jobs += [] if d.status("perf.serving") == "absent" else [  # a bundle without the check: not mentioned
             ("serving_pareto.png", "serving: throughput vs P90 interactivity (mixed prefill + decode)",
              (lambda: serving_plots.serving_pareto(serving, out_dir / "serving_pareto.png")) if has_points else None,
              serving_why),
             ("serving_cdf.png", "serving: per-request ITL and TTFT CDFs (mixed prefill + decode)",
              (lambda: serving_plots.serving_cdf(serving, out_dir / "serving_cdf.png")) if has_points else None,
              serving_why)]
    for name, title, fn, why in jobs:
        if fn is None:
            skipped.append(f"{name} ({why})")
            continue
        fn()
        drawn.append((name, title))
    return drawn, skipped


def render_bundle(
    path: str | Path,
    out_dir: str | Path,
    *,
    max_chars: int = MAX_CHARS,
    plots: bool = True,
    image_url: ImageUrl | None = None,
    preamble: Sequence[str] = (),
    summary_name: str = SUMMARY_NAME,
) -> RenderResult:
    """Write ``summary.md`` (and, with ``plots``, the PNGs) of bundle ``path`` into ``out_dir``.
    BundleError (exit 2) for an unreadable bundle; PlotError when matplotlib is missing."""
    d = read_bundle(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        drawn, skipped = _draw(d, out)
    else:
        drawn, skipped = [], ["all plots (--no-plots)"]
    text, truncated = build_summary(
        d, drawn, skipped, max_chars=max_chars, image_url=image_url, preamble=preamble
    )
    summary = out / summary_name
    summary.write_text(text, encoding="utf-8")
    return RenderResult(
        out_dir=out,
        summary=summary,
        plots=tuple(out / n for n, _ in drawn),
        skipped=tuple(skipped),
        chars=len(text),
        truncated=truncated,
    )
