"""perf.decode_sweep's bookkeeping without a GPU: targets met / missed from point records, the TP rank merge,
the statistics, the tier, and that the records carry the keys the bundle readers use."""

from __future__ import annotations

import random

import pytest

from verify.checks import perf
from verify.checks import perf_sweep as S

KEYS = ("batch", "context", "tp", "backend", "routing", "step_us_median", "step_us_p10", "step_us_p90", "floor_us",
        "pct_of_floor", "tokens_per_s_user", "tokens_per_s_gpu")


def _point(backend: str, batch: int, step: float, floor: float, context: int = 1024, tp: int = 1,
           timer: str = "cuda_graph_replay") -> dict:
    st = S.stats([step * x for x in (0.98, 1.0, 1.0, 1.01, 1.05)])
    return {"variant": "decode", "batch": batch, "context": context, "tp": tp, "routing": "uniform",
            "backend": backend, **st, "floor_us": floor, "pct_of_floor": floor / st["step_us_median"],
            "x_floor": st["step_us_median"] / floor, "timer": timer if backend == "fast" else "eager",
            **S.throughput(st["step_us_median"], batch, tp)}


def test_targets_met_and_missed_are_stated_with_numbers():
    pts = [_point("fast", 1, 100.0, 90.0), _point("standard", 1, 300.0, 90.0),
           _point("fast", 8, 200.0, 180.0), _point("standard", 8, 300.0, 180.0),
           _point("fast", 64, 500.0, 400.0), _point("standard", 64, 800.0, 400.0)]
    targets, problems = perf._sweep_targets(pts, [{"batch": 1, "fused_us": 8.0, "unfused_us": 20.0, "speedup": 2.5}])
    assert targets["speedup_batch_1"]["status"] == "met" and targets["speedup_batch_1"]["min"] == 3.0
    assert targets["speedup_batch_8"]["status"] == "missed"  # 1.5x < 1.8x
    assert targets["speedup_batch_64"]["status"] == "met"  # 1.6x >= 1.4x
    assert targets["fast_step_x_floor"]["status"] == "missed"  # 500/400 = 1.25x > 1.15x
    assert targets["fast_step_x_floor"]["worst"] == 1.25
    assert targets["tp2_fused_allreduce_vs_unfused"]["status"] == "met"
    assert any("batch 8: 1.50x < 1.8x" in p for p in problems)
    assert any("1.25x its floor at batch 64" in p for p in problems)
    assert len(problems) == 2


def test_an_eager_fast_point_is_a_problem_not_a_pass():
    pts = [_point("fast", 1, 100.0, 99.0, timer="eager"), _point("standard", 1, 300.0, 99.0)]
    _, problems = perf._sweep_targets(pts, [])
    assert any("did not run a captured fast step" in p for p in problems)


def test_stats_and_throughput(seed):
    rng = random.Random(seed)
    xs = [rng.uniform(10, 20) for _ in range(21)]
    st = S.stats(xs)
    assert st["step_us_p10"] <= st["step_us_median"] <= st["step_us_p90"]
    assert st["samples_n"] == 21 and st["step_us_median"] == sorted(xs)[10]
    t = S.throughput(250.0, 8, 2)
    assert t["tokens_per_s_user"] == 4000.0 and t["tokens_per_s_gpu"] == 16000.0


def test_merge_ranks_keeps_the_slowest_rank_and_drops_half_measured_points():
    def rank(r: int, med: float, extra: bool) -> dict:
        rows = [dict(_point("standard", 1, med, 50.0, tp=2), tp_step_fused_us=med * 0.9, tp_step_unfused_us=med)]
        if extra:
            rows.append(dict(_point("standard", 8, med, 50.0, tp=2), tp_step_fused_us=1.0, tp_step_unfused_us=med))
        return {"rank": r, "rows": rows, "notes": [], "allreduce": [{"batch": 1, "fused_us": 5.0 + r, "unfused_us": 9.0,
                                                                   "speedup": 0}]}
    m = S.merge_ranks([rank(0, 100.0, True), rank(1, 120.0, False)])
    assert len(m["rows"]) == 1 and m["rows"][0]["step_us_median"] == pytest.approx(120.0)
    assert m["allreduce"][0]["fused_us"] == 6.0 and m["allreduce"][0]["speedup"] == pytest.approx(1.5)
    assert any("not measured on every rank" in n for n in m["notes"])


def test_records_carry_the_reader_keys():
    from verify.bundle.readers import SweepPoint  # the render / compare side reads these

    rec = _point("fast", 4, 80.0, 70.0)
    assert all(k in rec for k in KEYS)
    assert SweepPoint.__dataclass_fields__.keys() >= {"batch", "context", "tp", "backend", "routing"}


def test_bench_decode_tier_loads():
    from verify.tiers import TIER_DIR, load_tier

    tier = load_tier(str(TIER_DIR / "bench-decode.yaml"))
    sweep = {c.id: c for c in tier.checks}["perf.decode_sweep"]
    assert sweep.params["batches"] == [1, 2, 4, 8, 16, 32, 64]
    assert sweep.params["contexts"] == [1024, 32768, 131072] and sweep.params["tp"] == [1, 2]


def test_floor_for_states_cold_l2_by_volume():
    from k3_fastpath.presets import preset

    cfg = preset("k3-mini").config
    fl = S.floor_for(cfg, 1, 8, 1024, 2, "uniform", None, 4.3e12)
    assert fl["floor_us"] > 0 and fl["cold_l2"].startswith("by volume")
    tiny = S.floor_for(preset("k3-tiny").config, 1, 1, 16, 2, "real", [4] * 7, 4.3e12)
    assert tiny["cold_l2"].startswith("NOT cold") and tiny["touched_experts_floor"] == [4.0] * 7
    assert fl["floor_us_split_front"] == fl["floor_us"]  # TP1: nothing to split
    k3 = preset("k3").config
    rank = S.floor_for(k3, 16, 1, 1024, 1, "uniform", None, 4.3e12)  # a K3 TP16 rank
    saved = rank["floor_bytes"] - rank["floor_bytes_split_front"]
    moe = sum(k3.is_moe_layer(i) for i in range(k3.num_hidden_layers))
    h, e, lat = k3.hidden_size, k3.num_experts, k3.routed_expert_hidden_size
    front = 2 * (e * h + 2 * lat * h)  # BF16 router + latent down + latent up, per MoE layer
    assert abs(saved - moe * front * 15 / 16) < 1e-6 * saved, (saved, moe, front)  # 15/16 of it not read


def _sweep_bundle(root, points, allreduce, targets_override=None, status=None, mixed=(), mixed_metrics=None,
                  spec=(), spec_metrics=None):
    from verify.bundle.writer import BundleWriter
    from verify.result import CheckResult

    w = BundleWriter(root, tool_version="0.0.0", argv=["k3-verify"], tier="t", planned_checks=["perf.decode_sweep"],
                     engines=[], config={}, seeds={}, env={})
    for p in points:
        w.record("perf.decode_sweep", p)
    for r in allreduce:
        w.record("perf.decode_sweep.allreduce", r)
    for r in mixed:
        w.record("perf.decode_sweep.mixed", r)
    for r in spec:
        w.record("perf.decode_sweep.spec", r)
    targets, problems = perf._sweep_targets(points, allreduce)
    targets.update(targets_override or {})
    status = status or ("failed" if problems else "passed")
    metrics = {"targets": targets}
    if mixed:
        from verify.checks.perf_mixed import mixed_summary

        metrics["mixed"] = mixed_metrics or mixed_summary(list(mixed), points)
    if spec:
        from verify.checks.perf_spec import spec_summary

        metrics["spec"] = spec_metrics or spec_summary(list(spec), points)
    w.add_result(CheckResult(id="perf.decode_sweep", status=status, reason=problems[0] if problems else
                             ("forged" if status == "failed" else ""), metrics=metrics))
    w.finalize()
    return root


def test_bundle_verify_rederives_the_sweep_targets(tmp_path):
    """The rescorer re-derives every target from the records: an honest bundle verifies, one whose result
    claims a missed target as met does not, and neither does a point whose median disagrees with its samples."""
    from verify.bundle.verify import verify_bundle

    pts = [_point("fast", 1, 100.0, 90.0), _point("standard", 1, 300.0, 90.0)]
    ar = [{"batch": 1, "fused_us": 8.0, "unfused_us": 20.0, "speedup": 2.5}]
    resc = [("perf.decode_sweep", perf.rescore_decode_sweep)]
    ok = verify_bundle(_sweep_bundle(tmp_path / "ok", pts, ar), rescorers=resc)
    assert ok.ok, ok.problems
    slow = [_point("fast", 1, 120.0, 90.0), _point("standard", 1, 200.0, 90.0)]  # 1.33x floor, 1.67x speedup
    lie = verify_bundle(_sweep_bundle(tmp_path / "lie", slow, ar, {"fast_step_x_floor": {"status": "met"}}),
                        rescorers=resc)
    assert not lie.ok and any("fast_step_x_floor" in p for p in lie.problems)
    bad = dict(_point("fast", 8, 100.0, 90.0), step_us_median=50.0)
    tampered = verify_bundle(_sweep_bundle(tmp_path / "bad", [bad], []), rescorers=resc)
    assert any("samples give" in p for p in tampered.problems)
    # the status itself: a sweep that misses its targets flipped to passed (targets left as measured), and a
    # passing one flipped to failed
    flipped = verify_bundle(_sweep_bundle(tmp_path / "flip", slow, ar, status="passed"), rescorers=resc)
    assert not flipped.ok and any("status 'passed', but its records give 'failed'" in p for p in flipped.problems)
    framed = verify_bundle(_sweep_bundle(tmp_path / "frame", pts, ar, status="failed"), rescorers=resc)
    assert not framed.ok and any("status 'failed', but its records give 'passed'" in p for p in framed.problems)


def test_fast_variants_are_checked():
    assert S.check_fast_variants(None) is None
    assert S.check_fast_variants({"fast_pdl": {"pdl": True}, "fast_mma": {"gemm_wgmma_min_m": 0}}) is None
    assert "must be fast_" in S.check_fast_variants({"pdl": {"pdl": True}})
    assert "unknown decode option" in S.check_fast_variants({"fast_x": {"graphs": False}})
    assert "true or false" in S.check_fast_variants({"fast_x": {"pdl": "yes"}})
    assert "mapping of options" in S.check_fast_variants({"fast_x": {}})


def test_fast_variant_rows_are_information_not_targets():
    var = dict(_point("fast_pdl", 1, 80.0, 90.0), variant_of="fast", options={"pdl": True}, vs_fast=1.25)
    pts = [_point("fast", 1, 100.0, 90.0), _point("standard", 1, 300.0, 90.0), var]
    targets, problems = perf._sweep_targets(pts, [])
    assert targets["fast_variants"]["fast_pdl"]["by_point"] == {"tp1 b1 ctx1024 uniform": 1.25}
    assert targets["speedup_batch_1"]["min"] == 3.0  # judged on the fast row, never on a variant
    assert not any("fast_pdl" in p for p in problems)


def test_merged_tp_variant_ratio_uses_the_slowest_rank():
    def rank(r: int, fast: float, pdl: float) -> dict:
        rows = [_point("fast", 1, fast, 50.0, tp=2),
                dict(_point("fast_pdl", 1, pdl, 50.0, tp=2), variant_of="fast", vs_fast=fast / pdl)]
        return {"rank": r, "rows": rows, "notes": [], "allreduce": []}
    m = S.merge_ranks([rank(0, 100.0, 80.0), rank(1, 110.0, 100.0)])
    by = {r["backend"]: r for r in m["rows"]}
    assert by["fast"]["step_us_median"] == pytest.approx(110.0)
    assert by["fast_pdl"]["vs_fast"] == pytest.approx(110.0 / 100.0)  # not rank 0's 1.25


def _mixed_row(backend: str, batch: int, step: float, timer: str = "cuda_graph_replay") -> dict:
    return {"variant": "mixed", "batch": batch, "context": 1024, "tp": 1, "routing": "uniform", "backend": backend,
            "prefill_tokens": 256, **S.stats([step * x for x in (0.99, 1.0, 1.02)]), "timer": timer}


def test_mixed_rows_are_summarised_apart_and_rederived(tmp_path):
    """The mixed rows (a separate stream) never enter the decode targets; ``metrics.mixed`` states each
    backend's mixed step and its ratio to the same backend's decode-only step, and ``bundle verify``
    re-derives it: a summary that understates the mixed step is found."""
    from verify.bundle.verify import verify_bundle
    from verify.checks.perf_mixed import mixed_summary

    pts = [_point("fast", 1, 100.0, 90.0), _point("standard", 1, 300.0, 90.0)]
    mixed = [_mixed_row("fast", 1, 2000.0), _mixed_row("standard", 1, 2000.0),
             _mixed_row("reference", 1, 600000.0, timer="eager")]
    summary = mixed_summary(mixed, pts)["by_point"]["b1 ctx1024 +256 prompt tokens"]
    assert summary["fast"]["x_decode_only"] == 20.0 and summary["standard"]["x_decode_only"] == 6.67
    assert summary["reference"]["x_decode_only"] is None  # no decode-only reference row at this point
    resc = [("perf.decode_sweep", perf.rescore_decode_sweep)]
    ok = verify_bundle(_sweep_bundle(tmp_path / "ok", pts, [], mixed=mixed), rescorers=resc)
    assert ok.ok, ok.problems
    forged = mixed_summary(mixed, pts)
    forged["by_point"]["b1 ctx1024 +256 prompt tokens"]["standard"]["step_us_median"] = 500.0
    lie = verify_bundle(_sweep_bundle(tmp_path / "lie", pts, [], mixed=mixed, mixed_metrics=forged), rescorers=resc)
    assert not lie.ok and any("metrics.mixed" in p for p in lie.problems)


def _spec_row(backend: str, batch: int, k: int, step: float) -> dict:
    st = S.stats([step * x for x in (0.99, 1.0, 1.02)])
    return {"variant": "spec", "batch": batch, "context": 1024, "tp": 1, "routing": "uniform", "k": k,
            "tokens_per_request": k + 1, "rows": batch * (k + 1), "backend": backend, **st,
            "timer": "cuda_graph_replay", "tokens_per_s_user": {str(n): n * 1e6 / st["step_us_median"]
                                                                for n in (2, 4, 6) if n <= k + 1}}


def test_spec_rows_are_summarised_apart_and_rederived(tmp_path):
    """The verify rows (stream ``spec``) never enter the decode targets; ``metrics.spec`` states each backend's
    verify step over its decode step, tokens/s/user per acceptance length, fast's speed-up and the seeds'
    target read at batch 1, k 7; ``bundle verify`` re-derives it and finds a summary that flatters the
    fast path; a point that did not fit a fused step says why."""
    from verify.bundle.verify import verify_bundle
    from verify.checks.perf_spec import spec_summary

    pts = [_point("fast", 1, 100.0, 90.0), _point("standard", 1, 300.0, 90.0)]
    spec = [_spec_row("fast", 1, 7, 150.0), _spec_row("standard", 1, 7, 450.0), _spec_row("fast", 1, 1, 110.0),
            {"variant": "spec", "batch": 16, "context": 1024, "tp": 1, "k": 7, "backend": "fast",
             "not_fused": "16 sequences x 8 tokens: more than 64 rows"}]
    summary = spec_summary(spec, pts)
    b1k7 = summary["by_point"]["b1 ctx1024 k7"]
    assert b1k7["fast"]["x_decode"] == 1.5 and b1k7["standard_over_fast"] == 3.0
    assert b1k7["fast"]["tokens_per_s_user"]["6"] == 40000.0
    assert summary["by_point"]["b1 ctx1024 k1"]["fast"]["tokens_per_s_user"] == {"2": pytest.approx(18181.8)}
    assert "more than 64 rows" in summary["by_point"]["b16 ctx1024 k7"]["fast"]["not_fused"]
    assert summary["seeds_target"]["measured_verify_over_decode"] == 1.5
    assert summary["seeds_target"]["measured_tokens_per_s_user"] == 40000.0
    resc = [("perf.decode_sweep", perf.rescore_decode_sweep)]
    ok = verify_bundle(_sweep_bundle(tmp_path / "ok", pts, [], spec=spec), rescorers=resc)
    assert ok.ok, ok.problems
    forged = spec_summary(spec, pts)
    forged["by_point"]["b1 ctx1024 k7"]["fast"]["x_decode"] = 1.1
    lie = verify_bundle(_sweep_bundle(tmp_path / "lie", pts, [], spec=spec, spec_metrics=forged), rescorers=resc)
    assert not lie.ok and any("metrics.spec" in p for p in lie.problems)
