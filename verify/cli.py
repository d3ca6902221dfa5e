"""``k3-verify``: run tiers of checks into result bundles, and verify / show bundles offline.

Heavy modules (torch, the checks) are imported inside the commands, so ``--help`` is instant.
Exit codes: 0 ok (a run whose verdict is pass or incomplete), 1 a check failed / a bundle did not
verify, 2 usage, config or input error (one line on stderr; ``K3_DEBUG=1`` adds the traceback).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from verify.output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Output, UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Verify and benchmark the Kimi K3 latency-specialized decode path; write result bundles.")
bundle_app = typer.Typer(no_args_is_help=True, help="Check, inspect and compare result bundles (no GPU needed).")
app.add_typer(bundle_app, name="bundle")

FormatOpt = typer.Option("text", "--format", help="text (rich tables) or json (one JSON document on stdout)")


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _version_cb(value: bool) -> None:
    if value:
        from verify.runner import TOOL_VERSION

        typer.echo(f"k3-verify {TOOL_VERSION}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_cb, is_eager=True,
                                       help="print the version and exit")) -> None:
    pass


@app.command()
def run(
    tier: str = typer.Option("smoke", "--tier", help="smoke | standard | full | path to a tier .yaml"),
    output: Path | None = typer.Option(None, "--output", "-o", help="bundle directory (default bundles/local/<timestamp>)"),
    preset: str = typer.Option("auto", "--preset", help="model for reference checks: auto (k3-tiny), a preset, or a checkpoint dir"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    seed: int = typer.Option(0, "--seed", help="global seed (recorded in the bundle)"),
    require_complete: bool = typer.Option(False, "--require-complete", help="exit 1 unless the verdict is pass"),
    fmt: str = FormatOpt,
) -> None:
    """Run a tier of checks and write a result bundle (directory + .tar.gz)."""
    out = Output(fmt)
    from verify.runner import run_tier

    verdict, _ = run_tier(tier, output, preset, device, seed, out, argv=["k3-verify", *sys.argv[1:]])
    out.finish()
    if verdict == "fail" or (require_complete and verdict != "pass"):
        raise _Exit(EXIT_FAILED)


@app.command()
def bench(
    what: str = typer.Argument(..., help="kernels"),
    output: Path | None = typer.Option(None, "--output", "-o", help="bundle directory (default bundles/local/<timestamp>)"),
    sweep: bool = typer.Option(False, "--sweep", help="also time one-factor-at-a-time variations of every heuristic constant (skinny GEMM, KDA)"),
    fmt: str = FormatOpt,
) -> None:
    """Benchmark the fast kernels against cuBLAS / PyTorch into a bundle (needs an H100/H200)."""
    out = Output(fmt)
    if what != "kernels":
        raise UserError(f"unknown bench {what!r}: available: kernels (the decode step sweep is perf.decode_sweep)")
    from verify.runner import run_tier
    from verify.tiers import TIER_DIR

    tier = TIER_DIR / "bench-kernels.yaml"
    overrides = {"bench.kernels": {"sweep": True}} if sweep else None
    verdict, _ = run_tier(str(tier), output, "auto", "auto", 0, out, argv=["k3-verify", *sys.argv[1:]],
                          overrides=overrides)
    out.finish()
    if verdict == "fail":
        raise _Exit(EXIT_FAILED)


@app.command("list")
def list_(fmt: str = FormatOpt) -> None:
    """List the tiers and every check (with what it needs and whether it runs here)."""
    out = Output(fmt)
    from verify.checks.registry import REGISTRY
    from verify.requirements import first_unmet
    from verify.tiers import BUILTIN_TIERS, load_tier

    tiers = {name: load_tier(name) for name in BUILTIN_TIERS}
    out.table("tiers", ["tier", "checks", "budget", "description"],
              [(t.name, len(t.checks), f"{t.budget_s / 60:.0f} min", t.description) for t in tiers.values()],
              key="tiers")
    rows = []
    for d in REGISTRY.values():
        in_tiers = ",".join(n for n, t in tiers.items() if d.id in t.check_ids)
        here = first_unmet(d.requires) or ("runs here" if d.implemented else f"not implemented ({d.issue})")
        rows.append((d.id, in_tiers, ",".join(d.requires) or "-", here, d.description))
    out.table("checks", ["check", "tiers", "needs", "here", "what it proves"], rows, key="checks")
    out.finish()


@app.command()
def env(fmt: str = FormatOpt) -> None:
    """Capture and print the environment a run would record."""
    out = Output(fmt)
    from verify import environment

    e = environment.capture()
    out.set("env", e)
    if not out.is_json:
        import json

        out.console.print_json(json.dumps(e, default=str))
    out.finish()


@bundle_app.command("verify")
def bundle_verify(path: Path = typer.Argument(..., help="bundle directory or .tar.gz"), fmt: str = FormatOpt) -> None:
    """Check hashes, schema and that the verdict follows from the records (0 ok, 1 failed, 2 unreadable)."""
    out = Output(fmt)
    from verify.bundle.verify import verify_bundle

    report = verify_bundle(path)
    out.set("ok", report.ok)
    out.set("exit_code", report.exit_code)
    out.set("verdict", report.verdict)
    out.set("problems", list(report.problems))
    if report.exit_code == EXIT_USAGE:
        out.finish()
        raise UserError(report.problems[0] if report.problems else f"{path}: unreadable bundle")
    if report.ok:
        out.line(f"OK  {path}: bundle verifies, verdict {report.verdict}")
    else:
        out.line(f"FAILED  {path}: {len(report.problems)} problem(s)")
        for p in report.problems:
            out.line(f"  - {p}")
    out.finish()
    if report.exit_code != EXIT_OK:
        raise _Exit(report.exit_code)


@bundle_app.command("show")
def bundle_show(path: Path = typer.Argument(..., help="bundle directory or .tar.gz"), fmt: str = FormatOpt) -> None:
    """Show a bundle's manifest essentials and its check results."""
    out = Output(fmt)
    from verify.bundle.show import show_bundle

    info = show_bundle(path)
    out.set("bundle", info)
    m = info["manifest"]
    out.line(f"{path}: tier {m.get('tier')}, verdict {m.get('verdict')}, state {m.get('state')}, "
             f"started {m.get('started_at')}")
    out.table("results", ["check", "status", "reason", "duration_s"],
              [(r["id"], r["status"], r.get("reason", ""), r.get("duration_s")) for r in info["results"]])
    for reason in m.get("verdict_reasons") or []:
        out.line(f"  - {reason}")
    out.finish()


def main() -> None:
    """Console-script entry: map exceptions to one-line errors and exit codes."""
    try:
        app(standalone_mode=False)
    except _Exit as e:
        sys.exit(e.code)
    except UserError as e:
        Output.error(str(e), e)
        sys.exit(EXIT_USAGE)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.BadParameter, typer.Abort) as e:
        Output.error(str(e), e)
        sys.exit(EXIT_USAGE)
    except SystemExit:
        raise
    except Exception as e:
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(EXIT_USAGE)
        Output.error(f"{type(e).__name__}: {e}", e)
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
