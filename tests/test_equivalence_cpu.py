"""The comparison logic of ``equivalence.decode`` on a CPU (the check itself needs an H200): greedy side by
side, the top-k rule at every mismatch, logit error / KL, the context fill, and one whole (emulated) run of
the check into a record sink. Inputs are fresh random logits / prompts per run (the ``seed`` fixture)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.synthetic import synthetic_state_dict
from verify.checks.context_fill import context_length, fill_reference, synthesize_context
from verify.checks.equivalence import compare_greedy, decode, step_metrics, tie_margins
from verify.checks.status_rules import equivalence_problems
from verify.context import CheckContext

CFG = preset("k3-tiny").config


class _Scripted:
    """A decoder replaying a list of logits, recording the tokens it was fed."""

    def __init__(self, logits: list[torch.Tensor]) -> None:
        self.logits, self.fed = logits, []

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.fed.append(tokens.clone())
        return self.logits[len(self.fed) - 1]


def _logits(seed: int, steps: int, b: int = 3, v: int = 50) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, v, generator=g) * 3 for _ in range(steps)]


def test_identical_sides_never_diverge(seed):
    ref = _logits(seed, 5)
    r = compare_greedy(_Scripted(ref), _Scripted([x.clone() for x in ref]), ref[0], 5)
    assert r["mismatches"] == 0 and r["first_divergence"] == [None] * 3
    assert r["max_abs_logit_err"] == 0.0 and abs(r["kl_mean"]) < 1e-12 and not r["topk_violations"]


def test_mismatch_inside_top5_passes_outside_fails(seed):
    ref = _logits(seed, 4)
    fast = [x.clone() for x in ref]
    top = ref[1][2].topk(5).indices
    fast[1][2, top[3]] = ref[1][2].max() + 1.0  # step 1, row 2: fast picks the reference's 4th choice
    low = ref[3][0].argmin()
    fast[3][0, low] = ref[3][0].max() + 50.0  # step 3, row 0: fast picks the reference's last choice
    rs, fs = _Scripted(ref), _Scripted(fast)
    r = compare_greedy(rs, fs, ref[0], 4, top_k=5)
    assert r["first_divergence"] == [3, None, 1]
    assert r["mismatches"] == 2
    assert [(v["step"], v["seq"]) for v in r["topk_violations"]] == [(3, 0)]
    assert not r["topk_violations"][0]["fast_in_ref_topk"]
    assert r["topk_violations"][0]["fast_token_rank_in_ref"] == ref[3].shape[-1]  # the reference's last choice
    assert not r["topk_violations"][0]["within_row_error"]
    assert r["first_divergence_violations"] == r["topk_violations"] and r["later_violation_rate"] == 0.0
    assert r["kl_max"] > 1.0
    for a, b in zip(rs.fed, fs.fed, strict=True):  # both sides are always fed the reference's token
        assert torch.equal(a, b)
    assert torch.equal(rs.fed[2], ref[1].argmax(-1))


def test_step_metrics_kl_and_error():
    ref = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]])
    fast = torch.tensor([[0.0, 1.0, 2.5], [0.0, 0.0, 0.0]])
    m = step_metrics(ref, fast)
    assert m["max_abs_err"] == [0.5, 0.0] and m["kl"][1] == 0.0 and m["kl"][0] > 0 and m["finite"]
    assert not step_metrics(ref, torch.full_like(fast, float("nan")))["finite"]


def test_context_parsing():
    assert context_length("short") is None and context_length(32768) == 32768 and context_length("128") == 128
    with pytest.raises(ValueError, match="context must be"):
        context_length("long")


def test_fill_reference_to_a_context(seed):
    m = load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.float32)
    cache = m.new_cache(2, 40)
    first = fill_reference(m, cache, 30, 4, seed)
    assert cache.lengths.tolist() == [30, 30] and first.shape == (2, CFG.vocab_size) and torch.isfinite(first).all()
    mla = cache.layers[CFG.mla_layer_ids[0]]
    assert float(mla.latent[:, :26].std()) > 0.5 and float(mla.latent[:, 30:].abs().max()) == 0.0
    other = m.new_cache(2, 40)
    synthesize_context(other, 26, seed + 1)
    assert torch.equal(other.layers[CFG.mla_layer_ids[0]].latent[:, :26], mla.latent[:, :26])


def test_standard_backend_compares_clean(seed):
    m = load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.float32)
    ex = DecodeExecutor(m, backend="standard", max_len=32)
    ref = m.new_cache(2, 32)
    first = fill_reference(m, ref, None, 5, seed)
    fast = ex.new_cache(2, 32)
    ex.copy_cache(fast, ref)
    r = compare_greedy(lambda t: m.decode(t, ref), lambda t: ex.decode(t, fast), first, 3)
    assert r["mismatches"] == 0 and r["max_abs_logit_err"] == 0.0


class _Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[str, dict]] = []

    def record(self, stream: str, obj: dict) -> None:
        self.rows.append((stream, obj))

    def log(self, text: str) -> None:
        pass


def test_check_runs_emulated_on_a_cpu(seed, tmp_path):
    sink = _Sink()
    ctx = CheckContext(check_id="equivalence.decode", preset="k3-tiny", device="cpu", seed=seed % 1000,
                       writer=sink, out=SimpleNamespace(note=lambda *_: None), tmp_dir=Path(tmp_path), budget_s=600)
    res = decode(ctx, batches=[2], contexts=["short"], steps=2, prompt_len=4, emulate=True)
    assert res.status == "passed", res.reason
    kinds = [o["kind"] for _, o in sink.rows]
    assert kinds == ["plan", "step", "step", "point"]
    # the status follows from these records by the rule bundle verify applies; tokens and KL forged fail it
    recs = [o for _, o in sink.rows]
    assert equivalence_problems(recs) == []
    forged = copy.deepcopy(recs)
    for r in forged[1:3]:
        r["fast_tokens"] = [t + 1 for t in r["ref_tokens"]]
        r["kl_mean"] = 5.0
    problems = equivalence_problems(forged)
    assert any("step 0 records mismatch rows" in p and "its tokens give [0, 1]" in p for p in problems), problems
    assert any("mean KL(reference || fast) 5 > 0.01" in p for p in problems), problems
    assert any("its steps give 4, [0, 0]" in p for p in problems), problems
    assert equivalence_problems(recs[:1] + recs[3:])[0].startswith("batch 2 context short: 0 step rows for 2 steps")
    assert equivalence_problems(recs[:1]) == ["batch 2 context short: no record of this planned point"]
    point = sink.rows[-1][1]
    assert point["trace"]["fast_steps"] == 2 and point["trace"]["fallbacks"] == {}
    assert res.metrics["standard_ops_steps"] == {}  # MLA attention and the routed experts are kernels
    n_moe = sum(1 for i in range(CFG.num_hidden_layers) if CFG.is_moe_layer(i))
    kfb = point["trace"]["kernel_fallbacks"]  # emulated: each kernel api served the call from its reference
    assert kfb["mla_decode: no cuda device"] == 2 * len(CFG.mla_layer_ids)
    assert kfb["moe_experts: no cuda device"] == 2 * n_moe


def test_check_passes_executor_options_and_refuses_unknown_ones(seed, tmp_path):
    """``executor_options`` reach the fast side's executor (situ_glu_kernel: the SiTU-GLU kernel op, served
    here by its reference and counted as refused per MLP per step) and are recorded; an unknown or
    non-boolean option fails the check before anything runs."""
    def ctx():
        return CheckContext(check_id="equivalence.decode", preset="k3-tiny", device="cpu", seed=seed % 1000,
                            writer=_Sink(), out=SimpleNamespace(note=lambda *_: None), tmp_dir=Path(tmp_path),
                            budget_s=600)

    c = ctx()
    res = decode(c, batches=[2], contexts=["short"], steps=2, prompt_len=4, emulate=True,
                 executor_options={"situ_glu_kernel": True})
    assert res.status == "passed", res.reason
    assert res.metrics["executor_options"] == {"situ_glu_kernel": True}
    point = c.writer.rows[-1][1]
    kfb = point["trace"]["kernel_fallbacks"]
    assert kfb["situ_glu: no cuda device"] == 2 * CFG.num_hidden_layers
    for bad in ({"situ_glu": True}, {"pdl": "yes"}):
        res = decode(ctx(), batches=[2], contexts=["short"], steps=2, prompt_len=4, emulate=True,
                     executor_options=bad)
        assert res.status == "failed" and "executor_options" in res.reason


def test_violation_after_the_first_divergence_counts_as_later():
    """A top-5 violation after a sequence's first divergence is a 'later' one (rate-bounded by the check), not
    a first-divergence one (which fails it)."""
    g = torch.Generator().manual_seed(3)
    ref = [torch.randn(2, 40, generator=g) for _ in range(4)]
    fast = [x.clone() for x in ref]
    top = ref[1][0].topk(5).indices
    fast[1][0, top[1]] = ref[1][0].max() + 1.0  # step 1, row 0: first divergence, inside the top-5
    low = ref[2][0].argmin()
    fast[2][0, low] = ref[2][0].max() + 50.0  # step 2, row 0: a later mismatch outside the top-5
    r = compare_greedy(_Scripted(ref), _Scripted(fast), ref[0], 3, top_k=5)
    assert r["first_divergence"] == [1, None]
    assert [(v["step"], v["first"]) for v in r["topk_violations"]] == [(2, False)]
    assert r["first_divergence_violations"] == [] and r["later_violation_rate"] == 1 / 6


def test_reference_dense_experts_survive_the_executor(monkeypatch, seed):
    """The reference's kept dense experts are still the ones served after a DecodeExecutor was built over the
    same model (its ExpertBank re-points the expert tensors: a copy made before that would be invalidated and
    every step would dequantise again). Counts mxfp4.dequantize calls during a reference decode."""
    import k3_fastpath.mxfp4 as mxfp4
    from k3_fastpath.presets import preset
    from k3_fastpath.runtime.envelope import Envelope
    from k3_fastpath.runtime.executor import DecodeExecutor
    from k3_fastpath.runtime.step_plan import ModelPlan
    from verify.checks.equivalence import _keep_reference_experts_dense, build_synthetic_model

    cfg = preset("k3-tiny").config
    model = build_synthetic_model(cfg, seed % 1000, "stable", "cpu")
    ModelPlan.build(model)
    assert _keep_reference_experts_dense(model, True) > 0
    DecodeExecutor(model, max_len=16, max_batch=2, envelope=Envelope(emulate=True))
    calls = []
    real = mxfp4.dequantize
    monkeypatch.setattr(mxfp4, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = model.new_cache(2, 8)
    g = torch.Generator().manual_seed(seed)
    model.prefill(torch.randint(3, cfg.vocab_size, (2, 4), generator=g), None, cache)
    assert calls == []


def test_violation_records_how_close_the_tie_was():
    g = torch.Generator().manual_seed(0)
    lr = torch.randn(1000, generator=g)
    lr[:6] = torch.tensor([5.0, 4.9, 4.8, 4.7, 4.6, 4.55])
    noise = 0.3 * torch.randn(1000, generator=g)  # p99 of |noise| ~ 0.77
    lf = lr + noise
    lf[0], lf[5] = 4.5, 5.0  # fast prefers token 5, which the reference ranks 6th; ref's token 0 drops
    m = tie_margins(lr, lf, 0, 5)
    assert m["fast_token_rank_in_ref"] == 6 and m["ref_token_rank_in_fast"] > 1
    assert m["ref_logit_gap"] == pytest.approx(0.45) and m["fast_logit_gap"] == pytest.approx(0.5)
    assert 0.5 < m["row_p99_abs_err"] and m["within_row_error"]
    assert not tie_margins(lr, lr + 0.01 * noise, 0, 5)["within_row_error"]  # gaps far above the noise


SESSION14_EQUIVALENCE = (Path(__file__).resolve().parents[1]
                         / "bundles/runs/2026-12-03-h200-session14/full/records/equivalence.decode.jsonl")


def _forge_later_violations(recs, batch, context, seq, steps):
    """Later top-k violations planted at (``seq``, each of ``steps``) of one point, consistent with its step
    rows (the fast token changed, the mismatch rows and the point's counts updated)."""
    point = next(r for r in recs if r.get("kind") == "point" and (r["batch"], r["context"]) == (batch, context))
    rows = {r["step"]: r for r in recs if r.get("kind") == "step" and (r["batch"], r["context"]) == (batch, context)}
    assert point["first_divergence"][seq] < min(steps)
    for s in steps:
        row = rows[s]
        assert seq not in row["mismatch_rows"]
        row["fast_tokens"][seq] = row["ref_tokens"][seq] + 1
        row["mismatch_rows"] = sorted([*row["mismatch_rows"], seq])
        point["mismatches"] += 1
        point["topk_violations"].append({"step": s, "seq": seq, "ref_token": row["ref_tokens"][seq],
                                         "fast_token": row["fast_tokens"][seq], "first": False,
                                         "fast_in_ref_topk": False, "ref_in_fast_topk": False})


def test_later_violations_are_judged_over_the_grid_and_by_improbable_points():
    """The H200 full-tier run at 46061c2 failed on one near-tie (batch 2, short: 1 later violation in 256
    row-steps, 0.39%); its plan had the per-point rate, which keeps that verdict. With the grid's rate
    (5 in 28,800 row-steps) it passes; 5 at that one point (P ~ 2e-4 at 0.2%) fail it alone; a grid rate
    above a tighter bound fails the grid without failing a point of one violation."""
    import json

    recs = [json.loads(line) for line in SESSION14_EQUIVALENCE.read_text().splitlines()]
    assert equivalence_problems(recs) == ["batch 2 context short: 0.391% of row-steps after a first divergence "
                                          "have tokens outside each other's top-5 (> 0.2%)"]
    grid = copy.deepcopy(recs)
    grid[0]["later_violations"] = "grid"
    assert equivalence_problems(grid) == []
    planted = copy.deepcopy(grid)
    point = next(r for r in planted if r.get("kind") == "point" and (r["batch"], r["context"]) == (2, "short"))
    free = [s for s in range(20, 128) if 1 not in next(r for r in planted if r.get("kind") == "step"
            and (r["batch"], r["context"], r["step"]) == (2, "short", s))["mismatch_rows"]]
    _forge_later_violations(planted, 2, "short", 1, free[:4])
    assert point["mismatches"] == 25
    problems = equivalence_problems(planted)
    assert len(problems) == 1 and problems[0].startswith(
        "batch 2 context short: 5 later top-5 violations in 256 row-steps: P = 1.9e-04 at the allowed 0.2%"), problems
    tight = copy.deepcopy(grid)
    tight[0]["max_later_violation_rate"] = 1e-4
    assert equivalence_problems(tight) == ["the grid: 0.017% of 28800 row-steps after a first divergence have tokens "
                                           "outside each other's top-5 (> 0.01%)"]
