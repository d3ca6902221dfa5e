"""The run's model source (verify/model_source.py): ``k3-verify run --checkpoint DIR`` reads DIR before any
check, refuses a damaged checkpoint with one line naming the file, records the digest of exactly the files
read, and every weight-using check runs on the checkpoint's tensors. CPU only, k3-tiny.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3_fastpath import synthetic, weights
from k3_fastpath.presets import preset
from k3_fastpath.weights import checkpoint_digest, checkpoint_files, write_synthetic_checkpoint
from verify.model_source import ModelSourceError, model_argument, resolve

REPO = Path(__file__).resolve().parent.parent
P = "language_model."
SHARD_BYTES = 1 << 20  # k3-tiny is ~3.5 MB: several shards


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # toy-sized tensors: intra-op threads only add contention
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cfg():
    return preset("k3-tiny").config


@pytest.fixture(scope="module")
def ckpt(cfg, tmp_path_factory):
    """k3-tiny's synthetic checkpoint with weight seed 5 (the runs below use --seed 0: its tensors are not the
    run's synthetic ones)."""
    return write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("ms") / "ckpt", seed=5,
                                      max_shard_bytes=SHARD_BYTES)


def _copy(ckpt: Path, tmp_path: Path, name: str = "ck") -> Path:
    d = tmp_path / name
    shutil.copytree(ckpt, d)
    return d


def _shard_of(d: Path, name: str) -> str:
    return json.loads((d / weights.INDEX_NAME).read_text())["weight_map"][name]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250"}
    env.pop("K3_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.mark.parametrize("flag", ["--checkpoint", "--preset"])
def test_truncated_shard_is_one_line_exit_2_and_writes_nothing(ckpt, tmp_path, flag):
    """--preset DIR is the alias of --checkpoint DIR: both read DIR in full before the bundle exists."""
    d = _copy(ckpt, tmp_path)
    fname = sorted(set(json.loads((d / weights.INDEX_NAME).read_text())["weight_map"].values()))[1]
    data = (d / fname).read_bytes()
    (d / fname).write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    r = _cli("run", "--tier", "smoke", flag, str(d), "--output", str(out))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3-verify: error: checkpoint "), r.stderr
    assert fname in lines[0] and "truncated" in lines[0] and P in lines[0]  # the file and the tensor
    assert not out.exists()


def test_preset_and_checkpoint_together_is_one_line_exit_2(ckpt, tmp_path):
    out = tmp_path / "out"
    r = _cli("run", "--tier", "smoke", "--preset", "k3-tiny", "--checkpoint", str(ckpt), "--output", str(out))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not both" in r.stderr, r.stderr
    assert not out.exists()


def test_model_argument(ckpt, tmp_path):
    assert model_argument("k3-tiny", None) == "k3-tiny"
    assert model_argument("auto", ckpt) == str(ckpt)
    with pytest.raises(ModelSourceError, match="not both"):
        model_argument("k3-mini", ckpt)
    with pytest.raises(ModelSourceError, match="not a directory"):
        model_argument("auto", tmp_path / "nowhere")


def test_preset_source_claims_no_digest():
    src = resolve("auto", seed=3)
    assert (src.kind, src.name, src.path, src.digest) == ("preset", "k3-tiny", None, None)
    m = src.manifest()
    assert m["weights"] == "synthetic (seed 3)" and m["digest"] is None and m["files"] == []
    with pytest.raises(ModelSourceError, match="k4-huge"):
        resolve("k4-huge")


def test_checkpoint_source_digest_files_and_tensors(cfg, ckpt):
    src = resolve(str(ckpt))
    assert src.kind == "checkpoint" and src.path == str(ckpt.resolve())
    assert src.digest == checkpoint_digest(ckpt)
    assert [f.name for f in src.files_read] == checkpoint_files(ckpt)
    assert all(f.bytes == (ckpt / f.name).stat().st_size for f in src.files_read)
    m = src.manifest()
    assert m["kind"] == "checkpoint" and m["digest"] == src.digest and m["weights"] == f"checkpoint {src.digest}"
    assert [f["name"] for f in m["files"]] == checkpoint_files(ckpt)
    want = synthetic.synthetic_state_dict(cfg, 5)
    sd = src.state_dict(seed=0)  # the seed does not apply to a checkpoint
    assert set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want)


def _logits(cfg, sd: dict) -> torch.Tensor:
    from k3_fastpath.reference.model import load_reference

    model = load_reference(cfg, sd, dtype=torch.float32)
    ids = torch.randint(3, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(2, 9)
    with torch.no_grad():
        return model.prefill(ids, torch.full((2,), 8), cache)


def test_one_changed_tensor_changes_digest_and_reference_logits(cfg, ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = P + "lm_head.weight"
    fname = _shard_of(d, name)
    tensors = load_file(d / fname)
    tensors[name] = tensors[name].clone()
    tensors[name][5] *= 2  # one row of the LM head: vocabulary entry 5's logits change
    save_file(tensors, d / fname, metadata={"format": "pt"})
    a, b = resolve(str(ckpt)), resolve(str(d))
    assert a.digest != b.digest and b.digest == checkpoint_digest(d)
    assert a.manifest()["digest"] != b.manifest()["digest"]
    changed = [f.name for f, g in zip(a.files_read, b.files_read, strict=True) if f.sha256 != g.sha256]
    assert changed == [fname]
    la, lb = _logits(cfg, a.state_dict()), _logits(cfg, b.state_dict())
    assert not torch.equal(la, lb)
    assert torch.equal(la[..., :5], lb[..., :5]) and not torch.equal(la[..., 5], lb[..., 5])


def test_nonfinite_tensor_names_tensor_and_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = P + "model.norm.weight"
    fname = _shard_of(d, name)
    tensors = load_file(d / fname)
    tensors[name] = tensors[name].clone()
    tensors[name][0] = float("nan")
    save_file(tensors, d / fname, metadata={"format": "pt"})
    with pytest.raises(ModelSourceError) as e:
        resolve(str(d))
    msg = str(e.value)
    assert "\n" not in msg and name in msg and fname in msg and "NaN" in msg


def test_read_failure_names_tensor_and_file(ckpt, monkeypatch):
    """A shard whose header checks out but whose read fails (safetensors' own error) names both."""
    from safetensors import SafetensorError

    real = weights.safe_open

    class Failing:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            raise SafetensorError("simulated read error")

    monkeypatch.setattr(weights, "safe_open", Failing)
    with pytest.raises(ModelSourceError) as e:
        resolve(str(ckpt))
    assert "truncated or corrupt" in str(e.value) and ".safetensors" in str(e.value) and P in str(e.value)


def test_directory_without_shards_points_at_config_json(ckpt, tmp_path):
    d = tmp_path / "cfg-only"
    d.mkdir()
    shutil.copy(ckpt / "config.json", d / "config.json")
    with pytest.raises(ModelSourceError, match="--preset .*config.json"):
        resolve(str(d))
    assert resolve(str(d / "config.json")).kind == "preset"  # a config file alone: synthetic weights


def test_checkpoint_run_checks_use_its_tensors(cfg, ckpt, tmp_path):
    """reference.determinism and weights.roundtrip through ``k3-verify run --checkpoint``: the determinism
    tokens are the checkpoint's (seed 5 weights), not the run's seed-0 synthetic ones; the manifest records
    the digest over the files read."""
    from typer.testing import CliRunner

    from k3_fastpath.reference.model import load_reference
    from verify import cli as cli_mod
    from verify.checks.reference import _greedy

    tier = tmp_path / "t.yaml"
    tier.write_text("name: ckpt\ndescription: checks on a checkpoint\ntarget_s: 600\nchecks:\n"
                    "  - id: reference.determinism\n    budget_s: 300\n"
                    "    params: {batch: 2, prompt_len: 6, decode_steps: 3}\n"
                    "  - id: weights.roundtrip\n    budget_s: 300\n    params: {tp_sizes: [2]}\n")
    out = tmp_path / "b"
    res = CliRunner().invoke(cli_mod.app, ["run", "--tier", str(tier), "--checkpoint", str(ckpt), "--seed", "0",
                                           "--device", "cpu", "--output", str(out), "--format", "json"],
                             standalone_mode=False)
    assert res.exception is None, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    model = manifest["config"]["model"]
    digest = checkpoint_digest(ckpt)
    assert model["kind"] == "checkpoint" and model["digest"] == digest and model["path"] == str(ckpt.resolve())
    assert [(f["name"], f["bytes"]) for f in model["files"]] == [(n, (ckpt / n).stat().st_size)
                                                                 for n in checkpoint_files(ckpt)]
    results = {r["id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert results["reference.determinism"]["status"] == "passed", results["reference.determinism"]
    assert results["weights.roundtrip"]["status"] == "passed", results["weights.roundtrip"]
    assert results["weights.roundtrip"]["metrics"]["checkpoint_digest"] == digest
    assert results["weights.roundtrip"]["metrics"]["source"] == "checkpoint"
    assert results["reference.determinism"]["metrics"]["weights"] == f"checkpoint {digest}"
    (rec,) = map(json.loads, (out / "records" / "reference.determinism.jsonl").read_text().splitlines())

    def tokens(seed: int) -> list:
        m = load_reference(cfg, synthetic.synthetic_state_dict(cfg, seed), dtype=torch.float32)
        return _greedy(m, cfg, 2, 6, 3, 0 + 7, "cpu")[1].tolist()

    assert rec["tokens"] == tokens(5) != tokens(0)


def test_builtin_engine_serves_the_source_tensors(cfg, ckpt, monkeypatch):
    """The builtin engine takes the run's tensors (no second read: load_checkpoint is not called again)."""
    from verify.engines.builtin import BuiltinEngine

    src = resolve(str(ckpt))

    def no_read(*a, **kw):
        raise AssertionError("the engine read the checkpoint again")

    monkeypatch.setattr(weights, "load_checkpoint", no_read)
    eng = BuiltinEngine(preset=src.preset, model_source=src, max_model_len=32)
    try:
        assert src.digest in eng.describe()["weights"]
        got = eng.model.state_dict()
        want = synthetic.synthetic_state_dict(cfg, 5)
        name = "model.layers.0.input_layernorm.weight"
        assert torch.equal(got[name].to(want[name].dtype), want[name])
    finally:
        eng.close()


def test_reference_model_copies_and_rank_slices_match_shard_state_dict(cfg, ckpt):
    """What equivalence.decode / perf.decode_sweep build from a checkpoint: a model holding a copy (the
    source's tensors are never aliased) and, for TP workers, each rank's slices read from disk equal
    ``tp.shard_state_dict`` of the full tensors."""
    from k3_fastpath.runtime.tp import shard_state_dict
    from verify.model_source import build_reference_model, checkpoint_rank_state_dict

    src = resolve(str(ckpt))
    sd = src.state_dict()
    model = build_reference_model(cfg, sd, "cpu")
    name = "lm_head.weight"
    assert torch.equal(model.state_dict()[name], sd[name])
    assert model.state_dict()[name].data_ptr() != sd[name].data_ptr()
    for rank in range(2):
        got = checkpoint_rank_state_dict(ckpt, cfg, 2, rank, "cpu")
        want = shard_state_dict(cfg, sd, 2, rank)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_equivalence_decode_runs_on_the_checkpoint(cfg, tmp_path, monkeypatch):
    """equivalence.decode (fast step emulated on the CPU) on a checkpoint run: the model is the checkpoint's
    (here the stable-conditioned synthetic draw, saved as one model.safetensors), never a synthetic build."""
    from types import SimpleNamespace

    import verify.checks.equivalence as eq
    from verify.context import CheckContext

    d = tmp_path / "stable"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(synthetic.synthetic_state_dict(cfg, 2, conditioning="stable"), d / "model.safetensors")

    def no_synthetic(*a, **kw):
        raise AssertionError("a synthetic model was built on a checkpoint run")

    monkeypatch.setattr(eq, "build_synthetic_model", no_synthetic)
    src = resolve(str(d))

    class Sink:
        def record(self, stream, obj):
            pass

        def log(self, text):
            pass

    ctx = CheckContext(check_id="equivalence.decode", preset=src.preset, device="cpu", seed=0, writer=Sink(),
                       out=SimpleNamespace(note=lambda *_: None), tmp_dir=tmp_path, budget_s=600, model_source=src)
    res = eq.decode(ctx, batches=[2], contexts=["short"], steps=2, prompt_len=4, emulate=True)
    assert res.status == "passed", res.reason
    assert res.metrics["weights"] == f"checkpoint {checkpoint_digest(d)}" and res.metrics["conditioning"] is None
