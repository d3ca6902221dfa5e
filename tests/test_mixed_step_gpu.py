"""The mixed step on an H100/H200 (k3_fastpath/runtime/mixed_step.py): fla's chunked KDA and SDPA serve the
prompt, the step is captured in a CUDA graph, and the replay computes what the eager step did. Run:
python -m pytest -m gpu tests/test_mixed_step_gpu.py

Numerics: the same FP64-oracle rule as tests/test_mixed_step_cpu.py (the mixed step's logits and two later
decode steps within 2x the BF16 reference's error + 1% of the logit scale, all row-steps but one). The replay
against the eager step: equal to 1e-3 of the logit scale (the grouped experts' FP32 combine adds with atomics,
so the two may round differently). ``perf_mixed.run_mixed`` then times the graph rows."""

from __future__ import annotations

import pytest
import torch
from test_mixed_step_cpu import CFG, _over

from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime import standard_prefill
from k3_fastpath.runtime.envelope import PREFILL_REASON
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.synthetic import synthetic_state_dict

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

MAX_LEN = 96
_models: dict = {}


def _models_():
    if not _models:
        sd = synthetic_state_dict(CFG, 0, conditioning="stable")
        _models["m"] = (load_reference(CFG, sd, dtype=torch.bfloat16, device="cuda"),
                        load_reference(CFG, sd, dtype=torch.float64))
    return _models["m"]


@pytest.mark.parametrize("backend", ["standard_graph", "latency_specialized"])
def test_mixed_step_captured_matches_eager_and_the_oracle(backend, seed):
    m16, m64 = _models_()
    assert standard_prefill.fla_chunk_kda() is not None, "fla is not importable here (stage fla-core)"
    ex = DecodeExecutor(m16, backend=backend, max_len=MAX_LEN, max_batch=8, buckets=(1, 2, 4, 8))
    assert ex.fast and ex.use_graphs, ex.model_reason
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size, (3, 12), generator=g)
    lens = torch.tensor([12, 0, 9])
    tokens = torch.randint(3, CFG.vocab_size, (3,), generator=g)
    prompt = torch.randint(3, CFG.vocab_size, (40,), generator=g)
    caches = [ex.new_cache(3) for _ in range(2)]
    c16, c64 = m16.new_cache(3, MAX_LEN), m64.new_cache(3, MAX_LEN)
    for model, c in [(ex, caches[0]), (ex, caches[1]), (m16, c16), (m64, c64)]:
        model.prefill(ids, lens, c)
    eager = ex.mixed(tokens.cuda(), caches[0], 1, prompt.cuda())  # warm-up (compiles, autotunes), then capture
    cap = ex.mixed_capture(3, 40, 0)
    assert cap is not None and cap.graph is not None, ex.mixed_eager_reason(3, 40, 0)
    got = ex.mixed(tokens.cuda(), caches[1], 1, prompt.cuda())  # the replay
    recs = [r for r in ex.trace.records if r.kind == "mixed"]
    assert [r.graph for r in recs] == [False, True]
    assert all(r.fallback == (PREFILL_REASON if backend == "latency_specialized" else None) for r in recs)
    ops = {o["op"]: o["reason"] for o in recs[-1].standard_ops}
    assert standard_prefill.FLA_CHUNK in ops["kda_prefill"], ops
    scale = float(eager.abs().max())
    assert float((got - eager).abs().max()) <= 1e-3 * scale, "the replay computed another step than the eager run"
    step_ids = torch.zeros(3, 40, dtype=torch.long)
    step_ids[:, 0], step_ids[1] = tokens, prompt
    step_lens = torch.tensor([1, 40, 1])
    last = step_lens - 1
    ref = m16.prefill(step_ids, step_lens, c16)[torch.arange(3, device="cuda"), last.cuda()]
    oracle = m64.prefill(step_ids, step_lens, c64)[torch.arange(3), last]
    problems = _over(got.cpu(), ref.cpu(), oracle, "mixed step")
    for step in range(2):
        tok = oracle.argmax(-1)
        got = ex.decode(tok.cuda(), caches[1])
        ref, oracle = m16.decode(tok.cuda(), c16), m64.decode(tok, c64)
        problems += _over(got.cpu(), ref.cpu(), oracle, f"decode step {step}")
    assert len(problems) <= 1, f"seed {seed}: {problems}"


def test_perf_mixed_rows_time_the_captured_step(seed):
    from verify.checks.perf_mixed import run_mixed

    m16, _ = _models_()
    kw = dict(max_len=512, max_batch=9)
    fast = DecodeExecutor(m16, backend="latency_specialized", **kw)
    strong = DecodeExecutor(m16, backend="standard_graph", pool_from=fast, **kw)
    std = DecodeExecutor(m16, backend="standard", **kw)
    rows = run_mixed(m16, fast, strong, std, 8, 128, 64, iters=5, standard_iters=2, seed=seed)
    by = {r["backend"]: r for r in rows}
    assert set(by) == {"fast", "standard", "reference"}
    for name in ("fast", "standard"):
        assert by[name]["timer"] == "cuda_graph_replay", by[name].get("eager_reason")
        assert by[name]["step_us_median"] > 0 and "fla chunk_kda" in by[name]["prefill_impl"]
    assert by["fast"]["fallback"] == PREFILL_REASON and by["standard"]["fallback"] is None
    assert by["reference"]["timer"] == "eager" and by["reference"]["information_only"]
