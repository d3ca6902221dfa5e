"""``bench.kernels``'s targets and pass/fail rule, as a function of its raw records (no torch).

The check (``verify/checks/bench.py``) writes one record per timed point -- a row named by ``kernel``
with the raw medians (``heuristic_us``/``ours_us``, the comparison's ``cublas_us``/``torch_us``/``fla_*``,
``floor_us`` with the ``bytes`` and ``read_bw_gbs`` it came from) and the ratios derived from them -- or
an ``error`` row where a point or a whole kernel bench raised; plus the run's read-bandwidth probe and the
launch counters before and after. ``bench_kernels_problems`` re-derives every ratio from the raw medians,
then judges the targets; the check calls it on what it just recorded and ``bundle verify`` calls it again
(``status_rules.RULES``), so an edited ratio or a flipped status fails verification.

Problems come in this order: ratios that do not follow from their medians; GEMM errors; KDA errors; the
kernel benches in the order they ran (``moe_router``, ``mla_decode``, ``moe_experts``: errors and
targets); KDA vs fla; the KDA layer; the GEMM targets; fallbacks during the bench.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

BIG_WEIGHT_BYTES = 32 * 2**20  # skinny GEMM weights at least this large must stream near the read bandwidth
SMALL_WEIGHT_BYTES = 16 * 2**20  # below this a GEMM's gap to its floor is launch latency (reported, not judged)
TARGET_BW_FRACTION = 0.85  # skinny GEMM (M <= 8, big weights) and MLA decode (context >= 32K, batch >= 8)
TARGET_VS_CUBLAS = 1.3  # skinny GEMM at M <= 8
TARGET_KDA_VS_FLA = 1.5  # fused KDA decode vs fla's whole composition of the step, batch <= 8
TARGET_KDA_LAYER_X_FLOOR = 1.25  # the KDA layer step of a TP8/TP16 rank, batch <= 8
TARGET_EXPERTS_FLOOR_FRACTION = 0.80  # MXFP4 experts at batch <= 8
TARGET_MOE_LAYER_VS_TORCH = 2.0  # router + experts + tail at batch 1

TARGETS = {"big_weights_pct_of_bw": TARGET_BW_FRACTION, "vs_cublas": TARGET_VS_CUBLAS,
           "kda_vs_fla_b_le_8": TARGET_KDA_VS_FLA, "kda_layer_x_floor": TARGET_KDA_LAYER_X_FLOOR,
           "mla_pct_ctx_ge_32k_b_ge_8": TARGET_BW_FRACTION, "experts_pct_b_le_8": TARGET_EXPERTS_FLOOR_FRACTION,
           "moe_layer_vs_torch_b1": TARGET_MOE_LAYER_VS_TORCH}

Records = Sequence[Mapping[str, Any]]
Row = Mapping[str, Any]
_REL = 1e-9  # JSON keeps a float exactly: a recomputed ratio differs only by the order of operations


def _ratio(num: str, den: str) -> Callable[[Row, float | None], float | None]:
    return lambda r, bw: r[num] / r[den] if _num(r.get(num)) and _num(r.get(den)) and r[den] else None


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _floor_from_bytes(r: Row, bw: float | None) -> float | None:
    return r["bytes"] / (r["read_bw_gbs"] * 1e3) if _num(r.get("bytes")) and _num(r.get("read_bw_gbs")) else None


def _gemm_floor(r: Row, bw: float | None) -> float | None:
    return r["weight_bytes"] / (bw * 1e3) if _num(r.get("weight_bytes")) and _num(bw) else None


def _tb_per_s(nbytes: str, t: str) -> Callable[[Row, float | None], float | None]:
    return lambda r, bw: (r[nbytes] / (r[t] * 1e-6) / 1e12 if _num(r.get(nbytes)) and _num(r.get(t)) and r[t]
                          else None)


# kernel -> (derived field, how it follows from the row's raw fields and the run's read bandwidth)
DERIVED: dict[str, tuple[tuple[str, Callable[[Row, float | None], float | None]], ...]] = {
    "skinny_gemm": (("weight_bytes", lambda r, bw: r["N"] * r["K"] * 2 if _num(r.get("N")) and _num(r.get("K"))
                     else None),
                    ("floor_us", _gemm_floor), ("pct_of_bw", _ratio("floor_us", "heuristic_us")),
                    ("tb_per_s", _tb_per_s("weight_bytes", "heuristic_us")),
                    ("vs_cublas", _ratio("cublas_us", "heuristic_us"))),
    "kda_decode": (("floor_us", _floor_from_bytes), ("pct_of_floor", _ratio("floor_us", "ours_us")),
                   ("vs_fla", _ratio("fla_full_us", "ours_us")),
                   ("vs_fla_recurrence_only", _ratio("fla_us", "ours_us"))),
    "kda_layer": (("floor_us", _floor_from_bytes), ("x_floor", _ratio("ours_us", "floor_us")),
                  ("vs_cublas_fla", _ratio("cublas_fla_us", "ours_us"))),
    "moe_router": (("floor_us", _floor_from_bytes), ("vs_torch", _ratio("torch_us", "ours_us")),
                   ("pct_of_floor", _ratio("floor_us", "ours_us"))),
    "mla_decode": (("floor_us", _floor_from_bytes), ("vs_torch", _ratio("torch_us", "ours_us")),
                   ("pct_of_floor", _ratio("floor_us", "ours_us")), ("tb_per_s", _tb_per_s("bytes", "ours_us"))),
    "moe_experts": (("floor_us", _floor_from_bytes), ("pct_of_floor", _ratio("floor_us", "ours_us")),
                    ("vs_torch", _ratio("torch_us", "ours_us")),
                    ("layer_vs_torch", _ratio("layer_torch_us", "layer_ours_us"))),
    "rmsnorm_residual": (("speedup", _ratio("torch_us", "ours_us")),),
    "attn_res_mix": (("speedup", _ratio("torch_us", "ours_us")),),
}


def _tag(r: Row) -> str:
    keys = ("shape", "N", "K", "M", "H", "B", "cache", "ctx", "fmt", "routing", "sources")
    return " ".join([str(r.get("kernel"))] + [f"{k}={r[k]}" for k in keys if k in r])


def derived_field_problems(records: Records) -> list[str]:
    """Every recorded ratio, floor and byte count that does not follow from its row's raw fields."""
    bw = next((r.get("gb_per_s") for r in records if r.get("probe") == "read_bandwidth"), None)
    problems = []
    for i, r in enumerate(records):
        for field, derive in DERIVED.get(r.get("kernel"), ()):
            if field not in r or r[field] is None:
                continue
            want = derive(r, bw)
            got = r[field]
            if want is None or not _num(got) or not math.isclose(got, want, rel_tol=_REL, abs_tol=0.0):
                problems.append(f"record {i} ({_tag(r)}): {field} {got!r} does not follow from its row "
                                + (f"({want:.6g})" if want is not None else "(its inputs are missing)"))
    return problems


def _router_problems(rows: list[Row]) -> list[str]:
    return [f"moe_router: {r['error']}" for r in rows if "error" in r]


def _mla_problems(rows: list[Row]) -> list[str]:
    problems = []
    for r in rows:
        tag = f"mla_decode {r.get('cache')} ctx={r.get('ctx')} B={r.get('B')}"
        if "error" in r:
            problems.append(f"{tag}: {r['error']}")
        elif "ours_us" in r and r["ctx"] >= 32768 and r["B"] >= 8 and r["pct_of_floor"] < TARGET_BW_FRACTION:
            problems.append(f"{tag}: {r['pct_of_floor']:.0%} of the read bandwidth < {TARGET_BW_FRACTION:.0%}")
    return problems


def _experts_problems(rows: list[Row]) -> list[str]:
    problems = []
    for r in rows:
        if "error" in r:
            problems.append(f"moe_experts: {r['error']}")
            continue
        tag = f"moe_experts {r['fmt']} {r['routing']} N={r['N']}"
        if r["N"] <= 8 and r["pct_of_floor"] < TARGET_EXPERTS_FLOOR_FRACTION:
            problems.append(f"{tag}: {r['pct_of_floor']:.0%} of the floor < {TARGET_EXPERTS_FLOOR_FRACTION:.0%}")
        if "layer_vs_torch" in r and r["layer_vs_torch"] < TARGET_MOE_LAYER_VS_TORCH:
            problems.append(f"router + experts + tail at batch 1: {r['layer_vs_torch']:.2f}x torch < "
                            f"{TARGET_MOE_LAYER_VS_TORCH}x")
    return problems


# The kernels whose bench module brings its own rows (``bench.KERNEL_BENCHES``), each with its rule.
KERNEL_BENCH_RULES: dict[str, Callable[[list[Row]], list[str]]] = {
    "moe_router": _router_problems, "mla_decode": _mla_problems, "moe_experts": _experts_problems}


def _kda_problems(kda: list[Row]) -> list[str]:
    problems = []
    for r in kda:
        if r.get("vs_fla") is not None and r["B"] <= 8 and r["vs_fla"] < TARGET_KDA_VS_FLA:
            problems.append(f"kda_decode H={r['H']} B={r['B']}: {r['vs_fla']:.2f}x fla < {TARGET_KDA_VS_FLA}x")
        if "ours_us" in r and r.get("fla_full_us") is None:
            problems.append(f"kda_decode H={r['H']} B={r['B']}: fla comparison not measured "
                            f"({r.get('fla_full_reason', 'fla not importable')})")
    return problems


def _kda_layer_problems(layer: list[Row]) -> list[str]:
    problems = []
    for r in layer:
        if "error" in r:
            problems.append(f"kda_layer H={r['H']}: {r['error']}")
        elif r["x_floor"] > TARGET_KDA_LAYER_X_FLOOR:
            problems.append(f"kda_layer H={r['H']} B={r['B']}: {r['x_floor']:.2f}x its floor > "
                            f"{TARGET_KDA_LAYER_X_FLOOR}x ({r['ours_us']:.1f} vs {r['floor_us']:.1f} us)")
    return problems


def _gemm_target_problems(gemm: list[Row]) -> list[str]:
    problems = []
    for r in (r for r in gemm if "heuristic_us" in r):
        tag = f"skinny_gemm {r['shape']} {r['N']}x{r['K']} M={r['M']}"
        if r["M"] <= 8 and r["weight_bytes"] >= BIG_WEIGHT_BYTES and r["pct_of_bw"] < TARGET_BW_FRACTION:
            problems.append(f"{tag}: {r['pct_of_bw']:.0%} of read bandwidth < {TARGET_BW_FRACTION:.0%}")
        if r["M"] <= 8 and r["vs_cublas"] < TARGET_VS_CUBLAS:
            problems.append(f"{tag}: {r['vs_cublas']:.2f}x cuBLAS < {TARGET_VS_CUBLAS}x")
    return problems


def _fallback_problems(records: Records) -> list[str]:
    before = next((r["counters_before"] for r in records if "counters_before" in r), None)
    after = next((r["counters_after"] for r in records if "counters_after" in r), None)
    if before is None or after is None:
        return [] if before is None else ["the launch counters after the bench were not recorded"]
    fell_back = {op: n for op, n in after.get("fallbacks", {}).items() if n != before.get("fallbacks", {}).get(op)}
    return [f"fallbacks during the bench (timed the reference, not the kernel): {fell_back}"] if fell_back else []


def bench_kernels_problems(records: Records, metrics: Mapping[str, Any] | None = None) -> list[str]:
    """``bench.kernels``'s problems, re-derived from its records (see the module docstring for the order)."""
    rows: dict[str, list[Row]] = {}
    for r in records:
        if "kernel" in r:
            rows.setdefault(r["kernel"], []).append(r)
    if not rows:
        return ["no kernel was timed"]
    gemm, kda, layer = rows.get("skinny_gemm", []), rows.get("kda_decode", []), rows.get("kda_layer", [])
    problems = derived_field_problems(records)
    problems += [f"skinny_gemm {r['shape']} {r['N']}x{r['K']} M={r['M']}: {r['error']}" for r in gemm if "error" in r]
    problems += [f"kda_decode H={r['H']} B={r['B']}: {r['error']}" for r in kda if "error" in r]
    for kernel in rows:  # in the order the benches ran
        if kernel in KERNEL_BENCH_RULES:
            problems += KERNEL_BENCH_RULES[kernel](rows[kernel])
    return (problems + _kda_problems(kda) + _kda_layer_problems(layer) + _gemm_target_problems(gemm)
            + _fallback_problems(records))
