"""``bundle render``: summary.md snapshot-tested on the golden bundles, the committed GPU example kept in sync,
PNGs checked to exist, decode and have the expected pixel size (never their bytes), the 65,536-character
limit on a huge bundle, partial bundles (no sweep, no evals) and the CLI.

Snapshots: tests/snapshots/render_*.md (``K3_UPDATE_SNAPSHOTS=1`` rewrites them). The committed example
bundles/runs/2026-11-30-h200-kernels/render/ is rewritten by
``k3-verify bundle render bundles/runs/2026-11-30-h200-kernels/20261130T155010Z-h200-bench-kernels
-o bundles/runs/2026-11-30-h200-kernels/render``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import make_compare_bundles as gold
import pytest

from verify.bundle import plots
from verify.bundle.render import MAX_CHARS, render_bundle
from verify.bundle.schema import BundleError, verdict_line
from verify.bundle.writer import BundleWriter
from verify.result import CheckResult

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
DATA = gold.DATA
RUNS = REPO / "bundles" / "runs" / "2026-11-30-h200-kernels"
BENCH = RUNS / "20261130T155010Z-h200-bench-kernels"
EXAMPLE = RUNS / "render"

# pixel sizes: figsize x dpi 100 (plots.py), for the golden base bundle (2 contexts, 1 group, 1 eval)
BASE_PNG_SIZES = {
    "step_time_vs_batch.png": (840, 340),
    "speedup_heatmap.png": (460, 360),
    "pct_of_floor.png": (640, 380),
    "eval_deltas.png": (640, 190),
}


def snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("K3_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}; run with K3_UPDATE_SNAPSHOTS=1 to write it"
    assert text == path.read_text(), f"output differs from {path} (K3_UPDATE_SNAPSHOTS=1 rewrites it)"


def png_size(path: Path) -> tuple[int, int]:
    """Decode the PNG (Pillow, a matplotlib dependency) and return (width, height); it must not be blank."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        assert im.format == "PNG"
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 20, f"{path.name} looks blank"
        return im.size


@pytest.fixture(scope="module")
def base_render(tmp_path_factory) -> object:
    return render_bundle(DATA / "base", tmp_path_factory.mktemp("render") / "base")


def test_full_bundle_summary_snapshot_and_plots(base_render) -> None:
    r = base_render
    text = r.summary.read_text()
    snapshot("render_base.md", text)
    assert verdict_line("fail") in text.splitlines() and r.chars == len(text) <= MAX_CHARS and not r.truncated
    names = {p.name for p in r.plots}
    assert (
        names == {*BASE_PNG_SIZES, "kernels_pct_of_floor.png", "kernels_vs_baseline.png"} and r.skipped == ()
    )
    for name, size in BASE_PNG_SIZES.items():
        assert png_size(r.out_dir / name) == size, name
    for name in ("kernels_pct_of_floor.png", "kernels_vs_baseline.png"):
        w, h = png_size(r.out_dir / name)
        assert w == 750 and 300 <= h <= 1200, (name, w, h)
    for p in r.plots:
        assert p.stat().st_size < 200_000, f"{p.name}: keep committed PNGs small"
        assert f"]({p.name})" in text


def test_render_is_deterministic(base_render, tmp_path: Path) -> None:
    again = render_bundle(DATA / "base", tmp_path / "again")
    assert again.summary.read_text() == base_render.summary.read_text()


def test_bundle_without_evals_skips_that_plot_and_says_so(tmp_path: Path) -> None:
    r = render_bundle(DATA / "noisy", tmp_path / "noisy")
    snapshot("render_noisy.md", r.summary.read_text())
    assert r.skipped == ("eval_deltas.png (no evals.* check with samples of both engines)",)
    assert "- not drawn: eval_deltas.png" in r.summary.read_text()


def test_kernels_only_bundle_skips_the_sweep_plots(tmp_path: Path) -> None:
    r = render_bundle(BENCH, tmp_path / "bench")
    text = r.summary.read_text()
    assert "No perf.decode_sweep points in this bundle (check absent)" in text
    assert {p.name for p in r.plots} == {"kernels_pct_of_floor.png", "kernels_vs_baseline.png"}
    assert [s.split(" ")[0] for s in r.skipped] == [
        "step_time_vs_batch.png",
        "speedup_heatmap.png",
        "pct_of_floor.png",
        "eval_deltas.png",
    ]
    assert "| skinny_gemm (us / x cuBLAS / % floor) | M=1 | M=2 | M=4 | M=8 | M=16 | M=32 | M=64 |" in text


def test_committed_gpu_example_is_the_render_of_the_committed_bundle(tmp_path: Path) -> None:
    r = render_bundle(BENCH, tmp_path / "render")
    committed = sorted(p.name for p in EXAMPLE.iterdir())
    assert committed == sorted(["summary.md", *(p.name for p in r.plots)]), (
        "rerun bundle render (module docstring)"
    )
    assert (EXAMPLE / "summary.md").read_text() == r.summary.read_text(), (
        "rerun bundle render (module docstring)"
    )
    for p in r.plots:
        assert png_size(EXAMPLE / p.name) == png_size(p)


def test_golden_smoke_without_perf_or_evals(tmp_path: Path) -> None:
    r = render_bundle(REPO / "bundles" / "example" / "golden-smoke", tmp_path / "smoke")
    assert r.plots == () and len(r.skipped) == 6
    assert "reference.determinism" in r.summary.read_text()


def _huge_bundle(root: Path, rng: random.Random) -> Path:
    checks = ["perf.decode_sweep", "bench.kernels"] + [f"x.check{i}" for i in range(150)]
    w = BundleWriter(
        root,
        tool_version="0",
        argv=["k3-verify", "run"],
        tier="huge",
        planned_checks=checks,
        engines=[],
        config={},
        seeds={},
        env={},
    )
    for b in range(1, 25):
        for c in range(1, 25):
            for backend in ("fast", "standard"):
                m = rng.uniform(1e3, 1e5)
                w.record(
                    "perf.decode_sweep",
                    {
                        "batch": b,
                        "context": 512 * c,
                        "tp": 1,
                        "backend": backend,
                        "step_us_median": m,
                        "step_us_p10": m * 0.99,
                        "step_us_p90": m * 1.01,
                        "floor_us": m * 0.5,
                    },
                )
    for i in range(700):
        w.record(
            "bench.kernels",
            {
                "kernel": "skinny_gemm",
                "shape": f"s{i // 7}",
                "N": 64 * (i // 7 + 1),
                "K": 512,
                "M": 2 ** (i % 7),
                "heuristic_us": rng.uniform(1, 50),
                "cublas_us": 10.0,
                "floor_us": 2.0,
            },
        )
    for cid in checks:
        status = rng.choice(["passed", "failed", "skipped"])
        w.add_result(
            CheckResult(
                id=cid,
                status=status,
                reason="" if status == "passed" else "why " * 60,
                metrics={f"m{j}": rng.random() for j in range(30)},
            )
        )
    w.finalize()
    return root


def test_huge_bundle_stays_under_the_comment_limit(tmp_path: Path, seed: int) -> None:
    root = _huge_bundle(tmp_path / "huge", random.Random(seed))
    r = render_bundle(root, tmp_path / "out", plots=False)
    text = r.summary.read_text()
    assert len(text) == r.chars <= MAX_CHARS and r.truncated, f"seed {seed}: {len(text)} characters"
    assert "more lines cut to stay under 65,536 characters" in text
    assert text.count("<details>") == 1 and text.rstrip().endswith("</details>")
    assert verdict_line("fail") in text.splitlines()
    small = render_bundle(root, tmp_path / "small", plots=False, max_chars=3000)
    body = small.summary.read_text()
    assert len(body) <= 3000 and small.truncated and "more lines cut" in body


def test_missing_matplotlib_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(
        plots.PlotError, match=r"matplotlib is not installed: pip install 'k3-verify\[report\]'"
    ):
        plots.pyplot()


def test_unreadable_bundle(tmp_path: Path) -> None:
    with pytest.raises(BundleError):
        render_bundle(tmp_path / "missing", tmp_path / "out")


def test_cli_render_json_and_errors(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "250"}
    out = tmp_path / "o"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "verify.cli",
            "bundle",
            "render",
            str(DATA / "noisy"),
            "-o",
            str(out),
            "--no-plots",
            "--format",
            "json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["summary"] == str(out / "summary.md") and doc["plots"] == [] and not doc["truncated"]
    bad = subprocess.run(
        [sys.executable, "-m", "verify.cli", "bundle", "render", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "no such file" in bad.stderr


def test_summary_cells_name_the_model_a_metric_describes() -> None:
    """A metric holding a model (or engine) description says which in summary.md: the evals' ``model`` names
    the checkpoint scored (the sentinel), which the run-level config (the tier's preset) does not."""
    from verify.bundle.schema import _cell

    model = {"scored": "sentinel", "name": "k3-sentinel", "digest": "b8249949577eb18c786ca7ea", "path": "/tmp/s"}
    assert _cell(model) == "k3-sentinel @ b8249949577e {4 keys}"
    assert _cell({"name": "k3-tiny", "seed": 0}) == "k3-tiny {2 keys}"
    assert _cell({"a": 1}) == "{1 keys}" and _cell([1, 2]) == "[2 items]"
