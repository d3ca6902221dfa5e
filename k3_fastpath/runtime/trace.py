"""The execution trace: per decode step, which kernels launched, which ops ran on the standard path, and
whether the whole step fell back (with the reason).

This is how anyone (the builtin engine, the vLLM plugin, a maintainer re-checking a bundle) tells a fast
step from a silent fallback (K3.md failure 1). One JSON object per line:

    {"type": "step", "executor": "e1", "step": 12, "backend": "latency_specialized", "batch": 3, "bucket": 4,
     "graph": true, "kernels": {"skinny_gemm": 131, "kda_decode": 5, "mla_decode": 2, "moe_experts": 7, ...},
     "standard_ops": [], "kernel_fallbacks": {}, "fallback": null}

``fallback`` is the whole step's reason for running the standard path (null on a fast step);
``standard_ops`` are ops of a fast step served by PyTorch for want of a kernel (allowed, but listed; the
default op table has none: MLA attention is ``mla_decode``, the routed experts ``moe_experts``);
``kernel_fallbacks`` are fast-kernel calls that their own ``is_supported`` refused ({op: {reason: n}}): on
a GPU inside the envelope there must be none. Each executor also writes one ``{"type": "meta", ...}``
line (envelope, buckets, what PDL and L2 prefetch do on this machine) before its first step.

With ``K3_FASTPATH_TRACE=<dir>`` the lines go to ``<dir>/trace-<pid>.jsonl`` as they happen (appended,
flushed per line, so an engine killed mid-run leaves a readable trace). ``read_trace`` and ``summarize``
are what checks use.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRACE_ENV = "K3_FASTPATH_TRACE"
_executor_ids = itertools.count(1)


@dataclass
class StepRecord:
    step: int
    backend: str
    batch: int
    bucket: int | None
    kernels: dict[str, int] = field(default_factory=dict)
    standard_ops: list[dict[str, Any]] = field(default_factory=list)
    kernel_fallbacks: dict[str, dict[str, int]] = field(default_factory=dict)
    fallback: str | None = None
    graph: bool = False
    kind: str = "decode"  # "decode" | "prefill" | "mixed" | "verify" (a fused speculative verify step)
    tokens: int = 1  # rows per sequence (a verify step's 1 + drafts)
    # steps this record stands for: 1 for a step that ran; 0 for a step captured into an engine's CUDA graph
    # (it ran nothing; its kernels are the graph's); n for n replays of such graphs counted on the device
    # (the vLLM route in place, ``vllm_inplace.InPlaceRouter.flush``)
    count: int = 1

    def to_dict(self, executor: str) -> dict[str, Any]:
        return {"type": "step", "executor": executor, **asdict(self)}


def trace_dir_from_env() -> str | None:
    value = os.environ.get(TRACE_ENV, "").strip()
    return value or None


class ExecutionTrace:
    """Step records of one executor: kept in memory (the last ``keep`` of them) with running totals, and
    streamed to ``<trace_dir>/trace-<pid>.jsonl`` when ``trace_dir`` is set."""

    def __init__(self, trace_dir: str | os.PathLike | None = None, meta: dict[str, Any] | None = None,
                 keep: int = 100_000) -> None:
        self.executor_id = f"e{next(_executor_ids)}"
        self.meta: dict[str, Any] = dict(meta or {})
        self.records: deque[StepRecord] = deque(maxlen=keep)
        self._steps = 0
        self._totals: dict[str, Counter] = {"fallback": Counter(), "kernels": Counter(), "standard_ops": Counter(),
                                            "kernel_fallbacks": Counter(), "buckets": Counter(),
                                            "backend": Counter(), "kind": Counter(), "fast": Counter()}
        self.path: Path | None = None
        self._fh = None
        self._meta_written = False
        if trace_dir is not None:
            d = Path(trace_dir)
            d.mkdir(parents=True, exist_ok=True)
            self.path = d / f"trace-{os.getpid()}.jsonl"

    # ------------------------------------------------------------------ writing
    def set_meta(self, **items: Any) -> None:
        self.meta.update(items)

    def _write(self, obj: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
        self._fh.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
        self._fh.flush()

    def record(self, rec: StepRecord) -> StepRecord:
        rec.step = self._steps
        self._steps += 1
        self.records.append(rec)
        t = self._totals
        t["fallback"][rec.fallback or ""] += 1
        if not rec.fallback and rec.backend == "latency_specialized":
            t["fast"]["steps"] += 1
        t["kernels"].update(rec.kernels)
        for op in rec.standard_ops:
            t["standard_ops"][f"{op['op']}: {op['reason']}"] += 1
        for op, reasons in rec.kernel_fallbacks.items():
            for reason, n in reasons.items():
                t["kernel_fallbacks"][f"{op}: {reason}"] += n
        t["buckets"][str(rec.bucket)] += 1
        t["backend"][rec.backend] += 1
        t["kind"][rec.kind] += 1
        if self.path is not None:
            if not self._meta_written:
                self._write({"type": "meta", "executor": self.executor_id, "pid": os.getpid(), **self.meta})
                self._meta_written = True
            self._write(rec.to_dict(self.executor_id))
        return rec

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self._steps

    def lines(self) -> list[dict[str, Any]]:
        """The meta line and the kept step records, as the JSONL file holds them."""
        out = [{"type": "meta", "executor": self.executor_id, "pid": os.getpid(), **self.meta}]
        return out + [r.to_dict(self.executor_id) for r in self.records]

    def to_jsonl(self, path: str | os.PathLike | None = None) -> str:
        """The trace as JSON lines (meta first); written to ``path`` too when given."""
        text = "".join(json.dumps(o, sort_keys=True, default=str) + "\n" for o in self.lines())
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def summary(self) -> dict[str, Any]:
        """Totals over every step recorded (not only the kept ones)."""
        t = self._totals
        fallbacks = {k: v for k, v in t["fallback"].items() if k}
        return {"steps": self._steps, "fast_steps": t["fast"]["steps"],
                "fallback_steps": sum(fallbacks.values()), "fallbacks": dict(fallbacks),
                "kernels": dict(t["kernels"]), "standard_ops": dict(t["standard_ops"]),
                "kernel_fallbacks": dict(t["kernel_fallbacks"]), "buckets": dict(t["buckets"]),
                "backends": dict(t["backend"]), "kinds": dict(t["kind"])}

    def since(self, step: int) -> list[StepRecord]:
        """The kept records with ``record.step >= step`` (a check's window of steps)."""
        return [r for r in self.records if r.step >= step]


DECODE_KINDS = ("decode", "verify")  # step kinds the fast path must serve


def read_trace(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(meta lines, step lines) of a trace file, or of every ``trace-*.jsonl`` in a directory."""
    p = Path(path)
    files = sorted(p.glob("trace-*.jsonl")) if p.is_dir() else [p]
    meta, steps = [], []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{n}: not a JSON line ({e.msg})") from None
            (meta if obj.get("type") == "meta" else steps).append(obj)
    return meta, steps


def summarize(steps: list[dict[str, Any]] | list[StepRecord], decode_only: bool = True) -> dict[str, Any]:
    """What a check asks of a trace: step counts (each record's ``count``), fallback reasons, kernel launches,
    standard ops and kernel fallbacks, over ``steps`` (dicts from ``read_trace`` or ``StepRecord``s). ``decode_only`` keeps the
    decode and verify steps (prefill and mixed steps run the standard path by design)."""
    rows = [asdict(s) if isinstance(s, StepRecord) else s for s in steps]
    if decode_only:
        rows = [r for r in rows if r.get("kind", "decode") in DECODE_KINDS]
    fallbacks: Counter = Counter()
    kernels: Counter = Counter()
    std: Counter = Counter()
    kfb: Counter = Counter()
    fast = 0
    for r in rows:
        n = int(r.get("count", 1))
        if r.get("fallback"):
            fallbacks[r["fallback"]] += n
        elif r.get("backend") == "latency_specialized":  # "standard" / "standard_graph" are never the fast path
            fast += n
        kernels.update(r.get("kernels") or {})
        for op in r.get("standard_ops") or []:
            std[f"{op['op']}: {op['reason']}"] += 1
        for op, reasons in (r.get("kernel_fallbacks") or {}).items():
            for reason, n in reasons.items():
                kfb[f"{op}: {reason}"] += n
    return {"steps": sum(int(r.get("count", 1)) for r in rows), "fast_steps": fast, "fallback_steps": sum(fallbacks.values()),
            "fallbacks": dict(fallbacks), "kernels": dict(kernels), "standard_ops": dict(std),
            "kernel_fallbacks": dict(kfb)}


def fast_path_problems(summary: dict[str, Any], expect_fast: bool = True) -> list[str]:
    """The trace-level failures of a run that expected the fast path: whole-step fallbacks, kernel calls
    refused by their kernel, and no fast step at all. Standard ops are not problems (they are listed)."""
    if not expect_fast:
        return []
    problems = [f"{n} step(s) fell back to the standard path: {reason}" for reason, n in summary["fallbacks"].items()]
    problems += [f"kernel fallback {what} ({n} call(s))" for what, n in summary["kernel_fallbacks"].items()]
    if summary["steps"] and not summary["fast_steps"]:
        problems.append("no step ran the fast path")
    return problems
