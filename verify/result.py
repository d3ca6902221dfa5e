"""``CheckResult``: what every check returns, one line of a bundle's ``results.jsonl``.

A result is a frozen record: the check id ("reference.determinism"), a status (``passed``, ``failed``,
``skipped`` or ``error``), a reason (required unless passed: "needs a CUDA device"), metrics (a dict of
JSON values), artifacts (bundle-relative paths such as "artifacts/perf.decode/latency.png"), the
duration and ISO-8601 UTC start/end times. ``to_dict``/``from_dict`` round-trip exactly; ``from_dict``
is strict (unknown or missing keys, wrong types) because the bundle verifier reads results with it.

Metrics must be JSON values: None, bool, int, finite float, str, lists and string-keyed dicts of those.
NaN and infinities are refused (strict JSON has no spelling for them: store None or a string);
numpy scalars are converted with ``.item()``; tuples become lists.

Imports nothing heavy (no torch, no numpy).
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
ERROR = "error"
STATUSES = (PASSED, FAILED, SKIPPED, ERROR)

# "reference.determinism", "perf.decode_sweep[bs=8,ctx=1024]", "kernels.compile:sm90a"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-\[\]=,+]{0,199}$")
# UTC only: a "Z" or "+00:00" suffix (datetime.isoformat() of an aware UTC datetime gives the latter)
_TS_RE = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d{1,6})?(Z|\+00:00)$")
_FIELDS = ("id", "status", "reason", "metrics", "artifacts", "duration_s", "started_at", "ended_at")


def utc_now() -> str:
    """Now as ISO-8601 UTC with milliseconds: ``2026-11-30T14:22:20.123Z``."""
    t = _dt.datetime.now(_dt.timezone.utc)
    return f"{t:%Y-%m-%dT%H:%M:%S}.{t.microsecond // 1000:03d}Z"


def parse_timestamp(value: str) -> _dt.datetime:
    """An aware UTC datetime from an ISO-8601 UTC string; ValueError for anything else."""
    m = _TS_RE.match(value) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"{value!r} is not an ISO-8601 UTC timestamp (like 2026-11-30T14:22:20.123Z)")
    base = _dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")  # ValueError for 2026-13-45
    micros = int((m.group(2) or ".0")[1:].ljust(6, "0"))
    return base.replace(microsecond=micros, tzinfo=_dt.timezone.utc)


def is_timestamp(value: Any) -> bool:
    try:
        parse_timestamp(value)
    except ValueError:
        return False
    return True


def is_check_id(value: Any) -> bool:
    return isinstance(value, str) and bool(_ID_RE.match(value))


def json_value(value: Any, where: str = "value") -> Any:
    """A normalized copy of ``value`` as a strict JSON value; ValueError naming ``where`` otherwise."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}: JSON has no NaN/Infinity (store None or a string)")
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a non-string key {k!r}")
            out[k] = json_value(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return json_value(value.item(), where)
    raise ValueError(f"{where} is a {type(value).__name__}, not a JSON value")


def is_bundle_relpath(value: Any) -> bool:
    """A POSIX path relative to the bundle root, without '..', '.', empty parts or backslashes."""
    if not isinstance(value, str) or not value or value.startswith("/") or "\\" in value or "\x00" in value:
        return False
    return all(part not in ("", ".", "..") for part in value.split("/"))


@dataclass(frozen=True)
class CheckResult:
    id: str
    status: str
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: tuple[str, ...] = ()
    duration_s: float = 0.0
    started_at: str | None = None
    ended_at: str | None = None

    def __post_init__(self) -> None:
        if not is_check_id(self.id):
            raise ValueError(f"check id {self.id!r} is not a valid id (like 'reference.determinism')")
        if self.status not in STATUSES:
            raise ValueError(f"{self.id}: status {self.status!r} is not one of {', '.join(STATUSES)}")
        if not isinstance(self.reason, str):
            raise ValueError(f"{self.id}: reason must be a string, got {type(self.reason).__name__}")
        if self.status != PASSED and not self.reason.strip():
            raise ValueError(f"{self.id}: a {self.status} result needs a reason")
        if "\n" in self.reason or "\r" in self.reason:
            raise ValueError(f"{self.id}: reason must be one line")
        if not isinstance(self.metrics, Mapping):
            raise ValueError(f"{self.id}: metrics must be a dict, got {type(self.metrics).__name__}")
        object.__setattr__(self, "metrics", json_value(self.metrics, f"{self.id}: metrics"))
        if isinstance(self.artifacts, (str, bytes)) or not isinstance(self.artifacts, (list, tuple)):
            raise ValueError(f"{self.id}: artifacts must be a list of bundle-relative paths")
        for a in self.artifacts:
            if not is_bundle_relpath(a):
                raise ValueError(f"{self.id}: artifact path {a!r} is not relative to the bundle root")
        object.__setattr__(self, "artifacts", tuple(self.artifacts))
        d = self.duration_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise ValueError(f"{self.id}: duration_s must be a finite number >= 0, got {d!r}")
        object.__setattr__(self, "duration_s", float(d))
        for name in ("started_at", "ended_at"):
            v = getattr(self, name)
            if v is not None and not is_timestamp(v):
                raise ValueError(f"{self.id}: {name} {v!r} is not an ISO-8601 UTC timestamp")
        if self.started_at and self.ended_at:
            if parse_timestamp(self.ended_at) < parse_timestamp(self.started_at):
                raise ValueError(f"{self.id}: ended_at {self.ended_at} is before started_at {self.started_at}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "reason": self.reason,
            "metrics": json_value(self.metrics),
            "artifacts": list(self.artifacts),
            "duration_s": self.duration_s,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }

    @classmethod
    def from_dict(cls, d: Any) -> CheckResult:
        """Strict: exactly the keys ``to_dict`` writes, with their types. ValueError otherwise."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a result must be a JSON object, got {type(d).__name__}")
        missing = [k for k in _FIELDS if k not in d]
        extra = sorted(k for k in d if k not in _FIELDS)
        if missing:
            raise ValueError(f"result {d.get('id', '?')!r} lacks {', '.join(missing)}")
        if extra:
            raise ValueError(f"result {d.get('id', '?')!r} has unknown keys {', '.join(map(str, extra))}")
        if not isinstance(d["artifacts"], list):
            raise ValueError(f"result {d['id']!r}: artifacts must be a list")
        return cls(**{k: d[k] for k in _FIELDS})
