"""What a check gets to work with: the model (preset or checkpoint), the device, seeds, and the bundle to stream into."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify.result import CheckResult


@dataclass
class CheckContext:
    check_id: str
    preset: str  # the model: a preset (k3-tiny on a CPU) or a checkpoint path (``model_source.preset``)
    device: str  # "cpu" or "cuda"
    seed: int
    writer: Any  # verify.bundle.writer.BundleWriter
    out: Any  # verify.output.Output
    tmp_dir: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    # the records this check wrote to its own stream, in order: what its status rule and ``bundle verify`` read
    recorded: list[dict[str, Any]] = field(default_factory=list)
    engines: Any = None  # verify.engines.EnginePool of the run (built lazily, closed by the runner)
    # verify.model_source.ModelSource: the run's model, resolved (a checkpoint: read and validated) once by the
    # runner before any check; a context made without one resolves ``preset`` itself
    model_source: Any = None

    def __post_init__(self) -> None:
        if self.model_source is None:
            from verify.model_source import resolve

            self.model_source = resolve(self.preset, self.seed)

    @property
    def config(self):
        return self.model_source.config

    @property
    def on_checkpoint(self) -> bool:
        """True when the run verifies a checkpoint directory (then every check uses its tensors)."""
        return self.model_source.is_checkpoint

    def state_dict(self, seed: int | None = None, conditioning: str = "default") -> dict[str, Any]:
        """The model's tensors: the checkpoint's (shared: never modify them in place), or the seeded synthetic
        ones of the preset (``seed`` defaults to the run's)."""
        return self.model_source.state_dict(self.seed if seed is None else seed, conditioning)

    def weights(self, seed: int | None = None) -> str:
        """What ``state_dict(seed)`` holds, for metrics: ``checkpoint <digest>`` or ``synthetic (seed N)``."""
        return self.model_source.weights(self.seed if seed is None else seed)

    @property
    def stream(self) -> str:
        return self.check_id

    def record(self, obj: dict[str, Any]) -> None:
        """Append one raw record to ``records/<check id>.jsonl`` (streamed to disk immediately)."""
        self.writer.record(self.stream, obj)
        self.recorded.append(obj)

    def artifact_path(self, name: str) -> Path:
        return self.writer.artifact_path(f"{self.check_id}/{name}")

    def engine_under_test(self, model_source: Any = None, speculative: str | None = None):
        """The engine the run verifies (``--engine``), built on first use and shared by every check;
        ``model_source``: the same engine serving that checkpoint instead of the run's model;
        ``speculative``: the same engine under speculative decoding (``EnginePool.get``)."""
        return self._engine("engine_under_test", model_source, speculative)

    def baseline_engine(self, model_source: Any = None, speculative: str | None = None):
        """The engine the engine under test is compared against (``--baseline-engine``)."""
        return self._engine("baseline", model_source, speculative)

    def _engine(self, role: str, model_source: Any = None, speculative: str | None = None):
        if self.engines is None:
            from verify.engines.base import EngineError

            raise EngineError(f"{self.check_id}: this run was started without engines")
        return self.engines.get(role, model_source, speculative)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def note(self, text: str) -> None:
        self.out.note(f"  {self.check_id}: {text}")
        self.writer.log(f"{self.check_id}: {text}")

    # -- results
    def _result(self, status: str, reason: str, metrics: dict[str, Any] | None, artifacts: list[str] | None
                ) -> CheckResult:
        return CheckResult(id=self.check_id, status=status, reason=reason, metrics=dict(metrics or {}),
                           artifacts=list(artifacts or []))

    def passed(self, metrics: dict[str, Any] | None = None, artifacts: list[str] | None = None,
               reason: str = "") -> CheckResult:
        return self._result("passed", reason, metrics, artifacts)

    def failed(self, reason: str, metrics: dict[str, Any] | None = None,
               artifacts: list[str] | None = None) -> CheckResult:
        return self._result("failed", reason, metrics, artifacts)

    def verdict(self, problems: list[str], metrics: dict[str, Any] | None = None,
                artifacts: list[str] | None = None) -> CheckResult:
        """passed when ``problems`` is empty, else failed with the first problem (and a count) as reason."""
        if not problems:
            return self.passed(metrics, artifacts)
        from verify.checks.status_rules import verdict_reason

        m = dict(metrics or {})
        m["problems"] = problems[:50]
        return self.failed(verdict_reason(problems), m, artifacts)
