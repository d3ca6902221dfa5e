"""Recorded gold-answer likelihoods judged under other margins: what a maintainer runs to see what another
``likelihood`` threshold set would have said of a bundle (``bundle verify`` judges by the recorded ones).
Kept apart from ``verify.evals.likelihood`` (the rescorer ``bundle verify`` loads), since it reads bundles."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from verify.evals.likelihood import LikelihoodThresholds, LikelihoodThresholdsError, compare, load_thresholds


def rejudge(path: str | Path, th: LikelihoodThresholds, check_id: str = "likelihood.gold_answers"
            ) -> list[tuple[str, dict[str, Any] | None, list[str]]]:
    """Per task of ``check_id`` in the bundle at ``path``: (task, metrics, problems) of its recorded samples
    judged under ``th`` (the seed the run recorded); metrics None where a side has no samples. What a
    maintainer runs to see what other margins would have said; ``bundle verify`` judges by the recorded ones."""
    from verify.bundle.readers import read_bundle

    recs = [r for rs in read_bundle(path).streams(check_id).values() for r in rs if isinstance(r, dict)]
    configs = [r for r in recs if r.get("type") == "config"]
    if len(configs) != 1:
        raise ValueError(f"{path}: {len(configs)} config records for {check_id} (expected one)")
    by: dict[tuple[str, str], list] = defaultdict(list)
    for r in recs:
        if r.get("type") == "sample":
            by[(str(r.get("task")), str(r.get("side")))].append(r)
    out: list[tuple[str, dict[str, Any] | None, list[str]]] = []
    for task in configs[0]["tasks"]:
        base, test = by.get((task, "baseline")), by.get((task, "under_test"))
        if not base or not test:
            out.append((task, None, [f"{task}: not scored on both sides"]))
            continue
        out.append((task, *compare(task, base, test, th, int(configs[0]["seed"]))))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m verify.evals.rejudge [--thresholds FILE] BUNDLE...``: each bundle's recorded gold-answer
    likelihoods judged under FILE's ``likelihood`` margins (default ``evals/thresholds.yaml``), one line a task;
    exit 1 when a task fails, 2 on bad input."""
    import argparse
    import sys

    from verify.bundle.schema import BundleError

    p = argparse.ArgumentParser(prog="python -m verify.evals.rejudge", description=main.__doc__.split("\n")[0])
    p.add_argument("--thresholds", help="a thresholds YAML with a 'likelihood' mapping")
    p.add_argument("bundles", nargs="+")
    args = p.parse_args(argv)
    failed = False
    try:
        th = load_thresholds(args.thresholds)
        for b in args.bundles:
            rows = rejudge(b, th)
            print(b)
            for task, m, problems in rows:
                failed |= m is not None and bool(problems)
                if m is None:
                    print(f"  {task}: not scored on both sides")
                    continue
                print(f"  {task}: {'FAIL' if problems else 'pass'}  nll {m['baseline']['nll']:.4g} -> "
                      f"{m['under_test']['nll']:.4g} ({m['nll_diff']:+.3g}, CI [{m['ci']['lo']:+.3g}, "
                      f"{m['ci']['hi']:+.3g}]), margin {m['margin']:.3g}, {m['items_worse']} of {m['items']} less likely")
    except (LikelihoodThresholdsError, BundleError, OSError, ValueError) as e:
        print(f"rejudge: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
