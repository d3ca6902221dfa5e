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
