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
image_app = typer.Typer(no_args_is_help=True, help="Build and run the k3-verify container images (Docker engine).")
app.add_typer(image_app, name="image")
keys_app = typer.Typer(no_args_is_help=True, help="Ed25519 keys that sign result bundles (run --sign, bundle sign).")
app.add_typer(keys_app, name="keys")

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
    preset: str = typer.Option("auto", "--preset", help="model with seeded synthetic weights: auto (k3-tiny), a preset or "
                               "preset spec (k3-tiny:experts=8), or a config.json; a directory is read as --checkpoint"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="HF K3 checkpoint directory to verify: read in "
                                           "full and validated before any check; every check and builtin engine "
                                           "uses its tensors; the bundle records its digest (not with --preset)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    seed: int = typer.Option(0, "--seed", help="global seed (recorded in the bundle)"),
    engine: str | None = typer.Option(None, "--engine", help="engine under test for features/evals: builtin:reference | "
                                      "builtin:fast | openai:URL | vllm | vllm+latency_specialized (default "
                                      "builtin:fast on an sm_90 GPU, else builtin:reference)"),
    baseline_engine: str | None = typer.Option(None, "--baseline-engine",
                                               help="engine it is compared against (default builtin:reference)"),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="HF model directory a `vllm` / "
                                          "`vllm+latency_specialized` engine launches vLLM on (its log and launch "
                                          "config go to the bundle's logs/)"),
    require_complete: bool = typer.Option(False, "--require-complete", help="exit 1 unless the verdict is pass"),
    resume: bool = typer.Option(False, "--resume", help="continue the unfinished bundle at --output: run only "
                                "the checks without a result, as a new part (same tier, GPU model and source)"),
    time_limit: float | None = typer.Option(None, "--time-limit", help="seconds: start no check whose budget "
                                            "would end past this (the bundle ends interrupted; --resume goes on)"),
    sign: Path | None = typer.Option(None, "--sign", help="Ed25519 private key (keys new): sign the finished "
                                     "bundle (attestation.dsse.json, in the directory and the .tar.gz)"),
    only: str | None = typer.Option(None, "--only", help="comma-separated check ids of the tier: plan and run "
                                    "only those (in tier order; recorded in the bundle)"),
    budget: list[str] = typer.Option([], "--budget", help="CHECK=SECONDS: that check's budget instead of the "
                                     "tier's (repeatable; recorded in the bundle)"),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="positions (prompt + output) the "
                                             "builtin engines and a launched vllm serve, as vLLM's --max-model-len: "
                                             "the fast path's cache pool is sized by it (default: the served "
                                             "model's max_position_embeddings; vllm, its own default); recorded in "
                                             "the bundle"),
    fmt: str = FormatOpt,
) -> None:
    """Run a tier of checks and write a result bundle (directory + .tar.gz)."""
    out = Output(fmt)
    from verify.model_source import model_argument
    from verify.runner import run_tier

    preset = model_argument(preset, checkpoint)  # --checkpoint DIR: the model is DIR (--preset DIR is its alias)
    if max_model_len is not None and max_model_len < 2:
        raise UserError(f"--max-model-len {max_model_len}: an engine serves at least 2 positions")
    signer = None
    if sign is not None:  # a bad key fails before anything runs
        from verify.bundle.signing import load_signer

        signer = load_signer(sign)
    verdict, root = run_tier(tier, output, preset, device, seed, out, argv=["k3-verify", *sys.argv[1:]],
                             engine=engine, baseline_engine=baseline_engine,
                             model_dir=str(model_dir) if model_dir else None, resume=resume,
                             time_limit_s=time_limit, only=_check_ids(only), budgets=_budgets(budget),
                             max_model_len=max_model_len)
    if signer is not None:
        _sign(root, signer, out)
    out.finish()
    if verdict == "fail" or (require_complete and verdict != "pass"):
        raise _Exit(EXIT_FAILED)


def _check_ids(only: str | None) -> list[str] | None:
    ids = [c.strip() for c in (only or "").split(",") if c.strip()]
    if only is not None and not ids:
        raise UserError("--only needs at least one check id")
    return ids or None


def _budgets(items: list[str]) -> dict[str, float] | None:
    out: dict[str, float] = {}
    for item in items:
        cid, sep, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if not sep or not cid.strip() or not seconds > 0 or seconds == float("inf"):
            raise UserError(f"--budget {item!r}: expected CHECK=SECONDS with a positive number of seconds")
        out[cid.strip()] = seconds
    return out or None


@app.command()
def bench(
    what: str = typer.Argument(..., help="kernels | decode"),
    output: Path | None = typer.Option(None, "--output", "-o", help="bundle directory (default bundles/local/<timestamp>)"),
    sweep: bool = typer.Option(False, "--sweep", help="also time one-factor-at-a-time variations of every heuristic constant (skinny GEMM, KDA)"),
    fmt: str = FormatOpt,
) -> None:
    """Benchmark into a bundle (needs an H100/H200): ``kernels`` (each kernel vs cuBLAS / PyTorch) or
    ``decode`` (perf.decode_sweep: whole decode steps, fast vs standard, batch x context x TP)."""
    out = Output(fmt)
    if what not in ("kernels", "decode"):
        raise UserError(f"unknown bench {what!r}: available: kernels, decode")
    if sweep and what != "kernels":
        raise UserError("--sweep applies to `bench kernels` only")
    from verify.runner import run_tier
    from verify.tiers import TIER_DIR

    tier = TIER_DIR / f"bench-{what}.yaml"
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
    from verify.requirements import first_unmet, missing_imports, missing_tools
    from verify.tiers import BUILTIN_TIERS, load_tier

    tiers = {name: load_tier(name) for name in BUILTIN_TIERS}
    out.table("tiers", ["tier", "checks", "budget", "target", "description"],
              [(t.name, len(t.checks), f"{t.budget_s / 60:.0f} min", f"{t.target_s / 60:.0f} min", t.description)
               for t in tiers.values()], key="tiers")
    rows = []
    for d in REGISTRY.values():
        in_tiers = ",".join(n for n, t in tiers.items() if d.id in t.check_ids)
        here = (first_unmet(d.requires) or "; ".join(missing_imports(d.imports) + missing_tools(d.tools))
                or "runs here")
        rows.append((d.id, in_tiers, ",".join((*d.requires, *d.imports, *d.tools)) or "-", here, d.description))
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
def bundle_verify(path: Path = typer.Argument(..., help="bundle directory or .tar.gz"),
                  repo: Path = typer.Option(None, "--repo", help="git repository: the commit the bundle names must "
                                            "hold the sources that ran"),
                  trusted_keys: Path = typer.Option(None, "--trusted-keys", help="public keys file (keys new writes "
                                                    "one): the bundle must be signed by one of them"),
                  fmt: str = FormatOpt) -> None:
    """Check hashes, schema and that the verdict follows from the records (0 ok, 1 failed, 2 unreadable)."""
    out = Output(fmt)
    from verify.bundle.verify import verify_bundle  # loads the built-in rescorers (perf sweep, evals)

    report = verify_bundle(path, repo=repo, trusted_keys=trusted_keys)
    out.set("ok", report.ok)
    out.set("notes", list(report.notes))
    out.set("exit_code", report.exit_code)
    out.set("verdict", report.verdict)
    out.set("problems", list(report.problems))
    if report.exit_code == EXIT_USAGE:
        out.finish()
        raise UserError(report.problems[0] if report.problems else f"{path}: unreadable bundle")
    if report.summary.get("source"):
        out.set("source", report.summary["source"])
    if report.ok:
        out.line(f"OK  {path}: bundle verifies, verdict {report.verdict}")
        if report.summary.get("source"):
            out.line(f"    {report.summary['source']}")
        for n in report.notes:
            if n == "unsigned" or n.startswith("signed by"):
                out.line(f"    {n}")
    else:
        out.line(f"FAILED  {path}: {len(report.problems)} problem(s)")
        for p in report.problems:
            out.line(f"  - {p}")
    out.finish()
    if report.exit_code != EXIT_OK:
        raise _Exit(report.exit_code)


def _sign(root: Path, signer, out: Output) -> None:
    from verify.bundle.signing import sign_bundle
    from verify.bundle.writer import write_tarball

    st = sign_bundle(root, signer)
    write_tarball(root)
    keyid = st["predicate"]["signer"]["keyid"]
    out.set("signed_by", keyid)
    out.line(f"signed {root} ({len(st['subject'])} files) with key {keyid[:16]}; archive rewritten: {root}.tar.gz")


@bundle_app.command("sign")
def bundle_sign(path: Path = typer.Argument(..., help="a finished bundle directory (its .tar.gz is rewritten)"),
                key: Path = typer.Option(..., "--key", help="Ed25519 private key (keys new)"),
                fmt: str = FormatOpt) -> None:
    """Sign a bundle that verifies: an in-toto statement over every file, in a DSSE envelope."""
    out = Output(fmt)
    from verify.bundle.signing import load_signer

    if not path.is_dir():
        raise UserError(f"{path}: sign the bundle directory (the .tar.gz is written from it)")
    _sign(path, load_signer(key), out)
    out.finish()


@keys_app.command("new")
def keys_new(path: Path = typer.Argument(..., help="private key file to create (0600); PATH.pub.json is its public key"),
             name: str | None = typer.Option(None, "--name", help="who holds it (recorded in the public entry)"),
             fmt: str = FormatOpt) -> None:
    """Make an Ed25519 signing key; give PATH.pub.json to the maintainers (their --trusted-keys file)."""
    out = Output(fmt)
    from verify.bundle.signing import PUBLIC_SUFFIX, new_key

    entry = new_key(path, name)
    out.set("key", entry)
    out.line(f"wrote {path} (private, keep it) and {path}{PUBLIC_SUFFIX} (public): keyid {entry['keyid']}")
    out.finish()


@keys_app.command("show")
def keys_show(path: Path = typer.Argument(..., help="a private key or a .pub.json file"), fmt: str = FormatOpt) -> None:
    """Print a key's public entry (what a --trusted-keys file lists)."""
    out = Output(fmt)
    import json

    from verify.bundle.signing import show_key

    entry = show_key(path)
    out.set("key", entry)
    if not out.is_json:
        out.console.print_json(json.dumps(entry))
    out.finish()


@bundle_app.command("audit")
def bundle_audit(path: Path = typer.Argument(..., help="bundle directory or .tar.gz"),
                 output: Path = typer.Option(..., "--output", "-o", help="the audit bundle directory to write"),
                 sample: int = typer.Option(20, "--sample", help="records compared per check (a seeded sample)"),
                 checks: str | None = typer.Option(None, "--checks", help="comma-separated check ids (default: all)"),
                 seed: int = typer.Option(0, "--seed", help="seed of the sample"),
                 timing_tol: float = typer.Option(0.25, "--timing-tol", help="relative tolerance for timings"),
                 device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
                 rerun: Path | None = typer.Option(None, "--rerun", help="compare with this re-run bundle (e.g. an "
                                                   "earlier audit's artifacts/audit.records/rerun.tar.gz) instead of executing"),
                 fmt: str = FormatOpt) -> None:
    """Re-execute the bundle's checks here and compare a seeded sample of its records (0 agree, 1 a record
    disagrees, 2 a check cannot run here); writes an audit bundle. With ``--rerun`` the comparison is redone
    against a re-run made before (on its machine), nothing executed."""
    out = Output(fmt)
    from verify.bundle.audit import audit_bundle, counted

    if sample < 1:
        raise UserError("--sample must be at least 1")
    rep = audit_bundle(path, output, sample=sample, checks=[c for c in (checks or "").split(",") if c] or None,
                       seed=seed, timing_tol=timing_tol, device=device, out=out, rerun=rerun)
    out.set("audit", {"exit_code": rep.exit_code, "audited": list(rep.audited), "bundle": str(rep.audit_root),
                      "disagreements": list(rep.disagreements), "cannot_run": list(rep.cannot_run),
                      "notes": list(rep.notes)})
    head = {0: "AGREES", 1: "DISAGREES", 2: "INCOMPLETE"}[rep.exit_code]
    real = counted(rep.disagreements)
    info = len(rep.disagreements) - len(real)
    out.line(f"{head}  {path}: {len(rep.audited)} check(s) {'compared' if rerun else 're-executed'}, "
             f"{len(real)} disagreement(s)" + (f" (+{info} informational: timings of information-only records)"
                                              if info else "") + f"; audit bundle {rep.audit_root}")
    for d in (real + [d for d in rep.disagreements if d.get("informational")])[:20]:
        out.line(f"  - {'(informational) ' if d.get('informational') else ''}{d['check']} record {d.get('index')}: "
                 f"{d.get('field')} {d.get('why')} "
                 f"(bundle {str(d.get('bundle'))[:60]!s}, re-run {str(d.get('rerun'))[:60]!s})")
    for c in rep.cannot_run:
        out.line(f"  - {c['check']}: {c['why']}")
    for n in rep.notes:
        out.line(f"  note: {n}")
    out.finish()
    if rep.exit_code:
        raise _Exit(rep.exit_code)


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


@bundle_app.command("compare")
def bundle_compare(
    a: Path = typer.Argument(..., help="bundle A (before): directory or .tar.gz"),
    b: Path = typer.Argument(..., help="bundle B (after): directory or .tar.gz"),
    noise_floor: float = typer.Option(0.02, "--noise-floor", help="smallest step-time change that counts (fraction)"),
    noise_floor_no_spread: float = typer.Option(0.05, "--noise-floor-no-spread",
                                                help="the same when a side recorded no spread (one median)"),
    changes_only: bool = typer.Option(False, "--changes-only", help="list only changed checks and perf rows"),
    fmt: str = FormatOpt,
) -> None:
    """Check status changes, perf deltas against the noise, eval deltas; a verdict (bundles/COMPARE.md).

    Exit 0 improved or within noise, 1 regressed, 2 a bundle is unreadable."""
    out = Output(fmt)
    from verify.bundle.compare import compare_bundles, render_compare
    from verify.bundle.schema import BundleError

    try:
        report = compare_bundles(a, b, noise_floor=noise_floor, noise_floor_no_spread=noise_floor_no_spread)
    except (BundleError, ValueError) as e:
        raise UserError(str(e)) from e
    out.set("compare", report.to_dict())
    if not out.is_json:
        out.console.print(render_compare(report, show_all=not changes_only), markup=False, end="")
    out.finish()
    if report.exit_code != EXIT_OK:
        raise _Exit(report.exit_code)


@bundle_app.command("render")
def bundle_render(
    path: Path = typer.Argument(..., help="bundle directory or .tar.gz"),
    output: Path | None = typer.Option(None, "--output", "-o", help="output directory (default <bundle>-render)"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="draw the PNG plots (needs matplotlib)"),
    fmt: str = FormatOpt,
) -> None:
    """Write summary.md (<= 65,536 characters, for a PR comment) and PNG plots of a bundle."""
    out = Output(fmt)
    from verify.bundle.plots import PlotError
    from verify.bundle.render import render_bundle
    from verify.bundle.schema import BundleError

    name = path.name[:-7] if path.name.endswith(".tar.gz") else path.name
    dest = output or path.with_name(f"{name}-render")
    try:
        res = render_bundle(path, dest, plots=plots)
    except (BundleError, PlotError) as e:
        raise UserError(str(e)) from e
    out.set("summary", str(res.summary))
    out.set("chars", res.chars)
    out.set("truncated", res.truncated)
    out.set("plots", [str(p) for p in res.plots])
    out.set("skipped", list(res.skipped))
    out.line(f"wrote {res.summary} ({res.chars:,} characters{', details truncated' if res.truncated else ''})")
    for p in res.plots:
        out.line(f"wrote {p}")
    for s in res.skipped:
        out.line(f"skipped {s}")
    out.finish()


@bundle_app.command("attach")
def bundle_attach(
    path: Path = typer.Argument(..., help="bundle directory or .tar.gz"),
    pr: int = typer.Option(..., "--pr", help="pull request number"),
    repo: str | None = typer.Option(None, "--repo", "-R", help="OWNER/REPO (default: gh's, from the current directory)"),
    tag: str = typer.Option("k3-verify-bundles", "--tag", help="release that stores archives and plots"),
    work_dir: Path | None = typer.Option(None, "--work-dir", help="where to stage the comment and assets "
                                                                  "(default <bundle>-attach)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the gh commands and the comment body; run nothing"),
    fmt: str = FormatOpt,
) -> None:
    """Post the bundle's summary as a PR comment and upload its archive and plots (a release) with gh."""
    out = Output(fmt)
    from verify.bundle import attach
    from verify.bundle.plots import PlotError
    from verify.bundle.schema import BundleError

    url_repo = None
    if not dry_run:
        attach.require_gh()
        url_repo = None if repo else attach.resolve_repo()
    try:
        plan = attach.plan_attach(path, pr, repo=repo, url_repo=url_repo, tag=tag, work_dir=work_dir)
    except (BundleError, PlotError, ValueError) as e:
        raise UserError(str(e)) from e
    out.set("dry_run", dry_run)
    out.set("commands", plan.commands())
    out.set("body_file", str(plan.body_file))
    out.set("body", plan.body)
    if dry_run:
        if not out.is_json:
            note = "" if plan.url_repo else f"# links name {attach.REPO_PLACEHOLDER}: pass --repo for the exact URLs\n"
            out.console.print(f"# dry run: nothing is run or posted\n{note}{plan.script()}"
                              f"# comment body ({plan.body_file}, {len(plan.body):,} characters):\n{plan.body}",
                              markup=False, end="")
        out.finish()
        return
    try:
        done = attach.execute(plan)
    except attach.AttachError as e:
        out.finish()
        Output.error(str(e))
        raise _Exit(EXIT_FAILED) from e
    out.set("done", done)
    out.line(f"posted the summary of {path} on PR #{pr}; archive {plan.archive.name} on release {tag}")
    out.finish()


@image_app.command("build")
def image_build(
    kind: str = typer.Option("cpu", "--kind", help="cpu (images/Dockerfile.cpu) or gpu (images/Dockerfile)"),
    tag: str | None = typer.Option(None, "--tag", "-t", help="image tag (default k3-verify:<kind>)"),
    base: str | None = typer.Option(None, "--base", help="BASE_IMAGE (default: the Dockerfile's pinned one)"),
    extras: str | None = typer.Option(None, "--extras", help="k3-verify extras to install (gpu: gpu,eval; cpu: report)"),
    extra_requirements: str | None = typer.Option(None, "--extra-requirements",
                                                  help="more requirements, space-separated (gpu: pytest>=8.0)"),
    python: str | None = typer.Option(None, "--python", help="the base's Python (gpu: python3; cpu: python3.11)"),
    wheelhouse: Path | None = typer.Option(None, "--wheelhouse", help="keep staged wheels here between builds"),
    stage_only: Path | None = typer.Option(None, "--stage-only", help="only stage the build context into this dir"),
    pull: bool = typer.Option(True, "--pull/--no-pull", help="pull the base image when it is not in the engine"),
    no_cache: bool = typer.Option(False, "--no-cache", help="do not reuse layers from earlier builds"),
    docker_host: str | None = typer.Option(None, "--docker-host", help="engine URL (default $DOCKER_HOST)"),
    fmt: str = FormatOpt,
) -> None:
    """Stage wheels + sources on the host, then build the image offline with streamed logs."""
    out = Output(fmt)
    from verify import images

    req = images.BuildRequest(kind=kind, tag=tag, base=base, extras=extras, extra_requirements=extra_requirements,
                              python=python, wheelhouse=wheelhouse, stage_only=stage_only, pull=pull,
                              nocache=no_cache, docker_host=docker_host)
    try:
        result = images.build(req, out)
    except images.ImageError as e:
        out.finish()
        Output.error(str(e), e)
        raise _Exit(EXIT_FAILED) from e
    out.set("image", result)
    if result.get("staged_only"):
        out.line(f"staged {result['context']} (build args in build-args.json); nothing built")
    else:
        out.line(f"built {result['tag']}  {result['image_id']}  base {result['base_image']}")
    out.finish()


@image_app.command("run")
def image_run(
    args: list[str] | None = typer.Argument(None, help="k3-verify arguments inside the container, after -- "
                                                       "(default: run --tier smoke)"),
    tag: str = typer.Option("k3-verify:gpu", "--tag", "-t", help="image to run"),
    bundles: Path = typer.Option(Path("bundles"), "--bundles", help="host directory mounted at /bundles"),
    gpus: str = typer.Option("auto", "--gpus", help="auto (all GPUs when the host has one) | all | none"),
    network: str = typer.Option("none", "--network", help="container network (none: offline)"),
    user: str | None = typer.Option(None, "--user", help="uid:gid inside (default: yours, so you own the bundles)"),
    env: list[str] | None = typer.Option(None, "--env", "-e", help="NAME=VALUE for the container (repeatable)"),
    shm_size: str = typer.Option("8g", "--shm-size", help="/dev/shm size (torch / NCCL need more than 64m)"),
    keep: bool = typer.Option(False, "--keep", help="keep the stopped container"),
    docker_host: str | None = typer.Option(None, "--docker-host", help="engine URL (default $DOCKER_HOST)"),
    fmt: str = FormatOpt,
) -> None:
    """Run k3-verify in an image with the bundle directory mounted; exit with the container's code."""
    out = Output(fmt)
    from verify import images

    req = images.RunRequest(tag=tag, args=list(args or ["run", "--tier", "smoke"]), bundles=bundles, gpus=gpus,
                            network=network, user=user, env=list(env or []), shm_size=shm_size, keep=keep,
                            docker_host=docker_host)
    try:
        result = images.run(req, out)
    except images.ImageError as e:
        out.finish()
        Output.error(str(e), e)
        raise _Exit(EXIT_FAILED) from e
    out.set("run", result)
    for b in result["bundles"]:
        out.line(f"bundle: {b}")
    if result["error"]:
        out.line(f"engine: {result['error']}")
    out.finish()
    if result["exit_code"] != EXIT_OK:
        raise _Exit(result["exit_code"])


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

        from verify.bundle.schema import BundleError

        if isinstance(e, BundleError):  # every command reads an unreadable bundle the same way
            Output.error(str(e), e)
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(EXIT_USAGE)
        Output.error(f"{type(e).__name__}: {e}", e)
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
