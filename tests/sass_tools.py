"""Shared by the compile-only kernel tests: where nvdisasm is, how a SASS instruction line looks, and a
compile cache isolated to one test module (so the cubins a SASS check reads are this run's)."""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import subprocess
from collections import Counter
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

def sass_lines(cubin: Path, nvdisasm: str | None = None) -> list[str]:
    """The cubin's SASS as instruction lines (predicate kept, ``;`` dropped) and labels (``.L_x_3``), in order."""
    out = subprocess.run([nvdisasm or NVDISASM, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = []
    for raw in out.splitlines():
        if raw.startswith(".L"):
            lines.append(raw.rstrip(":"))
        m = INSN.match(raw)
        if m:
            lines.append(m.group(1))
    return lines


def opcode(insn: str) -> str:
    """The opcode of one ``sass_lines`` instruction (its predicate skipped); "" for an empty line."""
    parts = insn.split()
    return parts[1] if parts and parts[0].startswith("@") else (parts[0] if parts else "")


def opcodes(cubin: Path) -> Counter:
    out = subprocess.run([NVDISASM, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops: Counter = Counter()
    for raw in out.splitlines():
        m = INSN.match(raw)
        if m:
            parts = m.group(1).split()
            ops[parts[1] if parts[0].startswith("@") else parts[0]] += 1
    return ops


def frame_sizes(cubin: Path) -> list[int]:
    """EIATTR_FRAME_SIZE (0x11) values of the cubin's .nv.info records: bytes of local memory per function."""
    b = cubin.read_bytes()
    (shoff,) = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx][4]
    out = []
    for sec in secs:
        if b[strtab + sec[0]: b.index(b"\0", strtab + sec[0])] != b".nv.info":
            continue
        p, end = sec[4], sec[4] + sec[5]
        while p < end:
            fmt, attr = b[p], b[p + 1]
            if fmt == 0x04:
                (size,) = struct.unpack_from("<H", b, p + 2)
                if size == 8 and attr == 0x11:
                    out.append(struct.unpack_from("<II", b, p + 4)[1])
                p += 4 + size
            else:
                p += 4 if fmt == 0x03 else 2
    return out
