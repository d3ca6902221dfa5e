"""Shared by the compile-only kernel tests: where nvdisasm is, how a SASS instruction line looks, and a
compile cache isolated to one test module (so the cubins a SASS check reads are this run's)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest


def find_nvdisasm() -> str | None:
    """nvdisasm from the PyPI package nvidia-cuda-nvdisasm (nvidia/cu13/bin), or None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        p = Path(root) / "cu13" / "bin" / "nvdisasm"
        if p.is_file():
            return str(p)
    return None


NVDISASM = find_nvdisasm()
INSN = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def isolated_cache(tmp_path_factory: pytest.TempPathFactory, name: str):
    """Generator for a module fixture: K3_KERNEL_CACHE points at a fresh directory, memory cache cleared."""
    from k3_fastpath._lib import compile_cache

    old = os.environ.get("K3_KERNEL_CACHE")
    os.environ["K3_KERNEL_CACHE"] = str(tmp_path_factory.mktemp(name))
    compile_cache.clear_memory()
    try:
        yield
    finally:
        compile_cache.clear_memory()
        if old is None:
            os.environ.pop("K3_KERNEL_CACHE", None)
        else:
            os.environ["K3_KERNEL_CACHE"] = old
