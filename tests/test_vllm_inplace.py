"""The vLLM route's decode step on vLLM's caches in place (k3_fastpath.integrations.vllm_inplace), on a CPU.

- the same steps through the import / export router (``VllmDecodeRouter``) and in place (``InPlaceRouter``),
  both over the emulated fast step (``Envelope(emulate=True)``: every kernel served by its reference) on copies
  of the same vLLM-layout caches (vLLM's own shape / dtype calculators, KDA windows and states in shared
  padded pages as vLLM's hybrid allocator lays them, paged MLA latents behind random block tables) and vLLM's
  own metadata classes: bitwise the same hidden states (the new latent written one
  position off fails it), and vLLM's caches after three steps bitwise the caches the import /
  export router writes back; a row vLLM pads (state index -1, slot -1) reads out 0; the trace records the
  in-place steps' kernel calls;
- classification from host-side counts only, every fallback reason; layouts refused in place.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3_fastpath.integrations.vllm_inplace import InPlaceRouter, classify_in_place, in_place_reason
from k3_fastpath.integrations.vllm_routing import VllmDecodeRouter
from k3_fastpath.integrations.vllm_state import VllmLayout
from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.runtime.envelope import PREFILL_REASON, Envelope
from k3_fastpath.runtime.executor import DecodeExecutor
from k3_fastpath.synthetic import synthetic_state_dict

pytest.importorskip("vllm", reason="needs vLLM (scripts/bootstrap --vllm)")
from vllm_layout import VllmCaches, decode_metadata, every_layer, kda_pages, mla_pages  # noqa: E402

CFG = preset("k3-tiny").config
KDA, MLA = "language_model.model.layers.1.self_attn", "language_model.model.layers.3.self_attn"
BS = 64  # vLLM's MLA block size (mla_decode pages by multiples of 64)
MAX_LEN = 256
BLOCKS = 24
NAMES = [f"language_model.model.layers.{i}.self_attn" for i in range(CFG.num_hidden_layers)]


@pytest.fixture(scope="module")
def m16():
    return load_reference(CFG, synthetic_state_dict(CFG, 0, conditioning="stable"), dtype=torch.bfloat16)


def _paged(vc: VllmCaches) -> None:
    """vLLM's hybrid layout: each KDA layer's conv window and state in one padded page per index (strided
    views), each MLA layer's pages interleaved with another layer's (page stride twice a page)."""
    for i, layer in enumerate(vc.layers):
        if CFG.is_kda_layer(i):
            layer.kv_cache = kda_pages(*layer.kv_cache)
        else:
            layer.kv_cache = mla_pages(layer.kv_cache)


def _clone(vc: VllmCaches) -> VllmCaches:
    """A copy of ``vc``'s caches in the same layouts (``_paged``'s)."""
    out = VllmCaches.__new__(VllmCaches)
    out.__dict__.update(vc.__dict__)
    out.layers = [SimpleNamespace(kv_cache=kda_pages(*la.kv_cache) if isinstance(la.kv_cache, tuple)
                                  else mla_pages(la.kv_cache)) for la in vc.layers]
    return out


def _setup(m16, seed, lens, idx):
    g = torch.Generator().manual_seed(seed)
    vc = VllmCaches(CFG, 9, BLOCKS, BS, torch.bfloat16, seed=seed)
    _paged(vc)
    ids = torch.randint(3, CFG.vocab_size, (len(lens), max(lens)), generator=g)
    ref = m16.new_cache(len(lens), MAX_LEN)
    m16.prefill(ids, torch.tensor(lens), ref)
    per = MAX_LEN // BS
    bts = torch.randperm(BLOCKS - 1, generator=g)[: len(lens) * per].add(1).reshape(len(lens), per).to(torch.int32)
    for r, i in enumerate(idx):
        vc.store(ref, r, i, bts[r])
    return g, vc, bts


def _equal_caches(a: VllmCaches, b: VllmCaches, idx_a: dict[int, list[int]], idx_b: list[int], bts, seq) -> None:
    """``a``'s requests (KDA layer i at ``idx_a[i]``) hold what ``b``'s do (every KDA layer at ``idx_b``)."""
    for i, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        if CFG.is_kda_layer(i):
            for x, y in zip(la.kv_cache, lb.kv_cache, strict=True):
                assert torch.equal(x[idx_a[i]], y[idx_b]), f"layer {i}: KDA cache differs"
        else:
            for r, n in enumerate(seq):
                for p in range(int(n)):
                    blk, off = int(bts[r, p // BS]), p % BS
                    assert torch.equal(la.kv_cache[blk, off], lb.kv_cache[blk, off]), f"layer {i} row {r} pos {p}"


def test_in_place_steps_are_the_import_export_route(m16, seed):
    """KDA layers 1 and 4 in a cache group of their own (as vLLM-CPU groups k3-tiny's layers,
    tests/integration/test_vllm_inplace_kv_layout.py): the same requests at other state indices there."""
    lens, idx, idx_b = [70, 5, 130], [5, 2, 7], [8, 1, 3]
    g, vc, bts = _setup(m16, seed, lens, idx)
    other = _clone(vc)  # the import / export router's caches: every KDA layer at ``idx``
    group_b = (1, 4)
    for i in group_b:  # move group B's states to its own indices, garbage where they were
        for t in vc.layers[i].kv_cache:
            t[idx_b] = t[idx]
            t[idx] = torch.randn(t[idx].shape, generator=g).to(t.dtype)
    layout = VllmLayout(False, BS)
    ex = DecodeExecutor(m16, max_batch=4, max_len=MAX_LEN, envelope=Envelope(emulate=True), readout="hidden")
    pooled = VllmDecodeRouter(ex, other.layers, layout, (KDA, MLA))
    inplace = InPlaceRouter(ex, vc.layers, layout, NAMES)
    seq = torch.tensor(lens)
    for step in range(3):
        seq = seq + 1
        tok = torch.randint(3, CFG.vocab_size, (4,), generator=g)
        # vLLM pads the batch to its graph's size: a fourth row with state index -1 and seq_len 0
        table = torch.cat([bts, bts[:1] * 0])
        meta_a, meta_b = (decode_metadata(KDA, MLA, ix + [-1], seq.tolist() + [0], table) for ix in (idx, idx_b))
        for m in (meta_a, meta_b):
            m[KDA].num_decodes = m[KDA].num_decode_tokens = 4
        meta = every_layer(meta_a, CFG, NAMES, {i: meta_b for i in group_b})
        plan = inplace.plan(meta, torch.cat([seq - 1, torch.zeros(1, dtype=torch.long)]))
        assert plan.route and plan.batch == 4, plan.reason
        got = inplace.run(plan, tok)
        rec = ex.trace.records[-1]
        assert rec.fallback is None and rec.batch == 4 and rec.kernels == {} and rec.kernel_fallbacks  # CPU
        assert set(rec.kernel_fallbacks) >= {"kda_decode", "mla_decode"}
        p_plan = pooled.plan(decode_metadata(KDA, MLA, idx, seq.tolist(), bts), positions=seq - 1)
        want = pooled.run(p_plan, tok[:3])
        assert got.shape == (4, CFG.hidden_size) and torch.equal(got[3], torch.zeros_like(got[3]))
        d = float((got[:3].float() - want.float()).abs().max())  # the same reference ops on the same rows
        assert torch.equal(got[:3], want), f"step {step}: hidden differs by {d} seed={seed}"
    pooled.sync_back()
    _equal_caches(vc, other, {i: idx_b if i in group_b else idx for i in range(CFG.num_hidden_layers)}, idx, bts, seq)


def test_classification_reads_host_counts_only():
    meta = decode_metadata(KDA, MLA, [4, 1, 7], [5, 9, 2], torch.zeros(3, 4, dtype=torch.int32))
    assert classify_in_place(meta, KDA, MLA, max_batch=4, num_tokens=3) == (None, 3)
    assert classify_in_place(meta, KDA, MLA, max_batch=2, num_tokens=3) == ("batch 3 > 2 (the executor's max_batch)", 3)
    assert classify_in_place(None, KDA, MLA, max_batch=4, num_tokens=3)[0].startswith("no attention metadata")
    pre = decode_metadata(KDA, MLA, [4, 1], [5, 9], torch.zeros(2, 4, dtype=torch.int32), num_prefills=1)
    assert classify_in_place(pre, KDA, MLA, max_batch=4, num_tokens=3)[0] == PREFILL_REASON
    spec = decode_metadata(KDA, MLA, [4], [5], torch.zeros(1, 4, dtype=torch.int32), num_spec=2)
    assert classify_in_place(spec, KDA, MLA, max_batch=4, num_tokens=5)[0].startswith("speculative decoding")
    assert "shorter than the batch" in classify_in_place(meta, KDA, MLA, max_batch=4, num_tokens=2)[0]


def test_layouts_refused_in_place(m16):
    vc = VllmCaches(CFG, 5, 4, BS, torch.bfloat16)
    assert in_place_reason(CFG, vc.caches(), VllmLayout(False, BS), conv_dtype=torch.bfloat16,
                           kv_dtype=torch.bfloat16) is None
    assert "not a multiple of 64" in in_place_reason(CFG, VllmCaches(CFG, 5, 4, 16, torch.bfloat16).caches(),
                                                     VllmLayout(False, 16), conv_dtype=torch.bfloat16,
                                                     kv_dtype=torch.bfloat16)
    spec = VllmCaches(CFG, 5, 4, BS, torch.bfloat16, num_spec=2)
    assert "speculative decoding" in in_place_reason(CFG, spec.caches(), VllmLayout(False, BS, num_spec=2),
                                                     conv_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    kda = next(i for i in range(CFG.num_hidden_layers) if CFG.is_kda_layer(i))
    conv, rec = vc.layers[kda].kv_cache
    vc.layers[kda].kv_cache = kda_pages(conv, rec, pad=4)  # a page stride that breaks 16-byte state rows
    assert "breaks 16-byte access" in in_place_reason(CFG, vc.caches(), VllmLayout(False, BS),
                                                      conv_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)


def test_model_class_runs_decode_steps_in_place(m16, tmp_path, monkeypatch, seed):
    """``vllm_model.KimiK3ForConditionalGeneration`` in route mode at TP 1 without a drafter, its vLLM base
    stood in for (tests/vllm_layout.py): no ``enforce_eager`` needed, the in-place router; a decode step's
    ``forward`` returns the import / export router's hidden states bitwise (padded tokens 0) without calling
    vLLM's forward; a prefill step calls vLLM's forward with nothing to hand back; an executor without its
    fast step makes every step fall back, naming why; all traced."""
    from vllm_layout import route_vllm_config, stand_in_vllm_k3

    from k3_fastpath.integrations import vllm_model
    from k3_fastpath.integrations.vllm_routing import VLLM_PATH
    from k3_fastpath.runtime.trace import read_trace

    lens, idx = [70, 5], [5, 2]
    g, vc, bts = _setup(m16, seed, lens, idx)
    other = _clone(vc)
    calls, context = stand_in_vllm_k3(monkeypatch, vc, CFG.hidden_size, m16)
    names = (vc.layers[0].prefix, vc.layers[3].prefix)
    monkeypatch.setenv("K3_FASTPATH_TRACE", str(tmp_path))
    cfg = route_vllm_config(dtype=torch.bfloat16, max_len=MAX_LEN, max_num_seqs=16, block_size=BS, fastpath_max_batch=4)
    cfg.model_config.enforce_eager = False  # in place: vLLM may capture its FULL decode graphs
    model = vllm_model.KimiK3ForConditionalGeneration(cfg)
    fast = model._k3_fast
    assert fast.in_place
    fast.executor = DecodeExecutor(m16, max_batch=4, max_len=MAX_LEN, envelope=Envelope(emulate=True),
                                   readout="hidden")  # what load_weights builds (emulated kernels on a CPU)
    seq = torch.tensor(lens) + 1
    tok = torch.randint(3, CFG.vocab_size, (2,), generator=g)
    context.attn_metadata = every_layer(decode_metadata(*names, idx, seq.tolist(), bts), CFG, NAMES)
    hidden = model.forward(torch.cat([tok, torch.zeros(2, dtype=torch.long)]),
                           torch.cat([seq - 1, torch.zeros(2, dtype=torch.long)]))
    assert isinstance(fast.router, InPlaceRouter) and not calls
    assert hidden.shape == (4, CFG.hidden_size) and not hidden[2:].any()
    ex2 = DecodeExecutor(m16, max_batch=4, max_len=MAX_LEN, envelope=Envelope(emulate=True), readout="hidden",
                         trace_dir=str(tmp_path / "pooled"))
    pooled = VllmDecodeRouter(ex2, other.layers, VllmLayout(False, BS), (KDA, MLA))
    want = pooled.run(pooled.plan(decode_metadata(KDA, MLA, idx, seq.tolist(), bts), positions=seq - 1), tok)
    assert torch.equal(hidden[:2], want), f"seed {seed}"
    context.attn_metadata = every_layer(decode_metadata(*names, idx, (seq + 1).tolist(), bts, num_prefills=1), CFG,
                                        NAMES)
    assert model.forward(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)) == "vllm hidden"
    assert len(calls) == 1
    fast.executor, fast.router = DecodeExecutor(m16, max_batch=4, max_len=MAX_LEN, readout="hidden"), None
    context.attn_metadata = every_layer(decode_metadata(*names, idx, (seq + 1).tolist(), bts), CFG, NAMES)
    assert model.forward(tok, seq) == "vllm hidden" and len(calls) == 2
    _, steps = read_trace(tmp_path)
    assert [(s["kind"], s["fallback"]) for s in steps] == [
        ("decode", None), ("prefill", f"{VLLM_PATH}: {PREFILL_REASON}"),
        ("decode", f"{VLLM_PATH}: executor: device cpu is not sm_90")]


def test_the_import_export_router_refuses_several_kda_cache_groups(m16):
    """One state index per request cannot serve KDA layers of two cache groups: the import / export router
    falls back naming it (the in-place router reads every layer's own, above)."""
    vc = VllmCaches(CFG, 9, BLOCKS, BS, torch.bfloat16)
    for i, layer in enumerate(vc.layers):
        layer.prefix = layer.layer_name = NAMES[i]
    router = VllmDecodeRouter(DecodeExecutor(m16, max_batch=4, max_len=MAX_LEN), vc.layers, VllmLayout(False, BS),
                              (KDA, MLA))
    table = torch.arange(1, 7, dtype=torch.int32).reshape(3, 2)
    one = decode_metadata(KDA, MLA, [5, 2, 7], [6, 9, 3], table)
    assert router.plan(every_layer(one, CFG, NAMES), torch.tensor([5, 8, 2])).route
    other = decode_metadata(KDA, MLA, [8, 1, 3], [6, 9, 3], table)
    p = router.plan(every_layer(one, CFG, NAMES, {1: other, 4: other}), torch.tensor([5, 8, 2]))
    assert not p.route and p.reason == ("cache layout: KDA layers in 2 cache groups (each its own state indices / "
                                        "blocks per request): the import / export router maps one")


def test_tp2_in_place_steps_are_the_import_export_route(seed):
    """Two TP ranks (threads, ``tp_tools.ThreadComm``), each with vLLM-layout caches of its own shapes: each
    rank's ``TPFastDecoder(in_place=True)`` (no pool of its own) stepping on them through ``InPlaceRouter`` gives
    bitwise the hidden states of the import / export router driving a pooled ``TPFastDecoder`` on a copy, the
    same on both ranks, and the caches end as that router hands its copies back."""
    from tp_tools import run_threads

    from k3_fastpath.runtime import tp as TP
    from k3_fastpath.runtime.tp_fast import TPFastDecoder

    sd = synthetic_state_dict(CFG, 0, conditioning="stable")
    world = 2

    def rank_work(rank: int, comm) -> dict:
        g = torch.Generator().manual_seed(seed)  # the same prompts and block tables on every rank
        m = TP.rank_model(CFG, sd, world, rank, torch.bfloat16)
        tpm = TP.TPModel(CFG, m, comm)
        lens, idx = [70, 5, 130], [5, 2, 7]
        vc = VllmCaches(m.cfg, 9, BLOCKS, BS, torch.bfloat16, seed=seed + rank)
        _paged(vc)
        ids = torch.randint(3, CFG.vocab_size, (3, max(lens)), generator=g)
        ref = tpm.new_cache(3, MAX_LEN)
        tpm.prefill(ids, torch.tensor(lens), ref)
        bts = torch.randperm(BLOCKS - 1, generator=g)[: 3 * (MAX_LEN // BS)].add(1).reshape(3, -1).to(torch.int32)
        for r, i in enumerate(idx):
            vc.store(ref, r, i, bts[r])
        other = _clone(vc)
        kw = {"max_batch": 4, "max_len": MAX_LEN, "use_graphs": False, "readout": "hidden"}
        inplace = InPlaceRouter(TPFastDecoder(CFG, m, comm, in_place=True, **kw), vc.layers, VllmLayout(False, BS),
                                NAMES)
        pooled = VllmDecodeRouter(TPFastDecoder(CFG, m, comm, **kw), other.layers, VllmLayout(False, BS), (KDA, MLA))
        assert inplace.ex.pool is None
        seq, same, hidden = torch.tensor(lens), [], []
        for _ in range(3):
            seq = seq + 1
            tok = torch.randint(3, CFG.vocab_size, (3,), generator=g)
            meta = decode_metadata(KDA, MLA, idx, seq.tolist(), bts)
            plan = inplace.plan(every_layer(meta, CFG, NAMES), seq - 1)
            assert plan.route, plan.reason
            got = inplace.run(plan, tok)
            want = pooled.run(pooled.plan(meta, positions=seq - 1), tok)
            same.append(torch.equal(got, want))
            hidden.append(got)
        pooled.sync_back()
        _equal_caches(vc, other, dict.fromkeys(range(CFG.num_hidden_layers), idx), idx, bts, seq)
        return {"same": same, "hidden": hidden}

    out = run_threads(world, rank_work)
    assert all(all(o["same"]) for o in out), [o["same"] for o in out]
    assert all(torch.equal(a, b) for a, b in zip(out[0]["hidden"], out[1]["hidden"], strict=True))


def test_steps_replayed_by_vllms_graphs_are_counted_on_the_device(m16, seed, monkeypatch):
    """Under vLLM's FULL graphs ``forward`` runs once per captured batch size: the eager warm-up step is traced
    (count 1), the capture too (count 0: it ran nothing, its kernels are the graph's), and each replay bumps a
    device counter the captured step holds; ``flush`` (at the next step vLLM runs itself) traces them as one
    record of that count, so the trace's step total is what ran. Capture is simulated on a CPU (every op
    runs), replays by bumping the counter."""
    import k3_fastpath.integrations.vllm_inplace as vi
    import k3_fastpath.runtime.graphs as exm
    from k3_fastpath.runtime.trace import summarize

    lens, idx = [70, 5, 130], [5, 2, 7]
    g, vc, bts = _setup(m16, seed, lens, idx)
    ex = DecodeExecutor(m16, max_batch=4, max_len=MAX_LEN, envelope=Envelope(emulate=True), readout="hidden")
    router = InPlaceRouter(ex, vc.layers, VllmLayout(False, BS), NAMES)
    seq = torch.tensor(lens) + 1
    meta = every_layer(decode_metadata(KDA, MLA, idx, seq.tolist(), bts), CFG, NAMES)
    tok = torch.randint(3, CFG.vocab_size, (3,), generator=g)
    router.run(router.plan(meta, seq - 1), tok)  # vLLM's eager warm-up
    for mod in (vi, exm):
        monkeypatch.setattr(mod, "capturing", lambda device: True)
    router.run(router.plan(meta, seq - 1), tok)  # the capture
    assert router.flush() == 0  # never read the counter while capturing
    router._ran.add_(4)  # four replays (plus the simulated capture, which ran here)
    for mod in (vi, exm):
        monkeypatch.setattr(mod, "capturing", lambda device: False)
    assert router.sync_back() == 0 and router.flush() == 0  # sync_back flushed the 5
    recs = list(ex.trace.records)
    assert [(r.graph, r.count) for r in recs] == [(False, 1), (True, 0), (True, 5)]
    assert recs[1].kernel_fallbacks and summarize(recs)["steps"] == 6 and summarize(recs)["fast_steps"] == 6
