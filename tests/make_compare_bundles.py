"""Write the golden bundles that ``bundle compare`` / ``bundle render`` are snapshot-tested on, byte for byte
reproducibly, under tests/data/bundles/:

    python tests/make_compare_bundles.py            # rewrite the committed copies
    python tests/make_compare_bundles.py /tmp/out   # write them elsewhere

Each is a small "H200" run of five checks written with ``BundleWriter`` (so each one verifies), with
``perf.decode_sweep`` points in the record schema of ``bundles/COMPARE.md`` (20 replay samples per point
and backend, batch 1/8/64 x context 1K/32K), ``bench.kernels`` rows as ``verify/checks/bench.py`` writes
them and per-sample ``evals.gsm8k`` records of both engines (200 items):

- ``base``: the reference run; ``bench.kernels`` failed (a target missed);
- ``improved``: the fast path 10% faster at every point, skinny GEMM 8% faster, bench.kernels passes,
  GSM8K 14 items right that were wrong and 2 the other way (McNemar p ~ 0.004);
- ``regressed``: the fast path 12% slower at batch 8 / context 32K only, ``kernels.numerics`` failed,
  GSM8K 20 items lost and 2 gained;
- ``noisy``: every fast point moved by 3-4% in either direction but with a 10% replay spread (within
  noise), the bench within 1%, and no ``evals.gsm8k`` at all (compare says "absent in B").
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from verify.bundle.writer import BundleWriter, tarball_path  # noqa: E402
from verify.checks.bench_rules import bench_kernels_problems  # noqa: E402
from verify.checks.status_rules import verdict_reason  # noqa: E402
from verify.result import CheckResult  # noqa: E402
from verify.stats import percentile  # noqa: E402

DATA = REPO / "tests" / "data" / "bundles"
NAMES = ("base", "improved", "regressed", "noisy")
BATCHES, CONTEXTS = (1, 8, 64), (1024, 32768)
EVAL_ITEMS = 200
SAMPLES = 20


class Clock:
    def __init__(self, start: _dt.datetime) -> None:
        self.t = start

    def __call__(self) -> str:
        s = f"{self.t:%Y-%m-%dT%H:%M:%S}.000Z"
        self.t += _dt.timedelta(seconds=1)
        return s


def floor_us(batch: int, context: int) -> float:
    """A made-up but K3-shaped floor: weights (grows with distinct experts) + cache reads (batch x context)."""
    return 2000.0 + 380.0 * batch**0.6 * 10 + 0.0125 * batch * context


def base_fast_us(batch: int, context: int) -> float:
    return floor_us(batch, context) / (0.55 + 0.05 * (batch == 1))


# per bundle: (fast factor per point, replay spread sigma as a fraction, standard factor)
def _fast_factor(name: str, batch: int, context: int, rng: random.Random) -> float:
    if name == "improved":
        return 0.90
    if name == "regressed":
        return 1.12 if (batch, context) == (8, 32768) else 1.0 + rng.uniform(-0.004, 0.004)
    if name == "noisy":
        return 1.0 + rng.choice((-1, 1)) * rng.uniform(0.03, 0.04)
    return 1.0


def _samples(median: float, sigma: float, rng: random.Random) -> list[float]:
    return [round(median * (1.0 + rng.gauss(0.0, sigma)), 3) for _ in range(SAMPLES)]


def _sweep(w: BundleWriter, name: str, rng: random.Random) -> dict:
    sigma = 0.04 if name == "noisy" else 0.004
    speedups = []
    for b in BATCHES:
        for c in CONTEXTS:
            f = floor_us(b, c)
            fast = base_fast_us(b, c) * _fast_factor(name, b, c, rng)
            std = base_fast_us(b, c) * 1.8 * (1.0 + rng.uniform(-0.003, 0.003))
            med = {}
            for backend, target in (("fast", fast), ("standard", std)):
                xs = _samples(target, sigma, rng)
                m = percentile(xs, 50)
                med[backend] = m
                w.record(
                    "perf.decode_sweep",
                    {
                        "batch": b,
                        "context": c,
                        "tp": 1,
                        "backend": backend,
                        "routing": "uniform",
                        "step_us_median": m,
                        "step_us_p10": percentile(xs, 10),
                        "step_us_p90": percentile(xs, 90),
                        "samples_n": SAMPLES,
                        "step_us_samples": xs,
                        "floor_us": round(f, 3),
                        "pct_of_floor": f / m,
                        "tokens_per_s_user": 1e6 / m,
                        "tokens_per_s_gpu": b * 1e6 / m,
                    },
                )
            speedups.append(med["standard"] / med["fast"])
    return {
        "points": len(BATCHES) * len(CONTEXTS),
        "min_speedup": min(speedups),
        "max_speedup": max(speedups),
    }


_GEMM = (("kda_in_proj", 6288, 7168, 23.7, 29.0), ("mla_q_b", 2304, 1536, 4.03, 5.63))


def _bench(w: BundleWriter, name: str, rng: random.Random) -> list[str]:
    recorded: list[dict] = []

    def rec(obj: dict) -> None:
        recorded.append(obj)
        w.record("bench.kernels", obj)

    bw = 4206.9 * (1.0 + rng.uniform(-0.005, 0.005))
    counters = {"launches": {}, "fallbacks": {}}
    rec({"counters_before": counters})
    rec({"probe": "read_bandwidth", "gb_per_s": bw})
    for shape, n, k, ours1, cublas1 in _GEMM:
        for m in (1, 8):
            f = {"improved": 0.92, "noisy": 1.0 + rng.uniform(-0.01, 0.01)}.get(name, 1.0)
            ours = ours1 * (1.0 + 0.04 * (m > 1)) * f
            cublas = cublas1 * (1.0 + 0.02 * (m > 1))
            floor = n * k * 2 / (bw * 1e3)
            rec(
                {
                    "M": m,
                    "N": n,
                    "K": k,
                    "heuristic_us": ours,
                    "cublas_us": cublas,
                    "kernel": "skinny_gemm",
                    "preset": "k3-tp8-rank",
                    "shape": shape,
                    "weight_bytes": n * k * 2,
                    "floor_us": floor,
                    "pct_of_bw": floor / ours,
                    "tb_per_s": n * k * 2 / (ours * 1e-6) / 1e12,
                    "vs_cublas": cublas / ours,
                },
            )
    for h in (12, 6):
        for b in (1, 8):
            ours = (5.9 if h == 12 else 5.0) * (1 + 0.05 * (b > 1))
            nbytes, fla = 1.6e6 * b * h / 12, ours * (1.6 if name == "improved" else 0.84)
            floor = nbytes / (bw * 1e3)
            rec(
                {
                    "H": h,
                    "B": b,
                    "bytes": nbytes,
                    "read_bw_gbs": bw,
                    "floor_us": floor,
                    "ours_us": ours,
                    "fla_full_us": fla,
                    "kernel": "kda_decode",
                    "pct_of_floor": floor / ours,
                    "vs_fla": fla / ours,
                },
            )
    rec(
        {
            "kernel": "rmsnorm_residual",
            "M": 1,
            "H": 7168,
            "ours_us": 12.85,
            "torch_us": 27.4,
            "speedup": 27.4 / 12.85,
        },
    )
    rec({"counters_after": counters})
    return bench_kernels_problems(recorded)


def _eval_scores(name: str, rng: random.Random) -> tuple[list[bool], list[bool]]:
    """(baseline, under test) correctness per item; the base run's engine under test equals its baseline
    except on 6 items (3 each way); the other bundles flip a fixed set of the base's items."""
    base_rng = random.Random(7)
    baseline = [base_rng.random() < 0.8 for _ in range(EVAL_ITEMS)]
    under = list(baseline)
    wrong = [i for i, x in enumerate(baseline) if not x]
    right = [i for i, x in enumerate(baseline) if x]
    for i in wrong[:3]:
        under[i] = True
    for i in right[:3]:
        under[i] = False
    gain, lose = {"improved": (14, 2), "regressed": (2, 20)}.get(name, (0, 0))
    for i in wrong[3 : 3 + gain]:
        under[i] = True
    for i in right[3 : 3 + lose]:
        under[i] = False
    return baseline, under


def _evals(w: BundleWriter, name: str, rng: random.Random) -> tuple[str, str, dict]:
    """Records in the real format of verify/checks/evals.py (a config record, then per-sample records of
    both sides with responses and targets), scored by evals.utils and judged by verify.evals.gates exactly as
    a run would, so ``bundle verify``'s eval rescorer re-derives every number. Returns (status, reason, metrics)."""
    from evals.utils import SCORERS
    from verify.evals.gates import compare, headline, load_thresholds

    baseline, under = _eval_scores(name, rng)
    th = load_thresholds("gsm8k")
    seed = 0
    w.record("evals.gsm8k", {"type": "config", "dataset": "gsm8k", "tasks": ["k3_gsm8k"], "thresholds": th.as_dict(),
                             "seed": seed, "limit": EVAL_ITEMS, "repeats": 1, "max_tokens": 256,
                             "data_dir": "synthetic", "synthetic_data": True})
    engines = {"baseline": "builtin:reference", "under_test": "builtin:fast"}
    sides: dict[str, list[dict]] = {}
    for side, oks in (("baseline", baseline), ("under_test", under)):
        rows = []
        for i, ok in enumerate(oks):
            h = hashlib.sha256(f"gsm8k-{i}".encode()).hexdigest()
            gold = 10 + i
            target = {"answer": f"Step by step. #### {gold}"}
            response = f"The answer is #### {gold if ok else gold + 1}"
            scored = SCORERS["gsm8k"](response, target)
            rec = {"type": "sample", "task": "k3_gsm8k", "dataset": "gsm8k", "doc_id": i, "doc_hash": h[:16],
                   "prompt_hash": h[16:32], "target_hash": h[32:48], "target": target, "repeats": 1,
                   "responses": [response], "scores": [scored["score"]], "extracted": [scored["extracted"]],
                   "rules": [scored["rule"]], "extraction_failed": [bool(scored["extraction_failed"])],
                   "output_tokens": [120 + (i * 37) % 90], "output_chars": [len(response)],
                   "finish_reasons": ["stop"], "truncated": [False], "seeds": [seed], "max_tokens": 256,
                   "side": side, "engine": engines[side]}
            w.record("evals.gsm8k", rec)
            rows.append(rec)
        sides[side] = rows
    metrics, problems = compare("k3_gsm8k", sides["baseline"], sides["under_test"], th, seed)
    w.record("evals.gsm8k", {"type": "task_stats", "task": "k3_gsm8k", "metrics": metrics, "problems": problems})
    status = "failed" if problems else "passed"
    return status, (problems[0] if problems else ""), {"tasks": {"k3_gsm8k": metrics}, **headline({"k3_gsm8k": metrics})}


def make_bundle(root: Path, name: str) -> Path:
    root = Path(root)
    shutil.rmtree(root, ignore_errors=True)
    tarball_path(root).unlink(missing_ok=True)
    rng = random.Random(f"k3-compare-{name}")
    clock = Clock(_dt.datetime(2026, 12, 1, 10, NAMES.index(name) * 10, 0, tzinfo=_dt.timezone.utc))
    planned = ["kernels.numerics", "perf.bandwidth_probe", "bench.kernels", "perf.decode_sweep"]
    planned += [] if name == "noisy" else ["evals.gsm8k"]
    env = {
        "gpus": [{"index": 0, "name": "NVIDIA H200", "driver": "580.159.04", "uuid": "GPU-0000"}],
        "packages": {"k3-verify": "0.1.0", "nvidia-cutlass-dsl": "4.8.1"},
        "torch": {"version": "2.11.0+cu130", "cuda": "13.0"},
        "git": {"commit": hashlib.sha1(name.encode()).hexdigest(), "dirty": False},
    }
    w = BundleWriter(
        root,
        tool_version="0.1.0",
        now=clock,
        tier="standard",
        planned_checks=planned,
        argv=["k3-verify", "run", "--tier", "standard", "-o", f"bundles/local/{name}"],
        engines=["builtin:fast", "builtin:reference"],
        config={"preset": "k3-tp16-rank", "device": "cuda"},
        seeds={"global": 0},
        env=env,
    )

    def add(cid: str, status: str, reason: str = "", metrics: dict | None = None) -> None:
        w.add_result(
            CheckResult(
                id=cid,
                status=status,
                reason=reason,
                metrics=metrics or {},
                duration_s=1.0,
                started_at=clock(),
                ended_at=clock(),
            )
        )

    # kernels.numerics: per-test records as verify/checks/kernels.py writes them (the status follows from them)
    tests = [{"test": f"tests/test_kda_decode_gpu.py::test_kda_decode[{b}]", "phase": "call", "outcome": "passed",
              "duration_s": 0.01, "counters": {"launches": {"kda_decode": 2}, "fallbacks": {}}} for b in (1, 8)]
    if name == "regressed":
        tests.append({"test": "tests/test_kda_decode_gpu.py::test_kda_decode[64]", "phase": "call",
                      "outcome": "failed", "reason": "max rel err 3.1e-2 > 2e-2", "duration_s": 0.01,
                      "counters": {"launches": {"kda_decode": 2}, "fallbacks": {}}})
    for t in tests:
        w.record("kernels.numerics", t)
    if name == "regressed":
        add("kernels.numerics", "failed", "tests/test_kda_decode_gpu.py::test_kda_decode[64]: max rel err 3.1e-2 > 2e-2",
            metrics={"tests": len(tests)})
    else:
        add("kernels.numerics", "passed", metrics={"tests": len(tests)})
    times = [0.9524 * (1 + 0.01 * i) for i in range(-1, 2)]  # 4 GiB at ~4.5 TB/s, 2% spread
    w.record("perf.bandwidth_probe", {"probe": "read_reduction", "bytes": 4 << 30, "median_ms": times[1],
                                      "read_bytes_per_s": (4 << 30) / (times[1] * 1e-3), "times_ms": times})
    add("perf.bandwidth_probe", "passed", metrics={"read_tb_per_s": (4 << 30) / (times[1] * 1e-3) / 1e12,
                                                   "read_spread": 0.02})
    problems = _bench(w, name, rng)
    add(
        "bench.kernels",
        "failed" if problems else "passed",
        verdict_reason(problems) if problems else "",
        {"gemm_rows": 4, "kda_rows": 4, "problems": problems},
    )
    add("perf.decode_sweep", "passed", metrics=_sweep(w, name, rng))
    if name != "noisy":
        status, reason, metrics = _evals(w, name, rng)
        add("evals.gsm8k", status, reason, metrics)
    w.finalize()
    tarball_path(root).unlink()  # the directories are the test data; tests make tarballs when they need one
    return root


def make_compare_bundles(out: Path = DATA) -> dict[str, Path]:
    return {name: make_bundle(Path(out) / name, name) for name in NAMES}


if __name__ == "__main__":
    made = make_compare_bundles(Path(sys.argv[1]) if len(sys.argv) > 1 else DATA)
    print("wrote " + ", ".join(str(p) for p in made.values()))
