"""Engines: what serves the model a feature check or an eval talks to (``base.Engine``).

``build_engine(spec, **opts)`` turns a spec string into an engine:

| spec | engine |
|---|---|
| ``builtin:reference`` | k3_fastpath's generator on the PyTorch reference (the standard path), in process |
| ``builtin:fast`` | the same generator on the fast-path executor (an sm_90 GPU with the CuTe DSL) |
| ``builtin:<path>+spec=ngram:K`` | either, with speculative decoding (``K`` drafts per verify step) |
| ``builtin:fast+defect=NAME`` | the fast path with a planted numerics defect (``verify/defects.py``) |
| ``openai:<base_url>`` | an OpenAI-compatible server that is already running (``openai.OpenAIEngine``) |
| ``vllm`` / ``vllm+latency_specialized`` | ``vllm serve`` launched by the suite, without / with the switch |
|  | (``vllm_server.launch_vllm``; needs ``model_dir``) |

``opts`` are the run's settings (``preset``, ``device``, ``seed``, ``max_model_len``, ``model``,
``tokenizer_dir``, ...); each engine takes the ones its constructor names and ignores the rest, so the
runner can hand every engine the same options.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from verify.engines.base import (
    Completion,
    Constraint,
    ContextLimitError,
    Engine,
    EngineError,
    SamplingParams,
)

__all__ = ["Completion", "Constraint", "ContextLimitError", "Engine", "EngineError", "SamplingParams",
           "SPEC_HELP", "build_engine", "default_engine_spec", "describe_spec", "parse_spec", "split_builtin",
           "with_speculation"]

SPEC_HELP = ("builtin:reference | builtin:fast | builtin:<path>+spec=ngram:K | openai:<base_url> | vllm | "
             "vllm+latency_specialized")
# builtin:<path>[+defect=NAME][+spec=METHOD:K]: a planted defect (a name of verify.defects.DEFECTS, fast path
# only: the suite's sensitivity runs) and speculative decoding (k3_fastpath.runtime.spec_decode.SpecConfig)
BUILTIN_OPTIONS = ("defect", "spec")
BUILTIN_PATHS = ("reference", "fast")


def split_builtin(arg: str) -> tuple[str, dict[str, str]]:
    """A builtin engine's argument -> (path, options): ``fast+defect=X+spec=ngram:3`` -> ("fast", {"defect":
    "X", "spec": "ngram:3"}). ``EngineError`` for an unknown path or option, a repeated or empty one, a
    defect on the reference path or an unknown defect, or a speculative config ``SpecConfig`` refuses."""
    path, *items = arg.split("+")
    if path not in BUILTIN_PATHS:
        raise EngineError(f"unknown engine builtin:{arg}: the builtin path must be one of "
                          f"{', '.join(BUILTIN_PATHS)}, got {path!r}; engines: {SPEC_HELP}")
    opts: dict[str, str] = {}
    for item in items:
        key, eq, val = item.partition("=")
        if key not in BUILTIN_OPTIONS or not eq or not val or key in opts:
            raise EngineError(f"builtin:{arg}: option {item!r} is not one of "
                              f"{', '.join(o + '=VALUE' for o in BUILTIN_OPTIONS)} (each at most once)")
        opts[key] = val
    if "defect" in opts:
        from verify.defects import DEFECTS

        if path != "fast":
            raise EngineError(f"builtin:{arg}: a planted defect goes into the fast path (builtin:fast+defect=NAME)")
        if opts["defect"] not in DEFECTS:
            raise EngineError(f"engine builtin:{arg}: unknown defect {opts['defect']!r}; defects: {', '.join(DEFECTS)}")
    if "spec" in opts:
        from k3_fastpath.runtime.spec_decode import SpecConfig

        try:
            SpecConfig.parse(opts["spec"])
        except ValueError as e:
            raise EngineError(f"builtin:{arg}: {e}") from None
    return path, opts


def with_speculation(spec: str, speculative: str) -> str:
    """The engine spec ``spec`` under speculative decoding ``speculative`` (``ngram:3``): a builtin engine with
    ``+spec=``; any other engine serves what it was launched with (``EngineError``)."""
    kind, arg = parse_spec(spec)
    if kind != "builtin":
        raise EngineError(f"{spec} decodes as it was launched: start the server with its own speculative config "
                          "(vLLM: --speculative-config) and pass it as openai:URL; speculative variants are built "
                          "for builtin engines")
    path, opts = split_builtin(arg)
    if opts.get("spec", speculative) != speculative:
        raise EngineError(f"{spec} already decodes with +spec={opts['spec']}, not {speculative}")
    opts["spec"] = speculative
    out = f"builtin:{path}" + "".join(f"+{k}={opts[k]}" for k in BUILTIN_OPTIONS if k in opts)
    parse_spec(out)
    return out


BASELINE_DEFAULT = "builtin:reference"


def parse_spec(spec: str) -> tuple[str, str]:
    """``spec`` -> (kind, argument): ("builtin", "fast"), ("openai", url), ("vllm", "" | "latency_specialized").
    Raises ``EngineError`` with the accepted forms for anything else."""
    s = (spec or "").strip()
    if s.startswith("builtin:"):
        arg = s[len("builtin:"):]
        split_builtin(arg)
        return "builtin", arg
    if s.startswith("openai:"):
        url = s[len("openai:"):]
        if not url.startswith(("http://", "https://")):
            raise EngineError(f"engine {spec!r}: openai: needs a base URL, e.g. openai:http://127.0.0.1:8000/v1")
        return "openai", url
    if s == "vllm":
        return "vllm", ""
    if s == "vllm+latency_specialized":
        return "vllm", "latency_specialized"
    raise EngineError(f"unknown engine {spec!r}; use {SPEC_HELP}")


def default_engine_spec(device: str) -> str:
    """The engine under test when none is named: the fast path on an sm_90 GPU, else the reference."""
    from verify.engines.builtin import fast_path_unavailable_reason

    if str(device).startswith("cuda") and fast_path_unavailable_reason(device) is None:
        return "builtin:fast"
    return "builtin:reference"


def _accepted(fn: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``opts`` that ``fn`` takes (all of them if it takes ``**kwargs``); None values dropped."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in opts.items() if v is not None}
    return {k: v for k, v in opts.items() if k in params and v is not None}


def build_engine(spec: str, **opts: Any) -> Engine:
    """Build (and for ``vllm`` launch) the engine ``spec`` names; ``EngineError`` says why it cannot."""
    kind, arg = parse_spec(spec)
    if kind == "builtin":
        from verify.engines.builtin import BuiltinEngine

        return BuiltinEngine(path=arg, **_accepted(BuiltinEngine.__init__, {k: v for k, v in opts.items()
                                                                           if k != "path"}))
    if kind == "openai":
        from verify.engines.openai import OpenAIEngine

        return OpenAIEngine(base_url=arg, **_accepted(OpenAIEngine.__init__,
                                                      {k: v for k, v in opts.items() if k != "base_url"}))
    from verify.engines.vllm_server import launch_vllm as launch

    rest = {k: v for k, v in opts.items() if k != "latency_specialized"}
    return launch(latency_specialized=(arg == "latency_specialized"), **_accepted(launch, rest))


def describe_spec(spec: str, role: str, **opts: Any) -> dict[str, Any]:
    """What the manifest says about an engine before it is built (engines are built on first use)."""
    kind, arg = parse_spec(spec)
    d: dict[str, Any] = {"role": role, "spec": spec, "kind": kind}
    if kind == "builtin":
        d["path"], options = split_builtin(arg)
        if "defect" in options:
            d["planted_defect"] = options["defect"]
        if "spec" in options:
            d["speculative"] = options["spec"]
    elif kind == "openai":
        d["base_url"] = arg
    else:
        d["decode_backend"] = "latency_specialized" if arg else "standard"
    d["options"] = {k: v for k, v in sorted(opts.items()) if isinstance(v, (str, int, float, bool))}
    return d


class EnginePool:
    """The engines of one run, by role (``engine_under_test``, ``baseline``): each built on first use, once,
    and closed by ``close()`` at the end of the run. Two roles with the same spec share one engine (on a
    CPU both are ``builtin:reference``). A failed build is remembered and re-raised, never retried (a
    vLLM launch that failed once is not launched again for every check)."""

    ROLES = ("engine_under_test", "baseline")

    def __init__(self, specs: dict[str, str], opts: dict[str, Any] | None = None, log: Any = None) -> None:
        for role, spec in specs.items():
            if role not in self.ROLES:
                raise ValueError(f"unknown engine role {role!r}; roles: {', '.join(self.ROLES)}")
            parse_spec(spec)
        self.specs = dict(specs)
        self.opts = dict(opts or {})
        self.log = log or (lambda text: None)
        self._by_spec: dict[str, Engine] = {}
        self._failed: dict[str, EngineError] = {}
        self.built: dict[str, dict[str, Any]] = {}  # role (or "role @ digest") -> describe() at build time
        self._checkpoints: dict[str, Any] = {}  # resolved path -> ModelSource read by ``checkpoint``

    def manifest_entries(self) -> list[dict[str, Any]]:
        return [describe_spec(spec, role, **self.opts) for role, spec in self.specs.items()]

    def checkpoint(self, path: str | Path) -> Any:
        """The checkpoint at ``path`` as a ``verify.model_source.ModelSource``, read and validated once per
        run (every eval scoring it shares the tensors and the engines built on them)."""
        from verify.model_source import read_checkpoint

        key = str(Path(path).expanduser().resolve())
        if key not in self._checkpoints:
            self._checkpoints[key] = read_checkpoint(key)
        return self._checkpoints[key]

    def get(self, role: str, model_source: Any = None, speculative: str | None = None) -> Engine:
        """The engine of ``role``; with ``model_source`` (a checkpoint ``verify.model_source.ModelSource``
        other than the run's, e.g. the sentinel the evals score) the same spec serving that checkpoint,
        built once per spec and checkpoint digest. Only builtin engines take another model: a server
        serves what it was launched on. With ``speculative`` (``ngram:3``, ``synthetic:3:p=0.8``): the same
        spec under speculative decoding (``with_speculation``), built once per spec."""
        if role not in self.specs:
            raise EngineError(f"this run has no {role} engine")
        spec, opts = self.specs[role], self.opts
        if speculative:
            spec = with_speculation(spec, speculative)
        if model_source is not None:
            if parse_spec(spec)[0] != "builtin":
                raise EngineError(f"{spec} serves the model it was launched on, not {model_source.name} "
                                  f"({model_source.path}): score that checkpoint with builtin engines, or serve it "
                                  "and pass it as the run's --checkpoint")
            opts = {**opts, "preset": model_source.preset, "model_source": model_source}
        tag = "" if model_source is None else f" @ {model_source.digest}"
        key = spec + tag
        if key in self._failed:
            raise self._failed[key]
        if key not in self._by_spec:
            self.log(f"building engine {key} ({role})")
            try:
                self._by_spec[key] = build_engine(spec, **opts)
            except EngineError as e:
                self._failed[key] = e
                raise
            except Exception as e:
                err = EngineError(f"engine {spec}: {type(e).__name__}: {e}")
                self._failed[key] = err
                raise err from e
        engine = self._by_spec[key]
        built_key = role + tag
        if built_key not in self.built:
            self.built[built_key] = engine.describe()
            self.log(f"engine {built_key}: {self.built[built_key]}")
        return engine

    def close(self) -> None:
        """Close every engine built (each once), keeping the first error to raise after all are closed."""
        first: Exception | None = None
        for spec, engine in list(self._by_spec.items()):
            try:
                engine.close()
            except Exception as e:  # keep closing the others
                self.log(f"closing engine {spec} failed: {type(e).__name__}: {e}")
                first = first or e
        self._by_spec.clear()
        self._checkpoints.clear()
        if first is not None:
            raise first
