"""The sentinel's checkpoint writer: a BF16-expert training state written as the real MXFP4 checkpoint,
loaded back through the normal loader, serving exactly the model whose experts are MXFP4-rounded."""

from __future__ import annotations

import pytest
import torch

from k3_fastpath import mxfp4
from k3_fastpath.manifest import tensor_specs
from k3_fastpath.presets import preset
from k3_fastpath.reference.model import load_reference
from k3_fastpath.sentinel.checkpoint import training_config, write_trained_checkpoint
from k3_fastpath.synthetic import synthetic_state_dict, torch_dtype
from k3_fastpath.weights import CheckpointError, load_checkpoint, write_checkpoint


@pytest.fixture(scope="module")
def trained():
    cfg = preset("k3-tiny").config
    return cfg, synthetic_state_dict(training_config(cfg), 3)


def test_the_written_checkpoint_serves_the_mxfp4_rounded_training_model_exactly(trained, tmp_path):
    cfg, sd = trained
    write_trained_checkpoint(cfg, sd, tmp_path / "ck")
    cfg2, sd2 = load_checkpoint(tmp_path / "ck")
    assert cfg2.expert_format == "mxfp4" and cfg2 == cfg
    specs = {s.name: s for s in tensor_specs(cfg)}
    for name, t in sd2.items():
        name = name.removeprefix("language_model.")
        assert t.dtype == torch_dtype(specs[name].dtype), name  # FP32 KDA parameters, U8 experts, BF16 else
    rounded = {k: mxfp4.dequantize(*mxfp4.quantize(v.float()), torch.float32).to(v.dtype) if ".experts." in k else v
               for k, v in sd.items()}
    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    want = load_reference(training_config(cfg), rounded, dtype=torch.float32)(ids)
    got = load_reference(cfg2, sd2, dtype=torch.float32)(ids)
    assert torch.equal(got, want)
    # and the experts really are quantized: the unrounded training model differs
    assert not torch.equal(load_reference(training_config(cfg), sd, dtype=torch.float32)(ids), got)


def test_a_missing_trained_tensor_is_named_and_nothing_is_left(trained, tmp_path):
    cfg, sd = trained
    partial = {k: v for k, v in sd.items() if "layers.2.block_sparse_moe.experts.5.w3" not in k}
    with pytest.raises(CheckpointError, match=r"experts\.5\.w3\.weight"):
        write_trained_checkpoint(cfg, partial, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_off_the_manifest_is_refused(trained, tmp_path):
    cfg, sd = trained

    def wrong_dtype(spec):
        t = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype))
        return t.to(torch.float16) if spec.name.endswith("A_log") else t

    with pytest.raises(CheckpointError, match=r"A_log: torch.float16"):
        write_checkpoint(cfg, tmp_path / "ck", wrong_dtype)
    assert list(tmp_path.iterdir()) == []
