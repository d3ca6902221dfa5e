"""Tiers: YAML files listing which checks run, with which parameters and time budgets.

A tier is ``smoke``, ``standard`` or ``full`` (the YAML files beside this module) or a path to a YAML
file of the same form::

    name: smoke
    description: ...
    budget_s: 1800
    checks:
      - id: reference.determinism      # must be a registered check (verify/checks/registry.py)
        budget_s: 120
        params: {batch: 2}

Parsed into frozen dataclasses; every problem is a ``TierError`` naming the file and the field.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Tier:
    name: str
    description: str
    budget_s: float
    checks: tuple[CheckSpec, ...]
    source: str

    @property
    def check_ids(self) -> list[str]:
        return [c.id for c in self.checks]


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
    for key in ("name", "description", "budget_s", "checks"):
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
        params = c.get("params") or {}
        if not isinstance(params, dict):
            raise TierError(f"{where}: field 'params' must be a mapping")
        unknown = set(params) - set(REGISTRY[cid].params)
        if unknown:
            raise TierError(f"{where}: check {cid!r} has no parameter(s) {', '.join(sorted(unknown))}")
        specs.append(CheckSpec(cid, float(budget), dict(params)))
    budget = raw["budget_s"]
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget <= 0:
        raise TierError(f"{path}: field 'budget_s' must be a positive number")
    return Tier(str(raw["name"]), str(raw["description"]), float(budget), tuple(specs), str(path))
