"""Write the golden example bundle, bundles/example/golden-smoke/ (+ .tar.gz), byte for byte reproducibly.

    python tests/make_golden_bundle.py            # rewrite the committed example
    python tests/make_golden_bundle.py /tmp/out   # write it elsewhere

A fixed clock, env and set of results stand in for a real CPU run of tier ``smoke`` cut down to four
checks: three passed (two with raw records, one with an artifact), one skipped ("needs a CUDA device"),
so the verdict is ``incomplete``. tests/test_bundle.py regenerates it and compares it with the committed
copy, and snapshot-tests the verifier on it and on tampered copies of it.
"""

from __future__ import annotations

import datetime as _dt
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from verify.bundle.writer import BundleWriter, tarball_path  # noqa: E402
from verify.result import CheckResult  # noqa: E402

GOLDEN = REPO / "bundles" / "example" / "golden-smoke"
PLANNED = ["reference.prefill_decode_consistency", "reference.determinism", "weights.roundtrip", "kernels.numerics"]
ENV = {
    "host": {"os": "Linux-6.8.0-x86_64", "cpu": "x86_64, 2 cores", "python": "3.11.7"},
    "gpu": None,
    "versions": {"k3-verify": "0.1.0", "torch": "2.13.0+cpu", "nvidia-cutlass-dsl": None, "vllm": None},
    "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False},
}
DETERMINISM = {"dtype": "torch.float32", "batch": 2, "prompt_len": 10, "decode_steps": 4, "weights": "synthetic (seed 0)",
               "control": "synthetic (seed 1)", "bitwise_equal": True, "max_logit_diff": 0.0, "control_differs": True,
               "tokens": [[17, 203, 5, 88], [4, 4, 912, 31]]}
WEIGHTS_RECORDS = [
    {"step": "load", "source": "preset", "checkpoint": None, "weights": "synthetic (seed 0)", "tensors": 412,
     "digest": "ab" * 32, "digest_expected": None, "names_missing": [], "names_extra": [], "mismatched": 0,
     "mismatched_names": [], "compared_with": "the written one", "fp32_violations": []},
    {"step": "mxfp4", "tensors_checked": 6, "max_abs_diff": 0.0, "differing": []},
    {"step": "tp", "tp_size": 2, "applicable": True, "tensors": 412, "mismatched": []},
    {"step": "tp", "tp_size": 4, "applicable": True, "tensors": 412, "mismatched": []},
]


class FixedClock:
    """ISO-8601 UTC timestamps one second apart from 2026-11-30T12:00:00Z, one per call."""

    def __init__(self) -> None:
        self.t = _dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=_dt.timezone.utc)

    def __call__(self) -> str:
        s = f"{self.t:%Y-%m-%dT%H:%M:%S}.000Z"
        self.t += _dt.timedelta(seconds=1)
        return s


def make_golden_bundle(root: Path = GOLDEN) -> Path:
    root = Path(root)
    shutil.rmtree(root, ignore_errors=True)
    tarball_path(root).unlink(missing_ok=True)
    clock = FixedClock()
    w = BundleWriter(root, tool_version="0.1.0", now=clock, tier="smoke", planned_checks=PLANNED,
                     argv=["k3-verify", "run", "--tier", "smoke", "--output", "bundles/example/golden-smoke"],
                     engines=["builtin:reference"], config={"preset": "k3-tiny", "device": "cpu", "dtype": "float64"},
                     seeds={"global": 0}, env=ENV)
    w.log("tier smoke: 4 checks, preset k3-tiny, device cpu")

    # records as verify/checks/reference.py and weights.py write them (bundle verify re-derives each status)
    cases = [{"case": "kda", "batch": 3, "lengths": [12, 11, 10], "decode_steps": 6, "max_rel_err": 2.1e-15},
             {"case": "mla", "batch": 3, "lengths": [12, 11, 10], "decode_steps": 6, "max_rel_err": 4.4e-16},
             {"case": "model_f64", "batch": 1, "lengths": [12], "decode_steps": 6, "max_rel_err": 3.0e-15},
             {"case": "model_f64", "batch": 3, "lengths": [12, 11, 10], "decode_steps": 6, "max_rel_err": 5.2e-15}]
    for c in cases:
        w.record("reference.prefill_decode_consistency",
                 dict(c, statistic="max_rel_err", tolerance=1e-8, ok=True))
    w.add_result(CheckResult(
        id="reference.prefill_decode_consistency", status="passed",
        metrics={"max_rel_err_f64": 5.2e-15, "tolerance_f64": 1e-8, "cases": len(cases), "max_abs_err_bf16": 0.0625},
        duration_s=1.5, started_at=clock(), ended_at=clock()))

    w.record("reference.determinism", DETERMINISM)
    w.artifact_path("reference.determinism/tokens.csv").write_text(
        "row,tokens\n" + "".join(f"{i},{' '.join(map(str, t))}\n" for i, t in enumerate(DETERMINISM["tokens"])))
    w.add_result(CheckResult(
        id="reference.determinism", status="passed",
        metrics={"identical_runs": True, "other_seed_differs": True, "tokens_compared": 8},
        artifacts=["artifacts/reference.determinism/tokens.csv"], duration_s=0.75, started_at=clock(),
        ended_at=clock()))

    for rec in WEIGHTS_RECORDS:
        w.record("weights.roundtrip", rec)
    w.add_result(CheckResult(
        id="weights.roundtrip", status="passed", metrics={"tensors": 412, "tp_sizes": [2, 4], "mxfp4_mismatches": 0},
        duration_s=2.25, started_at=clock(), ended_at=clock()))

    t = clock()
    w.add_result(CheckResult(id="kernels.numerics", status="skipped", reason="needs a CUDA device",
                             started_at=t, ended_at=t))
    w.log("all checks ran; finalizing")
    w.finalize()
    return root


if __name__ == "__main__":
    out = make_golden_bundle(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN)
    print(f"wrote {out} and {tarball_path(out)}")
