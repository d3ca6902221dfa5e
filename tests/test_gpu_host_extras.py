"""What the tiers import reaches the GPU host and the GPU image.

Every Python module a registered check declares (``@check(imports=...)``) must be installable by a
k3-verify extra that the GPU image installs (``image_build.DEFAULT_EXTRAS["gpu"]``), and must be staged
for the workplace's GPU host by ``scripts/gpu/host-extras.txt`` (pins, every dependency the host lacks
named too) unless the host image already holds it.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from verify import image_build
from verify.checks.registry import REGISTRY

REPO = Path(__file__).resolve().parents[1]
ON_THE_HOST = {"pytest", "torch", "numpy", "transformers", "tokenizers"}  # the GPU host's image has these


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _extras() -> dict[str, set[str]]:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = doc["project"]["optional-dependencies"]

    def dists(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            m = re.match(r"k3-verify\[([^\]]+)\]", req)
            if m:
                for e in m.group(1).split(","):
                    out |= dists(e.strip())
            else:
                out.add(_norm(re.match(r"[A-Za-z0-9_.\-]+", req).group(0)))
        return out

    return {e: dists(e) for e in extras}


def _imported_dists() -> set[str]:
    return {_norm(mod.split(".")[0]) for d in REGISTRY.values() for mod in d.imports}


def test_the_gpu_image_extras_install_every_module_a_check_imports():
    extras = _extras()
    image = set().union(*(extras[e] for e in image_build.DEFAULT_EXTRAS["gpu"].split(",")))
    missing = sorted(_imported_dists() - image - ON_THE_HOST)
    assert {"lm-eval", "jsonschema", "xgrammar"} <= _imported_dists()
    assert not missing, f"the GPU image's extras ({image_build.DEFAULT_EXTRAS['gpu']}) do not install {missing}"


def test_the_gpu_host_staging_list_pins_every_module_a_check_imports():
    lines = [x.strip() for x in (REPO / "scripts" / "gpu" / "host-extras.txt").read_text().splitlines()]
    pins = [x for x in lines if x and not x.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", p) for p in pins), pins
    names = [_norm(p.split("==")[0]) for p in pins]
    assert len(names) == len(set(names)), "a package pinned twice"
    missing = sorted(_imported_dists() - set(names) - ON_THE_HOST)
    assert not missing, f"scripts/gpu/host-extras.txt does not stage {missing}"
    pyproject = (REPO / "pyproject.toml").read_text()
    lm_eval_pin = re.search(r'"lm-eval\[api\]==([^"]+)"', pyproject).group(1)
    assert f"lm-eval=={lm_eval_pin}" in pins, "the host's lm-eval is not the version pyproject pins"
