"""The sentinel's compiled training glue (``sentinel.train_glue``) on a CPU, traced with ``aot_eager`` (dynamo
and AOT autograd, no code generation: the GPU uses inductor): training through it is the eager training
step for step, every swapped function really ran compiled, and the reference's functions are back after."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from k3_fastpath.sentinel import train as sentinel_train
from k3_fastpath.sentinel import train_glue

PLAN = sentinel_train.TrainPlan(preset="k3-tiny", steps=3, batch=2, seq_len=384, warmup=1, mrcr_chars=300,
                                mrcr_needles=(2,), heldout_items=0)


@pytest.mark.slow  # ~40 s on a 2-core CPU: dynamo traces every glue function forward and backward
def test_training_through_compiled_glue_is_the_eager_training(tmp_path, monkeypatch):
    monkeypatch.setattr(train_glue, "BACKEND", "aot_eager")
    originals = {(m, n): getattr(importlib.import_module(m), n) for m, n in train_glue.GLUE}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    glued = sentinel_train.train(dataclasses.replace(PLAN, compile_glue=True), tmp_path / "g", "cpu",
                                 log=lambda _: None)
    frames = sum(torch._dynamo.utils.counters["frames"].values())
    eager = sentinel_train.train(PLAN, tmp_path / "e", "cpu", log=lambda _: None)
    assert glued["compiled_glue"] == [f"{m}.{n}" for m, n in train_glue.GLUE] and eager["compiled_glue"] is None
    assert frames > 0  # dynamo compiled frames (the glue functions) during the run
    for a, b in zip(glued["loss_curve"], eager["loss_curve"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    for (m, n), fn in originals.items():  # the reference's own functions are back
        assert getattr(importlib.import_module(m), n) is fn


def test_the_swap_is_undone_when_training_fails(tmp_path, monkeypatch):
    originals = {(m, n): getattr(importlib.import_module(m), n) for m, n in train_glue.GLUE}
    with pytest.raises(RuntimeError, match="boom"):
        with train_glue.compiled_glue(True, backend="eager") as names:
            assert len(names) == len(train_glue.GLUE)
            assert importlib.import_module("k3_fastpath.reference.common").rms_norm is not \
                originals[("k3_fastpath.reference.common", "rms_norm")]
            raise RuntimeError("boom")
    for (m, n), fn in originals.items():
        assert getattr(importlib.import_module(m), n) is fn
