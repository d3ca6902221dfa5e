"""GPU: the fused speculative verify step (``k3_fastpath/runtime/verify_step.py``) on the executor's CUDA graphs.
Run: python -m pytest -m gpu tests/test_verify_step_gpu.py

Per case (model, backend, requests B, tokens per request T): a fast (or standard_graph) executor with
``spec_tokens = 8``, caches filled by the reference prefill of random prompts; one fused verify step of random
feeds with ragged active rows, then a commit of random kept rows, against the same rows run as T decode steps
of the same executor on a copy of the cache (``spec_decode.verify_step(fused=False)`` + its restoring commit;
12 x 8 rows run as two launches, ``spec_all_rows``):

* logits: mean KL(decode steps || fused) over the active rows <= 0.01 and every row within 25% of its largest
  logit (``equivalence.spec_decode``'s ``kl_tol`` / ``logit_tol``; a fused step computes each row at
  M = B*T, a decode step at M = B: k3-mini on an H100 showed up to 7% at one row of 64), argmax equal or
  each side's token in the other's top 5 (``equivalence.decode``'s rule); inactive rows 0;
* the committed KDA conv / recurrent state and MLA latents (up to each length) within 5% of their scale;
* the step was one captured graph replay (trace ``graph``), with ``kda_decode`` launched once per KDA layer
  (one launch for all T tokens) and no kernel fallback.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.runtime.spec_decode import commit, verify_step
from verify.checks.context_fill import fill_reference
from verify.checks.equivalence import build_synthetic_model, tie_margins

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an sm_90 CUDA device")]

_models: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _free_models():
    """The module's models (k3-mini: ~10 GB) go when it ends: later GPU test modules need the memory."""
    yield
    _models.clear()
    torch.cuda.empty_cache()


def _model(name: str):
    if name not in _models:
        cfg = preset("k3-tiny").config
        if name == "tiny-6heads":  # a TP16 rank's KDA and MLA heads
            cfg = cfg.replace(linear_attn_config=dataclasses.replace(cfg.linear_attn_config, num_heads=6),
                              num_attention_heads=6, name="tiny-6heads")
        elif name == "k3-mini":
            cfg = preset("k3-mini").config
        _models[name] = build_synthetic_model(cfg, 0, "stable", "cuda")
    return _models[name]


def _close(a, b, what, rel=0.05):
    d = (a.float() - b.float()).abs().max().item()
    scale = max(b.float().abs().max().item(), 1e-6)
    assert d <= rel * scale, f"{what}: max diff {d:.3g} > {rel} x {scale:.3g}"
    return d / scale


@pytest.mark.parametrize("name", ["k3-tiny", "tiny-6heads", "k3-mini"])
@pytest.mark.parametrize("backend", ["latency_specialized", "standard_graph"])
@pytest.mark.parametrize("batch,tokens", [(1, 2), (1, 8), (3, 4), (8, 8), (12, 8)])
def test_fused_verify_step_on_graphs(name, backend, batch, tokens, seed):
    model = _model(name)
    if name == "k3-mini" and backend == "standard_graph" and batch > 1:
        pytest.skip(reason="k3-mini's standard path: batch 1 is enough (its experts are dequantised BF16 copies)")
    max_len = 128
    ex = DecodeExecutor(model, backend=backend, max_len=max_len, max_batch=2 * batch, buckets=(1, 2, 4, 8),
                        spec_tokens=8, spec_all_rows=batch * tokens > 64)  # 12 x 8: two launches (8 + 4)
    assert ex.fast, ex.model_reason
    ex.warmup_and_capture()
    g = torch.Generator().manual_seed(seed)
    ref = model.new_cache(batch, max_len)
    fill_reference(model, ref, None, 16, seed)
    fused, cols = ex.new_cache(batch), ex.new_cache(batch)
    ex.copy_cache(fused, ref)
    ex.copy_cache(cols, ref)
    feed = torch.randint(3, model.cfg.vocab_size, (batch, tokens), generator=g).cuda()
    n_act = torch.randint(1, tokens + 1, (batch,), generator=g)
    active = (torch.arange(tokens)[None, :] < n_act[:, None]).cuda()
    keep = torch.minimum(torch.randint(1, tokens + 1, (batch,), generator=g), n_act)
    what = f"{name} {backend} B={batch} T={tokens} seed={seed}"
    logits = ex.verify(feed, fused, active)
    ex.commit_verify(fused, keep)
    rec = [r for r in ex.trace.records if r.kind == "verify"][-1]
    assert rec.graph and not rec.kernel_fallbacks and rec.fallback is None, f"{rec} {what}"
    if backend == "latency_specialized":
        n_kda = len(model.cfg.kda_layer_ids)
        assert rec.kernels.get("kda_decode") == n_kda, f"kda_decode launches {rec.kernels} for {n_kda} layers {what}"
    assert torch.equal(logits[~active], torch.zeros_like(logits[~active])), what
    s0 = cols.lengths.clone()
    want, states = verify_step(ex, cols, feed, active, fused=False)
    commit(cols, s0, states, keep)
    worst, kls = 0.0, []
    for b, t in active.nonzero().tolist():
        worst = max(worst, _close(logits[b, t], want[b, t], f"request {b} row {t} logits {what}", rel=0.25))
        pr, pf = torch.log_softmax(want[b, t].double(), -1), torch.log_softmax(logits[b, t].double(), -1)
        kls.append(float((pr.exp() * (pr - pf)).sum()))
        if logits[b, t].argmax() != want[b, t].argmax():
            m = tie_margins(want[b, t], logits[b, t], int(want[b, t].argmax()), int(logits[b, t].argmax()))
            assert max(m["ref_token_rank_in_fast"], m["fast_token_rank_in_ref"]) <= 5, \
                f"request {b} row {t}: argmax differs beyond the top 5 {m} {what}"
    assert fused.lengths.tolist() == cols.lengths.tolist(), what
    for la, lb in zip(fused.layers, cols.layers, strict=True):
        if hasattr(la, "tensors"):
            for x, y in zip(la.tensors(), lb.tensors(), strict=True):
                _close(x, y, f"committed KDA state {what}")
        else:
            for r, n in enumerate(cols.lengths.tolist()):
                _close(la.latent[r, :n], lb.latent[r, :n], f"MLA latents of request {r} {what}")
    assert sum(kls) / len(kls) <= 0.01, f"mean KL {sum(kls) / len(kls):.3g} over {len(kls)} rows {what}"
    print(f"\n[verify] {what}: worst row logit error {worst:.2e} of the row's largest logit, mean KL "
          f"{sum(kls) / len(kls):.2e}, max KL {max(kls):.2e}")
    ex.close()
    del ex, fused, cols
    torch.cuda.empty_cache()
