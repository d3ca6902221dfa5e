"""AIPerf (NVIDIA's load generator, PyPI ``aiperf``) as ``perf.serving``'s driver: locate it, synthesize
agentic sessions, run one ``aiperf profile`` per point, and read its per-request export.

AIPerf is a command line with a large dependency tree of its own, so it is run as a subprocess and may
live in its own environment: ``K3_AIPERF`` (the ``aiperf`` executable), else this interpreter's
``python -m aiperf`` (the ``[serve]`` extra), else ``aiperf`` on PATH, else the repository's
``.venv-serve/bin/aiperf`` (``scripts/bootstrap --serve``). ``AIPERF_VERSION`` is the version the record
fields below were read from; another version is refused.

Workloads (``Workload``):
* ``agentic``: sessions from AIPerf's agentic-code synthesizer (``aiperf synthesize agentic-code``; the
  generator behind the AgentX-style scenarios) scaled to the served model's context: a prefix shared by
  every session, a per-session prefix, new tokens per turn, tool pauses (agentic) and human pauses between
  turns, contexts that grow until they reach ``context_fraction`` of the model's limit or reset. Replayed
  as a ``mooncake_trace`` on the chat endpoint (each turn carries the session's history), timestamps and
  pauses honoured. ``subagents`` > 0 adds sub-agent fan-out, which the synthesizer has none of
  (``add_subagents``): every ``subagent_every``-th turn of a session spawns that many child sessions that
  start together from the session's shared prefix (its first prompt's full blocks: KV reuse across the
  children) plus a task of their own, run ``subagent_turns`` turns each, while the parent waits on them
  (its next turn's pause grows by their scheduled time).
* ``fixed``: ``requests`` single-turn prompts of exactly ``isl`` tokens asking for ``osl`` tokens.
Every request sets ``ignore_eos`` and token counts are the server's (``--use-server-token-count``);
AIPerf's warm-up phase is excluded from the records.

Tokenizers: AIPerf resolves a tokenizer through the Hugging Face cache when offline; a local model
directory is exposed to it as the repo ``k3-local/<name>-<hash>`` in a private cache (``local_tokenizer_repo``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AIPERF_VERSION = "0.13.0"
REPO = Path(__file__).resolve().parents[1]
HOW_TO_INSTALL = ("scripts/bootstrap --serve (AIPerf in .venv-serve), pip install 'k3-verify[serve]', "
                  "or K3_AIPERF=/path/to/aiperf")
_SNAPSHOT = "0" * 40


class AIPerfError(RuntimeError):
    """AIPerf is missing, the wrong version, or a run of it failed (the message says which, in one line)."""


def aiperf_command() -> list[str] | None:
    """How to run AIPerf here (see the module docstring), or None."""
    env = os.environ.get("K3_AIPERF")
    if env:
        return [env] if os.access(env, os.X_OK) else None
    import importlib.util

    if importlib.util.find_spec("aiperf") is not None:
        return [sys.executable, "-m", "aiperf"]
    found = shutil.which("aiperf")
    if found:
        return [found]
    local = REPO / ".venv-serve" / "bin" / "aiperf"
    return [str(local)] if os.access(local, os.X_OK) else None


def tool_problem() -> str | None:
    """None when the pinned AIPerf runs here, else why not (the preflight's line)."""
    cmd = aiperf_command()
    if cmd is None:
        return f"needs AIPerf {AIPERF_VERSION} ({HOW_TO_INSTALL})"
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"AIPerf at {cmd[0]} does not run ({type(e).__name__})"
    version = (out.stdout.strip().splitlines() or ["?"])[-1]
    if out.returncode != 0 or version != AIPERF_VERSION:
        return f"needs AIPerf {AIPERF_VERSION}, {cmd[0]} is {version!r} ({HOW_TO_INSTALL})"
    return None


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # agentic | fixed
    sessions: int = 8  # agentic
    context_fraction: float = 0.7  # agentic: contexts grow to this share of max_model_len
    turn_tokens: int = 48  # agentic: mean new tokens per turn
    osl: int = 16  # tokens asked per request (agentic: the mean)
    isl: int = 128  # fixed
    requests: int = 24  # fixed
    subagents: int = 0  # agentic: child sessions per fan-out (0: none)
    subagent_every: int = 4  # agentic: a fan-out after every this many turns of a session
    subagent_turns: int = 2  # agentic: turns of each child session

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown or "name" not in d or d.get("kind") not in ("agentic", "fixed"):
            raise ValueError(f"a perf.serving workload is {{name, kind: agentic|fixed, ...}} with fields "
                             f"{sorted(cls.__dataclass_fields__)}; got {d}")
        return cls(**d)


def local_tokenizer_repo(tokenizer_dir: str | Path, cache: Path) -> str:
    """Expose ``tokenizer_dir``'s tokenizer files as the Hugging Face repo ``k3-local/<name>-<path hash>`` in
    ``cache`` (two directories with one base name get two repos)."""
    import hashlib

    src = Path(tokenizer_dir)
    name = f"{src.resolve().name}-{hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]}"
    repo = cache / f"models--k3-local--{name}"
    snap = repo / "snapshots" / _SNAPSHOT
    snap.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.suffix in (".jinja", ".txt", ".model")
                            or f.name in ("config.json", "special_tokens_map.json", "generation_config.json")):
            shutil.copy2(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    return f"k3-local/{name}"


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
            "NO_COLOR": "1"}


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> None:
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise AIPerfError(f"aiperf {cmd[1] if len(cmd) > 1 else ''} did not finish in {timeout_s:.0f} s "
                              f"(log {log.name})") from None
    if rc != 0:
        tail = [x for x in log.read_text(errors="replace").splitlines() if "Reason:" in x or "ERROR" in x]
        raise AIPerfError(f"aiperf exited {rc}: " + (" ".join(tail[-1].split())[:200] if tail else f"see {log.name}"))


def _command() -> list[str]:
    cmd = aiperf_command()
    if cmd is None:
        raise AIPerfError(tool_problem() or "AIPerf not found")
    return cmd


def synthesize_agentic(w: Workload, out: Path, seed: int, max_model_len: int, log: Path, timeout_s: float) -> Path:
    """A mooncake-format session trace for ``w`` (see the module docstring); returns dataset.jsonl."""
    cmd = _command()
    block = 16
    max_prompt = int(max_model_len * w.context_fraction) - 2 * w.osl
    config = {
        "new_tokens_per_turn": {"mean": w.turn_tokens, "median": max(1, int(w.turn_tokens * 0.8)),
                                "max": 2 * w.turn_tokens, "bias": 1.1},
        "generation_length": {"mean": w.osl, "median": w.osl, "max": int(w.osl * 1.5)},
        "inter_turn_delay": {"agentic_fraction": 0.8,
                             "agentic_delay": {"mean": 200, "median": 150, "max": 600},
                             "human_delay": {"mean": 1000, "median": 800, "max": 2000}, "max": None},
        "reset": {"base_probability": 0.05, "context_scaling": 1.5},
        "max_prompt_tokens": max_prompt,
        "block_size": block,
        "cache": {"layer1_tokens": 8 * block, "layer1_5_tokens": 0,
                  "layer2": {"mean": 4 * block, "median": 3 * block, "max": 8 * block},
                  "layer1_5_groups": {"num_groups": 1, "zipf_alpha": 0.6}},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _run([*cmd, "synthesize", "agentic-code", "--config", str(out / "config.json"), "--num-sessions",
          str(w.sessions), "--seed", str(seed), "--output", str(out)], _env(out), log, timeout_s)
    found = sorted(out.glob("*/dataset.jsonl"))
    if not found:
        raise AIPerfError(f"aiperf synthesize wrote no dataset.jsonl under {out.name}")
    if w.subagents:
        rows = [json.loads(x) for x in found[-1].read_text().splitlines() if x.strip()]
        rows = add_subagents(rows, w.subagents, w.subagent_every, w.subagent_turns, w.turn_tokens, block)
        found[-1].write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    return found[-1]


SUBAGENT_MARK = "-sub"  # a child session's id: <parent id>-sub<fan-out>.<child>


def add_subagents(rows: list[dict[str, Any]], fanout: int, every: int, turns: int, turn_tokens: int,
                  block: int) -> list[dict[str, Any]]:
    """Mooncake trace rows (a session's turns in order: the first with ``timestamp`` ms, later ones with
    ``delay`` ms) with sub-agent fan-out (module docstring). A child's first turn is the parent's first prompt
    cut to whole ``block``-token blocks (the same ``hash_ids``: the same text) plus two blocks of its own; its
    later turns add about ``turn_tokens`` new tokens after the parent's agentic pause. New hash ids start above
    every id in the trace, so no child block collides with another's."""
    if fanout < 1 or every < 1 or turns < 1:
        raise ValueError(f"sub-agents: fanout {fanout}, every {every}, turns {turns} must each be >= 1")
    sessions: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        sessions.setdefault(r["session_id"], []).append(dict(r))
    next_id = 1 + max((h for r in rows for h in r["hash_ids"]), default=0)
    out: list[dict[str, Any]] = []
    for sid, session in sessions.items():
        first = session[0]
        shared = first["hash_ids"][: first["input_length"] // block]
        clock = float(first.get("timestamp", 0.0))
        pauses = sorted(float(x.get("delay", 0.0)) for x in session[1:]) or [0.0]
        gap = pauses[len(pauses) // 2]  # the session's median pause between its own turns
        children: list[list[dict[str, Any]]] = []
        for t, turn in enumerate(session):
            clock += float(turn.get("delay", 0.0))
            if (t + 1) % every or t + 1 == len(session):  # no fan-out here, nor after the last turn
                continue
            for c in range(fanout):
                child, ids = [], list(shared) + [next_id, next_id + 1]
                next_id += 2
                child.append({"session_id": f"{sid}{SUBAGENT_MARK}{t}.{c}", "input_length": len(ids) * block,
                              "output_length": turn["output_length"], "hash_ids": ids, "timestamp": round(clock, 1),
                              **({"group_id": first["group_id"]} if "group_id" in first else {})})
                for _ in range(turns - 1):
                    n = max(1, -(-turn_tokens // block))
                    child.append({"session_id": child[0]["session_id"], "input_length": n * block,
                                  "output_length": turn["output_length"], "hash_ids": list(range(next_id, next_id + n)),
                                  "delay": gap})
                    next_id += n
                children.append(child)
            # the parent waits on its children (their scheduled pauses)
            session[t + 1]["delay"] = round(float(session[t + 1].get("delay", 0.0)) + gap * (turns - 1), 1)
        out += session
        for child in children:
            out += child
    return out


def profile(*, url: str, model: str, tokenizer_repo: str, cache: Path, workload: Workload, dataset: Path | None,
            concurrency: int, seed: int, warmup_requests: int, artifact_dir: Path, log: Path, timeout_s: float,
            request_timeout_s: float, client_workers: int | None = None) -> list[dict[str, Any]]:
    """One ``aiperf profile`` run; returns its profiled requests as ``perf.serving`` request records (without
    the point's key). ``client_workers``: AIPerf's worker and record-processor processes (default: its own
    choice; 1 when the server shares the host's few cores)."""
    cmd = _command()
    args = [*cmd, "profile", "--model", model, "--url", url, "--streaming", "--tokenizer", tokenizer_repo,
            "--concurrency", str(concurrency), "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--random-seed", str(seed), "--artifact-dir", str(artifact_dir), "--ui-type", "none",
            "--export-level", "records", "--request-timeout-seconds", str(request_timeout_s)]
    if client_workers:
        args += ["--workers-max", str(client_workers), "--record-processor-service-count", str(client_workers)]
    if workload.kind == "agentic":
        args += ["--endpoint-type", "chat", "--input-file", str(dataset), "--custom-dataset-type", "mooncake_trace",
                 "--prompt-input-tokens-block-size", "16"]
    else:
        args += ["--endpoint-type", "completions", "--request-count", str(workload.requests),
                 "--prompt-input-tokens-mean", str(workload.isl), "--prompt-input-tokens-stddev", "0",
                 "--prompt-output-tokens-mean", str(workload.osl), "--prompt-output-tokens-stddev", "0"]
        if warmup_requests:
            args += ["--warmup-request-count", str(warmup_requests)]
    _run(args, _env(cache), log, timeout_s)
    export = artifact_dir / "profile_export.jsonl"
    if not export.is_file():
        raise AIPerfError(f"aiperf wrote no {export.name} (log {log.name})")
    rows = [json.loads(x) for x in export.read_text().splitlines() if x.strip()]
    return [request_record(r) for r in rows if r["metadata"].get("benchmark_phase") == "profiling"]


def _metric(m: dict[str, Any], name: str, unit: str) -> Any:
    v = m.get(name)
    if v is None:
        return None
    if v.get("unit") != unit:
        raise AIPerfError(f"AIPerf reported {name} in {v.get('unit')!r}, expected {unit!r} (AIPerf {AIPERF_VERSION})")
    return v["value"]


def request_record(row: dict[str, Any]) -> dict[str, Any]:
    """One AIPerf export row (``MetricRecordInfo``) as a ``perf.serving`` request record."""
    md, m, err = row["metadata"], row.get("metrics") or {}, row.get("error")
    return {
        "kind": "request",
        "start_ns": md["request_start_ns"],
        "end_ns": md["request_end_ns"],
        "latency_ms": _metric(m, "request_latency", "ms"),
        "ttft_ms": _metric(m, "time_to_first_token", "ms"),
        "gaps_ms": _metric(m, "inter_chunk_latency", "ms"),
        "output_tokens": _metric(m, "usage_completion_tokens", "tokens"),
        "prompt_tokens": _metric(m, "usage_prompt_tokens", "tokens"),
        "cached_tokens": _metric(m, "usage_prompt_cache_read_tokens", "tokens"),
        "error": None if err is None else " ".join(f"{err.get('code') or ''} {err.get('message')}".split())[:300],
        "session": md.get("conversation_id"),
        "turn": md.get("turn_index"),
        "aiperf_itl_ms": _metric(m, "inter_token_latency", "ms"),
    }
