"""``standard_ops.mla_attention_standard`` (the standard path's absorbed MLA decode: gathered BF16 chunks,
one score GEMM over all 576 latent dims with FP32 out, online softmax, BF16 P) against an FP64 oracle of
absorbed MLA attention, on a CPU.

Contract: within 2x the error of the previous all-FP32 PyTorch implementation (kept here only as the
baseline, ``_fp32_chunked_mla``) of the same oracle, plus 0.1% of the output scale; positions past a
row's ``pos`` (stale NaN / huge bytes) never change a bit of the output; padded slot-0 rows are finite
(0); chunk boundaries anywhere (``pos`` straddling a chunk, a chunk wholly past ``pos``) change nothing
but the summation order. K3 shapes per head (nope 128, rope 64, rank 512, v 128); fresh inputs per run."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath.kernels.mla_decode.api import write_latent as write_mla_latent
from k3_fastpath.reference.common import compute_dtype
from k3_fastpath.reference.mla import FP8
from k3_fastpath.runtime import standard_ops as S

NOPE, ROPE, RANK, V, HEADS = 128, 64, 512, 128, 8
SOFTMAX_SCALE = (NOPE + ROPE) ** -0.5
EPS = 1e-6
LENGTH = 384  # three chunks of 128 when the chunk is forced to 128
SLOTS = torch.tensor([3, 1, 6, 0, 4, 2, 5], dtype=torch.int32)
POS = torch.tensor([0, 127, 128, 0, 255, 383, 200])  # pos 0, both sides of a chunk edge, the last position


def _fp32_chunked_mla(q, kv, kv_norm_w, eps, latent, scale, slot, pos, w_uk, w_uv, softmax_scale, gate,
                      chunk):
    """The previous ``mla_attention_standard`` (every latent chunk converted to FP32 and masked with
    ``torch.where``, FP32 einsums), kept as the error baseline of the new one."""
    write_mla_latent(kv, kv_norm_w, eps, latent, scale, slot, pos)
    bk, heads, _ = q.shape
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    dt = q.dtype
    cdt = compute_dtype(dt)
    fp8 = latent.dtype == FP8
    rows = slot.long()
    q_lat = torch.einsum("bhd,hdr->bhr", q[..., :nope].to(cdt), w_uk.to(cdt)).to(dt).to(cdt)
    q_pe = q[..., nope:].to(cdt)
    m = torch.full((bk, heads), float("-inf"), dtype=cdt)
    denom = torch.zeros(bk, heads, dtype=cdt)
    acc = torch.zeros(bk, heads, rank, dtype=cdt)
    max_len = latent.shape[1]
    for s0 in range(0, max_len, chunk):
        s1 = min(max_len, s0 + chunk)
        lat = latent[rows, s0:s1]
        lat = ((lat.float() * scale).to(dt) if fp8 else lat.to(dt)).to(cdt)
        ok = torch.arange(s0, s1)[None, :] <= pos[:, None]
        lat = torch.where(ok[..., None], lat, 0.0)
        sc = (torch.einsum("bhr,bsr->bhs", q_lat, lat[..., :rank])
              + torch.einsum("bhd,bsd->bhs", q_pe, lat[..., rank:])) * softmax_scale
        sc = sc.masked_fill(~ok[:, None, :], float("-inf"))
        m_new = torch.maximum(m, sc.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(sc - m_new[..., None])
        denom = denom * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("bhs,bsr->bhr", p, lat[..., :rank])
        m = m_new
    o_lat = (acc / denom[..., None]).to(dt)
    o = torch.einsum("bhr,hdr->bhd", o_lat.to(cdt), w_uv.to(cdt)).to(dt).reshape(bk, heads * w_uv.shape[1])
    return (o.float() * torch.sigmoid(gate.float())).to(dt)


def _oracle(q, latent, scale, slot, pos, w_uk, w_uv, gate):
    """Absorbed MLA in FP64 over the stored latents (FP8: ``e4m3 * scale`` exactly), positions 0..pos."""
    d = torch.float64
    out = torch.zeros(q.shape[0], HEADS * V, dtype=d)
    for b in range(q.shape[0]):
        n = int(pos[b]) + 1
        raw = latent[int(slot[b]), :n]
        c = raw.to(d) * float(scale) if raw.dtype == FP8 else raw.to(d)
        q_lat = torch.einsum("hd,hdr->hr", q[b, :, :NOPE].to(d), w_uk.to(d))
        scores = (q_lat @ c[:, :RANK].T + q[b, :, NOPE:].to(d) @ c[:, RANK:].T) * SOFTMAX_SCALE
        o_lat = torch.softmax(scores, dim=-1) @ c[:, :RANK]
        o = torch.einsum("hr,hvr->hv", o_lat, w_uv.to(d)).reshape(-1)
        out[b] = o * torch.sigmoid(gate[b].to(d))
    return out


def _problem(seed: int, kv_dtype: torch.dtype, w_uk_dtype: torch.dtype, stale: str):
    """Fresh inputs: q, kv (the new token), a slot pool whose positions 0..pos-1 of every used slot hold
    N(0,1) latents and every other position holds ``stale`` (zeros, or NaN / huge values)."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    bk = len(SLOTS)
    scale = torch.tensor(1.0 if kv_dtype != FP8 else 0.75)
    q = (torch.randn(bk, HEADS, NOPE + ROPE, generator=g) * 1.5).to(bf)
    kv = torch.randn(bk, RANK + ROPE, generator=g).to(bf)
    kv_norm_w = (1 + 0.1 * torch.randn(RANK, generator=g)).to(bf)
    w_uk = (torch.randn(HEADS, NOPE, RANK, generator=g) * NOPE ** -0.5).to(w_uk_dtype)
    w_uv = (torch.randn(HEADS, V, RANK, generator=g) * RANK ** -0.5).to(bf)
    gate = torch.randn(bk, HEADS * V, generator=g).to(bf)
    fresh = torch.randn(8, LENGTH, RANK + ROPE, generator=g)
    if stale == "zeros":
        pool = torch.zeros(8, LENGTH, RANK + ROPE)
    else:  # NaN and the largest finite value of the storage dtype, alternating
        big = 448.0 * float(scale) if kv_dtype == FP8 else torch.finfo(bf).max
        pool = torch.full((8, LENGTH, RANK + ROPE), float("nan"))
        pool[:, 1::2] = big
    for s, p in zip(SLOTS.tolist(), POS.tolist(), strict=True):
        if s:
            pool[s, :p] = fresh[s, :p]
    latent = (pool / scale).to(FP8) if kv_dtype == FP8 else pool.to(bf)
    return dict(q=q, kv=kv, kv_norm_w=kv_norm_w, eps=EPS, latent=latent, scale=scale, slot=SLOTS.clone(),
                pos=POS.clone(), w_uk=w_uk, w_uv=w_uv, softmax_scale=SOFTMAX_SCALE, gate=gate)


def _new(args, chunk: int | None, monkeypatch, latent: torch.Tensor | None = None):
    """The op on a copy of the pool (or on ``latent`` itself), chunks of ``chunk`` positions if given."""
    if chunk is not None:
        monkeypatch.setattr(S, "_latent_chunk", lambda *a, **k: chunk)
    a = dict(args, latent=args["latent"].clone() if latent is None else latent)
    got = S.mla_attention_standard(a["q"], a["kv"], a["kv_norm_w"], a["eps"], a["latent"], a["scale"],
                                   a["slot"], a["pos"], None, None, a["w_uk"], a["w_uv"], a["softmax_scale"],
                                   a["gate"])
    monkeypatch.undo()
    return got, a["latent"]


def _err(x: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> float:
    return float((x[real].double() - ref[real]).abs().max())


@pytest.mark.parametrize("w_uk_dtype", [torch.float32, torch.bfloat16], ids=["w_uk_fp32", "w_uk_bf16"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@torch.no_grad()
def test_matches_the_fp64_oracle_within_2x_the_fp32_implementation(kv_dtype, w_uk_dtype, seed, monkeypatch):
    """Chunks of 128 over a 384-position pool (rows at pos 0, 127, 128, 200, 255, 383 and a padded slot-0
    row) and one chunk over the whole pool: each within 2x the FP32 implementation's error of the FP64
    oracle (+0.1% of the scale); the same latent written as the kernel path writes it; slot-0 row 0."""
    args = _problem(seed, kv_dtype, w_uk_dtype, "zeros")
    real = SLOTS != 0
    old_lat = args["latent"].clone()
    a = args
    old = _fp32_chunked_mla(a["q"], a["kv"], a["kv_norm_w"], EPS, old_lat, a["scale"], a["slot"], a["pos"],
                            a["w_uk"], a["w_uv"], SOFTMAX_SCALE, a["gate"], 128)
    ref = _oracle(args["q"], old_lat, args["scale"], args["slot"], args["pos"], args["w_uk"], args["w_uv"],
                  args["gate"])
    scale = float(ref.abs().max())
    e_old = _err(old, ref, real)
    for chunk in (128, None):
        got, lat = _new(args, chunk, monkeypatch)
        assert got.dtype == args["q"].dtype and got.shape == (len(SLOTS), HEADS * V)
        assert torch.equal(lat.view(torch.uint8), old_lat.view(torch.uint8)), "a different latent was written"
        e_new = _err(got, ref, real)
        assert e_new <= 2 * e_old + 1e-3 * scale, f"seed {seed} chunk {chunk}: {e_new:.4g} vs old {e_old:.4g}"
        assert torch.isfinite(got).all() and torch.all(got[~real] == 0)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@torch.no_grad()
def test_stale_positions_never_enter(kv_dtype, seed, monkeypatch):
    """Every position past a row's ``pos`` (and every slot the batch does not use) holds NaN or the dtype's
    largest value: the output is bit-identical to the same pool with zeros there, for chunked and
    single-chunk runs, and finite everywhere (the padded slot-0 row included)."""
    for chunk in (128, None):
        clean, _ = _new(_problem(seed, kv_dtype, torch.float32, "zeros"), chunk, monkeypatch)
        dirty, _ = _new(_problem(seed, kv_dtype, torch.float32, "garbage"), chunk, monkeypatch)
        assert torch.isfinite(dirty).all(), f"seed {seed} chunk {chunk}: a stale value leaked"
        assert torch.equal(clean, dirty), f"seed {seed} chunk {chunk}: stale bytes changed the output"


def test_latent_chunk_bounds_the_temporaries():
    """Chunks spread evenly over the pool, multiples of 128 (or the whole pool), the per-chunk bytes
    within the budget (+ one 128-row rounding step), a single chunk at batch 1 and 128K positions."""
    for bk, length, heads in ((1, 131072, 96), (64, 131072, 12), (64, 32768, 96), (17, 4096, 12),
                              (64, 24, 8)):
        chunk = S._latent_chunk(bk, length, heads)
        assert chunk == length or chunk % 128 == 0, (bk, length, chunk)
        per_row = 2 * 576 + 10 * heads + 24
        assert bk * (chunk - 127) * per_row <= S._CHUNK_BYTES or chunk == 128 or chunk == length
        n = -(-length // chunk)
        assert length - (n - 1) * chunk > chunk - 128 * n, (bk, length, chunk)  # no tiny last chunk
    assert S._latent_chunk(1, 131072, 96) == 131072


@pytest.mark.parametrize("view", ["positions", "width", "odd_slot_stride"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@torch.no_grad()
def test_pool_views_gather_the_same_rows(view, kv_dtype, seed, monkeypatch):
    """The pool as a strided view (``CachePool``'s ``latent[slots, :max_len]``, a padded row width, a slot
    stride that is no multiple of the row stride, served by the two-index gather): the same output, bit
    for bit, as the contiguous pool, and the new latent written into the viewed storage."""
    args = _problem(seed, kv_dtype, torch.float32, "garbage")
    lat = args["latent"]
    n, length, width = lat.shape
    if view == "positions":
        base = torch.zeros(n, length + 64, width, dtype=lat.dtype)
        pool = base[:, :length]
    elif view == "width":
        base = torch.zeros(n, length, width + 16, dtype=lat.dtype)
        pool = base[..., :width]
    else:
        base = torch.zeros(n * (length * width + 8), dtype=lat.dtype)
        pool = base.as_strided((n, length, width), (length * width + 8, width, 1))
    pool.view(torch.uint8).copy_(lat.view(torch.uint8))
    assert (S._latent_rows(pool) is None) == (view == "odd_slot_stride")
    for chunk in (128, None):  # the second call writes the same latent again
        want, want_lat = _new(args, chunk, monkeypatch)
        got, _ = _new(args, chunk, monkeypatch, latent=pool)
        assert torch.equal(got, want), f"seed {seed} chunk {chunk}"
        assert torch.equal(pool.view(torch.uint8), want_lat.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@torch.no_grad()
def test_cuda_uses_fp32_out_bmm_matches_the_oracle_and_captures(kv_dtype, seed):
    """On an sm_90 GPU: cuBLAS BF16 bmm with FP32 output exists (else the upcasting fallback runs: slow);
    the CPU error rule against the FP64 oracle holds; stale NaN / huge bytes stay out; the op captured in
    a CUDA graph replays to the eager result, also after new inputs are copied into its static buffers."""
    assert S.bmm_out_dtype_works("cuda:0"), "torch.bmm(bf16, bf16, out_dtype=torch.float32) does not run here"
    names = ("q", "kv", "kv_norm_w", "eps", "latent", "scale", "slot", "pos", "bt", "ctx", "w_uk", "w_uv",
             "softmax_scale", "gate")

    def call(a):
        a = dict(a, bt=None, ctx=None)
        return S.mla_attention_standard(*(a[n] for n in names))

    def cuda(a):
        return {k: v.cuda() if torch.is_tensor(v) else v for k, v in a.items()}

    args = _problem(seed, kv_dtype, torch.float32, "zeros")
    real = SLOTS != 0
    old_lat = args["latent"].clone()
    a = args
    old = _fp32_chunked_mla(a["q"], a["kv"], a["kv_norm_w"], EPS, old_lat, a["scale"], a["slot"], a["pos"],
                            a["w_uk"], a["w_uv"], SOFTMAX_SCALE, a["gate"], 128)
    ref = _oracle(a["q"], old_lat, a["scale"], a["slot"], a["pos"], a["w_uk"], a["w_uv"], a["gate"])
    got = call(cuda(args)).cpu()
    e_old, e_new = _err(old, ref, real), _err(got, ref, real)
    assert e_new <= 2 * e_old + 1e-3 * float(ref.abs().max()), f"seed {seed}: {e_new:.4g} vs old {e_old:.4g}"

    dirty = cuda(_problem(seed, kv_dtype, torch.float32, "garbage"))
    eager = call(dict(dirty, latent=dirty["latent"].clone()))
    assert torch.isfinite(eager).all() and torch.equal(eager.cpu(), got), f"seed {seed}: stale bytes entered"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(dirty)  # warm-up outside capture (probes, cuBLAS handles); writes the same latent
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(dirty)
    graph.replay()
    tol = 1e-3 * float(eager.abs().max())
    assert float((out - eager).abs().max()) <= tol, f"seed {seed}: replay differs from eager"
    g = torch.Generator().manual_seed(seed + 1)
    dirty["q"].copy_((torch.randn(dirty["q"].shape, generator=g) * 1.5).to(dirty["q"].dtype))
    graph.replay()
    again = call(dict(dirty, latent=dirty["latent"].clone()))
    assert float((out - again).abs().max()) <= 1e-3 * float(again.abs().max()), f"seed {seed}: stale capture"
