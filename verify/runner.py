"""``k3-verify run``: load a tier, capture the environment, run each check into a streaming bundle.

Order of events: tier parsed (bad tier -> exit 2 before anything is written) -> bundle directory
created with a manifest in state ``running`` -> each check in tier order: unmet requirement ->
``skipped`` with the reason; declared but not implemented -> ``error``; otherwise the check runs, its
raw records stream into ``records/<id>.jsonl`` and its ``CheckResult`` lands in ``results.jsonl`` the
moment it ends -> finalize (summary, SHA256SUMS, tarball). SIGINT/SIGTERM finalize the bundle as
``interrupted`` (verdict incomplete); a SIGKILL leaves a ``running`` bundle that still verifies.
"""

from __future__ import annotations

import copy
import datetime as _dt
import signal
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from verify.bundle.schema import PART_IDENTITY
from verify.checks.registry import REGISTRY
from verify.context import CheckContext
from verify.output import Output, UserError
from verify.requirements import first_unmet, missing_imports, missing_tools
from verify.result import CheckResult

TOOL_VERSION = "0.1.0"


class _Terminated(BaseException):
    """SIGTERM / SIGINT during a run (a BaseException: a check's ``except Exception`` cannot swallow it)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(f"received signal {signum}")


def default_output_dir() -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("bundles") / "local" / stamp


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


class OverBudget(BaseException):
    """Raised in the main thread when a check outlives its budget. A BaseException, so a check's own
    ``except Exception`` cannot swallow it; the runner turns it into ``error: over budget (N s)``."""


def _raise_over_budget(signum: int, frame: Any) -> None:
    raise OverBudget()


def call_within_budget(fn: Any, budget_s: float) -> Any:
    """``fn()``, stopped by ``OverBudget`` after ``budget_s`` seconds (SIGALRM; main thread only: elsewhere
    it runs unbounded, as a library caller's thread would)."""
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return fn()
    old = signal.signal(signal.SIGALRM, _raise_over_budget)
    signal.setitimer(signal.ITIMER_REAL, max(float(budget_s), 0.001))
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_check(ctx: CheckContext, decl: Any, params: dict[str, Any]) -> CheckResult:
    reason = first_unmet(decl.requires)
    if reason:
        return CheckResult(id=decl.id, status="skipped", reason=reason)
    fn = decl.load()
    return call_within_budget(lambda: fn(ctx, **params), ctx.budget_s)


def preflight(tier: Any) -> dict[str, str]:
    """{check id: one line} for every check of ``tier`` whose Python imports or tools are missing here, each
    line naming how to install them. Checks whose machine requirements are unmet are left out: they are
    skipped with their own reason, not errors."""
    out: dict[str, str] = {}
    for spec in tier.checks:
        decl = REGISTRY[spec.id]
        if first_unmet(decl.requires):
            continue
        missing = missing_imports(decl.imports) + missing_tools(decl.tools)
        if missing:
            out[spec.id] = "; ".join(missing)
    return out


def _free_device_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # a device left broken by the stopped check: the next check reports it
        pass


def make_engine_pool(engine: str | None, baseline_engine: str | None, preset: str, device: str, seed: int,
                     log: Any = None, model_dir: str | None = None, log_dir: str | None = None,
                     max_model_len: int | None = None) -> Any:
    """The run's engines (built lazily by the checks that use them): ``engine`` defaults to builtin:fast on
    an sm_90 GPU and builtin:reference elsewhere; the baseline to builtin:reference. A bad spec -> UserError.
    ``model_dir``: the HF model a launched ``vllm`` engine serves; ``log_dir``: where it keeps the server's
    log and launch config (the bundle's ``logs/``); ``max_model_len``: the positions every engine serves
    (None: each engine's default, the served model's ``max_position_embeddings`` for builtin ones)."""
    from verify.engines import BASELINE_DEFAULT, EngineError, EnginePool, default_engine_spec

    specs = {"engine_under_test": engine or default_engine_spec(device),
             "baseline": baseline_engine or BASELINE_DEFAULT}
    opts: dict[str, Any] = {"preset": preset, "device": device, "seed": seed}
    if max_model_len is not None:
        opts["max_model_len"] = int(max_model_len)
    if any(s.startswith("vllm") for s in specs.values()):
        opts.update(model_dir=model_dir, log_dir=log_dir)
    try:
        return EnginePool(specs, opts, log=log)
    except EngineError as e:
        raise UserError(str(e)) from None


def _part(env: dict[str, Any], device: str, checks: list[str]) -> dict[str, Any]:
    """What identifies the machine and code one part of a run ran on (``manifest.parts``)."""
    torch_env = env.get("torch") or {}
    return {"gpu": torch_env.get("device_name") if device == "cuda" else None, "device": device,
            "source_tree_sha256": env.get("source_tree_sha256"), "commit": (env.get("git") or {}).get("commit"),
            "claimed_commit": (env.get("git") or {}).get("claimed_commit"),
            "hostname_sha256": env.get("hostname_sha256"), "checks": list(checks)}


def _resume_problem(manifest: dict[str, Any], tier: Any, preset: str, device: str, part: dict[str, Any],
                    model_digest: str | None = None, max_model_len: int | None = None) -> str | None:
    """Why ``part`` may not continue the bundle whose manifest is ``manifest``, or None. The rule: the same
    tier (checks in the same order), preset, device, checkpoint digest and max_model_len, and every part on the first part's GPU model
    and source tree (``parts[0]``): numbers from two GPU models or two versions of the code are never mixed
    in one verdict."""
    if manifest.get("planned_checks") != tier.check_ids:
        return f"the bundle's tier {manifest.get('tier')!r} plans other checks than {tier.name!r}"
    cfg = manifest.get("config") or {}
    for key, want in (("preset", preset), ("device", device), ("max_model_len", max_model_len)):
        if cfg.get(key) != want:
            return f"the bundle ran with {key} {cfg.get(key)!r}, this run has {want!r}"
    recorded = (cfg.get("model") or {}).get("digest") if isinstance(cfg.get("model"), dict) else None
    if recorded != model_digest:
        return f"the bundle read checkpoint digest {recorded!r}, this run reads {model_digest!r}"
    first = (manifest.get("parts") or [None])[0]
    if not isinstance(first, dict):
        return "the bundle records no parts (written by an older k3-verify): it cannot be resumed"
    for key, what in PART_IDENTITY:
        if first.get(key) != part.get(key):
            return f"its first part ran on {what} {first.get(key)!r}, this machine has {part.get(key)!r}"
    return None


def run_tier(tier_name: str, output: Path | None, preset: str, device: str, seed: int, out: Output,
             argv: list[str], overrides: dict[str, dict[str, Any]] | None = None, engine: str | None = None,
             baseline_engine: str | None = None, model_dir: str | None = None,
             resume: bool = False, time_limit_s: float | None = None, only: list[str] | None = None,
             budgets: dict[str, float] | None = None, max_model_len: int | None = None) -> tuple[str, Path]:
    """Run ``tier_name`` into the bundle at ``output`` (or a new ``bundles/local/<stamp>``); ``resume``
    continues the unfinished bundle at ``output``, running only the checks without a result.
    ``max_model_len``: the positions every engine serves (``config.max_model_len``; None: the engines'
    defaults; a resumed bundle requires the one it recorded). ``only`` /
    ``budgets``: the tier's checks narrowed to those ids / given other budgets (``tiers.select_checks``;
    the bundle plans only those and records the selection as ``config.tier_selection``).
    ``time_limit_s``: start no check whose budget would end past this many seconds from now (the first
    check of the part always starts); the bundle then ends ``interrupted``, to be resumed."""
    import json

    from verify import environment
    from verify.bundle.schema import BundleError
    from verify.bundle.writer import BundleWriter, sealed_results
    from verify.tiers import TierError, load_tier, select_checks

    try:
        tier = load_tier(tier_name)
        if only or budgets:
            tier = select_checks(tier, only, budgets)
    except TierError as e:
        raise UserError(str(e)) from None
    device = resolve_device(device)
    # every check's parameters (the tier's for this device, then the caller's overrides) and budget, resolved
    # once: what runs, and what the manifest records for `bundle audit`
    check_plan = {}
    for c in tier.checks:
        try:
            params = REGISTRY[c.id].resolve_params({**c.params_for(device), **(overrides or {}).get(c.id, {})})
        except (KeyError, TypeError) as e:
            raise UserError(str(e.args[0] if e.args else e)) from None
        check_plan[c.id] = {"params": params, "budget_s": c.budget_s}
    from verify.model_source import resolve as resolve_model

    source = resolve_model(preset, seed)  # a checkpoint is read in full and validated here, before any output
    preset = source.preset
    cpu_threads = _set_cpu_threads(device)
    if resume and output is None:
        raise UserError("--resume needs --output: the bundle directory to continue")
    root = Path(output) if output else default_output_dir()
    if root.exists() and not root.is_dir():
        raise UserError(f"--output {root} is a file, not a directory")
    env = environment.capture()
    if resume:
        if not (root / "manifest.json").is_file():
            raise UserError(f"--resume: {root} is not a bundle directory (no manifest.json)")
        from verify.bundle.verify import verify_bundle

        report = verify_bundle(root)
        if report.exit_code != 0:
            raise UserError(f"--resume: {root} does not verify: {report.problems[0] if report.problems else '?'}")
        manifest = json.loads((root / "manifest.json").read_text())
        if manifest.get("state") == "finished":
            raise UserError(f"--resume: {root} is finished (verdict {manifest.get('verdict')}): nothing to resume")
        done = {r.id for r in sealed_results(root)}
        todo_ids = [c for c in tier.check_ids if c not in done]
        part = _part(env, device, todo_ids)
        problem = _resume_problem(manifest, tier, preset, device, part, source.digest, max_model_len)
        if problem:
            raise UserError(f"--resume: refusing to continue {root}: {problem}")
    elif root.exists() and any(root.iterdir()):
        raise UserError(f"output directory {root} exists and is not empty (continue it with --resume)")
    pool = make_engine_pool(engine, baseline_engine, preset, device, seed, model_dir=model_dir,
                            log_dir=str(root / "logs"), max_model_len=max_model_len)
    pool.opts["model_source"] = source  # builtin engines serve the tensors the run read (not in the manifest)
    try:
        if resume:
            part["index"] = len(manifest.get("parts") or [])
            writer = BundleWriter.resume(root, part)
        else:
            part = dict(_part(env, device, tier.check_ids), index=0)
            writer = BundleWriter(
                root, tool_version=TOOL_VERSION, argv=argv, tier=tier.name, planned_checks=tier.check_ids,
                engines=pool.manifest_entries(),
                config={"preset": preset, "weights": source.weights(), "model": source.manifest(), "device": device,
                        "tier_source": tier.source, "cpu_threads": cpu_threads,
                        "tier_budget_s": tier.budget_s, "tier_target_s": tier.target_s,
                        "check_plan": check_plan, "max_model_len": max_model_len,
                        **({"tier_selection": {"only": list(only or []), "budgets": dict(budgets or {})}}
                           if only or budgets else {})},
                seeds={"global": seed}, env=env, part=part,
            )
    except BundleError as e:
        raise UserError(str(e)) from None
    todo = [c for c in tier.checks if c.id not in set(writer.done_checks)]
    out.note(f"tier {tier.name}: {len(todo)} of {len(tier.checks)} checks to run (budget {tier.budget_s:.0f} s, "
             f"target {tier.target_s:.0f} s), preset {preset}, device {device} -> {root}"
             + (f" (resumed: part {part['index']})" if resume else ""))
    if resume:
        writer.log(f"resumed as part {part['index']}: {len(todo)} checks left")
    missing = preflight(tier)
    for cid, line in missing.items():
        if cid in part["checks"]:
            out.note(f"preflight: {cid}: {line}")
            writer.log(f"preflight: {cid}: {line}")
    pool.log = writer.log  # engine builds and descriptions go to logs/run.log
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, _raise_terminated)
    state = "finished"
    rows = []
    try:
        run_t0 = time.monotonic()
        queue = list(todo)
        with tempfile.TemporaryDirectory(prefix="k3verify-") as tmp, out.progress(len(todo), "checks") as bar:
            while queue:
                left = None if time_limit_s is None else time_limit_s - (time.monotonic() - run_t0)
                # under --time-limit: the next check (in tier order) whose budget fits the time left; the
                # first check of a part always starts
                spec = next((c for c in queue if left is None or len(queue) == len(todo) or c.budget_s <= left), None)
                if spec is None:
                    state = "interrupted"
                    msg = (f"time limit: none of the {len(queue)} checks left (smallest budget "
                           f"{min(c.budget_s for c in queue):.0f} s) fits in the {max(left, 0):.0f} s left of "
                           f"--time-limit {time_limit_s:.0f} s; stopping here (continue with --resume)")
                    writer.log(msg)
                    out.note(msg)
                    break
                queue.remove(spec)
                decl = REGISTRY[spec.id]
                params = copy.deepcopy(check_plan[spec.id]["params"])  # a check may not change the plan
                bar.advance(0, description=spec.id)
                ctx = CheckContext(check_id=spec.id, preset=preset, device=device, seed=seed, writer=writer, out=out,
                                   tmp_dir=Path(tmp), budget_s=spec.budget_s, engines=pool, model_source=source)
                started = _dt.datetime.now(_dt.timezone.utc).isoformat()
                t0 = time.monotonic()
                try:
                    if spec.id in missing:
                        result = CheckResult(id=spec.id, status="error", reason=f"preflight: {missing[spec.id]}")
                    else:
                        result = run_check(ctx, decl, params)
                except _Terminated:
                    raise
                except OverBudget:
                    writer.log(f"{spec.id}: stopped at its budget of {spec.budget_s:.0f} s\n{traceback.format_exc()}")
                    result = CheckResult(id=spec.id, status="error",
                                         reason=f"over budget ({spec.budget_s:.0f} s): stopped after "
                                                f"{time.monotonic() - t0:.0f} s")
                    _free_device_memory()
                except Exception as e:  # a crashing check is an error result, never a crashed run
                    writer.log(f"{spec.id}: exception\n{traceback.format_exc()}")
                    msg = " ".join(str(e).split())[:300]
                    result = CheckResult(id=spec.id, status="error", reason=f"{type(e).__name__}: {msg}")
                dur = time.monotonic() - t0
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
    total = sum(r.duration_s or 0 for r in writer.results)
    out.table(f"k3-verify run --tier {tier.name}: verdict {verdict}", ["check", "status", "reason", "time"], rows,
              key="results")
    out.set("verdict", verdict)
    out.set("bundle", str(root))
    out.set("checks_time_s", round(total, 1))
    out.line(f"verdict: {verdict}   checks took {total:.0f} s (target {tier.target_s:.0f} s)   bundle: {root}   "
             f"archive: {root}.tar.gz")
    return verdict, root
