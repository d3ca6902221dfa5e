"""What the tests that call a check function directly share: a ``CheckContext`` on a CPU whose records land
in a list instead of a bundle."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

from verify.context import CheckContext


class RecordSink:
    """The writer a ``CheckContext`` records into: each record deep-copied into ``rows``."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record(self, stream: str, obj: dict) -> None:
        self.rows.append(copy.deepcopy(obj))

    def log(self, text: str) -> None:
        pass


def cpu_context(check_id: str, seed: int, tmp_path: Path, budget_s: float = 600) -> tuple[CheckContext, RecordSink]:
    """A context for ``check_id`` on k3-tiny on the CPU with seed ``seed % 1000``, and the sink of its records."""
    sink = RecordSink()
    ctx = CheckContext(check_id=check_id, preset="k3-tiny", device="cpu", seed=seed % 1000, writer=sink,
                       out=SimpleNamespace(note=lambda *_: None), tmp_dir=tmp_path, budget_s=budget_s)
    return ctx, sink
