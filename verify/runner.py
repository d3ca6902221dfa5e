"""``k3-verify run``: load a tier, capture the environment, run each check into a streaming bundle.

Order of events: tier parsed (bad tier -> exit 2 before anything is written) -> bundle directory
created with a manifest in state ``running`` -> each check in tier order: unmet requirement ->
``skipped`` with the reason; declared but not implemented -> ``error``; otherwise the check runs, its
raw records stream into ``records/<id>.jsonl`` and its ``CheckResult`` lands in ``results.jsonl`` the
moment it ends -> finalize (summary, SHA256SUMS, tarball). SIGINT/SIGTERM finalize the bundle as
``interrupted`` (verdict incomplete); a SIGKILL leaves a ``running`` bundle that still verifies.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import signal
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from verify.checks.registry import REGISTRY
from verify.context import CheckContext
from verify.output import Output, UserError
from verify.requirements import first_unmet
from verify.result import CheckResult

TOOL_VERSION = "0.1.0"


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(f"received signal {signum}")


def default_output_dir() -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("bundles") / "local" / stamp


def resolve_preset(preset: str) -> str:
    from k3_fastpath.config import PRESET_NAMES, ConfigError, get_config

    if preset == "auto":
        return "k3-tiny"
    if preset in PRESET_NAMES:
        return preset
    try:
        get_config(preset)
    except ConfigError as e:
        raise UserError(str(e)) from None
    return preset


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


def _set_cpu_threads(device: str) -> int:
    """CPU runs use one intra-op thread unless K3_CPU_THREADS says otherwise: the reference checks run
    k3-tiny, whose ops are so small that thread hand-off dominates (k3-tiny greedy decode: 7.7 s on two
    threads of a busy 2-core machine, 0.76 s on one)."""
    import os

    import torch

    n = int(os.environ.get("K3_CPU_THREADS", "1" if device == "cpu" else str(torch.get_num_threads())))
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def run_check(ctx: CheckContext, decl: Any, params: dict[str, Any]) -> CheckResult:
    reason = first_unmet(decl.requires)
    if reason:
        return CheckResult(id=decl.id, status="skipped", reason=reason)
    if not decl.implemented:
        return CheckResult(id=decl.id, status="error",
                           reason=f"not implemented in k3-verify {TOOL_VERSION}; tracked in issue {decl.issue}")
    module = importlib.import_module(f"verify.checks.{decl.module}")
    fn = getattr(module, decl.function)
    return fn(ctx, **params)


def make_engine_pool(engine: str | None, baseline_engine: str | None, preset: str, device: str, seed: int,
                     log: Any = None, model_dir: str | None = None, log_dir: str | None = None) -> Any:
    """The run's engines (built lazily by the checks that use them): ``engine`` defaults to builtin:fast on
    an sm_90 GPU and builtin:reference elsewhere; the baseline to builtin:reference. A bad spec -> UserError.
    ``model_dir``: the HF model a launched ``vllm`` engine serves; ``log_dir``: where it keeps the server's
    log and launch config (the bundle's ``logs/``)."""
    from verify.engines import BASELINE_DEFAULT, EngineError, EnginePool, default_engine_spec

    specs = {"engine_under_test": engine or default_engine_spec(device),
             "baseline": baseline_engine or BASELINE_DEFAULT}
    opts: dict[str, Any] = {"preset": preset, "device": device, "seed": seed}
    if any(s.startswith("vllm") for s in specs.values()):
        opts.update(model_dir=model_dir, log_dir=log_dir)
    try:
        return EnginePool(specs, opts, log=log)
    except EngineError as e:
        raise UserError(str(e)) from None


def run_tier(tier_name: str, output: Path | None, preset: str, device: str, seed: int, out: Output,
             argv: list[str], overrides: dict[str, dict[str, Any]] | None = None, engine: str | None = None,
             baseline_engine: str | None = None, model_dir: str | None = None) -> tuple[str, Path]:
    from verify import environment
    from verify.bundle.writer import BundleWriter
    from verify.tiers import TierError, load_tier

    try:
        tier = load_tier(tier_name)
    except TierError as e:
        raise UserError(str(e)) from None
    preset = resolve_preset(preset)
    device = resolve_device(device)
    cpu_threads = _set_cpu_threads(device)
    root = Path(output) if output else default_output_dir()
    if root.exists() and any(root.iterdir()):
        raise UserError(f"output directory {root} exists and is not empty")
    pool = make_engine_pool(engine, baseline_engine, preset, device, seed, model_dir=model_dir,
                            log_dir=str(root / "logs"))
    out.note(f"tier {tier.name}: {len(tier.checks)} checks, preset {preset}, device {device} -> {root}")
    env = environment.capture()
    writer = BundleWriter(
        root, tool_version=TOOL_VERSION, argv=argv, tier=tier.name, planned_checks=tier.check_ids,
        engines=pool.manifest_entries(),
        config={"preset": preset, "device": device, "tier_source": tier.source, "cpu_threads": cpu_threads},
        seeds={"global": seed}, env=env,
    )
    pool.log = writer.log  # engine builds and descriptions go to logs/run.log
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, _raise_terminated)
    state = "finished"
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="k3verify-") as tmp, out.progress(len(tier.checks), "checks") as bar:
            for spec in tier.checks:
                decl = REGISTRY[spec.id]
                params = {**decl.params, **spec.params, **(overrides or {}).get(spec.id, {})}
                bar.advance(0, description=spec.id)
                ctx = CheckContext(check_id=spec.id, preset=preset, device=device, seed=seed, writer=writer, out=out,
                                   tmp_dir=Path(tmp), budget_s=spec.budget_s, engines=pool)
                started = _dt.datetime.now(_dt.timezone.utc).isoformat()
                t0 = time.monotonic()
                try:
                    result = run_check(ctx, decl, params)
                except _Terminated:
                    raise
                except Exception as e:  # a crashing check is an error result, never a crashed run
                    writer.log(f"{spec.id}: exception\n{traceback.format_exc()}")
                    msg = " ".join(str(e).split())[:300]
                    result = CheckResult(id=spec.id, status="error", reason=f"{type(e).__name__}: {msg}")
                dur = time.monotonic() - t0
                if result.status == "passed" and dur > spec.budget_s:
                    result = replace(result, status="failed",
                                     reason=f"took {dur:.0f}s, over its time budget of {spec.budget_s:.0f}s")
                result = replace(result, duration_s=round(dur, 3), started_at=started,
                                 ended_at=_dt.datetime.now(_dt.timezone.utc).isoformat())
                writer.add_result(result)
                rows.append((spec.id, result.status, result.reason, f"{dur:.1f}s"))
                out.note(f"{result.status:>7}  {spec.id}  {result.reason}")
                bar.advance(1)
    except _Terminated:
        state = "interrupted"
        writer.log("run interrupted by a signal; finalizing an incomplete bundle")
    finally:
        try:
            pool.close()  # stop launched servers, free models; a failure is logged, never a crashed run
        except Exception as e:
            writer.log(f"closing the engines failed: {type(e).__name__}: {e}")
        for s, h in old.items():
            signal.signal(s, h)
    verdict = writer.finalize(state=state)
    out.table(f"k3-verify run --tier {tier.name}: verdict {verdict}", ["check", "status", "reason", "time"], rows,
              key="results")
    out.set("verdict", verdict)
    out.set("bundle", str(root))
    out.line(f"verdict: {verdict}   bundle: {root}   archive: {root}.tar.gz")
    return verdict, root
