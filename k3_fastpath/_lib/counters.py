"""Process-wide execution trace: kernel launches and fallbacks.

The fast path's contract (ARCHITECTURE.md) is that it exposes, per kernel, how often it launched and,
per fallback, how often and why. Every torch-facing kernel op (its ``_lib.kernel_op.KernelOp``) calls
``count_launch(name)`` when it launches its compiled kernel and ``count_fallback(op, reason)`` when it
serves the call from its reference instead. Tests and the CLI read ``snapshot()`` (a plain-dict copy) and call ``reset()``.

Counting is host-side: a CUDA-graph replay does not re-run Python, so launches inside a captured graph
are counted once, at capture. Callers that replay graphs account for replays themselves.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

_lock = threading.Lock()
_launches: Counter[str] = Counter()
_fallbacks: Counter[tuple[str, str]] = Counter()


def count_launch(name: str, n: int = 1) -> None:
    """Record ``n`` launches of kernel ``name``."""
    with _lock:
        _launches[name] += n


def count_fallback(op: str, reason: str, n: int = 1) -> None:
    """Record that ``op`` was served by its reference path because of ``reason``."""
    with _lock:
        _fallbacks[(op, reason)] += n


def launches(name: str) -> int:
    with _lock:
        return _launches[name]


def fallbacks(op: str | None = None) -> int:
    """Total fallbacks of ``op`` (all ops when ``None``), over every reason."""
    with _lock:
        return sum(v for (o, _), v in _fallbacks.items() if op is None or o == op)


def snapshot() -> dict[str, Any]:
    """``{"launches": {kernel: n}, "fallbacks": {op: {reason: n}}}``: a copy, safe to keep."""
    with _lock:
        fb: dict[str, dict[str, int]] = {}
        for (op, reason), n in sorted(_fallbacks.items()):
            fb.setdefault(op, {})[reason] = n
        return {"launches": dict(sorted(_launches.items())), "fallbacks": fb}


def reset() -> None:
    """Zero every counter."""
    with _lock:
        _launches.clear()
        _fallbacks.clear()
