"""A real vLLM server (the CPU build) serving a tiny locally made Llama, driven through the ``openai`` engine.

One server for the whole module (session fixture; started by ``VLLMServer``, stopped by PID at the end,
and checked gone). Against it:
- the engine's contract, each part against an independent reference: next-token distributions and greedy
  tokens against a float32 re-implementation of the Llama forward written here from the weights; seeded
  sampling; logprobs; choice / regex / JSON-schema constraints validated here; chat through the template;
  the context limit (the engine's own rejection, the server's HTTP 400, and the silent cut vLLM does on
  prompt + max_tokens over the limit);
- ``k3-verify run`` with every feature check and a small eval through ``--engine openai:<url>`` into a
  bundle that ``k3-verify bundle verify`` accepts;
- the vLLM plugin on a served model, and the launch path: ``k3-verify run --engine vllm+latency_specialized
  --model-dir DIR`` launches a second server with the switch; on this non-K3 model it is logged and traced
  as "ignored", and at full context it serves bitwise the tokens of the plain server;
- ``perf.serving`` through AIPerf: two runs, each verified, compared with each other and rendered.

About 3-5 minutes on 2 idle cores (two server start-ups of ~20 s, the CLI run ~60 s, two serving runs ~90 s each).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from verify.engines.base import Constraint, ContextLimitError, SamplingParams
from verify.engines.tiny_model import TinyLlamaSpec, make_tiny_llama, tiny_llama_weights

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/bootstrap --vllm)"),
]

REPO = Path(__file__).resolve().parents[2]
SPEC = TinyLlamaSpec()
MAX_MODEL_LEN = 512
TIER = REPO / "verify" / "tiers" / "vllm-cpu.yaml"
# float32 serving (the launcher's CPU default) vs the float32 reference: summation order only
LOGPROB_TOL = 1e-3


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "tiny", SPEC, seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model, tmp_path_factory):
    from verify.engines.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm-log") / "vllm-server.log"
    server = VLLMServer(tiny_model, "tiny", max_model_len=MAX_MODEL_LEN, log_path=log, startup_timeout_s=600)
    server.start()
    yield server
    pid = server.pid
    server.stop()
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid), f"vLLM server pid {pid} still running after stop()"


@pytest.fixture(scope="session")
def engine(vllm_server, tiny_model):
    from verify.engines.openai import OpenAIEngine

    return OpenAIEngine(vllm_server.base_url + "/v1", model="tiny", tokenizer_dir=tiny_model)


@pytest.fixture
def rng():
    s = random.randrange(2**31)
    r = random.Random(s)
    r.seed_value = s  # reported in failure messages
    return r


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, SPEC.vocab_size) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- reference
class ReferenceLlama:
    """The HF Llama forward in float32, written from the weights (independent of vLLM and transformers)."""

    def __init__(self, spec: TinyLlamaSpec, seed: int = 0) -> None:
        self.s = spec
        self.w = {k: v.float() for k, v in tiny_llama_weights(spec, seed).items()}

    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """log-softmax of the logits at every position, [T, V]."""
        s, w = self.s, self.w
        t, hd, nh, nkv = len(ids), s.head_dim, s.num_attention_heads, s.num_key_value_heads
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        pos = torch.arange(t, dtype=torch.float32)
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)  # [T, hd]
        cos, sin = ang.cos(), ang.sin()

        def rope(v: torch.Tensor) -> torch.Tensor:  # [H, T, hd], rotate_half convention
            v1, v2 = v[..., : hd // 2], v[..., hd // 2:]
            return v * cos + torch.cat([-v2, v1], dim=-1) * sin

        mask = torch.full((t, t), float("-inf")).triu(1)
        for i in range(s.num_hidden_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, dim=-1) @ v
            x = x + att.transpose(0, 1).reshape(t, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            g = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + g @ w[p + "mlp.down_proj.weight"].T
        logits = self._norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T
        return torch.log_softmax(logits.double(), dim=-1)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        ids, out, dists = list(ids), [], []
        for _ in range(n):
            lp = self.logprobs(ids)[-1]
            tok = int(lp.argmax())
            out.append(tok)
            dists.append(lp)
            ids.append(tok)
        return out, dists


@pytest.fixture(scope="session")
def reference():
    return ReferenceLlama(SPEC)


# ---------------------------------------------------------------------------------------------- engine contract
def test_next_token_distribution_matches_reference(engine, reference, rng):
    for n in (1, 7, 40):
        prompt = _prompt(rng, n)
        got = engine.next_token_logprobs(prompt)
        assert sorted(got) == list(range(SPEC.vocab_size))
        total = math.fsum(math.exp(v) for v in got.values())
        assert abs(total - 1.0) < 1e-3, f"seed {rng.seed_value}: sums to {total}"
        ref = reference.logprobs(prompt)[-1]
        served = torch.tensor([got[i] for i in range(SPEC.vocab_size)], dtype=torch.float64)
        err = float((served - ref).abs().max())
        assert err < LOGPROB_TOL, f"seed {rng.seed_value}, prompt {prompt}: max |logprob - reference| = {err}"


def test_greedy_matches_reference_and_repeats(engine, reference, rng):
    prompt = _prompt(rng, 9)
    params = SamplingParams(max_tokens=12, logprobs=5, ignore_eos=True)
    a, b = engine.generate([prompt, prompt], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12 and a.finish_reason == "length"
    assert a.prompt_tokens == 9
    assert engine.generate([prompt], params)[0].token_ids == a.token_ids  # across requests too
    ref_tokens, ref_dists = reference.greedy(prompt, 12)
    # vLLM's model-test rule: identical, or at the first divergence each side's token in the other's top-5
    pos = next((i for i, (x, y) in enumerate(zip(a.token_ids, ref_tokens, strict=True)) if x != y), None)
    if pos is not None:
        ref_top5 = set(torch.topk(ref_dists[pos], 5).indices.tolist())
        assert a.token_ids[pos] in ref_top5 and ref_tokens[pos] in a.logprobs[pos], (
            f"seed {rng.seed_value}: served {a.token_ids} vs reference {ref_tokens}, diverging at {pos}")
    # the served chosen-token logprobs agree with the reference where the sequences agree
    for i in range(pos if pos is not None else 12):
        assert abs(a.logprobs[i][a.token_ids[i]] - float(ref_dists[i][a.token_ids[i]])) < LOGPROB_TOL


def test_logprobs_are_the_raw_distribution(engine, rng):
    """Top-n logprobs of a sampled (T=1.7, top_k=5) completion are the unmodified distribution: equal to
    the full next-token distribution at position 0, and including the chosen token."""
    prompt = _prompt(rng, 6)
    full = engine.next_token_logprobs(prompt)
    c = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=1.7, top_k=5, seed=rng.randrange(1 << 30),
                                                 logprobs=5, ignore_eos=True))[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    top5 = sorted(full, key=full.get, reverse=True)[:5]
    first = c.logprobs[0]
    assert set(top5) <= set(first)
    for t in top5:
        assert abs(first[t] - full[t]) < 1e-4
    for tok, row in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in row


def test_seeded_sampling(engine, rng):
    prompt = _prompt(rng, 5)
    s = rng.randrange(1 << 30)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)
    a = engine.generate([prompt], params)[0].token_ids
    assert engine.generate([prompt], params)[0].token_ids == a
    x, y = engine.generate([prompt, prompt], params)  # the seed is per request: both rows equal
    assert x.token_ids == y.token_ids == a
    others = [engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=s + k,
                                                       ignore_eos=True))[0].token_ids for k in (1, 2)]
    assert all(o != a for o in others), f"seed {rng.seed_value}: other seeds gave the same 24 tokens"


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "count", "code", "ok"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "code": {"type": "string", "pattern": "^[a-z]{2,5}$"},
                         "ok": {"type": "boolean"}}}


def _schema_ok(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"]) and obj["color"] in ("red", "green", "blue")
            and isinstance(obj["count"], int) and not isinstance(obj["count"], bool) and 0 <= obj["count"] <= 999
            and isinstance(obj["code"], str) and re.fullmatch("[a-z]{2,5}", obj["code"]) is not None
            and isinstance(obj["ok"], bool))


@pytest.mark.parametrize("kind,spec,valid", [
    ("choice", ["alpha", "beta", "gamma delta"], lambda t: t in ("alpha", "beta", "gamma delta")),
    ("regex", r"[0-9]{3}-[a-z]{2,4}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) is not None),
    ("json_schema", SCHEMA, _schema_ok),
])
def test_constrained_outputs_validate(engine, rng, kind, spec, valid):
    constraint = Constraint(kind, spec)
    prompts = [_prompt(rng, rng.randrange(2, 12)) for _ in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=1.0, seed=rng.randrange(1 << 30)),
                           constraint)
    outs.append(engine.chat([{"role": "user", "content": "Answer."}], SamplingParams(max_tokens=64), constraint))
    for c in outs:
        assert c.finish_reason == "stop" and valid(c.text), f"seed {rng.seed_value}: {kind} gave {c.text!r}"
    if kind == "json_schema":  # the constraint changes the output: unconstrained, the model writes noise
        free = engine.generate(prompts[:1], SamplingParams(max_tokens=20, seed=1))[0]
        assert not _schema_ok(free.text)


def test_chat_applies_the_template(engine, tiny_model):
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 2?"}]
    c = engine.chat(msgs, SamplingParams(max_tokens=5, logprobs=2))
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert c.prompt_tokens == len(expected)
    assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)


def test_context_limit(engine, vllm_server, rng, tiny_model):
    from verify.engines.openai import OpenAIEngine

    limit = engine.max_model_len
    assert limit == MAX_MODEL_LEN  # read from /v1/models
    full = engine.generate([_prompt(rng, limit - 3)], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(full.token_ids) == 3 and full.prompt_tokens == limit - 3  # exactly full: served whole
    for n, m in ((limit - 3, 4), (limit, 1), (limit + 1, 1)):
        with pytest.raises(ContextLimitError, match=str(limit)):
            engine.generate([_prompt(rng, n)], SamplingParams(max_tokens=m))
    with pytest.raises(ContextLimitError, match=str(limit)):
        engine.chat([{"role": "user", "content": "word " * limit}], SamplingParams(max_tokens=4))
    # an engine told a larger limit skips its own check: then the server's answers are what it sees
    blind = OpenAIEngine(vllm_server.base_url, model="tiny", tokenizer_dir=tiny_model, max_model_len=10 * limit)
    with pytest.raises(ContextLimitError, match="maximum context length is 512"):  # HTTP 400, server's words
        blind.generate([_prompt(rng, limit + 5)], SamplingParams(max_tokens=1))
    with pytest.raises(ContextLimitError, match="finish_reason=length"):  # the server's silent cut, caught
        blind.generate([_prompt(rng, limit - 2)], SamplingParams(max_tokens=8, ignore_eos=True))


# ---------------------------------------------------------------------------------------------- k3-verify run
def test_k3_verify_run_through_the_openai_engine(vllm_server, tmp_path):
    url = f"openai:{vllm_server.base_url}/v1"
    bundle = tmp_path / "bundle"
    cli = [sys.executable, "-m", "verify.cli"]
    run = subprocess.run([*cli, "run", "--tier", str(TIER), "--engine", url, "--baseline-engine", url,
                          "-o", str(bundle), "--require-complete"], cwd=REPO, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, f"k3-verify run exited {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-3000:]}"
    results = [json.loads(line) for line in (bundle / "results.jsonl").read_text().splitlines()]
    assert {r["id"]: r["status"] for r in results} == {
        "features.structured_output": "passed", "features.temperature_sampling": "passed",
        "features.full_context": "passed", "evals.gsm8k": "passed"}
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["verdict"] == "pass"
    assert all(e["spec"] == url for e in manifest["engines"])
    samples = [json.loads(x) for x in (bundle / "records" / "evals.gsm8k.jsonl").read_text().splitlines()]
    assert len([s for s in samples if s.get("type") == "sample" or "doc_hash" in s]) >= 5
    for target in (bundle, Path(f"{bundle}.tar.gz")):
        v = subprocess.run([*cli, "bundle", "verify", str(target)], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
        assert v.returncode == 0, f"bundle verify {target}: {v.stdout}\n{v.stderr}"


# ---------------------------------------------------------------------------------------------- the vLLM plugin
SWITCH_TIER = """\
name: vllm-cpu-switch
description: the decode_backend switch on a non-K3 model changes nothing (full context vs the plain server)
target_s: 1200
checks:
  - id: features.full_context
    budget_s: 600
    params: {max_tokens: 12, top_logprobs: 5}
"""


def test_latency_specialized_on_a_non_k3_model_changes_nothing(vllm_server, tiny_model, tmp_path):
    """``k3-verify run --engine vllm+latency_specialized --model-dir DIR`` launches vLLM with
    ``--additional-config '{"decode_backend": "latency_specialized"}'``, which reaches the plugin in the
    served process: on this Llama it is logged and traced as ignored, and a greedy request filling the
    whole context gives bitwise the tokens and logprobs of the plain server (the baseline). The bundle
    keeps the launched server's log and launch config; the server is stopped when the run ends."""
    from k3_fastpath.runtime.trace import TRACE_ENV, read_trace

    tier = tmp_path / "switch.yaml"
    tier.write_text(SWITCH_TIER)
    trace = tmp_path / "trace"
    bundle = tmp_path / "bundle"
    cli = [sys.executable, "-m", "verify.cli"]
    run = subprocess.run([*cli, "run", "--tier", str(tier), "--engine", "vllm+latency_specialized",
                          "--baseline-engine", f"openai:{vllm_server.base_url}/v1", "--model-dir", str(tiny_model),
                          "-o", str(bundle), "--require-complete"], cwd=REPO, capture_output=True, text=True,
                         timeout=1200, env={**os.environ, TRACE_ENV: str(trace)})
    assert run.returncode == 0, f"k3-verify run exited {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-3000:]}"
    (result,) = [json.loads(line) for line in (bundle / "results.jsonl").read_text().splitlines()]
    m = result["metrics"]
    assert result["status"] == "passed" and m["engine_under_test"] == "openai:vllm+latency_specialized"
    assert m["first_divergence"] is None and m["max_chosen_logprob_diff"] == 0.0 and m["prompt_len"] == 500
    expected = "decode_backend=latency_specialized ignored: model LlamaForCausalLM is not Kimi K3"
    meta, steps = read_trace(trace)
    assert [x["message"] for x in meta] == [expected] and steps == []
    assert expected in (bundle / "logs" / "vllm-tiny+latency_specialized.log").read_text()
    launch = json.loads((bundle / "logs" / "vllm-tiny+latency_specialized.json").read_text())
    assert launch["additional_config"] == {"decode_backend": "latency_specialized"}
    assert json.loads(launch["command"][launch["command"].index("--additional-config") + 1]) == {
        "decode_backend": "latency_specialized"}
    run_log = (bundle / "logs" / "run.log").read_text()
    pid = int(re.search(r"'pid': (\d+)", run_log).group(1))  # the engine's describe(), logged when built
    assert pid != vllm_server.pid
    assert not _running(pid), f"launched vLLM server {pid} still running after the run"
    v = subprocess.run([*cli, "bundle", "verify", str(bundle)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, f"bundle verify: {v.stdout}\n{v.stderr}"


# ---------------------------------------------------------------------------------------------- perf.serving
SERVING_TIER = """\
name: serving-ci
description: perf.serving through AIPerf on the tiny model (plumbing; a 2-core VM's serving noise is large)
target_s: 900
checks:
  - id: perf.serving
    budget_s: 900
    params:
      workloads: [{name: agentic, kind: agentic, sessions: 6, osl: 16, turn_tokens: 32, subagents: 2,
                   subagent_every: 4}]
      concurrency: [2]
      repeats: 2
      min_requests: 20
      # on 2 shared cores the P90 interactivity of one point spread by up to 169% between two repeats
      # (a fixed ISL/OSL point, this launcher's in-process server) and by 8-21% on agentic points: the
      # noise rule is what is tested here, and a server 2x slower still exceeds a 100% floor
      noise_floor: 1.0
      max_burst_share: 1.0  # a 2-core VM coalesces streams (verify/tiers/serving-cpu.yaml): not judged here
      client_workers: 1
      point_timeout_s: 300
"""


@pytest.mark.skipif(__import__("verify.aiperf", fromlist=["x"]).tool_problem() is not None,
                    reason="needs AIPerf 0.13.0 (scripts/bootstrap --serve)")
def test_perf_serving_through_aiperf_verifies_compares_and_renders(vllm_server, tmp_path):
    """Two ``k3-verify run``s of perf.serving against the server: each writes >= 20 per-request records per
    point with P90 interactivity and TTFT, verifies and is re-scored offline; the second compares with the
    first within the noise rule; the render draws the Pareto and CDF plots."""
    from verify.aiperf import SUBAGENT_MARK

    url = f"openai:{vllm_server.base_url}/v1"
    tier = tmp_path / "serving.yaml"
    tier.write_text(SERVING_TIER)
    cli = [sys.executable, "-m", "verify.cli"]
    bundles = []
    for name in ("a", "b"):
        out = tmp_path / name
        run = subprocess.run([*cli, "run", "--tier", str(tier), "--engine", url, "--baseline-engine", url, "-o",
                              str(out), "--require-complete"], cwd=REPO, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"k3-verify run exited {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-3000:]}"
        recs = [json.loads(x) for x in (out / "records" / "perf.serving.jsonl").read_text().splitlines()]
        points = [r for r in recs if r["kind"] == "point"]
        assert len(points) == 4 and all(p["metrics"]["succeeded"] >= 20 for p in points)
        assert all(p["metrics"]["ttft_ms_p50"] > 0 and p["metrics"]["itl_ms_p90"] is not None for p in points)
        assert sum(r["kind"] == "request" for r in recs) >= 80
        assert any(SUBAGENT_MARK in (r.get("session") or "") for r in recs if r["kind"] == "request")  # the fan-out
        v = subprocess.run([*cli, "bundle", "verify", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert v.returncode == 0, v.stdout + v.stderr
        bundles.append(out)
    c = subprocess.run([*cli, "bundle", "compare", str(bundles[0]), str(bundles[1])], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert c.returncode == 0 and "perf.serving: 2 compared" in c.stdout, c.stdout + c.stderr
    r = subprocess.run([*cli, "bundle", "render", str(bundles[1]), "-o", str(tmp_path / "render")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (tmp_path / "render" / "serving_pareto.png").stat().st_size > 0, r.stdout + r.stderr
    assert (tmp_path / "render" / "serving_cdf.png").stat().st_size > 0
