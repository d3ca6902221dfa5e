"""VLLMServer without vLLM: the command and environment it builds, and its process handling (start-up
failure with the log tail, start-up timeout, SIGTERM then SIGKILL of the whole process group), driven by
a fake ``python`` that plays a server. The real server is exercised in tests/integration/."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from verify.engines.base import EngineError
from verify.engines.vllm_server import VLLMServer, engine_name, launch_vllm

FAKE = textwrap.dedent(f"""\
    #!{sys.executable}
    # plays `python -m vllm.entrypoints.openai.api_server ...`; FAKE_MODE picks the behaviour
    import http.server, os, signal, subprocess, sys, time
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    mode = os.environ["FAKE_MODE"]
    print("fake vllm argv:", " ".join(argv), flush=True)
    child = subprocess.Popen(["sleep", "300"])  # a grandchild: stop() must take the whole group
    print("child", child.pid, flush=True)
    if mode == "crash":
        print("ValueError: this fake model cannot be served", flush=True)
        sys.exit(3)
    if mode == "hang":
        time.sleep(300)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


@pytest.fixture
def fake_python(tmp_path):
    p = tmp_path / "fake-python"
    p.write_text(FAKE)
    p.chmod(0o755)
    return str(p)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 777}))
    return d


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _alive(pid: int, settle_s: float = 5.0) -> bool:
    """Still running after ``settle_s`` (signals are delivered asynchronously)."""
    end = time.monotonic() + settle_s
    while _running(pid):
        if time.monotonic() > end:
            return True
        time.sleep(0.05)
    return False


def _child_pid(log: Path) -> int:
    for line in log.read_text().splitlines():
        if line.startswith("child "):
            return int(line.split()[1])
    raise AssertionError(f"no child pid in {log}")


def test_command_and_environment(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the caller's value wins over the default
    s = VLLMServer(model_dir, "tiny", additional_config={"decode_backend": "latency_specialized"},
                   max_model_len=256, port=12345, env={"EXTRA": "1"})
    cmd = s.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = dict(zip(cmd[3::1], cmd[4::1], strict=False))
    assert args["--model"] == str(model_dir) and args["--served-model-name"] == "tiny"
    assert args["--host"] == "127.0.0.1" and args["--port"] == "12345" and args["--max-model-len"] == "256"
    assert args["--max-logprobs"] == "777"  # the vocabulary from config.json: full next-token distributions
    assert json.loads(args["--additional-config"]) == {"decode_backend": "latency_specialized"}
    assert json.loads(args["--structured-outputs-config"]) == {"backend": "xgrammar", "disable_any_whitespace": True}
    env = s.environment()
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1" and env["EXTRA"] == "1"
    assert args["--dtype"] == ("float32" if s.on_cpu else "bfloat16")
    if s.on_cpu:
        assert "--enforce-eager" in cmd
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    plain = VLLMServer(model_dir, "tiny").command()
    assert "--additional-config" not in plain and "--language-model-only" not in plain
    assert engine_name(None) == "openai:vllm"
    assert engine_name({"decode_backend": "latency_specialized"}) == "openai:vllm+latency_specialized"


def test_crash_during_startup_reports_log_tail(model_dir, fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "crash")
    log = tmp_path / "logs" / "server.log"
    s = VLLMServer(model_dir, "tiny", python=fake_python, log_path=log, startup_timeout_s=60)
    with pytest.raises(EngineError, match=r"exited with code 3 during start-up(?s:.*)cannot be served"):
        s.start()
    assert log.is_file() and "fake vllm argv" in log.read_text()
    assert not _alive(s.pid) and not _alive(_child_pid(log))


def test_startup_timeout_stops_the_process_group(model_dir, fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang")
    log = tmp_path / "server.log"
    s = VLLMServer(model_dir, "tiny", python=fake_python, log_path=log, startup_timeout_s=1.5, stop_grace_s=2)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="not healthy after 2s"):
        s.start()
    assert time.monotonic() - t0 < 20
    assert not _alive(s.pid) and not _alive(_child_pid(log))


def test_healthy_then_stopped_by_pid(model_dir, fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "ok")
    log = tmp_path / "server.log"
    with VLLMServer(model_dir, "tiny", python=fake_python, log_path=log, startup_timeout_s=60) as s:
        assert s.alive() and s.startup_s is not None
        pid, child = s.pid, _child_pid(log)
        assert _running(pid) and _running(child)
    assert not s.alive() and not _alive(pid) and not _alive(child)
    assert s.returncode is not None and s.describe()["pid"] == pid  # the PID stays on record


def test_sigterm_ignored_escalates_to_sigkill(model_dir, fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "stubborn")
    log = tmp_path / "server.log"
    s = VLLMServer(model_dir, "tiny", python=fake_python, log_path=log, startup_timeout_s=60, stop_grace_s=1).start()
    pid = s.pid
    t0 = time.monotonic()
    assert s.stop() == -9
    assert time.monotonic() - t0 < 15
    assert not _alive(pid) and not _alive(_child_pid(log))
    assert s.stop() == -9  # idempotent


def test_launch_vllm_input_errors(tmp_path):
    with pytest.raises(EngineError, match="needs a HF model directory"):
        launch_vllm()
    with pytest.raises(EngineError, match="does not exist"):
        launch_vllm(tmp_path / "nope")


def test_a_k3_checkpoint_without_vision_weights_is_served_text_only(tmp_path):
    """vLLM builds a default vision tower for a kimi_k3 config without vision_config; the launcher passes its
    text-only switch, once, and not for a config that has a vision tower or another model."""
    from k3_fastpath.presets import preset
    from k3_fastpath.weights import write_synthetic_checkpoint

    k3 = tmp_path / "k3"
    write_synthetic_checkpoint(preset("k3-tiny").config, k3, seed=0)
    assert VLLMServer(k3, "k3").command().count("--language-model-only") == 1
    assert VLLMServer(k3, "k3", extra_args=["--language-model-only"]).command().count("--language-model-only") == 1
    cfg = json.loads((k3 / "config.json").read_text())
    (k3 / "config.json").write_text(json.dumps({**cfg, "vision_config": {"depth": 27}}))
    assert "--language-model-only" not in VLLMServer(k3, "k3").command()
