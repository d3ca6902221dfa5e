"""Running a check function outside ``k3-verify run`` in tests: a ``CheckContext`` whose writer keeps the
records in memory (each checked to be strict JSON, as a bundle's must be) and whose output is silent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verify.context import CheckContext


class RecordingWriter:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def record(self, stream: str, obj: dict) -> None:
        json.dumps(obj, allow_nan=False)  # records must be strict JSON
        self.records.append(obj)

    def log(self, text: str) -> None:
        pass


class QuietOut:
    def note(self, text: str) -> None:
        pass


def check_context(check_id: str, seed: int, engines: Any, preset: str = "k3-tiny", budget_s: float = 600
                  ) -> tuple[CheckContext, RecordingWriter]:
    """A context for ``check_id`` on a CPU with ``engines`` (an ``EnginePool``-like ``get``) and its writer."""
    w = RecordingWriter()
    ctx = CheckContext(check_id=check_id, preset=preset, device="cpu", seed=seed, writer=w, out=QuietOut(),
                       tmp_dir=Path("."), budget_s=budget_s, engines=engines)
    return ctx, w
