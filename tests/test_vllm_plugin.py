"""The vLLM plugin (k3_fastpath.integrations.vllm): what can be checked without a GPU.

- the decision table (off / ignored / route) and its trace lines, from config objects;
- registration: vLLM's own plugin loader finds the entry point and puts the K3 architecture in its
  ModelRegistry as our lazy "module:Class" (a subclass of vLLM's K3 model); VLLM_PLUGINS without
  k3_fastpath leaves vLLM's registry and model loader untouched;
- config plumbing through vLLM's real ``initialize_model`` with a real ``VllmConfig``: the switch off ->
  vLLM's constructor runs unchanged and nothing route-mode is attached (stood in for: vLLM's K3 model needs
  a GPU); on with a drafter but without ``enforce_eager`` -> a clear ``RoutingUnavailableError`` before vLLM's constructor; on
  with it -> vLLM's model plus the route-mode state (executor limits, token ids requested), and a trace
  line per decision. The served-model end of the plumbing (a real server with ``--additional-config`` on a
  non-K3 model) is in tests/integration/test_vllm_server.py; the routing itself is tests/test_vllm_routing.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3_fastpath.integrations import vllm as plugin
from k3_fastpath.runtime.trace import TRACE_ENV, read_trace

REPO = Path(__file__).resolve().parents[1]
K3 = "KimiK3ForConditionalGeneration"


def _cfg(extra, arch="LlamaForCausalLM"):
    return SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(architectures=[arch]))


def test_entry_point_declared():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == plugin.PLUGIN_NAME]
    assert len(eps) == 1, "k3_fastpath is not installed as a vllm.general_plugins entry point (pip install -e .)"
    assert eps[0].value == "k3_fastpath.integrations.vllm:register"
    assert eps[0].load() is plugin.register


@pytest.mark.parametrize("extra", [None, {}, {"decode_backend": None}, {"decode_backend": "standard"},
                                   {"decode_backend": "Latency_Specialized"}, {"kda_decode_backend": "auto"}])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", K3])
def test_off_changes_nothing_and_writes_nothing(extra, arch, tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))
    d = plugin.on_model_init(_cfg(extra, arch))
    assert d.action == "off" and d.architecture == arch
    assert not (tmp_path / "trace").exists()


def test_non_k3_with_switch_is_ignored_and_traced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))
    arch = f"Model{os.getpid()}ForCausalLM"  # any non-K3 name
    with caplog.at_level("WARNING", logger="vllm.k3_fastpath"):
        d = plugin.on_model_init(_cfg({"decode_backend": "latency_specialized"}, arch))
    expected = f"decode_backend=latency_specialized ignored: model {arch} is not Kimi K3"
    assert d.action == "ignored" and d.message == expected
    assert expected in caplog.text
    meta, steps = read_trace(tmp_path / "trace")
    assert steps == [] and len(meta) == 1
    assert meta[0]["source"] == "vllm_plugin" and meta[0]["message"] == expected and meta[0]["pid"] == os.getpid()


def test_k3_with_switch_routes_to_the_executor(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    d = plugin.decide(_cfg({"decode_backend": "latency_specialized"}, K3))
    assert d.action == "route" and "DecodeExecutor" in d.message and "eligible decode steps" in d.message
    assert plugin.write_trace(d) is None  # no K3_FASTPATH_TRACE: nothing written


def test_additional_config_object_with_get():
    class Extra:  # vLLM also allows a SupportsHash object for additional_config
        def get(self, key, default=None):
            return {"decode_backend": "latency_specialized"}.get(key, default)

    assert plugin.decode_backend_of(SimpleNamespace(additional_config=Extra())) == "latency_specialized"
    assert plugin.decode_backend_of(SimpleNamespace()) is None


# --------------------------------------------------------------------------- through vLLM itself (subprocess)
REGISTRY_PROBE = textwrap.dedent("""
    import json
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    m = ModelRegistry.models["KimiK3ForConditionalGeneration"]
    print("RESULT", json.dumps({
        "module": m.module_name, "cls": m.class_name,
        "supported": "KimiK3ForConditionalGeneration" in ModelRegistry.get_supported_archs(),
        "hook": bool(getattr(BaseModelLoader.create_model, "_k3_fastpath_decode_backend_hook", False))}))
""")

# runs after REGISTRY_PROBE in the same interpreter (one vLLM import for both)
PLUMBING_PROBE = textwrap.dedent("""
    import torch
    from vllm.config import VllmConfig
    from vllm.model_executor.model_loader.utils import initialize_model
    import vllm.models.kimi_k3 as builtin
    cls = ModelRegistry._try_load_model_cls("KimiK3ForConditionalGeneration")
    out = {"cls": f"{cls.__module__}:{cls.__name__}",
           "subclass": issubclass(cls, builtin.KimiK3ForConditionalGeneration), "off": [], "on": None}
    calls = []
    def stand_in(self, vllm_config, prefix=""):  # vLLM's K3 constructor needs a GPU and a checkpoint
        torch.nn.Module.__init__(self)
        calls.append({"additional_config": vllm_config.additional_config, "prefix": prefix})
    builtin.KimiK3ForConditionalGeneration.__init__ = stand_in
    for extra in ({}, {"decode_backend": "standard"}):
        model = initialize_model(vllm_config=VllmConfig(additional_config=extra), model_class=cls, prefix="lm")
        out["off"].append({"type": type(model).__name__, "call": calls[-1], "fast": model._k3_fast is not None,
                           "raw_tokens": model.requires_raw_input_tokens})
    out["on"] = []
    from types import SimpleNamespace
    spec = SimpleNamespace(method="ngram", num_speculative_tokens=3)  # verify steps: the executor's pool, eager
    for mc, sc in ((None, spec), (SimpleNamespace(enforce_eager=True, max_model_len=2048, architectures=[cls.__name__]),
                                  None)):
        cfg = VllmConfig(additional_config={"decode_backend": "latency_specialized", "fastpath_max_batch": 8})
        cfg.speculative_config = sc
        if mc is not None:
            cfg.model_config = mc
        n = len(calls)
        try:
            model = initialize_model(vllm_config=cfg, model_class=cls, prefix="lm")
            fast = model._k3_fast
            out["on"].append({"base_called": len(calls) > n, "max_batch": fast.max_batch, "max_len": fast.max_len,
                              "raw_tokens": model.requires_raw_input_tokens, "executor": fast.executor})
        except Exception as e:
            out["on"].append({"error": type(e).__name__, "message": str(e), "base_called": len(calls) > n})
    print("PLUMBING", json.dumps(out))
""")


def _probe(code: str, env_extra: dict[str, str]) -> dict[str, dict]:
    """Run ``code`` in a fresh interpreter (vLLM loads plugins once per process); its ``TAG {json}`` lines."""
    pytest.importorskip("vllm", reason="needs vLLM (scripts/bootstrap --vllm)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", **env_extra}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    found = {}
    for line in p.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in ("RESULT", "PLUMBING"):
            found[tag] = json.loads(rest)
    assert p.returncode == 0 and found, f"probe failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return found


@pytest.fixture(scope="module")
def with_plugin(tmp_path_factory):
    trace = tmp_path_factory.mktemp("plugin-trace")
    return _probe(REGISTRY_PROBE + PLUMBING_PROBE, {TRACE_ENV: str(trace)}), trace


@pytest.mark.slow
def test_vllm_plugin_loader_registers_the_k3_architecture(with_plugin):
    got = with_plugin[0]["RESULT"]
    assert got == {"module": "k3_fastpath.integrations.vllm_model", "cls": K3, "supported": True, "hook": True}


@pytest.mark.slow
def test_vllm_plugins_exclusion_leaves_vllm_untouched():
    # another plugin named: k3_fastpath is not loaded, the K3 architecture stays vLLM's own, no loader hook
    got = _probe(REGISTRY_PROBE, {"VLLM_PLUGINS": "lora_filesystem_resolver"})["RESULT"]
    assert got == {"module": plugin.VLLM_K3_MODULE, "cls": K3, "supported": True, "hook": False}


@pytest.mark.slow
def test_additional_config_reaches_the_model_class_through_vllm(with_plugin):
    found, trace = with_plugin
    got = found["PLUMBING"]
    assert got["cls"] == f"k3_fastpath.integrations.vllm_model:{K3}" and got["subclass"]
    # off: exactly vLLM's constructor, with vLLM's own arguments, nothing of route mode attached
    assert [o["call"] for o in got["off"]] == [{"additional_config": {}, "prefix": "lm"},
                                              {"additional_config": {"decode_backend": "standard"}, "prefix": "lm"}]
    assert all(o["type"] == K3 and not o["fast"] and not o["raw_tokens"] for o in got["off"])
    # on with a drafter, without enforce_eager: refused before vLLM's constructor runs, with the one-line reason
    refused, built = got["on"]
    assert refused["error"] == "RoutingUnavailableError" and not refused["base_called"]
    assert "needs enforce_eager" in refused["message"] and "\n" not in refused["message"]
    # on with enforce_eager: vLLM's model, plus route mode (the executor is built by load_weights)
    assert built == {"base_called": True, "max_batch": 8, "max_len": 2048, "raw_tokens": True, "executor": None}
    meta, _ = read_trace(trace)
    assert [(m["action"], m["architecture"]) for m in meta] == [("route", K3), ("route", K3)]
