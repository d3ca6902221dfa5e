"""The server path: an engine with a ``base_url`` runs lm-eval's own local-completions / local-chat-completions
(through ``verify.evals.api_lm``) against an OpenAI-style HTTP server. A small in-process server stands in
for vLLM here (the real one is the integration tests' job) and records what lm-eval sent: every AIME
repeat must carry its own seed (the same ones on a second run), MRCR must arrive as real chat turns, and
finish_reason / usage must land in the sample records."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("lm_eval", reason="needs_eval_extra: scripts/bootstrap --eval")

from evals.data.make_synthetic import make_all  # noqa: E402
from verify.evals.runner import run_tasks  # noqa: E402


class _Server:
    def __init__(self) -> None:
        self.payloads: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.payloads.append((self.path, body))
                reply = outer.answer(self.path, body)
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, path: str, body: dict) -> dict:
        chat = path.endswith("/chat/completions")
        m = re.match(r"Prepend (\w+) to the (\d+)", body["messages"][-1]["content"]) if chat else None
        if m:  # MRCR: the prefix, then the first message
            text = m[1] + body["messages"][1]["content"]
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 50, "completion_tokens": 11}}
        seed = body.get("seed") or 0
        length = body["temperature"] > 0 and seed % 2 == 1  # sampled requests with an odd seed "hit max_tokens"
        text, finish = f"\\boxed{{{seed % 5}}}", "length" if length else "stop"
        choice = ({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"choices": [{"index": 0, **choice, "finish_reason": finish}],
                "usage": {"prompt_tokens": 30, "completion_tokens": body["max_tokens"] if length else 3}}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _ServerEngine:
    """What the runner needs of ``verify.engines.openai.OpenAIEngine``: name, base_url, model, limits."""

    name = "openai:fake"
    model = "tiny"
    tokenizer_dir = None
    max_model_len = 4096

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_repeats_get_their_own_seeds_and_finish_reasons(server, tmp_path, monkeypatch, chat) -> None:
    """AIME goes out as a chat (``CHAT_DATASETS``); the completions path, for a dataset sent as plain text,
    keeps the same seeds and records."""
    from verify.evals import runner

    if not chat:
        monkeypatch.setattr(runner, "CHAT_DATASETS", runner.CHAT_DATASETS - {"aime25"})
    make_all(tmp_path, seed=1, gsm8k=2, aime=3, mrcr=1, mrcr_chars=200, needles=(2,))
    runs = [run_tasks(_ServerEngine(server.base_url), "aime25", ["k3_aime25"], limit=2, max_tokens=9, repeats=3,
                      data_dir=tmp_path, seed=11)["k3_aime25"] for _ in range(2)]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    sent = [b for p, b in server.payloads if p == path]
    assert len(sent) == 12 and all(b["max_tokens"] == 9 and b["temperature"] == 0.6 and b["top_p"] == 0.95 for b in sent)
    first = sent[:6]
    by_prompt: dict[str, list[int]] = {}
    for b in first:
        by_prompt.setdefault(json.dumps(b["messages"]) if chat else b["prompt"], []).append(b["seed"])
    assert len(by_prompt) == 2 and all(len(set(s)) == 3 for s in by_prompt.values())  # 3 repeats, 3 seeds
    assert [b["seed"] for b in sent[6:]] == [b["seed"] for b in first]  # the second run draws the same seeds
    assert sorted(sorted(s["seeds"]) for s in runs[0].samples) == sorted(sorted(v) for v in by_prompt.values())
    for s in runs[0].samples:
        assert s["repeats"] == 3
        assert s["finish_reasons"] == ["length" if x % 2 else "stop" for x in s["seeds"]]
        assert s["truncated"] == [x % 2 == 1 for x in s["seeds"]]
        assert s["output_tokens"] == [9 if x % 2 else 3 for x in s["seeds"]]
        assert s["responses"] == [f"\\boxed{{{x % 5}}}" for x in s["seeds"]]
    kind = "chat-completions" if chat else "completions"
    assert runs[0].model["model"] == f"k3-local-{kind}"
    assert runs[0].model["model_args"]["base_url"] == f"{server.base_url}/{kind.replace('-', '/')}"


def test_mrcr_goes_out_as_chat_turns(server, tmp_path) -> None:
    make_all(tmp_path, seed=2, gsm8k=1, aime=1, mrcr=2, mrcr_chars=300, needles=(4,))
    run = run_tasks(_ServerEngine(server.base_url), "mrcr", ["k3_mrcr_4needle"], limit=2, max_tokens=64, repeats=None,
                    data_dir=tmp_path, seed=0)["k3_mrcr_4needle"]
    sent = [b for p, b in server.payloads if p == "/v1/chat/completions"]
    assert len(sent) == 2
    for b in sent:
        roles = [m["role"] for m in b["messages"]]
        assert len(roles) >= 9 and roles[-1] == "user" and roles[:2] == ["user", "assistant"]
        assert b["messages"][-1]["content"].startswith("Prepend ")
        assert b["temperature"] == 0 and b["max_tokens"] == 64
    for s in run.samples:
        assert s["finish_reasons"] == ["stop"] and s["output_tokens"] == [11] and s["truncated"] == [False]
        assert s["extraction_failed"] == [False]  # the prefix came back first
    assert run.model["model"] == "k3-local-chat-completions"
