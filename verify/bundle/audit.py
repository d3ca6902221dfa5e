"""``k3-verify bundle audit BUNDLE``: re-execute a bundle's checks here and compare a seeded sample of its
records with the re-execution's, which catches fabricated raw records that a rescorer cannot.

How: the bundle must verify. Its manifest's ``config.check_plan`` (every check's resolved parameters and
budget, written by ``k3-verify run``) and its model, seed and engines are turned into a tier that
``k3-verify run`` executes into a re-run bundle (or ``--rerun B`` names a re-run made before, e.g. the one
an earlier audit attached: the comparison is then redone without executing, against B's device); then for
each audited check a seeded sample of its records (``--sample N`` indices, the same ones for the same
``--seed``) is compared field by field with the re-run's record at the same index:

* **timings** (``verify/checks/record_fields.py: TIMING``, and every field inside one, e.g.
  ``section_us.L3.mlp``) agree within a tolerance, on the same GPU
  model: ``timing_tol`` (relative) widened to the larger of the two runs' own spreads, a timed record's
  ``(p10 .. p90) / median`` of its step samples and, for a nested timing ``<field>.<key>``, the record's
  ``timing_spread[<field>][<key>]`` (the sweep's per-section and per-layer-type spreads); a nested
  microsecond timing (``section_us.head.in``) may also differ by ``STEP_FRACTION`` of the record's step
  median (a difference that small moves no ratio the record reports by more than that). Per-sample lists
  (``*_samples``) are compared through their median and percentiles, not element by element;
* **wall-clock stamps and wall times** (``record_fields.IGNORED``) are not compared;
* **everything else** is deterministic for a seeded check on the same device model: equal bitwise; on a
  different device model (another GPU, or a CPU where the bundle ran on a GPU) numbers get ``rel 1e-6``
  and the audit says so;
* the re-run's status must equal the bundle's, and its number of records the bundle's (a record dropped
  or added anywhere is found, sampled or not);
* a record its check declares information only on both sides (``CheckDecl.information_only``: one no
  status rule gates, e.g. the sweep's eager PyTorch reference rows, whose times are bound by the host's
  dispatch and whose per-layer split moves with it) has its timing disagreements recorded as
  ``informational``: listed, not counted. Every other field of it is compared as above, so a record made
  to look information-only (its backend changed) is a disagreement.

Output: an audit bundle (check ``audit.records``: one ``audited`` record per check, one ``disagreement``
record per differing field, ``cannot_run`` where a check cannot run here; the re-run bundle attached as
``artifacts/audit.records/rerun.tar.gz``) whose status ``bundle verify`` re-derives. Exit 1 when a record
disagrees (informational disagreements aside), 2 when a check cannot run here (nothing disagreeing), else 0.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verify.bundle.schema import BundleError
from verify.checks.record_fields import IGNORED, TIMING

AUDIT_CHECK = "audit.records"
STEP_FRACTION = 0.01  # of a timed record's step median: the absolute slack of its nested microsecond timings
CROSS_DEVICE_REL = 1e-6


@dataclass(frozen=True)
class AuditReport:
    exit_code: int
    audit_root: Path
    audited: tuple[str, ...]
    disagreements: tuple[dict[str, Any], ...]
    cannot_run: tuple[dict[str, Any], ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Tolerance:
    """How one record's timings are compared: ``rel`` overall, ``nested[field][key]`` for ``field.key``,
    ``abs_us`` for nested microsecond timings."""

    rel: float
    nested: dict[str, dict[str, float]]
    abs_us: float

    def at(self, path: str) -> tuple[float, float]:
        """(relative, absolute) tolerance of the timing at ``path`` (``.section_us.head.in``)."""
        field, _, key = path.lstrip(".").partition(".")
        rel = max(self.rel, self.nested.get(field, {}).get(key, 0.0)) if key else self.rel
        return rel, (self.abs_us if key and field.endswith("_us") else 0.0)


def _walk(a: Any, b: Any, path: str, key: str, tol: Tolerance, rel: float, out: list[dict[str, Any]],
          in_timing: bool = False) -> None:
    if IGNORED.search(key):
        return
    timing = in_timing or bool(TIMING.search(key))
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                if not IGNORED.search(k):
                    out.append({"field": f"{path}.{k}".lstrip("."), "bundle": a.get(k), "rerun": b.get(k),
                                "why": "present on one side only"})
                continue
            _walk(a[k], b[k], f"{path}.{k}", k, tol, rel, out, timing)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append({"field": path.lstrip("."), "bundle": f"{len(a)} items", "rerun": f"{len(b)} items",
                        "why": "lengths differ"})
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}[{i}]", key, tol, rel, out, timing)
        return
    num = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if num and timing:
        t_rel, t_abs = tol.at(path)
        ok = math.isclose(a, b, rel_tol=t_rel, abs_tol=max(t_abs, 1e-9))
        why = f"timing beyond {t_rel:.0%}" + (f" and {t_abs:.3g} us" if t_abs else "")
        if not ok:
            out.append({"field": path.lstrip("."), "bundle": a, "rerun": b, "why": why, "timing": True})
        return
    elif num and rel:
        ok = math.isclose(a, b, rel_tol=rel, abs_tol=0.0)
        why = f"differs beyond rel {rel:g}"
    else:
        ok = a == b
        why = "differs"
    if not ok:
        out.append({"field": path.lstrip("."), "bundle": a, "rerun": b, "why": why})


def recorded_spread(record: dict[str, Any]) -> float:
    """A timed record's own run-to-run spread, ``(p90 - p10) / median`` of its step samples (0 without them,
    or for anything but a record)."""
    if not isinstance(record, dict):
        return 0.0
    p10, p90, med = (record.get(f"step_us_{k}") for k in ("p10", "p90", "median"))
    if all(isinstance(v, (int, float)) for v in (p10, p90, med)) and med > 0:
        return max(0.0, (p90 - p10) / med)
    return 0.0


def record_tolerance(a: dict[str, Any], b: dict[str, Any], tol: float) -> Tolerance:
    """The ``Tolerance`` of a record pair: the larger of both runs' spreads everywhere (see the module doc)."""
    nested: dict[str, dict[str, float]] = {}
    for rec in (a, b):
        spreads = rec.get("timing_spread") if isinstance(rec, dict) else None
        for field, per in (spreads or {}).items():
            for k, v in (per or {}).items():
                if isinstance(v, (int, float)):
                    nested.setdefault(field, {})[k] = max(nested.get(field, {}).get(k, 0.0), float(v))
    med = a.get("step_us_median") if isinstance(a, dict) else None
    abs_us = STEP_FRACTION * med if isinstance(med, (int, float)) and med > 0 else 0.0
    return Tolerance(max(tol, recorded_spread(a), recorded_spread(b)), nested, abs_us)


def compare_records(bundle: list[dict[str, Any]], rerun: list[dict[str, Any]], indices: list[int], tol: float,
                    rel: float, information_only: Any = None) -> list[dict[str, Any]]:
    """The disagreements between the sampled ``bundle`` records and the ``rerun`` records at the same index
    (``information_only``: the check's predicate, see the module doc)."""
    out: list[dict[str, Any]] = []
    for i in indices:
        if i >= len(rerun):
            out.append({"index": i, "field": "", "bundle": "a record", "rerun": None,
                        "why": f"the re-run wrote {len(rerun)} records"})
            continue
        found: list[dict[str, Any]] = []
        _walk(bundle[i], rerun[i], "", "", record_tolerance(bundle[i], rerun[i], tol), rel, found)
        info = information_only is not None and all(isinstance(r, dict) and information_only(r)
                                                    for r in (bundle[i], rerun[i]))
        for d in found:
            if d.pop("timing", False) and info:
                d["informational"] = True
            out.append({"index": i, **d})
    return out


def counted(disagreements: Any) -> list[dict[str, Any]]:
    """The disagreements an audit's verdict rests on: all but the ``informational`` ones."""
    return [d for d in disagreements if not d.get("informational")]


def _device_model(manifest: dict[str, Any]) -> str:
    env = manifest.get("env") or {}
    gpus = env.get("gpus") or []
    if gpus and isinstance(gpus[0], dict):
        return f"gpu:{gpus[0].get('name')}"
    cpu = env.get("cpu")
    return f"cpu:{cpu.get('model') if isinstance(cpu, dict) else cpu}"


def _tier_yaml(plan: dict[str, dict[str, Any]], ids: list[str]) -> str:
    import yaml

    checks = [{"id": c, "budget_s": float(plan[c]["budget_s"]), "params": plan[c]["params"]} for c in ids]
    total = sum(c["budget_s"] for c in checks)
    return yaml.safe_dump({"name": "audit", "description": "re-execution of a bundle's checks (bundle audit)",
                           "target_s": total, "checks": checks}, sort_keys=False)


def audit_bundle(path: str | Path, out_dir: str | Path, *, sample: int = 20, checks: list[str] | None = None,
                 seed: int = 0, timing_tol: float = 0.25, device: str = "auto", out: Any = None,
                 rerun: str | Path | None = None) -> AuditReport:
    from verify import environment
    from verify.bundle.readers import read_bundle
    from verify.bundle.verify import verify_bundle
    from verify.bundle.writer import BundleWriter
    from verify.checks.registry import REGISTRY
    from verify.output import Output
    from verify.requirements import first_unmet
    from verify.result import CheckResult
    from verify.runner import TOOL_VERSION, run_tier

    out = out or Output("json")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise BundleError(f"audit output {out_dir} exists and is not empty")
    report = verify_bundle(path)
    if report.exit_code == 2:
        raise BundleError(report.problems[0] if report.problems else f"{path}: unreadable bundle")
    if not report.ok:
        raise BundleError(f"{path} does not verify ({report.problems[0]}): audit a bundle that verifies", 1)
    data = read_bundle(path)
    manifest = data.manifest
    results = [r.to_dict() for r in data.results.values()]
    records = data.records
    config = manifest.get("config") or {}
    plan = config.get("check_plan") or {}
    cannot, notes, ids = [], [], []
    for r in results:
        cid = r["id"]
        if (checks and cid not in checks) or r["status"] not in ("passed", "failed") or cid.startswith("audit."):
            continue
        if cid not in plan:
            cannot.append({"check": cid, "why": "the bundle records no check_plan for it (written before audits)"})
        elif cid not in REGISTRY:
            cannot.append({"check": cid, "why": "this k3-verify has no such check"})
        elif rerun is None and first_unmet(REGISTRY[cid].requires):
            cannot.append({"check": cid, "why": f"cannot run here: {first_unmet(REGISTRY[cid].requires)}"})
        else:
            ids.append(cid)
    if checks:
        cannot += [{"check": c, "why": "not a passed or failed result of the bundle"}
                   for c in checks if c not in {r["id"] for r in results}]
    model = config.get("model") or {}
    if ids and model.get("kind") not in (None, "preset"):
        cannot += [{"check": c, "why": "the bundle ran on a checkpoint: audit it with the checkpoint's run"} for c in ids]
        ids = []
    env = environment.capture()
    done = None
    if rerun is not None:  # a re-run made before: its device is the one the comparison is against
        done = read_bundle(rerun)
        rv = verify_bundle(rerun)
        if not rv.ok:
            raise BundleError(f"--rerun {rerun} does not verify ({rv.problems[0] if rv.problems else 'unreadable'})", 1)
        if (done.manifest.get("env") or {}).get("source_tree_sha256") != (manifest.get("env") or {}).get("source_tree_sha256"):
            notes.append("the re-run ran other sources than the bundle (source_tree_sha256 differs)")
        notes.append(f"compared with the re-run {rerun} (made on {_device_model(done.manifest)}), not executed here")
    here = _device_model(done.manifest if done is not None else {"env": env})
    there = _device_model(manifest)
    rel = 0.0 if here == there else CROSS_DEVICE_REL
    if rel:
        notes.append(f"the bundle ran on {there}, this audit on {here}: numbers compared within rel {rel:g}, "
                     "not bitwise")
    tmp = Path(tempfile.mkdtemp(prefix="k3-audit-"))
    rerun_root = tmp / "rerun"
    rerun_recs: dict[str, list] = {}
    rerun_status: dict[str, str] = {}
    try:
        if ids and done is not None:
            rerun_recs = done.records
            rerun_status = {cid: r.status for cid, r in done.results.items()}
            cannot += [{"check": c, "why": f"the re-run {rerun} has no result for it"} for c in ids if c not in rerun_status]
            ids = [c for c in ids if c in rerun_status]
        elif ids:
            (tmp / "audit.yaml").write_text(_tier_yaml(plan, ids))
            engines = {e.get("role"): e.get("spec") for e in manifest.get("engines") or [] if isinstance(e, dict)}
            run_tier(str(tmp / "audit.yaml"), rerun_root, config.get("preset") or "auto", device,
                     int((manifest.get("seeds") or {}).get("global", 0)), out,
                     argv=["k3-verify", "bundle", "audit", str(path)], engine=engines.get("engine_under_test"),
                     baseline_engine=engines.get("baseline"), max_model_len=config.get("max_model_len"))
            rerun = read_bundle(rerun_root)
            rerun_recs = rerun.records
            rerun_status = {cid: r.status for cid, r in rerun.results.items()}
        rng = random.Random(seed)
        audited_rows, disagreements = [], []
        for cid in ids:
            orig = records.get(cid, [])
            idx = sorted(rng.sample(range(len(orig)), min(sample, len(orig))))
            found = compare_records(orig, rerun_recs.get(cid, []), idx, timing_tol, rel,
                                    REGISTRY[cid].information_only)
            if len(orig) != len(rerun_recs.get(cid, [])):  # a record dropped or added, whichever index it had
                found.insert(0, {"index": None, "field": "(record count)", "bundle": len(orig),
                                 "rerun": len(rerun_recs.get(cid, [])), "why": "the record counts differ"})
            status = next(r["status"] for r in results if r["id"] == cid)
            if rerun_status.get(cid) != status:
                found.insert(0, {"index": None, "field": "status", "bundle": status, "rerun": rerun_status.get(cid),
                                 "why": "the re-run's status differs"})
            audited_rows.append({"kind": "audited", "check": cid, "records": len(orig),
                                 "rerun_records": len(rerun_recs.get(cid, [])), "sampled": idx,
                                 "status": status, "rerun_status": rerun_status.get(cid), "disagreements": len(found),
                                 "informational": len(found) - len(counted(found))})
            disagreements += [{"kind": "disagreement", "check": cid, **d} for d in found]
        argv = ["k3-verify", "bundle", "audit", str(path), *(["--rerun", str(rerun)] if rerun is not None else [])]
        w = BundleWriter(out_dir, tool_version=TOOL_VERSION, argv=argv,
                         tier="audit", planned_checks=[AUDIT_CHECK], engines=[],
                         config={"audited_bundle": {"tier": manifest.get("tier"), "started_at": manifest.get("started_at"),
                                                    "source": (manifest.get("env") or {}).get("source_tree_sha256")},
                                 "sample": sample, "seed": seed, "timing_tol": timing_tol, "numbers_rel": rel,
                                 "rerun_from": None if done is None else {"path": str(rerun), "device": here,
                                                                           "started_at": done.manifest.get("started_at")}},
                         seeds={"global": seed}, env=env)
        w.record(AUDIT_CHECK, {"kind": "plan", "sample": sample, "seed": seed, "timing_tol": timing_tol,
                               "numbers_rel": rel, "device_bundle": there, "device_here": here})
        for row in audited_rows + disagreements + [{"kind": "cannot_run", **c} for c in cannot]:
            w.record(AUDIT_CHECK, row)
        artifacts = []
        if done is not None and Path(rerun).is_file():  # the re-run compared with travels with the audit
            shutil.copy(rerun, tmp / "rerun.tar.gz")
        elif done is not None:
            from verify.bundle.writer import write_tarball

            write_tarball(Path(rerun), tmp / "rerun.tar.gz")
        elif (rerun_root / "manifest.json").is_file():
            from verify.bundle.writer import write_tarball

            write_tarball(rerun_root, tmp / "rerun.tar.gz")
        if (tmp / "rerun.tar.gz").is_file():
            dest = w.artifact_path(f"{AUDIT_CHECK}/rerun.tar.gz")
            shutil.copy(tmp / "rerun.tar.gz", dest)
            artifacts.append(f"artifacts/{AUDIT_CHECK}/rerun.tar.gz")
        from verify.checks.status_rules import audit_problems, verdict_reason

        problems = audit_problems(audited_rows + disagreements + [{"kind": "cannot_run", **c} for c in cannot])
        real = counted(disagreements)
        status = "error" if cannot and not real else ("failed" if problems else "passed")
        reason = verdict_reason(problems) if problems else ""
        w.add_result(CheckResult(AUDIT_CHECK, status, reason, metrics={"audited": ids, "disagreements": len(real),
                                                                        "informational": len(disagreements) - len(real),
                                                                        "cannot_run": len(cannot)},
                                 artifacts=artifacts))
        w.finalize()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    code = 1 if real else 2 if cannot else 0
    return AuditReport(code, out_dir, tuple(ids), tuple(disagreements), tuple(cannot), tuple(notes))
