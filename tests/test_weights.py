"""The checkpoint layer (k3_fastpath/weights.py) on the k3-tiny preset, CPU only.

Contract: a synthetic checkpoint loads back bit for bit in its checkpoint dtypes; writing is deterministic
and atomic; every TP rule's rank slices reassemble the full tensor (MXFP4 experts: the dequantized slices
reassemble the dequantized full weight); every malformed checkpoint is rejected with a message naming the
offending tensor and file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3_fastpath import mxfp4, synthetic, weights
from k3_fastpath.manifest import COL, EXPERT_COL, EXPERT_ROW, HEAD_VEC, REP, ROW, tensor_specs
from k3_fastpath.presets import preset
from k3_fastpath.weights import CheckpointError, load_checkpoint, slice_tensor, write_synthetic_checkpoint

P = "language_model."
SHARD_BYTES = 1 << 20  # k3-tiny is ~3.5 MB: several shards
_DIMS = {COL: 0, EXPERT_COL: 0, ROW: 1, EXPERT_ROW: 1, HEAD_VEC: 0}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # toy-sized tensors: intra-op threads only add contention (k3-tiny's synthetic draw: 3 s -> 35 s on a
    # loaded 2-core host with 2 threads)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cfg():
    return preset("k3-tiny").config


@pytest.fixture(scope="module")
def small(cfg):
    """k3-tiny cut to 2 layers (KDA + dense MLP, MLA + MoE) and 4 experts: every TP rule, a fraction of the work."""
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,), full_attn_layers=(2,))
    return cfg.replace(num_hidden_layers=2, num_experts=4, num_experts_per_token=2, linear_attn_config=lac)


@pytest.fixture(scope="module")
def ref(cfg):
    return synthetic.synthetic_state_dict(cfg, seed=0)


@pytest.fixture(scope="module")
def ckpt(cfg, tmp_path_factory):
    return write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("w") / "ckpt", seed=0,
                                      max_shard_bytes=SHARD_BYTES)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(ckpt, d)
    return d


def _index(d: Path) -> dict:
    return json.loads((d / weights.INDEX_NAME).read_text())


def _rewrite(d: Path, name: str, mutate) -> str:
    """Apply ``mutate(tensors)`` to the shard holding ``name`` and keep the index in step; returns the file."""
    idx = _index(d)
    fname = idx["weight_map"][name]
    tensors = load_file(d / fname)
    mutate(tensors)
    save_file(tensors, d / fname, metadata={"format": "pt"})
    wm = {k: v for k, v in idx["weight_map"].items() if v != fname or k in tensors}
    wm.update({k: fname for k in tensors})
    idx["weight_map"] = wm
    (d / weights.INDEX_NAME).write_text(json.dumps(idx))
    return fname


def _problems(d: Path, **kw) -> list[str]:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(d, **kw)
    assert str(ei.value)  # the message is the problems, joined
    return ei.value.problems


# ---------------------------------------------------------------------------------------------- round trip
def test_roundtrip_bitwise(cfg, ref, ckpt):
    files = sorted(p.name for p in ckpt.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", f) for f in shards)
    assert set(files) == {*shards, "config.json", weights.INDEX_NAME}
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    idx = _index(ckpt)
    assert set(idx["weight_map"]) == {P + k for k in ref}
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    assert json.loads((ckpt / "config.json").read_text()) == json.loads(json.dumps(cfg.to_hf_dict()))

    got_cfg, sd = load_checkpoint(ckpt, expect_config=cfg)
    assert got_cfg == cfg
    assert list(sd) == list(ref)  # manifest order, no prefix
    bad = [k for k in ref if not _same_bits(sd[k], ref[k])]
    assert not bad, bad[:5]
    # FP32 parameters stay FP32 (K3.md failure mode 6), U8 stays U8
    assert sd["model.layers.1.self_attn.A_log"].dtype == torch.float32
    assert sd["model.layers.1.self_attn.q_conv1d.weight"].dtype == torch.float32
    assert sd["model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"].dtype == torch.uint8


def test_deterministic_bytes(cfg, small, ckpt, tmp_path):
    again = write_synthetic_checkpoint(cfg, tmp_path / "again", seed=0, max_shard_bytes=SHARD_BYTES)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for n in names:
        assert (ckpt / n).read_bytes() == (again / n).read_bytes(), n
    assert weights.checkpoint_digest(ckpt) == weights.checkpoint_digest(again)

    a = write_synthetic_checkpoint(small, tmp_path / "a", seed=0, max_shard_bytes=1 << 16)
    b = write_synthetic_checkpoint(small, tmp_path / "b", seed=1, max_shard_bytes=1 << 16)
    assert weights.checkpoint_digest(a) != weights.checkpoint_digest(b)
    shards = sorted(p.name for p in a.glob("model-*.safetensors"))
    assert shards == sorted(p.name for p in b.glob("model-*.safetensors"))  # same layout, other values
    for n in shards:
        assert (a / n).read_bytes() != (b / n).read_bytes(), n
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


def test_digest_sees_one_byte(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    before = weights.checkpoint_digest(d)
    shard = d / sorted(_index(d)["weight_map"].values())[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert weights.checkpoint_digest(d) != before


def test_write_is_atomic(small, tmp_path, monkeypatch):
    real = synthetic.synthetic_tensor
    n_specs = len(tensor_specs(small))
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == n_specs - 3:  # after several shards were written
            raise RuntimeError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(synthetic, "synthetic_tensor", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_synthetic_checkpoint(small, tmp_path / "ck", max_shard_bytes=1 << 16)
    assert calls["n"] == n_specs - 3
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir
    monkeypatch.setattr(synthetic, "synthetic_tensor", real)

    out = write_synthetic_checkpoint(small, tmp_path / "ck", seed=0, max_shard_bytes=1 << 16)
    assert len(list(out.glob("model-*.safetensors"))) > 2
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in out.iterdir())  # every file readable by all
    with pytest.raises(FileExistsError):
        write_synthetic_checkpoint(small, out, seed=1)
    first = weights.checkpoint_digest(out)
    write_synthetic_checkpoint(small, out, seed=1, overwrite=True)
    assert weights.checkpoint_digest(out) != first
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    _, sd = load_checkpoint(out)
    want = synthetic.synthetic_state_dict(small, seed=1)
    assert all(_same_bits(sd[k], want[k]) for k in want)


def test_describe(cfg, ckpt):
    s = weights.describe(ckpt)
    specs = tensor_specs(cfg)
    assert s.num_tensors == len(specs)
    assert s.expert_format == "mxfp4" and s.num_experts == cfg.num_experts
    assert s.num_files == len(set(_index(ckpt)["weight_map"].values()))
    want: dict[str, int] = {}
    for sp in specs:
        want[sp.dtype] = want.get(sp.dtype, 0) + sp.nbytes
    assert s.bytes_by_dtype == want and s.total_bytes == sum(want.values())
    assert s.to_dict()["bytes_by_dtype"]["U8"] > 0


# ---------------------------------------------------------------------------------------------- MXFP4
def _slow_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An independent MXFP4 decoder: per element, e2m1 decoded by bit arithmetic (no lookup table)."""
    rows = []
    for prow, srow in zip(packed.tolist(), scale.tolist(), strict=True):
        row = []
        for j in range(2 * len(prow)):
            byte = prow[j // 2]
            code = (byte >> 4) if j % 2 else (byte & 0x0F)  # low nibble first
            sign = -1.0 if code & 0b1000 else 1.0
            exp = (code >> 1) & 0b11
            man = code & 0b1
            mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2.0)  # e2m1, bias 1
            s = srow[j // 32]
            row.append(float("nan") if s == 255 else sign * mag * 2.0 ** (s - 127))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def _assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    ok = ~a.isnan()
    assert _same_bits(a[ok], b[ok])  # bitwise: -0.0 must stay -0.0


def test_mxfp4_codec_against_slow_decoder():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)  # every byte once
    scale = torch.tensor([[0, 1, 126, 127], [128, 129, 140, 200], [254, 100, 127, 3], [255, 127, 64, 190]],
                         dtype=torch.uint8)
    _assert_same_values(mxfp4.dequantize(packed, scale), _slow_decode(packed, scale))


def test_dequantized_experts_match_slow_decoder(cfg, ref, ckpt):
    _, sd = load_checkpoint(ckpt, dequantize_experts=True)
    assert not [k for k in sd if k.endswith(("weight_packed", "weight_scale"))]
    codes_seen: set[int] = set()
    checked = 0
    for layer in (1, cfg.num_hidden_layers - 1):
        for e in (0, cfg.num_experts - 1):
            for w in ("w1", "w2", "w3"):
                base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
                packed, scale = ref[base + "weight_packed"], ref[base + "weight_scale"]
                got = sd[base + "weight"]
                assert got.dtype == torch.bfloat16
                inter, lat = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
                assert got.shape == ((lat, inter) if w == "w2" else (inter, lat))
                slow = _slow_decode(packed, scale)
                _assert_same_values(got.float(), slow.to(torch.bfloat16).float())
                assert _same_bits(slow, slow.to(torch.bfloat16).float())  # MXFP4 values are exact in BF16
                codes_seen |= set((packed & 0xF).flatten().tolist()) | set((packed >> 4).flatten().tolist())
                checked += 1
    assert checked == 12 and len(codes_seen) >= 15  # the decoder's branches were all exercised


# ---------------------------------------------------------------------------------------------- TP slicing
def _check_reassembles(cfg, full_sd, tp, rank_sds):
    """Every rule: the rank slices concatenate back to the full tensor (packed experts: after dequantizing)."""
    heads = cfg.linear_attn_config.num_heads
    rules = set()
    for spec in tensor_specs(cfg):
        full = full_sd[spec.name]
        parts = [r[spec.name] for r in rank_sds]
        rules.add(spec.tp)
        want_shape = weights.rank_shape(spec, tp, cfg)
        assert all(p.shape == want_shape and p.dtype == full.dtype for p in parts), spec.name
        if spec.tp == REP:
            assert all(_same_bits(p, full) for p in parts), spec.name
            continue
        cat = torch.cat(parts, dim=_DIMS[spec.tp])
        want = full[:heads] if spec.tp == HEAD_VEC else full
        assert _same_bits(cat, want), spec.name
        if spec.kind == "packed":  # dequantize(concat of slices) == dequantize(full), and per rank
            base = spec.name[: -len("weight_packed")]
            scales = [r[base + "weight_scale"] for r in rank_sds]
            dim = _DIMS[spec.tp]
            whole = mxfp4.dequantize(full, full_sd[base + "weight_scale"])
            assert _same_bits(mxfp4.dequantize(cat, torch.cat(scales, dim=dim)), whole), spec.name
            n = whole.shape[dim] // tp
            for r, (p, s) in enumerate(zip(parts, scales, strict=True)):
                assert _same_bits(mxfp4.dequantize(p, s), whole.narrow(dim, r * n, n)), (spec.name, r)
    assert rules == {COL, ROW, REP, HEAD_VEC, EXPERT_COL, EXPERT_ROW}


@pytest.mark.parametrize("tp", [2, 4])
def test_slice_tensor_reassembles(cfg, ref, small, tp):
    # k3-tiny's moe_intermediate_size 64 / 4 = 16 would cut MXFP4 scale groups: TP4 runs on a wider one
    c = cfg if tp == 2 else small.replace(moe_intermediate_size=128)
    full = ref if tp == 2 else synthetic.synthetic_state_dict(c, seed=0)
    specs = tensor_specs(c)
    ranks = [{s.name: slice_tensor(s, full[s.name], tp, r, cfg=c) for s in specs} for r in range(tp)]
    assert ranks[1]["model.layers.0.self_attn.A_log"].shape == (c.linear_attn_config.num_heads // tp,)
    w2 = "model.layers.1.block_sparse_moe.experts.0.w2."
    assert ranks[0][w2 + "weight_packed"].shape == (c.routed_expert_hidden_size, c.moe_intermediate_size // tp // 2)
    assert ranks[0][w2 + "weight_scale"].shape == (c.routed_expert_hidden_size, c.moe_intermediate_size // tp // 32)
    _check_reassembles(c, full, tp, ranks)


class _RecordingOpen:
    """Wraps safetensors.safe_open to record which tensors were read whole and which by slice."""

    def __init__(self, real):
        self.real, self.full, self.sliced = real, [], []

    def __call__(self, *a, **k):
        rec, handle = self, self.real(*a, **k)

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, n):
                rec.full.append(n)
                return self.f.get_tensor(n)

            def get_slice(self, n):
                rec.sliced.append(n)
                return self.f.get_slice(n)

        return Handle()


def test_load_ranks_reassemble_and_read_only_slices(cfg, ref, ckpt, monkeypatch):
    rec = _RecordingOpen(weights.safe_open)
    monkeypatch.setattr(weights, "safe_open", rec)
    ranks = [load_checkpoint(ckpt, tp_size=2, rank=r)[1] for r in range(2)]
    _check_reassembles(cfg, ref, 2, ranks)
    rep = {P + s.name for s in tensor_specs(cfg) if s.tp == REP}
    assert set(rec.full) == rep  # a rank never materialises a full split tensor
    assert len(rec.sliced) == 2 * (len(ref) - len(rep))

    _, deq = load_checkpoint(ckpt, tp_size=2, rank=1, dequantize_experts=True)
    for w, dim in (("w1", 0), ("w2", 1), ("w3", 0)):
        base = f"model.layers.2.block_sparse_moe.experts.5.{w}."
        whole = mxfp4.dequantize(ref[base + "weight_packed"], ref[base + "weight_scale"], torch.bfloat16)
        n = whole.shape[dim] // 2
        assert _same_bits(deq[base + "weight"], whole.narrow(dim, n, n)), w


def test_tp_errors(cfg, ckpt, tmp_path):
    narrow = cfg.replace(moe_intermediate_size=64, num_hidden_layers=2,
                         linear_attn_config=dataclasses.replace(cfg.linear_attn_config, kda_layers=(1,),
                                                                full_attn_layers=(2,)))
    narrow_ckpt = write_synthetic_checkpoint(narrow, tmp_path / "narrow")
    (msg,) = _problems(narrow_ckpt, tp_size=4, rank=0)  # 64 / 4 = 16: not a multiple of 32
    assert "w2.weight_packed" in msg and "multiple of 32" in msg
    spec = next(s for s in tensor_specs(narrow) if s.name.endswith("experts.0.w2.weight_scale"))
    with pytest.raises(CheckpointError, match="experts.0.w2.weight_scale.*multiple of 32"):
        weights.rank_shape(spec, 4, narrow)
    with pytest.raises(CheckpointError, match="embed_tokens.*not divisible by tp_size 3"):
        load_checkpoint(ckpt, tp_size=3, rank=0)
    with pytest.raises(CheckpointError, match="rank must be in 0..1"):
        load_checkpoint(ckpt, tp_size=2, rank=2)
    a_log = next(s for s in tensor_specs(cfg) if s.tp == HEAD_VEC)
    with pytest.raises(CheckpointError, match="A_log.*head count"):
        slice_tensor(a_log, torch.zeros(a_log.shape), 2, 0)


def test_presliced_rank_checkpoint(small, tmp_path):
    d = write_synthetic_checkpoint(small, tmp_path / "rank1", tp_size=2, rank=1)
    assert _index(d)["metadata"]["k3_tp_size"] == 2
    _, got = load_checkpoint(d, tp_size=2, rank=1)
    full = synthetic.synthetic_state_dict(small)
    want = {s.name: slice_tensor(s, full[s.name], 2, 1, cfg=small) for s in tensor_specs(small)}
    assert list(got) == list(want) and all(_same_bits(got[k], want[k]) for k in want)
    assert weights.describe(d).tp_size == 2
    (msg,) = _problems(d)
    assert "holds only rank 1 of tp_size 2" in msg


def test_bf16_experts_roundtrip_and_tp4(small, tmp_path):
    c = small.replace(expert_format="bf16")
    d = write_synthetic_checkpoint(c, tmp_path / "bf16")
    got_cfg, sd = load_checkpoint(d)
    assert got_cfg.expert_format == "bf16" and weights.describe(d).expert_format == "bf16"
    full = synthetic.synthetic_state_dict(c)
    assert all(_same_bits(sd[k], full[k]) for k in full)
    assert sd["model.layers.1.block_sparse_moe.experts.3.w2.weight"].dtype == torch.bfloat16
    ranks = [load_checkpoint(d, tp_size=4, rank=r)[1] for r in range(4)]  # bf16 w2 splits at 16: allowed
    _check_reassembles(c, full, 4, ranks)


# ---------------------------------------------------------------------------------------------- names
def test_unprefixed_single_file(cfg, ref, tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(dict(ref), d / "model.safetensors")  # no prefix, no index
    _, sd = load_checkpoint(d)
    assert list(sd) == list(ref) and all(_same_bits(sd[k], ref[k]) for k in ref)
    name = "model.layers.0.input_layernorm.weight"
    save_file({**ref, P + name: ref[name].clone()}, d / "model.safetensors")
    (msg,) = _problems(d)
    assert "stored twice" in msg and name in msg


def test_vision_and_mtp_ignored(cfg, ref, ckpt, tmp_path, caplog):
    d = _copy(ckpt, tmp_path)
    extra = {"vision_tower.blocks.0.attn.qkv.weight": torch.ones(4, 4, dtype=torch.bfloat16),
             "mm_projector.linear_1.weight": torch.ones(2, 4, dtype=torch.bfloat16),
             P + "model.mtp.0.proj.weight": torch.ones(3, dtype=torch.float32)}
    _rewrite(d, P + "model.norm.weight", lambda t: t.update(extra))
    with caplog.at_level(logging.INFO, logger="k3_fastpath.weights"):
        _, sd = load_checkpoint(d)
    assert list(sd) == list(ref)
    assert "ignored 3 tensors" in caplog.text and "vision_tower.*" in caplog.text
    assert weights.describe(d).ignored == {"vision_tower.*": 1, "mm_projector.*": 1, "*.mtp*": 1}


# ---------------------------------------------------------------------------------------------- errors
def test_wrong_shape_names_tensor_and_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = P + "model.layers.3.self_attn.kv_b_proj.weight"  # MLA layer: (4 * (32 + 32), 32)
    fname = _rewrite(d, name, lambda t: t.update({name: t[name][:128].clone()}))
    assert _problems(d) == [f"{name}: shape (128, 32) in {fname}, expected (256, 32)"]


def test_fp32_cast_rejected(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = P + "model.layers.1.self_attn.A_log"
    fname = _rewrite(d, name, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    (msg,) = _problems(d)
    assert msg.startswith(f"{name}: dtype BF16 in {fname}, expected F32")


def test_missing_and_unexpected(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    gone = P + "model.layers.2.self_attn.q_conv1d.weight"
    _rewrite(d, gone, lambda t: t.pop(gone))
    (msg,) = _problems(d)
    assert msg.startswith(f"{gone}: missing")
    d2 = _copy(ckpt, tmp_path / "b")
    odd = P + "model.layers.0.self_attn.foo.weight"
    fname = _rewrite(d2, P + "model.norm.weight", lambda t: t.update({odd: torch.zeros(2, dtype=torch.bfloat16)}))
    assert _problems(d2) == [f"{odd} in {fname}: unexpected tensor, not in the K3 manifest of this config"]


def test_all_problems_reported_together(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    a = P + "model.layers.1.self_attn.dt_bias"
    b = P + "lm_head.weight"
    _rewrite(d, a, lambda t: t.update({a: t[a].to(torch.bfloat16)}))
    _rewrite(d, b, lambda t: t.update({b: t[b][:, :64].clone()}))
    probs = _problems(d)
    assert len(probs) == 2 and probs[0].startswith(a) and probs[1].startswith(b)


def test_truncated_shard(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    fname = sorted(set(_index(d)["weight_map"].values()))[1]
    data = (d / fname).read_bytes()
    (d / fname).write_bytes(data[: len(data) - 1000])
    (msg,) = _problems(d)
    assert msg.startswith(f"{fname}: truncated: {P}model.") and "needs bytes" in msg
    with pytest.raises(CheckpointError, match=re.escape(fname)):
        weights.describe(d)


@pytest.mark.parametrize("damage", ["huge_length", "garbage_json", "tiny_file", "trailing_bytes"])
def test_bad_header(ckpt, tmp_path, damage):
    d = _copy(ckpt, tmp_path)
    fname = sorted(set(_index(d)["weight_map"].values()))[0]
    data = (d / fname).read_bytes()
    if damage == "huge_length":
        data = (1 << 40).to_bytes(8, "little") + data[8:]
    elif damage == "garbage_json":
        data = data[:8] + b"\xff\xfe not json" + data[18:]
    elif damage == "tiny_file":
        data = data[:5]
    else:
        data = data + b"\0" * 16
    (d / fname).write_bytes(data)
    (msg,) = _problems(d)
    assert msg.startswith(f"{fname}: ")
    assert {"huge_length": "bad header", "garbage_json": "not valid JSON", "tiny_file": "too short",
            "trailing_bytes": "trailing bytes"}[damage] in msg


def test_index_points_to_missing_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    idx = _index(d)
    name = P + "model.layers.4.self_attn.o_proj.weight"
    idx["weight_map"][name] = "model-00009-of-00009.safetensors"
    (d / weights.INDEX_NAME).write_text(json.dumps(idx))
    probs = _problems(d)
    assert probs[0] == (f"{weights.INDEX_NAME}: weight_map sends {name} to model-00009-of-00009.safetensors, "
                        "which does not exist")
    assert len(probs) == 2 and probs[1].startswith(f"{name} in ") and "not listed" in probs[1]


def test_index_points_to_wrong_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    idx = _index(d)
    name = P + "model.embed_tokens.weight"
    other = sorted(set(idx["weight_map"].values()))[-1]
    assert idx["weight_map"][name] != other
    idx["weight_map"][name] = other
    (d / weights.INDEX_NAME).write_text(json.dumps(idx))
    probs = _problems(d)
    assert f"{name}: {weights.INDEX_NAME} places it in {other}, which does not hold it" in probs
    assert any(p.startswith(f"{name} in ") and "not listed" in p for p in probs)


def test_config_errors(cfg, ckpt, tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: differs .*rms_norm_eps"):
        load_checkpoint(ckpt, expect_config=cfg.replace(rms_norm_eps=1e-6))
    d = _copy(ckpt, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: no config.json"):
        load_checkpoint(d)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere")
