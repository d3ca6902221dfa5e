"""Planted defects (verify/defects.py) on a CPU: each one, planted into the fast step emulated with every
kernel served by its reference (``Envelope(emulate=True)``), changes the logits of 4 teacher-forced steps
on fresh prompts (the clean executor is bitwise reproducible, so any change is the defect's), leaves the
clean executor beside it unchanged and counts the calls it changed. On k3-tiny's stable synthetic draw the
changes are (relative, seeds 1 and 2) kda_dt_bias_dropped 0.82-0.97, mla_ctx_off_by_one 0.18, mla_scale_nope_only
0.07, router_ids_sorted 0.04, kda_state_bf16 0.02, router_bias_in_weights 0.014-0.03, against 0.028 between
the clean fast step and the BF16 reference: on random weights some hide in BF16's own noise, which is why the
sentinel's evals, not logit distances, are the test of the suite's sensitivity. A uniform rescale of a
token's routed weights is absorbed by K3's latent norm (shown here; why the catalog has no dropped top-k
renormalisation). The engine spec ``builtin:fast+defect=NAME`` is parsed, named in the manifest and refused
with one line where it cannot be. The GPU runs (the sentinel evals catching each defect) are
``scripts/gpu/h200_smoke_and_bench.sh sentinel-defects``; ``tests/test_defects_gpu.py`` plants each into the
real kernels."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.envelope import Envelope
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.synthetic import synthetic_state_dict
from verify.defects import DEFECTS, PlantedDefect
from verify.engines import EngineError, describe_spec, parse_spec

CFG = preset("k3-tiny").config
STEPS = 4
MIN_MOVE = 0.003  # relative logit change from the clean fast step (bitwise reproducible: any change is the defect's; the smallest seen over seeds ~0.009)


@pytest.fixture(scope="module")
def model16():
    return load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.bfloat16)


def _decode(model, ex, ids, lens, tokens):
    """Logits [steps, B, V] of ``STEPS`` teacher-forced decode steps after a prefill (``ex`` None: the model)."""
    stepper = ex or model
    cache = ex.new_cache(ids.shape[0]) if ex else model.new_cache(ids.shape[0], 32)
    stepper.prefill(ids, lens, cache)
    active = torch.ones(ids.shape[0], dtype=torch.bool)
    return torch.stack([stepper.decode(t, cache, active).float() for t in tokens])


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_every_defect_moves_the_fast_steps_logits_and_counts_its_calls(model16, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size, (3, 7), generator=g)
    lens = torch.tensor([7, 5, 6])
    tokens = torch.randint(3, CFG.vocab_size, (STEPS, 3), generator=g)
    clean = _decode(model16, DecodeExecutor(model16, max_len=32, max_batch=4, envelope=Envelope(emulate=True)),
                    ids, lens, tokens)
    layers = {"mla_attention": len(CFG.mla_layer_ids), "kda_step": len(CFG.kda_layer_ids),
              "moe_router": sum(1 for i in range(CFG.num_hidden_layers) if i >= CFG.first_k_dense_replace)}
    moved = {}
    for name, d in DEFECTS.items():
        ex = DecodeExecutor(model16, max_len=32, max_batch=4, envelope=Envelope(emulate=True))
        planted = PlantedDefect(ex, name)
        moved[name] = _rel(_decode(model16, ex, ids, lens, tokens), clean)
        assert planted.calls == STEPS * layers[d.op], (name, planted.calls)
        assert planted.describe()["op"] == d.op and d.models
    assert all(v > MIN_MOVE for v in moved.values()), moved
    # the clean executor was not touched by the planted ones (each executor owns its op table)
    again = DecodeExecutor(model16, max_len=32, max_batch=4, envelope=Envelope(emulate=True))
    assert torch.equal(_decode(model16, again, ids, lens, tokens), clean)


def test_a_uniform_rescale_of_the_routed_weights_is_absorbed_and_a_permutation_is_not(model16, seed):
    """Why the catalog has no dropped top-k renormalisation: K3 normalises the latent routed sum
    (``latent_moe_use_norm``), so scaling a token's routed weights by any factor leaves the MoE output as it
    was, up to the norm's eps (set to 0 here: with it, small random sums move by ~1e-4 at a 0.3x scale);
    giving each expert another's weight (``router_ids_sorted``) does not."""
    from k3_fastpath.reference.model import load_reference

    model = load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.float32)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    assert CFG.latent_moe_use_norm
    moe.routed_expert_norm.eps = 0.0
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, CFG.hidden_size, generator=g)
    with torch.no_grad():
        ids, w = moe.gate(x)
        base = moe.routed(x, ids, w)
        scaled = moe.routed(x, ids, w * (0.3 + 3 * torch.rand(16, 1, generator=g)))
        permuted = moe.routed(x, ids, w.flip(-1))
    assert _rel(scaled, base) < 1e-4
    assert _rel(permuted, base) > 1e-2


def test_bad_defects_are_refused(model16):
    ex = DecodeExecutor(model16, max_len=32, max_batch=4, envelope=Envelope(emulate=True))
    with pytest.raises(ValueError, match="unknown defect 'nope'; defects: mla_scale_nope_only"):
        PlantedDefect(ex, "nope")


def test_the_engine_spec_names_the_defect():
    assert parse_spec("builtin:fast+defect=kda_state_bf16") == ("builtin", "fast+defect=kda_state_bf16")
    d = describe_spec("builtin:fast+defect=kda_state_bf16", "under_test")
    assert d["path"] == "fast" and d["planted_defect"] == "kda_state_bf16"
    assert "planted_defect" not in describe_spec("builtin:fast", "under_test")
    with pytest.raises(EngineError, match=r"unknown defect 'nope'; defects: mla_scale_nope_only, "):
        parse_spec("builtin:fast+defect=nope")


def test_a_defect_engine_on_a_cpu_says_the_fast_path_is_unavailable():
    from verify.engines.builtin import BuiltinEngine

    with pytest.raises(EngineError, match="builtin:fast is unavailable here"):
        BuiltinEngine(path="fast+defect=kda_state_bf16", device="cpu")
    with pytest.raises(EngineError, match="goes into the fast path \\(builtin:fast\\+defect=NAME\\)"):
        BuiltinEngine(path="reference+defect=kda_state_bf16", device="cpu")


def _eval_bundle(root, under_test: str, statuses: dict[str, tuple[str, float, float]],
                 baseline: str = "builtin:reference", model: dict | None = None):
    """A finished bundle of eval results only (``statuses``: check -> (status, reference acc, fast acc); the
    evals' ``model`` metrics where given)."""
    from verify.bundle.writer import BundleWriter
    from verify.result import CheckResult

    w = BundleWriter(root, tool_version="0.1.0", argv=["k3-verify", "run"], tier="sentinel-evals",
                     planned_checks=list(statuses), config={"preset": "k3-tiny", "device": "cuda"}, seeds={},
                     env={}, engines=[describe_spec(under_test, "engine_under_test"),
                                      describe_spec(baseline, "baseline")])
    for check, (status, ref, fast) in statuses.items():
        task = "k3_" + check.split(".", 1)[1]
        if check.startswith("likelihood."):  # (status, reference nll, fast nll)
            metrics = {f"{task}:baseline_nll": ref, f"{task}:under_test_nll": fast, f"{task}:nll_diff": fast - ref,
                       f"{task}:ci_diff": [0.03, 0.05], f"{task}:margin": 0.0005,
                       "tasks": {task: {"items": 30, "items_worse": 21}}}
        else:
            metrics = {f"{task}:baseline_accuracy": ref, f"{task}:under_test_accuracy": fast,
                       f"{task}:accuracy_diff": fast - ref, f"{task}:p_value": 0.01}
            if model is not None:
                metrics["model"] = model
        w.add_result(CheckResult(id=check, status=status, reason="" if status == "passed" else "accuracy drop",
                                 metrics=metrics, duration_s=1.0))
    w.finalize()
    return str(root)


def test_the_catch_table_says_which_eval_caught_which_defect(tmp_path, capsys):
    from verify.defects import catch_table, main

    clean = _eval_bundle(tmp_path / "clean", "builtin:fast", {"evals.gsm8k": ("passed", 0.9, 0.9),
                                                               "evals.mrcr": ("passed", 0.8, 0.8)})
    scale = _eval_bundle(tmp_path / "scale", "builtin:fast+defect=mla_scale_nope_only",
                         {"evals.gsm8k": ("passed", 0.9, 0.88), "evals.mrcr": ("failed", 0.8, 0.3)})
    bf16 = _eval_bundle(tmp_path / "bf16", "builtin:fast+defect=kda_state_bf16",
                        {"evals.gsm8k": ("passed", 0.9, 0.9), "evals.mrcr": ("passed", 0.8, 0.8)})
    rows, problems = catch_table(clean, [scale, bf16])
    assert [(r["defect"], r["task"], r["caught"]) for r in rows] == [
        ("mla_scale_nope_only", "k3_gsm8k", False), ("mla_scale_nope_only", "k3_mrcr", True),
        ("kda_state_bf16", "k3_gsm8k", False), ("kda_state_bf16", "k3_mrcr", False)]
    assert problems == ["kda_state_bf16: no eval caught it"]
    assert main(["table", clean, scale]) == 0
    assert ("| mla_scale_nope_only | builtin:reference | k3_mrcr | accuracy | failed | 80.0% | 30.0% | -50.0% | 0.01 "
            "| - | - | yes |" in capsys.readouterr().out)  # these bundles hold no sample records and no served counts
    # against the clean fast path as the baseline: accepted; against another engine: refused
    cheap = _eval_bundle(tmp_path / "cheap", "builtin:fast+defect=router_ids_sorted",
                         {"evals.gsm8k": ("failed", 0.9, 0.6)}, baseline="builtin:fast")
    other = _eval_bundle(tmp_path / "other", "builtin:fast+defect=router_ids_sorted",
                         {"evals.gsm8k": ("failed", 0.9, 0.6)}, baseline="vllm")
    rows, problems = catch_table(clean, [cheap, other])
    assert [(r["against"], r["caught"]) for r in rows] == [("builtin:fast", True), ("vllm", True)]
    assert problems == ["router_ids_sorted: baseline 'vllm', neither the clean run's 'builtin:reference' nor the "
                        "clean fast path"]
    assert main(["table", clean, bf16]) == 1
    # a clean run that failed an eval cannot tell a defect apart; a clean bundle as a defect run is refused
    capsys.readouterr()
    weak = _eval_bundle(tmp_path / "weak", "builtin:fast", {"evals.gsm8k": ("failed", 0.1, 0.1)})
    rows, problems = catch_table(weak, [clean])
    assert problems == ["clean run: evals.gsm8k failed (it cannot tell a defect apart)",
                        f"{clean}: its engine under test has no planted defect"]
    assert main(["list"]) == 0 and capsys.readouterr().out.split() == list(DEFECTS)
    assert main(["table", clean]) == 2


def test_an_uncaught_mla_defect_says_how_little_the_model_uses_its_mla_layers(tmp_path):
    """Where the clean run's evals recorded the scored model's held-out losses with its MLA layers zeroed
    (``training.json``'s ``heldout.ablated``), an MLA defect no eval caught says how far that moved them; a
    defect elsewhere, or a model without the measure, says nothing of it."""
    from verify.defects import catch_table

    held = {"checkpoint": {"gsm8k": {"loss": 0.02}, "mrcr": {"loss": 2.0}},
            "ablated": {"mla_zeroed": {"gsm8k": {"loss": 0.0206}, "mrcr": {"loss": 2.002}}}}
    ok = {"evals.gsm8k": ("passed", 0.9, 0.9)}
    clean = _eval_bundle(tmp_path / "clean", "builtin:fast", ok, model={"training": {"heldout": held}})
    mla = _eval_bundle(tmp_path / "mla", "builtin:fast+defect=mla_ctx_off_by_one", ok)
    kda = _eval_bundle(tmp_path / "kda", "builtin:fast+defect=kda_state_bf16", ok)
    _, problems = catch_table(clean, [mla, kda])
    assert problems == ["mla_ctx_off_by_one: no eval caught it; with its MLA layers zeroed the scored model's "
                        "held-out losses moved 3% at most (its training.json)",
                        "kda_state_bf16: no eval caught it"]
    bare = _eval_bundle(tmp_path / "bare", "builtin:fast", ok, model={"training": {"heldout": {}}})
    assert catch_table(bare, [mla])[1] == ["mla_ctx_off_by_one: no eval caught it"]
    apart = {"checkpoint": {"aime25": {"loss": 0.05}}, "ablated": {"mla_zeroed": {"gsm8k": {"loss": 0.03}}}}
    disjoint = _eval_bundle(tmp_path / "apart", "builtin:fast", ok, model={"training": {"heldout": apart}})
    assert catch_table(disjoint, [mla])[1] == ["mla_ctx_off_by_one: no eval caught it"]  # no task scored both ways


def test_the_catch_table_counts_the_gold_answers_likelihood_as_an_eval(tmp_path, capsys):
    from verify.defects import _moved, catch_table, main

    clean = _eval_bundle(tmp_path / "clean", "builtin:fast", {"evals.gsm8k": ("passed", 0.9, 0.9),
                                                               "likelihood.gold_answers": ("passed", 0.05, 0.0501)})
    bf16 = _eval_bundle(tmp_path / "bf16", "builtin:fast+defect=kda_state_bf16",
                        {"evals.gsm8k": ("passed", 0.9, 0.9), "likelihood.gold_answers": ("failed", 0.05, 0.09)},
                        baseline="builtin:fast")
    rows, problems = catch_table(clean, [bf16])
    assert [(r["check"], r["measure"], r["caught"]) for r in rows] == [
        ("evals.gsm8k", "accuracy", False), ("likelihood.gold_answers", "nll", True)]
    assert problems == []
    assert main(["table", clean, bf16]) == 0
    assert ("| kda_state_bf16 | builtin:fast | k3_gold_answers | nll | failed | 0.05 | 0.09 | 0.04 | CI low 0.03 vs "
            "margin 0.0005 | 21 of 30 | - | yes |" in capsys.readouterr().out)
    # not caught: moved under the margin, or not measurably at all
    under = _eval_bundle(tmp_path / "under", "builtin:fast+defect=router_ids_sorted",
                         {"likelihood.gold_answers": ("passed", 0.05, 0.0501)}, baseline="builtin:fast")
    assert catch_table(clean, [under])[1] == [
        "router_ids_sorted: no eval caught it; it made the answers less likely (k3_gold_answers: nll +0.0001, CI "
        "low 0.03) by less than the margin 0.0005"]
    rows = [{"defect": "x", "measure": "nll", "ci_low": -1e-5, "margin": 5e-4, "task": "t", "diff": 1e-6}]
    assert "moved by no measurable amount" in _moved(rows, "x")  # an interval holding 0
