"""The whole K3 reference model (k3_fastpath.reference.model) on k3-tiny with seeded synthetic weights.

Contracts:
* ``state_dict()`` holds exactly the manifest's tensors, shapes and dtypes; ``load_reference`` is strict and
  names the offending tensor;
* FP64: step-by-step ``decode`` reproduces ``prefill``'s logits at every position (rel 1e-9), for batch 1,
  batch 3 with ragged lengths, and a prefill split in two pieces;
* BF16 (on the ``stable`` synthetic draw): decode and prefill agree at each sequence's first position to
  1e-2 (there they run the same math); later positions differ by rounding, so the bound there is the house
  rule -- decode's RMS error against the FP64 oracle is at most 2x prefill's + 0.02 -- plus a median
  per-position decode/prefill difference under 5%. The default draw amplifies rounding through routing
  flips (a 0.4% input perturbation moves FP64 logits by up to ~90% at some positions): over 36 draws its
  median per-position difference was at most 2.2%, yet one CI draw reached 14.5%; the stable draw's was
  at most 1.2%;
* runs are bitwise deterministic; AttnRes blocks close at layers 0, 3, 6 and stash the pre-mix stream;
  padded tokens / inactive sequences change no cache and get logits 0.
Fresh weights and token ids each run (both seeds printed).
"""

from __future__ import annotations

import secrets

import pytest
import torch

from k3_fastpath.manifest import tensor_specs
from k3_fastpath.presets import preset
from k3_fastpath.reference.kda import KDACache
from k3_fastpath.reference.mla import FP8, GatedMLA, MLACache
from k3_fastpath.reference.model import K3ForCausalLM, load_reference
from k3_fastpath.synthetic import synthetic_state_dict, torch_dtype

CFG = preset("k3-tiny").config


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny ops: intra-op threads only contend (synthetic weights take 2 s on one thread, 17 s on two)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def seed() -> int:
    s = secrets.randbits(31)
    print(f"seed={s}")
    return s


@pytest.fixture(scope="module")
def weights(seed, _one_thread) -> dict[str, torch.Tensor]:
    return synthetic_state_dict(CFG, seed)


@pytest.fixture(scope="module")
def m64(weights) -> K3ForCausalLM:
    return load_reference(CFG, weights, torch.float64)


@pytest.fixture(scope="module")
def m16(weights) -> K3ForCausalLM:
    return load_reference(CFG, weights, torch.bfloat16)


@pytest.fixture(scope="module")
def stable_pair(seed, _one_thread) -> tuple[K3ForCausalLM, K3ForCausalLM]:
    """(FP64, BF16) models on the ``stable`` draw: the BF16 bound measures decode vs prefill, not routing chaos."""
    w = synthetic_state_dict(CFG, seed, conditioning="stable")
    return load_reference(CFG, w, torch.float64), load_reference(CFG, w, torch.bfloat16)


@pytest.fixture
def gen(seed) -> torch.Generator:
    g = seed + secrets.randbits(20)
    print(f"token-id seed={g}")
    return torch.Generator().manual_seed(g)


def _ids(gen, b, t):
    return torch.randint(3, CFG.vocab_size, (b, t), generator=gen)


def _decode_all(m, ids, lengths, kv=None, max_len=None):
    """Logits ``[B, T, V]`` from one decode step per position, each sequence inactive past its length."""
    b, t = ids.shape
    cache = m.new_cache(b, max_len or t, kv_dtype=kv)
    out = []
    for s in range(t):
        out.append(m.decode(ids[:, s], cache, active=s < lengths))
    return torch.stack(out, dim=1), cache


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ---------------------------------------------------------------------------------------------- structure
def test_state_dict_matches_manifest():
    for cfg in (CFG, CFG.replace(expert_format="bf16")):
        sd = K3ForCausalLM(cfg).state_dict()
        specs = tensor_specs(cfg)
        assert len(sd) == len(specs) and set(sd) == {s.name for s in specs}
        for s in specs:
            assert tuple(sd[s.name].shape) == s.shape, s.name
            assert sd[s.name].dtype == torch_dtype(s.dtype), s.name


def test_compute_dtype_changes_bf16_tensors_only():
    m = K3ForCausalLM(CFG).set_compute_dtype(torch.float32)
    sd = m.state_dict()
    for s in tensor_specs(CFG):
        want = {"BF16": torch.float32, "F32": torch.float32, "U8": torch.uint8}[s.dtype]
        assert sd[s.name].dtype == want, s.name
    m.to(torch.float64)
    assert all(t.dtype in (torch.float64, torch.uint8) for t in m.state_dict().values())
    m.set_compute_dtype(torch.bfloat16)  # back to the checkpoint's dtypes, FP32 ones restored to FP32
    sd = m.state_dict()
    assert all(sd[s.name].dtype == torch_dtype(s.dtype) for s in tensor_specs(CFG))


def test_load_reference_is_strict(weights):
    kda = f"model.layers.{CFG.kda_layer_ids[0]}.self_attn.A_log"
    bad = dict(weights)
    del bad["model.layers.3.self_attn.kv_b_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.3.self_attn.kv_b_proj.weight"):
        load_reference(CFG, bad, torch.bfloat16)
    bad = dict(weights, **{"model.layers.2.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.layers.2.extra.weight"):
        load_reference(CFG, bad, torch.bfloat16)
    bad = dict(weights, **{"model.norm.weight": torch.ones(CFG.hidden_size + 1, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_reference(CFG, bad, torch.bfloat16)
    bad = dict(weights, **{kda: weights[kda].bfloat16()})  # K3.md failure mode 6: a blanket BF16 cast
    with pytest.raises(TypeError, match=kda):
        load_reference(CFG, bad, torch.bfloat16)
    m = load_reference(CFG, {"language_model." + k: v for k, v in weights.items()}, torch.bfloat16)
    assert torch.equal(m.state_dict()[kda], weights[kda])


# ---------------------------------------------------------------------------------------------- FP64
def _oracle(m, ids):
    """The layer recipe written out independently (one sequence, FP64): the stream, the AttnRes mixes from
    their formula, the block stashes; only the attention and MLP modules themselves are reused."""
    cfg, eps = m.cfg, m.cfg.rms_norm_eps

    def norm(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    def mix(prefix, blocks, proj, nw):
        src = blocks + [prefix]
        logits = torch.stack([(norm(v, 1.0) * nw * proj[0]).sum(-1) for v in src], -1)
        p = torch.softmax(logits, -1)
        return sum(p[..., j:j + 1] * v for j, v in enumerate(src))

    t = ids.shape[1]
    stream = m.model.embed_tokens.weight[ids]
    blocks: list[torch.Tensor] = []
    for i, layer in enumerate(m.model.layers):
        h = mix(stream, blocks, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight) \
            if blocks else stream
        partial = stream
        if i % cfg.attn_res_block_size == 0:
            blocks, partial = blocks + [stream], 0.0
        a_in = norm(h, layer.input_layernorm.weight)
        if cfg.is_kda_layer(i):
            a = layer.self_attn(a_in, KDACache.empty(cfg, 1, conv_dtype=torch.float64, state_dtype=torch.float64))
        else:
            a = layer.self_attn(a_in, MLACache.empty(cfg, 1, t, torch.float64), torch.zeros(1, dtype=torch.long))
        partial = partial + a
        h = mix(partial, blocks, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight)
        mlp = layer.block_sparse_moe if cfg.is_moe_layer(i) else layer.mlp
        stream = partial + mlp(norm(h, layer.post_attention_layernorm.weight))
    h = mix(stream, blocks, m.model.output_attn_res_proj.weight, m.model.output_attn_res_norm.weight)
    return norm(h, m.model.norm.weight) @ m.lm_head.weight.T


def test_prefill_matches_layer_recipe_oracle(m64, gen):
    ids = _ids(gen, 1, 6)
    with torch.no_grad():
        ref = _oracle(m64, ids)
    assert _rel(m64(ids), ref) < 1e-10


def test_prefill_runs_plain_and_decode_runs_absorbed_mla(m64, gen, monkeypatch):
    calls = []
    for name in ("_attend_plain", "_attend_absorbed"):
        real = getattr(GatedMLA, name)
        monkeypatch.setattr(GatedMLA, name, lambda self, *a, _n=name, _r=real: calls.append(_n) or _r(self, *a))
    cache = m64.new_cache(2, 4)
    m64.prefill(_ids(gen, 2, 3), torch.tensor([3, 2]), cache)
    assert set(calls) == {"_attend_plain"} and len(calls) == len(CFG.mla_layer_ids)
    calls.clear()
    m64.decode(_ids(gen, 2, 1)[:, 0], cache)
    assert set(calls) == {"_attend_absorbed"} and len(calls) == len(CFG.mla_layer_ids)


@pytest.mark.parametrize("lengths", [[7], [9, 4, 6]], ids=["batch1", "batch3-ragged"])
def test_decode_equals_prefill_fp64(m64, gen, lengths):
    b, t = len(lengths), max(lengths)
    ids = _ids(gen, b, t)
    lens = torch.tensor(lengths)
    cache = m64.new_cache(b, t + 2)
    lp = m64.prefill(ids, lens, cache)
    ld, dcache = _decode_all(m64, ids, lens, max_len=t + 2)
    assert lp.dtype == torch.float64 and lp.shape == (b, t, CFG.vocab_size)
    assert torch.equal(cache.lengths, lens) and torch.equal(dcache.lengths, lens)
    for i, n in enumerate(lengths):
        assert _rel(ld[i, :n], lp[i, :n]) < 1e-9
        assert torch.equal(lp[i, n:], torch.zeros_like(lp[i, n:])), "padded rows must be exactly 0"
        assert torch.equal(ld[i, n:], torch.zeros_like(ld[i, n:]))
    assert lp.abs().max() > 0.5
    # the caches agree too (MLA latents where written, KDA states)
    for a, d in zip(cache.layers, dcache.layers, strict=True):
        if isinstance(a, MLACache):
            torch.testing.assert_close(a.latent, d.latent, rtol=1e-10, atol=1e-10)
        else:
            torch.testing.assert_close(a.state, d.state, rtol=1e-9, atol=1e-10)


def test_prefill_split_in_two_equals_prefill_at_once(m64, gen):
    lengths = [8, 5, 6]
    first = [3, 5, 0]  # ragged split, one sequence entirely in the second piece, one entirely in the first
    ids = _ids(gen, 3, 8)
    full = m64.prefill(ids, torch.tensor(lengths), m64.new_cache(3, 10))
    cache = m64.new_cache(3, 10)
    a = m64.prefill(ids[:, :5], torch.tensor(first), cache)
    rest = [n - f for n, f in zip(lengths, first, strict=True)]
    ids2 = torch.stack([torch.cat([ids[i, first[i]:], ids.new_full((first[i],), 7)]) for i in range(3)])
    b = m64.prefill(ids2[:, :max(rest)], torch.tensor(rest), cache)
    for i in range(3):
        if first[i]:
            assert _rel(a[i, :first[i]], full[i, :first[i]]) < 1e-9
        if rest[i]:
            assert _rel(b[i, :rest[i]], full[i, first[i]:lengths[i]]) < 1e-9
    # and one decode step after the split prefill equals a decode step after the one-shot prefill
    nxt = _ids(gen, 3, 1)[:, 0]
    c_full = m64.new_cache(3, 10)
    m64.prefill(ids, torch.tensor(lengths), c_full)
    assert _rel(m64.decode(nxt, cache), m64.decode(nxt, c_full)) < 1e-9


def test_a_long_prefill_attends_in_query_slices_with_the_same_result(m64, gen, monkeypatch):
    """Past ``SCORE_ELEMENTS`` scores the plain MLA attends in slices of queries: same logits (FP64),
    ragged lengths and padding included; the slicing really happens (each MLA layer attends 3+ times)."""
    from k3_fastpath.reference import mla as mla_mod

    ids, lens = _ids(gen, 2, 9), torch.tensor([9, 6])
    whole = m64.prefill(ids, lens, m64.new_cache(2, 9))
    calls = []
    real = GatedMLA._attend_plain
    monkeypatch.setattr(GatedMLA, "_attend_plain",
                        lambda self, *a, **kw: calls.append(a[0].shape[1]) or real(self, *a, **kw))
    monkeypatch.setattr(mla_mod, "SCORE_ELEMENTS", 2 * CFG.num_attention_heads * 9 * 4)  # 4 queries a pass
    sliced = m64.prefill(ids, lens, m64.new_cache(2, 9))
    assert calls == [4, 4, 1] * len(CFG.mla_layer_ids)
    assert _rel(sliced, whole) < 1e-12 and torch.equal(sliced[1, 6:], torch.zeros_like(sliced[1, 6:]))


def test_forward_is_a_fresh_prefill(m64, gen):
    ids = _ids(gen, 2, 5)
    lens = torch.tensor([5, 3])
    assert torch.equal(m64(ids, lens), m64.prefill(ids, lens, m64.new_cache(2, 5)))


# ---------------------------------------------------------------------------------------------- BF16
def test_decode_vs_prefill_bf16_bound(stable_pair, gen):
    m64, m16 = stable_pair
    lengths = torch.tensor([8, 3, 6])
    ids = _ids(gen, 3, 8)
    valid = torch.arange(8)[None] < lengths[:, None]
    ref = m64.prefill(ids, lengths, m64.new_cache(3, 8))
    lp = m16.prefill(ids, lengths, m16.new_cache(3, 8))
    ld, _ = _decode_all(m16, ids, lengths)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all() and torch.isfinite(ld).all()
    # first positions: nearly the same math on both paths (KDA chunked vs recurrent may differ by an ulp,
    # which a routing near-tie can amplify in one sequence: hence the median over the three sequences)
    first = (ld[:, 0] - lp[:, 0]).double().norm(dim=-1) / lp[:, 0].double().norm(dim=-1)
    assert float(first.median()) < 1e-2, first.tolist()
    r, p, d = ref[valid], lp[valid].double(), ld[valid].double()

    def rms(x):
        return float(x.pow(2).mean().sqrt())

    e_p, e_d = rms(p - r) / rms(r), rms(d - r) / rms(r)
    assert e_d <= 2 * e_p + 0.02, (e_p, e_d)
    per_pos = (d - p).norm(dim=-1) / p.norm(dim=-1)
    assert float(per_pos.median()) < 5e-2, per_pos.tolist()


def test_fp8_kv_cache_runs_and_matches_at_first_position(m16, gen):
    lengths = torch.tensor([5, 2, 4])
    ids = _ids(gen, 3, 5)
    cache = m16.new_cache(3, 5, kv_dtype=FP8)
    lp = m16.prefill(ids, lengths, cache)
    assert all(c.latent.dtype == FP8 for c in cache.layers if isinstance(c, MLACache))
    ld, _ = _decode_all(m16, ids, lengths, kv=FP8)
    assert torch.isfinite(lp).all() and torch.isfinite(ld).all()
    first = (ld[:, 0] - lp[:, 0]).double().norm(dim=-1) / lp[:, 0].double().norm(dim=-1)
    assert float(first.median()) < 1e-2, first.tolist()
    l16 = m16.prefill(ids, lengths, m16.new_cache(3, 5))
    assert 0 < _rel(lp[0, 1:], l16[0, 1:]), "FP8 latents must change something after the first token"


def test_deterministic(m16, gen):
    lengths = torch.tensor([6, 4, 5])
    ids = _ids(gen, 3, 6)
    nxt = _ids(gen, 3, 3)
    runs = []
    for _ in range(2):
        cache = m16.new_cache(3, 9)
        logits = [m16.prefill(ids, lengths, cache)]
        for s in range(3):
            logits.append(m16.decode(nxt[:, s], cache, active=torch.tensor([True, s != 1, True])))
        tensors = [t for c in cache.layers for t in (c.tensors() if isinstance(c, KDACache) else (c.latent,))]
        runs.append((logits, tensors, cache.lengths))
    (la, ta, na), (lb, tb, nb) = runs
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    assert all(torch.equal(x.float(), y.float()) for x, y in zip(ta, tb, strict=True))
    assert torch.equal(na, nb) and na.tolist() == [9, 6, 8]


def test_inactive_sequences_and_padding_change_no_cache(m16, gen):
    ids = _ids(gen, 3, 4)
    cache = m16.new_cache(3, 8)
    m16.prefill(ids, torch.tensor([4, 2, 3]), cache)
    before = [[t.clone() for t in (c.tensors() if isinstance(c, KDACache) else (c.latent,))] for c in cache.layers]
    out = m16.decode(_ids(gen, 3, 1)[:, 0], cache, active=torch.tensor([False, True, False]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert out[1].abs().max() > 0
    assert cache.lengths.tolist() == [4, 3, 3]
    for c, old in zip(cache.layers, before, strict=True):
        new = c.tensors() if isinstance(c, KDACache) else (c.latent,)
        for x, y in zip(new, old, strict=True):
            assert torch.equal(x[0].float(), y[0].float()) and torch.equal(x[2].float(), y[2].float())
            if isinstance(c, MLACache):  # sequence 1 wrote exactly its position 2
                changed = (x[1].float() != y[1].float()).any(-1).nonzero().flatten().tolist()
                assert changed == [2]


# ---------------------------------------------------------------------------------------------- AttnRes
def test_attn_res_blocks_close_at_the_right_layers(m64, gen):
    seen = []

    def hook(layer, args, out):
        x, blocks = args[0], args[1]
        new_blocks = out[1]
        seen.append((layer.layer_idx, len(blocks), len(new_blocks), new_blocks[-1] is x if new_blocks else False))

    handles = [layer.register_forward_hook(hook) for layer in m64.model.layers]
    try:
        m64(_ids(gen, 2, 3))
    finally:
        for h in handles:
            h.remove()
    size = CFG.attn_res_block_size
    closing = [i for i in range(CFG.num_hidden_layers) if i % size == 0]
    assert closing == [0, 3, 6]
    count = 0
    for i, n_in, n_out, stashed_input in seen:
        assert n_in == count
        if i in closing:
            count += 1
            assert stashed_input, f"layer {i} must stash its incoming (pre-mix) stream"
        assert n_out == count, (i, n_out, count)
    assert count == CFG.num_attn_res_blocks
