"""Tiers: YAML files listing which checks run, with parameter overrides and per-check time budgets.

A tier is ``smoke``, ``standard`` or ``full`` (the YAML files beside this module) or a path to a YAML
file of the same form::

    name: smoke
    description: ...
    target_s: 300                      # the time the whole tier must fit in (one H200, cold compile cache)
    part_limit_s: 530                  # optional: the longest part (``run --resume``) the tier is run in;
                                       # every check's budget must fit in one
    checks:
      - id: reference.determinism      # a registered check (``k3-verify list``)
        budget_s: 120                  # its measured time plus a stated margin; enforced by the runner
        params: {batch: 2}             # overrides of the check's own defaults, validated by name
        cpu_params: {batch: 1}         # optional: merged over params when the run's device is a CPU
                                       # (smaller sizes for the same check; ``CheckSpec.params_for``)

The tier's budget is the sum of its checks' budgets (``Tier.budget_s``) and must not exceed
``target_s``. Parsed into frozen dataclasses; every problem is a ``TierError`` naming the file and the
field (the CLI exits 2 with it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TIER_DIR = Path(__file__).resolve().parent
BUILTIN_TIERS = ("smoke", "standard", "full")


class TierError(ValueError):
    pass


@dataclass(frozen=True)
class CheckSpec:
    id: str
    budget_s: float
    params: dict[str, Any] = field(default_factory=dict)
    cpu_params: dict[str, Any] = field(default_factory=dict)  # merged over params on a CPU run

    def params_for(self, device: str) -> dict[str, Any]:
        """The tier's parameters for a run on ``device`` (``"cpu"`` or ``"cuda"``)."""
        return {**self.params, **self.cpu_params} if device == "cpu" else dict(self.params)


@dataclass(frozen=True)
class Tier:
    name: str
    description: str
    target_s: float
    checks: tuple[CheckSpec, ...]
    source: str
    part_limit_s: float | None = None  # every check's budget fits in one part of this many seconds

    @property
    def check_ids(self) -> list[str]:
        return [c.id for c in self.checks]

    @property
    def budget_s(self) -> float:
        """The tier's budget: the sum of its checks' budgets."""
        return float(sum(c.budget_s for c in self.checks))


def tier_path(name_or_path: str) -> Path:
    if name_or_path in BUILTIN_TIERS:
        return TIER_DIR / f"{name_or_path}.yaml"
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    raise TierError(f"unknown tier {name_or_path!r}: use one of {', '.join(BUILTIN_TIERS)} or a path to a .yaml file")


def load_tier(name_or_path: str) -> Tier:
    from verify.checks.registry import REGISTRY

    path = tier_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TierError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise TierError(f"{path}: a tier must be a mapping with name, description, budget_s, checks")
    if "budget_s" in raw:
        raise TierError(f"{path}: top-level 'budget_s': a tier's budget is the sum of its checks' budget_s; "
                        "name the time the tier must fit in 'target_s'")
    for key in ("name", "description", "target_s", "checks"):
        if key not in raw:
            raise TierError(f"{path}: field '{key}' is missing")
    if not isinstance(raw["checks"], list) or not raw["checks"]:
        raise TierError(f"{path}: field 'checks' must be a non-empty list")
    specs = []
    seen = set()
    for i, c in enumerate(raw["checks"]):
        where = f"{path}: checks[{i}]"
        if not isinstance(c, dict) or "id" not in c:
            raise TierError(f"{where}: each check needs an 'id'")
        cid = c["id"]
        if cid not in REGISTRY:
            raise TierError(f"{where}: unknown check id {cid!r} (see `k3-verify list`)")
        if cid in seen:
            raise TierError(f"{where}: check {cid!r} is listed twice")
        seen.add(cid)
        budget = c.get("budget_s")
        if not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget <= 0:
            raise TierError(f"{where}: field 'budget_s' must be a positive number")
        params, cpu_params = c.get("params") or {}, c.get("cpu_params") or {}
        for key, value in (("params", params), ("cpu_params", cpu_params)):
            if not isinstance(value, dict):
                raise TierError(f"{where}: field {key!r} must be a mapping")
        extra = sorted(set(c) - {"id", "budget_s", "params", "cpu_params"})
        if extra:
            raise TierError(f"{where}: unknown field(s) {', '.join(map(repr, extra))} (a check takes id, budget_s, "
                            "params, cpu_params)")
        spec = CheckSpec(cid, float(budget), dict(params), dict(cpu_params))
        for device in ("cuda", "cpu"):
            try:
                REGISTRY[cid].resolve_params(spec.params_for(device))
            except (KeyError, TypeError) as e:
                raise TierError(f"{where}{' (cpu_params)' if device == 'cpu' and cpu_params else ''}: "
                                f"{e.args[0] if e.args else e}") from None
        specs.append(spec)
    target = raw["target_s"]
    if not isinstance(target, (int, float)) or isinstance(target, bool) or target <= 0:
        raise TierError(f"{path}: field 'target_s' must be a positive number")
    part_limit = raw.get("part_limit_s")
    if part_limit is not None:
        if not isinstance(part_limit, (int, float)) or isinstance(part_limit, bool) or part_limit <= 0:
            raise TierError(f"{path}: field 'part_limit_s' must be a positive number")
        over = [c for c in specs if c.budget_s > part_limit]
        if over:
            raise TierError(f"{path}: check {over[0].id!r} has budget_s {over[0].budget_s:.0f}, over the tier's "
                            f"part_limit_s of {part_limit:.0f} s: no part could run it (lower its size or budget)")
    total = sum(c.budget_s for c in specs)
    if total > target:
        raise TierError(f"{path}: the checks' budgets sum to {total:.0f} s, over the tier's target_s of "
                        f"{target:.0f} s (lower a check's size or budget, or raise target_s)")
    return Tier(str(raw["name"]), str(raw["description"]), float(target), tuple(specs), str(path),
                None if part_limit is None else float(part_limit))


def select_checks(tier: Tier, only: list[str] | None = None, budgets: dict[str, float] | None = None) -> Tier:
    """``tier`` narrowed to the checks ``only`` names (tier order kept) and with the check budgets
    ``budgets`` gives (seconds); the caller records the selection. Unknown or unplanned ids and non-positive
    budgets raise ``TierError`` naming the tier's checks."""
    known = tier.check_ids
    for cid in [*(only or []), *(budgets or {})]:
        if cid not in known:
            raise TierError(f"check {cid!r} is not in tier {tier.name!r} (its checks: {', '.join(known)})")
    bad = [f"{c}={b}" for c, b in (budgets or {}).items()
           if isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0]
    if bad:
        raise TierError(f"a check budget must be a positive number of seconds, got {', '.join(bad)}")
    keep = set(only) if only else set(known)
    checks = tuple(dataclasses.replace(c, budget_s=float((budgets or {}).get(c.id, c.budget_s)))
                   for c in tier.checks if c.id in keep)
    return dataclasses.replace(tier, checks=checks)
