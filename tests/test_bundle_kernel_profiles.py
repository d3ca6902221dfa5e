"""The kernel profile a perf.decode_sweep point records (kernel_profile: true) in a rendered bundle summary:
read back from the records, one table row per point and backend, a profile that recorded an error as a note."""

from __future__ import annotations

import random
from pathlib import Path

from k3_fastpath.measure.kernel_profile import summarize_kernels
from verify.bundle.kernel_profiles import kernel_profiles
from verify.bundle.readers import read_bundle
from verify.bundle.render import render_bundle
from verify.bundle.writer import BundleWriter
from verify.result import CheckResult

GEMM = "kernel_cutlass_kernel_k3_fastpathkernelsskinny_gemmkernel_wgmmaSkinnyGemmWgmmaKernel_0"
EXPERTS = "kernel_cutlass_kernel_k3_fastpathkernelsmoe_expertskernelExpertGemmKernel_0"
GLUE = "void at::native::vectorized_elementwise_kernel<4, at::native::tanh_kernel_cuda>"


def _bundle(root: Path, rng: random.Random) -> tuple[Path, dict]:
    t, events = 0.0, []
    for _ in range(3):  # three replays
        for name in (GEMM, GLUE, EXPERTS, GEMM):
            d = rng.uniform(5, 60)
            events.append((name, t, t + d))
            t += d + rng.uniform(0.5, 3)
    prof = summarize_kernels(events, 3)
    w = BundleWriter(root, tool_version="0", argv=["k3-verify", "run"], tier="t", planned_checks=["perf.decode_sweep"],
                     engines=[], config={}, seeds={}, env={})
    base = {"context": 1024, "tp": 1, "routing": "uniform", "step_us_median": prof["span_us"], "floor_us": 50.0}
    w.record("perf.decode_sweep", {**base, "batch": 8, "backend": "fast", "kernel_profile": prof})
    w.record("perf.decode_sweep", {**base, "batch": 64, "backend": "fast",
                                   "kernel_profile": {"error": "RuntimeError: CUPTI unavailable"}})
    w.record("perf.decode_sweep", {**base, "batch": 8, "backend": "standard", "step_us_median": 2 * prof["span_us"]})
    w.add_result(CheckResult(id="perf.decode_sweep", status="passed"))
    w.finalize()
    return root, prof


def test_profile_table_and_error_note(tmp_path: Path, seed: int) -> None:
    root, prof = _bundle(tmp_path / "b", random.Random(seed))
    profiles, notes = kernel_profiles(read_bundle(root))
    assert [(p.label, p.backend) for p in profiles] == [("tp=1 uniform batch=8 ctx=1024", "fast")]
    p = profiles[0]
    assert p.span_us == prof["span_us"] and list(p.ops)[0] == max(prof["ops"], key=lambda k: prof["ops"][k]["us"])
    assert len(notes) == 1 and "CUPTI unavailable" in notes[0] and "record 2" in notes[0]
    text = render_bundle(root, tmp_path / "r", plots=False).summary.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| tp=1 uniform batch=8 ctx=1024 | fast |"))
    idle = prof["idle_us"] / prof["span_us"]
    assert f"{prof['span_us'] / 1000:.2f}" in row and f"{idle:.1%}" in row
    assert "skinny_gemm" in row and "moe_experts" in row and "other" in row and " ms excl. (" in row
    top = max(prof["ops"], key=lambda o: prof["ops"][o]["exclusive_us"])
    assert row.split("| ")[-1].startswith(f"{top} {prof['ops'][top]['exclusive_us'] / 1000:.2f} ms excl.")
    assert "kernel profile not taken: RuntimeError: CUPTI unavailable" in text


def test_committed_full_rank_bundle_has_its_profiles() -> None:
    root = Path(__file__).parents[1] / "bundles/runs/2026-12-01-h200-session6/20261201T105315Z-h200-rank-emulation-full"
    profiles, notes = kernel_profiles(read_bundle(root))
    assert notes == [] and [p.label for p in profiles] == ["tp=16 uniform batch=1 ctx=1024",
                                                           "tp=16 uniform batch=64 ctx=1024"]
    assert all(p.backend == "fast" and "skinny_gemm" in p.ops and 0 < p.busy_us <= p.span_us for p in profiles)
    assert not any("exclusive_us" in o for p in profiles for o in p.ops.values())  # recorded before them
