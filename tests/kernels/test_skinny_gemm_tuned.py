"""The tuned-config table: built from sweep records, consulted before the heuristic, only for measured wins."""

from __future__ import annotations

import json

import pytest

from k3_fastpath.kernels.skinny_gemm import tuned
from k3_fastpath.kernels.skinny_gemm.config import SkinnyGemmConfig


def _record(M, N, K, heur_us, best_cfg, best_us, shape="s"):
    heur = SkinnyGemmConfig.from_heuristic(M, N, K)
    return {"kernel": "skinny_gemm", "shape": shape, "M": M, "N": N, "K": K, "heuristic": repr(heur),
            "heuristic_us": heur_us, "best": repr(best_cfg), "best_us": best_us, "cublas_us": 9.0,
            "best_changes": {}}


def test_parse_config_repr_roundtrip():
    cfg = SkinnyGemmConfig("mma", m_max=32, rows_per_warp=1, warps_n=8, split_k=4, k_unroll=2)
    assert SkinnyGemmConfig(**tuned.parse_config_repr(repr(cfg))) == cfg
    with pytest.raises(ValueError, match="lacks"):
        tuned.parse_config_repr("SkinnyGemmConfig(variant='fma')")


def test_only_wins_above_the_noise_enter_the_table():
    win = SkinnyGemmConfig("fma", m_max=2, rows_per_warp=1, warps_n=4, k_unroll=2)
    table = tuned.table_from_records([
        _record(2, 4096, 7168, 30.0, win, 25.0, "big_win"),      # 17% faster: kept
        _record(3, 4096, 7168, 30.0, win, 29.0, "noise"),        # 3% faster: within the run-to-run spread
        {"kernel": "kda_decode", "B": 1},                         # other kernels ignored
    ], source="unit")
    assert list(table["configs"]) == ["4096,7168,2"]
    assert table["configs"]["4096,7168,2"]["k_unroll"] == 2
    assert "big_win" in table["evidence"]["4096,7168,2"]


def test_heuristic_returns_the_tuned_config_for_its_bucket(monkeypatch, tmp_path):
    entry = {"variant": "mma", "m_max": 32, "rows_per_warp": 1, "warps_n": 8, "warps_k": 1, "split_k": 2,
             "k_unroll": 2, "min_ctas_per_sm": 1}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"source": "unit", "configs": {"4096,7168,32": entry}}))
    monkeypatch.setattr(tuned, "TABLE", path)
    tuned._table.cache_clear()
    try:
        for M in (17, 24, 32):  # every M of the 32-row bucket shares the compiled variant
            cfg = SkinnyGemmConfig.from_heuristic(M, 4096, 7168, residual=True)
            assert (cfg.warps_n, cfg.split_k, cfg.residual) == (8, 2, True)
        assert SkinnyGemmConfig.from_heuristic(8, 4096, 7168).warps_n == 4  # other buckets: the rules
        assert SkinnyGemmConfig.from_heuristic(32, 4104, 7168).warps_n == 4  # other shapes: the rules
    finally:
        tuned._table.cache_clear()


def test_committed_table_parses_and_every_entry_is_a_valid_config():
    table = json.loads(tuned.TABLE.read_text())
    assert table["configs"], "the committed H200 table is empty"
    for key, fields in table["configs"].items():
        N, K, M = (int(x) for x in key.split(","))
        cfg = SkinnyGemmConfig(**fields)
        assert cfg.m_max >= M and K % cfg.k_granule == 0, key
        assert key in table["evidence"]
