"""The fused verify step (``k3_fastpath/runtime/verify_step.py``) on a CPU, k3-tiny in BF16, the fast step
emulated (every kernel served by its reference) and the standard path's op table.

A fused verify step of ``T`` rows per request gives the logits of the same rows run as ``T`` decode steps
(to BF16 rounding at another M; on this CPU they agree bitwise or nearly), and ``commit_verify`` leaves each
request's caches those after its kept rows: a rejected draft leaves no trace, the requests' own slots are not
written by the step itself, and a request with ``keep`` 0 is untouched. The executor says why a verify step
cannot be fused (no scratch, too many rows, a foreign cache) and ``spec_decode.verify_step`` then runs decode
steps and counts the reason. The standard path's verify conv (``standard_verify._conv_verify``, what its fla
path runs) equals the decode conv token by token."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.cache_pool import copy_cache
from k3_fastpath.runtime.envelope import Envelope
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.synthetic import synthetic_state_dict

CFG = preset("k3-tiny").config


@pytest.fixture(scope="module")
def model():
    return load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.bfloat16)


def _executor(model, backend="latency_specialized", spec_tokens=4, max_batch=8):
    return DecodeExecutor(model, backend=backend, max_len=48, max_batch=max_batch, envelope=Envelope(emulate=True),
                          spec_tokens=spec_tokens)


def _prefilled(ex, seed, batch=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size, (batch, 6), generator=g)
    lens = torch.tensor([6, 4, 5, 3][:batch])
    cache = ex.new_cache(batch)
    ex.prefill(ids, lens, cache)
    return cache, g


def _kda_state(cache):
    return [t.clone() for layer in cache.layers if hasattr(layer, "tensors") for t in layer.tensors()]


def _close(a, b, what, rel=0.02):
    d = (a.float() - b.float()).abs().max().item()
    assert d <= rel * max(b.float().abs().max().item(), 1e-6), f"{what}: max diff {d:.3g}"


NEAR_TIE = 1e-2  # a router score margin (k-th minus (k+1)-th selection score) below which BF16 rounding at
# another M may pick the other expert


def _record_routing(ex) -> list:
    """Every ``moe_router`` call of ``ex`` from now on, appended as (each row's top-k ids sorted, each row's
    margin between the k-th and the (k+1)-th selection score)."""
    from verify.defects import wrap_op

    calls = []

    def make(fn):
        def routed(x, w, bias, k, *rest, **kw):
            ids, weights = fn(x, w, bias, k, *rest, **kw)
            score = (torch.sigmoid(x.float() @ w.float().t()) + bias.float()).sort(dim=-1, descending=True).values
            calls.append((ids.sort(dim=-1).values, score[:, k - 1] - score[:, k]))
            return ids, weights
        return routed

    wrap_op(ex, "moe_router", make)
    return calls


def _routing_flips(fused_calls: list, step_calls: list, active: torch.Tensor) -> dict[int, int]:
    """Per request, its first verify row whose expert selection differs in some layer between the fused step
    (one call a layer, rows ``b * T + t``) and the decode steps (``T`` steps of one call a layer, row ``b``).
    The first such layer must sit at a near tie on both sides (a selection that differs otherwise is a bug);
    the layers and rows after it see different inputs and may differ anyway."""
    layers, rows = len(fused_calls), active.shape[1]
    assert len(step_calls) == rows * layers
    first: dict[int, int] = {}
    for b, t in active.nonzero().tolist():  # each request's rows in order
        if b in first:  # rows after a flip see other inputs
            continue
        for layer in range(layers):
            f_ids, f_margin = (c[b * rows + t] for c in fused_calls[layer])
            s_ids, s_margin = (c[b] for c in step_calls[t * layers + layer])
            if not torch.equal(f_ids, s_ids):
                assert max(f_margin, s_margin) < NEAR_TIE, (b, t, layer, f_ids, s_ids, f_margin, s_margin)
                first[b] = t
                break  # its later layers see other inputs
    return first


@pytest.mark.parametrize("backend", ["latency_specialized", "standard_graph"])
def test_fused_verify_is_decode_steps_and_commits_the_kept_rows(model, seed, backend):
    from k3_fastpath.runtime.spec_decode import commit, verify_step

    ex = _executor(model, backend)
    fused, g = _prefilled(ex, seed)
    cols = ex.new_cache(3)
    copy_cache(cols, fused)
    feed = torch.randint(3, CFG.vocab_size, (3, 4), generator=g)
    active = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # ragged; one request idle
    keep = torch.tensor([3, 1, 0])
    own_before = _kda_state(fused)
    routing = _record_routing(ex)
    logits = ex.verify(feed, fused, active)
    fused_routing = list(routing)
    routing.clear()
    assert logits.shape == (3, 4, CFG.vocab_size)
    for a, b in zip(_kda_state(fused), own_before, strict=True):  # nothing written to the requests' own slots yet
        assert torch.equal(a, b)
    assert torch.equal(logits[~active], torch.zeros_like(logits[~active]))
    ex.commit_verify(fused, keep)
    start = cols.lengths.clone()  # the same rows as decode steps on the copy, committed by restoring copies
    ref, states = verify_step(ex, cols, feed, active, fused=False)
    commit(cols, start, states, keep)
    # a router near tie that BF16 rounding at another M breaks the other way changes that row and the
    # request's later rows: those are not compared (most seeds have none)
    flipped = _routing_flips(fused_routing, routing, active)
    compared = [(b, t) for b, t in active.nonzero().tolist() if t < flipped.get(b, active.shape[1])]
    assert compared
    for b, t in compared:
        _close(logits[b, t], ref[b, t], f"{backend} request {b} row {t} logits")
    assert fused.lengths.tolist() == cols.lengths.tolist() == [9, 5, 5]
    for a, b in zip(_kda_state(fused), _kda_state(cols), strict=True):
        for r in range(3):
            if r not in flipped:
                _close(a[r], b[r], f"{backend} request {r} committed KDA state")
    for la, lb in zip(fused.layers, cols.layers, strict=True):
        if not hasattr(la, "tensors"):
            for r, n in enumerate(cols.lengths.tolist()):
                n = min(n, int(start[r]) + flipped.get(r, n))  # a flipped request: its positions before the flip
                _close(la.latent[r, :n], lb.latent[r, :n], f"{backend} MLA latents of request {r}")
    kinds = ex.trace.summary()["kinds"]
    assert kinds.get("verify") == 1, kinds
    rec = next(r for r in ex.trace.records if r.kind == "verify")
    assert rec.tokens == 4 and rec.batch == 3 and rec.fallback is None


def test_a_commit_of_the_wrong_row_is_caught_by_the_comparison(model, seed):
    """The comparison above can fail: committing the state after every fed row (rejected drafts included)."""
    from k3_fastpath.runtime.verify_step import commit_verify

    ex = _executor(model)
    fused, g = _prefilled(ex, seed)
    cols = ex.new_cache(3)
    copy_cache(cols, fused)
    feed = torch.randint(3, CFG.vocab_size, (3, 4), generator=g)
    ex.verify(feed, fused)
    commit_verify(ex.pool, fused, torch.tensor([4, 4, 4]), 4)  # the planted defect: every row kept ...
    fused.lengths -= 3  # ... while the lengths say one
    ex.decode(feed[:, 0].contiguous(), cols)
    with pytest.raises(AssertionError, match="committed KDA state"):
        for a, b in zip(_kda_state(fused), _kda_state(cols), strict=True):
            _close(a, b, "committed KDA state")


def test_why_a_verify_step_is_not_fused(model):
    from k3_fastpath.runtime.spec_decode import verify_step

    ex = _executor(model, spec_tokens=0)
    cache, _ = _prefilled(ex, 0)
    assert "spec_tokens 0" in ex.verify_reason(3, 4, cache)
    with pytest.raises(ValueError, match="no fused verify step of 3 x 4"):
        ex.verify(torch.zeros(3, 4, dtype=torch.long), cache)
    logits, states = verify_step(ex, cache, torch.zeros(3, 4, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    assert logits.shape == (3, 4, CFG.vocab_size) and isinstance(states, list)
    assert list(ex.verify_splits.values()) == [1] and ex.trace.meta["verify_splits"] == ex.verify_splits
    ex = _executor(model, spec_tokens=8, max_batch=16)
    big, _ = _prefilled(ex, 0, batch=4)
    assert ex.verify_reason(4, 8, big) is None
    assert ex.verify_reason(9, 8, big)  # 9 requests: not this cache's batch / more rows than a fused step holds
    assert ex.pool.scratch == 64
    other = model.new_cache(3, 48)
    assert "not allocated by this executor" in ex.verify_reason(3, 2, other)
    with pytest.raises(ValueError, match="commit_verify without a verify step"):
        ex.commit_verify(big, torch.ones(4, dtype=torch.long))
    off = DecodeExecutor(model, max_len=48, max_batch=4, envelope=Envelope(emulate=True, speculative=False),
                         spec_tokens=4)
    assert off.verify_reason(1, 3, off.new_cache(1)) == "speculative decoding (2 draft tokens)"
    std = DecodeExecutor(model, backend="standard", max_len=48, max_batch=4, spec_tokens=4)
    assert "runs no fused verify step" in std.verify_reason(1, 2, std.new_cache(1))


def test_the_standard_verify_conv_is_the_decode_conv_token_by_token(seed):
    from k3_fastpath.runtime.standard_ops import _conv_standard
    from k3_fastpath.runtime.standard_verify import _conv_verify

    g = torch.Generator().manual_seed(seed)
    B, T, C, N = 3, 5, 16, 24
    x = torch.randn(B * T, C, generator=g).bfloat16()
    w = torch.randn(C, 4, generator=g)
    pool = torch.randn(N, 3, C, generator=g).bfloat16()
    slot = torch.tensor([2, 7, 0])
    out = torch.arange(B * T) + 9
    got_pool = pool.clone()
    y = _conv_verify(x, w, got_pool, slot, out, T)
    seq = pool.clone()
    for t in range(T):
        rows = torch.arange(B) * T + t
        idx = slot if t == 0 else out[rows - 1]
        work = seq.index_select(0, idx)
        tmp = torch.cat([work, torch.zeros(1, 3, C, dtype=work.dtype)])
        y_t = _conv_standard(x[rows], w, tmp, torch.arange(B))
        # the same conv; the four taps summed over another dimension's layout (decode [B, W, C], verify
        # [B, T, C, W]): on some CPUs the FP32 sums differ by an ulp
        torch.testing.assert_close(y[rows], y_t, rtol=1e-6, atol=1e-6, msg=f"token {t}")
        seq.index_copy_(0, out[rows], tmp[:B])
        assert torch.equal(got_pool[out[rows]], tmp[:B]), f"token {t}: window kept at slot_out"
    assert torch.equal(got_pool[:9], pool[:9])


def test_a_verify_step_of_more_rows_than_one_launch_runs_as_several(model, seed):
    """``spec_all_rows=True``: scratch for every row of the largest bucket (32 x 8 = 256), so a verify step of
    12 requests x 8 tokens (96 rows > 64, one launch's most) runs fused as two launches (8 + 4 requests, each a
    replay of the (bucket, 8) step) and commits like the decode steps it replaces; without it the executor
    says why and the rows run as decode steps."""
    from k3_fastpath.runtime.spec_decode import commit, verify_step

    b, T = 12, 8
    ex = DecodeExecutor(model, max_len=48, max_batch=32, envelope=Envelope(emulate=True), spec_tokens=T,
                        spec_all_rows=True)  # room for two caches of 12
    assert ex._ensure_pool().scratch == 256
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 7, (b,), generator=g)
    fused = ex.new_cache(b)
    ex.prefill(torch.randint(3, CFG.vocab_size, (b, 6), generator=g), lens, fused)
    cols = ex.new_cache(b)
    copy_cache(cols, fused)
    feed = torch.randint(3, CFG.vocab_size, (b, T), generator=g)
    q = torch.randint(1, T + 1, (b,), generator=g)
    active = torch.arange(T)[None, :] < q[:, None]
    keep = torch.stack([torch.randint(1, int(n) + 1, (1,), generator=g)[0] for n in q])  # the fed token and more
    assert ex.verify_reason(b, T, fused) is None
    logits = ex.verify(feed, fused, active)
    ex.commit_verify(fused, keep)
    launches = [r for r in ex.trace.records if r.kind == "verify"]
    assert [(r.batch, r.bucket) for r in launches] == [(8, 8), (4, 4)] and all(r.fallback is None for r in launches)
    start = cols.lengths.clone()
    ref, states = verify_step(ex, cols, feed, active, fused=False)
    commit(cols, start, states, keep)
    for r, t in active.nonzero().tolist():
        _close(logits[r, t], ref[r, t], f"request {r} row {t} logits")
    assert fused.lengths.tolist() == cols.lengths.tolist() == (start + keep).tolist()
    for a, c in zip(_kda_state(fused), _kda_state(cols), strict=True):
        _close(a, c, "committed KDA state")
    # without scratch for every row: the executor's reason, and the rows as decode steps
    small = DecodeExecutor(model, max_len=48, max_batch=16, envelope=Envelope(emulate=True), spec_tokens=T)
    assert "more rows than the 64 scratch rows" in small.verify_reason(b, T, small.new_cache(b))
