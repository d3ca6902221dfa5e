"""The evals' ``model`` param: the evals score a checkpoint other than the run's model (the trained
sentinel, or any checkpoint directory) through the run's builtin engines, name it in the records, skip
with the training command when no sentinel is there, and refuse a checkpoint that does not load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="needs_eval_extra: scripts/bootstrap --eval")
pytest.importorskip("transformers", reason="needs_eval_extra: scripts/bootstrap --eval")

from eval_tools import PERMISSIVE, QuietOut  # noqa: E402

from evals.data.make_synthetic import make_all  # noqa: E402
from k3_fastpath.presets import preset  # noqa: E402
from k3_fastpath.sentinel.checkpoint import DIR_ENV  # noqa: E402
from k3_fastpath.weights import write_synthetic_checkpoint  # noqa: E402
from verify.bundle.writer import BundleWriter  # noqa: E402
from verify.checks import evals as eval_checks  # noqa: E402
from verify.context import CheckContext  # noqa: E402
from verify.engines import EnginePool  # noqa: E402
from verify.engines.base import EngineError  # noqa: E402
from verify.model_source import read_checkpoint  # noqa: E402

SPECS = {"engine_under_test": "builtin:reference", "baseline": "builtin:reference"}
OPTS = {"preset": "k3-tiny", "device": "cpu", "seed": 0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(preset("k3-tiny").config, tmp_path_factory.mktemp("m") / "other", seed=7)


def test_the_pool_serves_another_checkpoint_once_per_digest_and_servers_refuse(ckpt):
    source = read_checkpoint(ckpt)
    pool = EnginePool(SPECS, OPTS)
    try:
        run_model, other = pool.get("baseline"), pool.get("baseline", source)
        assert other is not run_model and pool.get("engine_under_test", source) is other  # one spec, one build
        assert source.digest in other.weights_source and "synthetic" in run_model.weights_source
        prompt = "Question: what is 2 + 3?"
        assert run_model.next_token_logprobs(prompt) != other.next_token_logprobs(prompt)  # other weights
        assert f"baseline @ {source.digest}" in pool.built
    finally:
        pool.close()
    served = EnginePool({"engine_under_test": "openai:http://127.0.0.1:9", "baseline": "builtin:reference"}, OPTS)
    with pytest.raises(EngineError, match="serves the model it was launched on"):
        served.get("engine_under_test", source)


def _gsm8k(tmp_path: Path, pool, **params):
    tmp_path.mkdir(exist_ok=True)
    data = tmp_path / "data"
    make_all(data, seed=3, gsm8k=2, aime=1, mrcr=1, mrcr_chars=160, needles=(2,))
    (tmp_path / "th.yaml").write_text(PERMISSIVE)
    writer = BundleWriter(tmp_path / "b", tool_version="0.1.0", argv=["pytest"], tier="t",
                          planned_checks=["evals.gsm8k"], engines=["builtin:reference"],
                          config={"preset": "k3-tiny"}, seeds={"global": 0}, env={})
    ctx = CheckContext(check_id="evals.gsm8k", preset="k3-tiny", device="cpu", seed=0, writer=writer, out=QuietOut(),
                       tmp_dir=tmp_path, budget_s=600, engines=pool)
    r = eval_checks.gsm8k(ctx, limit=2, max_tokens=6, data_dir=str(data), thresholds=str(tmp_path / "th.yaml"),
                          **params)
    return r, ctx.recorded


def test_a_checkpoint_param_is_the_model_scored_and_named(ckpt, tmp_path, monkeypatch):
    pool = EnginePool(SPECS, OPTS)
    try:
        r, recs = _gsm8k(tmp_path, pool, model=str(ckpt))
        import verify.model_source

        def no_second_read(path):
            raise AssertionError(f"{path} read again")

        monkeypatch.setattr(verify.model_source, "read_checkpoint", no_second_read)
        again, _ = _gsm8k(tmp_path / "again", pool, model=str(ckpt))  # the next eval: the run's read, shared
        assert again.status == "passed" and again.metrics["model"] == r.metrics["model"]
    finally:
        pool.close()
    digest = read_checkpoint(ckpt).digest
    assert r.status == "passed", r.reason
    assert r.metrics["model"] == {"scored": str(ckpt), "path": str(ckpt.resolve()), "name": "k3-tiny", "digest": digest}
    config = next(x for x in recs if x.get("type") == "config")
    assert config["model"]["digest"] == digest
    assert list(pool.built) == [f"baseline @ {digest}", f"engine_under_test @ {digest}"]  # the run's model unused


def test_no_sentinel_is_a_skip_naming_the_training_command(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "nowhere"))
    r, _ = _gsm8k(tmp_path, EnginePool(SPECS, OPTS), model="sentinel")
    assert r.status == "skipped"
    assert f"python -m k3_fastpath.sentinel.train --out {tmp_path / 'nowhere'}" in r.reason and "\n" not in r.reason


def test_a_checkpoint_that_does_not_load_is_an_error_naming_the_file(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    shard = next(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    r, _ = _gsm8k(tmp_path, EnginePool(SPECS, OPTS), model=str(bad))
    assert r.status == "error" and shard.name in r.reason, r.reason
    rec = json.dumps(r.metrics)
    assert "digest" not in rec  # nothing claimed about a checkpoint that was not read


def _synthetic_gsm8k(tmp_path: Path, pool, seed: int, limit: int, **params):
    tmp_path.mkdir()
    (tmp_path / "th.yaml").write_text(PERMISSIVE)
    writer = BundleWriter(tmp_path / "b", tool_version="0.1.0", argv=["pytest"], tier="t",
                          planned_checks=["evals.gsm8k"], engines=["builtin:reference"],
                          config={"preset": "k3-tiny"}, seeds={"global": seed}, env={})
    ctx = CheckContext(check_id="evals.gsm8k", preset="k3-tiny", device="cpu", seed=seed, writer=writer,
                       out=QuietOut(), tmp_dir=tmp_path, budget_s=600, engines=pool)
    return eval_checks.gsm8k(ctx, limit=limit, max_tokens=4, data_dir="synthetic",
                             thresholds=str(tmp_path / "th.yaml"), model="sentinel", **params)


def test_the_sentinel_scores_only_items_its_training_kept_out(ckpt, tmp_path, monkeypatch):
    """Scored on synthetic items, the sentinel must have been trained with those items kept out
    (training.json: the eval seeds and item counts excluded); the run's seed outside them, a limit past
    them, or no training record is an error saying which, before any engine runs."""
    import shutil

    sentinel = tmp_path / "sentinel"
    shutil.copytree(ckpt, sentinel)
    monkeypatch.setenv(DIR_ENV, str(sentinel))
    record = {"eval_seeds_excluded": [0], "eval_items_excluded": {"gsm8k": 3, "aime25": 3, "mrcr": 2}}
    (sentinel / "training.json").write_text(json.dumps(record))
    pool = EnginePool(SPECS, OPTS)
    try:
        ok = _synthetic_gsm8k(tmp_path / "ok", pool, seed=0, limit=2)
        assert ok.status == "passed", ok.reason
        assert ok.metrics["model"]["training"]["eval_items_excluded"]["gsm8k"] == 3
        for where, seed, limit, why in (("seed", 5, 2, "of seed 5 could score items it was trained on"),
                                        ("limit", 0, 4, "scoring 4 items of seed 0")):
            r = _synthetic_gsm8k(tmp_path / where, pool, seed=seed, limit=limit)
            assert r.status == "error" and why in r.reason and "--seed 0 and a limit of at most 3" in r.reason, r.reason
        (sentinel / "training.json").unlink()
        r = _synthetic_gsm8k(tmp_path / "none", pool, seed=0, limit=2)
        assert r.status == "error" and "no training.json" in r.reason
    finally:
        pool.close()


def test_synthetic_data_holds_the_limit(tmp_path):
    """A limit past the synthetic files' default sizes generates that many items (the first ones unchanged),
    so the limit is the number of items scored."""
    ctx = CheckContext(check_id="evals.gsm8k", preset="k3-tiny", device="cpu", seed=0, writer=None, out=QuietOut(),
                       tmp_dir=tmp_path, budget_s=60, engines=None)
    data_dir, _ = eval_checks._data_sources(ctx, "gsm8k", (), "synthetic", None, 73)
    rows = (Path(data_dir) / "gsm8k" / "test.jsonl").read_text().splitlines()
    make_all(tmp_path / "default", seed=0)
    assert len(rows) == 73 and rows[:50] == (tmp_path / "default" / "gsm8k" / "test.jsonl").read_text().splitlines()


@pytest.mark.slow  # ~35 s on the 2-core CPU: a 2-step k3-tiny sentinel, then 6 items x 2 engines x 192 tokens
def test_the_standard_tier_scores_a_trained_sentinel_on_a_cpu(tmp_path):
    """End to end, as a contributor runs it: `python -m k3_fastpath.sentinel.train`, then the standard tier's
    gsm8k with ``$K3_SENTINEL_DIR``: the CPU's sizes (cpu_params) planned and run, the sentinel and its
    training named in the records, the bundle verified (status re-derived); another seed than the
    training kept out is refused before any engine runs."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    sentinel = tmp_path / "sentinel"
    train = [sys.executable, "-m", "k3_fastpath.sentinel.train", "--out", str(sentinel), "--preset", "k3-tiny",
             "--steps", "2", "--warmup", "1", "--batch", "2", "--seq-len", "384", "--mrcr-chars", "300",
             "--heldout-items", "2", "--device", "cpu"]
    subprocess.run(train, cwd=repo, check=True, capture_output=True, timeout=300)
    held = json.loads((sentinel / "training.json").read_text())["heldout"]
    assert held["checkpoint"]["gsm8k"]["items"] == 2 and held["training_forward"]["mrcr"]["answer_tokens"] > 0
    env = {**os.environ, DIR_ENV: str(sentinel)}

    def run(out: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "verify.cli", "run", "--tier", "standard", "--only", "evals.gsm8k",
                               "--device", "cpu", "-o", str(tmp_path / out), *extra], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=600)

    run("b")
    bundle = tmp_path / "b"
    plan = json.loads((bundle / "manifest.json").read_text())["config"]["check_plan"]["evals.gsm8k"]["params"]
    assert plan["limit"] == 6 and plan["model"] == "sentinel"  # standard.yaml's cpu_params
    recs = [json.loads(line) for line in (bundle / "records" / "evals.gsm8k.jsonl").read_text().splitlines()]
    config = next(r for r in recs if r.get("type") == "config")
    assert config["limit"] == 6 and config["model"]["scored"] == "sentinel"
    assert config["model"]["training"]["steps_done"] == 2 and config["model"]["digest_matches_training"]
    assert sum(1 for r in recs if r.get("type") == "sample" and r.get("side") == "under_test") == 6
    result = next(json.loads(line) for line in (bundle / "results.jsonl").read_text().splitlines())
    assert result["status"] in ("passed", "failed") and result["metrics"]["k3_gsm8k:mde"] > 0
    verify = subprocess.run([sys.executable, "-m", "verify.cli", "bundle", "verify", str(bundle)], cwd=repo,
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    other = run("seed5", "--seed", "5")
    res = next(json.loads(line) for line in (tmp_path / "seed5" / "results.jsonl").read_text().splitlines())
    assert res["status"] == "error" and "could score items it was trained on" in res["reason"], (res, other.stderr)
