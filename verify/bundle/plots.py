"""PNG plots of a bundle for ``bundle render``: small (dpi 100), one question per figure.

- ``step_time_vs_batch.png``: decode step time vs batch, one panel per context, fast and standard, with
  the p10-p90 band and the HBM floor (``perf.decode_sweep``);
- ``speedup_heatmap.png``: standard / fast step time, batch x context, one panel per (variant, TP, routing);
- ``pct_of_floor.png``: floor / step time per point (1.0 = at the HBM floor);
- ``kernels_pct_of_floor.png`` / ``kernels_vs_baseline.png``: ``bench.kernels`` shapes x M as heatmaps
  (% of the read-bandwidth floor; ours vs cuBLAS / fla / torch);
- ``eval_deltas.png``: accuracy of the engine under test minus the baseline per eval, with its 95% CI.

matplotlib is an optional dependency (extra ``report``), imported lazily with the Agg backend; a missing
matplotlib is one clear error. Only the numbers reach the PNGs; tests check they exist, decode and have
the expected pixel size, never their bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verify.bundle.readers import BenchRow, SweepPoint, speedups

DPI = 100
_COLORS = {"fast": "tab:blue", "standard": "tab:orange", "reference": "tab:gray"}
_STYLES = ("-", "--", ":", "-.")


class PlotError(Exception):
    """Plots cannot be drawn here (matplotlib missing)."""


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            "matplotlib is not installed: pip install 'k3-verify[report]' (or pass --no-plots)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Save at dpi 100, then as a 256-colour palette PNG (about a third of the RGBA size; Pillow comes with
    matplotlib): the committed example renders stay small."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    pyplot().close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)
    return path


def _groups(points: Sequence[SweepPoint]) -> list[tuple[str, int, str]]:
    """(variant, tp, routing) groups, the plain decode ones first."""
    return sorted({(p.variant, p.tp, p.routing) for p in points}, key=lambda g: (g[0] != "decode", g))


def _group_label(g: tuple[str, int, str]) -> str:
    return f"{'' if g[0] == 'decode' else g[0] + ' '}tp={g[1]} {g[2]}"


def step_time_vs_batch(points: Sequence[SweepPoint], path: Path) -> Path:
    plt = pyplot()
    contexts = sorted({p.context for p in points})
    groups = _groups(points)[: len(_STYLES)]
    ncol = min(3, len(contexts))
    nrow = -(-len(contexts) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    for ax, ctx in zip(axes.flat, contexts, strict=False):
        for gi, g in enumerate(groups):
            floor_drawn = False
            for backend in ("fast", "standard"):
                pts = sorted(
                    (
                        p
                        for p in points
                        if p.context == ctx and p.backend == backend and (p.variant, p.tp, p.routing) == g
                    ),
                    key=lambda p: p.batch,
                )
                if not pts:
                    continue
                xs = [p.batch for p in pts]
                ax.plot(
                    xs,
                    [p.median_us / 1e3 for p in pts],
                    _STYLES[gi],
                    marker="o",
                    ms=3,
                    color=_COLORS[backend],
                    label=f"{backend} {_group_label(g)}",
                )
                if all(p.p10_us is not None and p.p90_us is not None for p in pts):
                    ax.fill_between(
                        xs,
                        [p.p10_us / 1e3 for p in pts],
                        [p.p90_us / 1e3 for p in pts],
                        color=_COLORS[backend],
                        alpha=0.2,
                        lw=0,
                    )
                if not floor_drawn and all(p.floor_us is not None for p in pts):
                    ax.plot(
                        xs,
                        [p.floor_us / 1e3 for p in pts],
                        _STYLES[gi],
                        color="gray",
                        lw=1,
                        label=f"HBM floor {_group_label(g)}",
                    )
                    floor_drawn = True
        ax.set_xscale("log", base=2)
        batches = sorted({p.batch for p in points if p.context == ctx})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"context {ctx}", fontsize=9)
        ax.set_xlabel("batch", fontsize=8)
        ax.set_ylabel("step time (ms)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(contexts) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle("decode step time vs batch (median, p10-p90 band)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _heatmap(
    ax: Any,
    rows: list[str],
    cols: list[str],
    values: list[list[float | None]],
    fmt: str,
    center: float | None,
    title: str,
    cmap: str = "RdYlGn",
) -> None:
    import matplotlib.colors as mcolors
    import numpy as np

    arr = np.array([[np.nan if v is None else v for v in row] for row in values], dtype=float)
    finite = arr[np.isfinite(arr)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if center is not None:
        norm = mcolors.TwoSlopeNorm(vcenter=center, vmin=min(lo, center * 0.9), vmax=max(hi, center * 1.1))
    else:
        norm = mcolors.Normalize(vmin=min(lo, 0.0), vmax=max(hi, 1.0))
    ax.imshow(np.ma.masked_invalid(arr), cmap=cmap, norm=norm, aspect="auto")
    ax.minorticks_off()
    ax.set_xticks(range(len(cols)), cols, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    small = len(rows) * len(cols) > 300
    for i in range(len(rows)):
        for j in range(len(cols)):
            if np.isfinite(arr[i, j]):
                dark = not 0.15 < float(norm(arr[i, j])) < 0.85  # white text on the saturated ends
                ax.text(
                    j,
                    i,
                    format(arr[i, j], fmt),
                    ha="center",
                    va="center",
                    fontsize=5 if small else 7,
                    color="white" if dark else "black",
                )
    ax.set_title(title, fontsize=9)


def speedup_heatmap(points: Sequence[SweepPoint], path: Path) -> Path:
    plt = pyplot()
    sp = speedups(points)
    groups = [g for g in _groups(points) if any(k[:3] == g for k in sp)][:4] or _groups(points)[:1]
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 3.6), squeeze=False)
    for ax, g in zip(axes.flat, groups, strict=False):
        batches = sorted({k[3] for k in sp if k[:3] == g})
        contexts = sorted({k[4] for k in sp if k[:3] == g})
        vals = [[sp.get((*g, b, c)) for b in batches] for c in contexts]
        _heatmap(
            ax,
            [str(c) for c in contexts],
            [str(b) for b in batches],
            vals,
            ".2f",
            1.0,
            f"speedup (standard / fast) {_group_label(g)}",
        )
        ax.set_xlabel("batch", fontsize=8)
        ax.set_ylabel("context", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def pct_of_floor(points: Sequence[SweepPoint], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    g = _groups(points)[0]
    cmap = plt.get_cmap("tab10")
    contexts = sorted({p.context for p in points if (p.variant, p.tp, p.routing) == g})
    for ci, ctx in enumerate(contexts):
        color = cmap(ci % 10)
        for backend, style in (("fast", "-"), ("standard", "--")):
            pts = sorted(
                (
                    p
                    for p in points
                    if (p.variant, p.tp, p.routing) == g
                    and p.context == ctx
                    and p.backend == backend
                    and p.pct_of_floor is not None
                ),
                key=lambda p: p.batch,
            )
            if pts:
                ax.plot(
                    [p.batch for p in pts],
                    [100 * p.pct_of_floor for p in pts],
                    style,
                    marker="o",
                    ms=3,
                    color=color,
                    label=f"{backend} ctx {ctx}",
                )
    ax.axhline(100, color="gray", lw=1)
    ax.set_xscale("log", base=2)
    batches = sorted({p.batch for p in points if (p.variant, p.tp, p.routing) == g})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch", fontsize=8)
    ax.set_ylabel("% of HBM floor (floor / step time)", fontsize=8)
    ax.set_title(f"how close each step is to the HBM floor ({_group_label(g)})", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def _shape_grid(
    rows: Sequence[BenchRow], kernel: str, row_fields: Sequence[str], col_field: str, value: str
) -> tuple[list[str], list[str], list[list[float | None]]]:
    sel = [r for r in rows if r.kernel == kernel]
    keyed: dict[str, dict[Any, float | None]] = {}
    cols: set = set()
    for r in sel:
        d = dict(r.ids)
        if col_field not in d:
            continue
        name = " ".join(
            str(d[f]) if f != "N" else f"{d['N']}x{d.get('K')}" for f in row_fields if f in d and f != "K"
        )
        keyed.setdefault(name, {})[d[col_field]] = getattr(r, value)
        cols.add(d[col_field])
    col_list = sorted(cols)
    names = list(keyed)
    return names, [str(c) for c in col_list], [[keyed[n].get(c) for c in col_list] for n in names]


_KERNEL_PANELS = (  # kernel, row fields, column field, title word
    ("skinny_gemm", ("shape", "N", "K"), "M", "skinny GEMM (rows: shape, columns: M)"),
    ("kda_decode", ("H",), "B", "KDA decode (rows: heads per GPU, columns: batch)"),
    ("kda_layer", ("H",), "B", "KDA layer step (rows: heads per GPU, columns: batch)"),
    ("rmsnorm_residual", (), "M", "rmsnorm_residual (columns: M)"),
    ("attn_res_mix", ("sources",), "M", "attn_res_mix (rows: sources, columns: M)"),
)


def _kernel_figure(
    rows: Sequence[BenchRow], path: Path, value: str, fmt: str, center: float | None, what: str
) -> Path:
    plt = pyplot()
    panels = []
    for kernel, row_fields, col, title in _KERNEL_PANELS:
        names, cols, vals = _shape_grid(rows, kernel, row_fields, col, value)
        if names and any(v is not None for row in vals for v in row):
            panels.append((names, cols, vals, title, kernel))
    if not panels:
        raise PlotError(f"no bench.kernels rows with {what}")
    heights = [max(1.5, 0.22 * len(p[0]) + 0.9) for p in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7.5, sum(heights)), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, (names, cols, vals, title, kernel) in zip(axes.flat, panels, strict=False):
        names = [n or kernel for n in names]
        base = next((r.baseline for r in rows if r.kernel == kernel), "baseline")
        _heatmap(ax, names, cols, vals, fmt, center, f"{what.format(baseline=base)}: {title}")
    fig.tight_layout()
    return _save(fig, path)


def kernels_pct_of_floor(rows: Sequence[BenchRow], path: Path) -> Path:
    return _kernel_figure(rows, path, "pct_of_floor", ".0%", None, "% of the HBM floor")


def kernels_vs_baseline(rows: Sequence[BenchRow], path: Path) -> Path:
    return _kernel_figure(rows, path, "vs_baseline", ".2f", 1.0, "speedup vs {baseline}")


def eval_deltas(deltas: Sequence[tuple[str, float, float, float, str]], path: Path) -> Path:
    """``deltas``: (eval check, delta, ci low, ci high, label) of the engine under test minus the baseline."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.5 * len(deltas) + 1.4))
    ys = list(range(len(deltas)))
    for y, (_, d, lo, hi, _label) in zip(ys, deltas, strict=True):
        color = "tab:green" if lo > 0 else "tab:red" if hi < 0 else "tab:gray"
        ax.errorbar(
            [100 * d], [y], xerr=[[100 * (d - lo)], [100 * (hi - d)]], fmt="o", color=color, capsize=4
        )
    ax.axvline(0, color="black", lw=1)
    ax.set_yticks(ys, [f"{c} ({label})" for c, *_, label in deltas], fontsize=7)
    ax.set_xlabel("accuracy delta, engine under test - baseline (points, 95% CI)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.set_title("eval deltas within this run (engine under test vs baseline)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)
