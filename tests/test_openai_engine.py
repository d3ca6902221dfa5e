"""OpenAIEngine against a scripted HTTP server: request bodies, response parsing and the error mapping
(HTTP 400 over the context -> ContextLimitError with the server's words, a silent cut -> ContextLimitError,
other errors -> EngineError). No tokenizer, no vLLM: the real server is in tests/integration/."""

from __future__ import annotations

import http.server
import json
import math
import threading

import pytest

from verify.engines.base import Constraint, ContextLimitError, EngineError, SamplingParams
from verify.engines.openai import OpenAIEngine, structured_outputs_field


class Scripted(http.server.ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[dict] = []
        self.reply: dict = {}  # path -> (status, json)
        self.models = [{"id": "m", "max_model_len": 64, "root": "/nonexistent"}]


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a) -> None:
        pass

    def _send(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"data": self.server.models})
        elif self.path == "/version":
            self._send(200, {"version": "test"})
        else:
            self._send(404, {"error": {"message": "no"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append({"path": self.path, **body})
        if self.path == "/tokenize":
            self._send(200, {"tokens": [ord(c) % 50 + 3 for c in body["prompt"]]})
            return
        status, obj = self.server.reply[self.path]
        self._send(status, obj(body) if callable(obj) else obj)


@pytest.fixture
def server():
    s = Scripted()
    t = threading.Thread(target=s.serve_forever, daemon=True)
    t.start()
    yield s
    s.shutdown()
    s.server_close()


def _engine(server, **kw) -> OpenAIEngine:
    return OpenAIEngine(f"http://127.0.0.1:{server.server_address[1]}/v1", vocab_size=50, **kw)


def _choice(ids, finish="length", index=0, logprobs=None):
    return {"index": index, "text": "".join(chr(97 + i % 26) for i in ids), "token_ids": ids,
            "finish_reason": finish, "logprobs": logprobs}


def test_discovery_and_request_body(server):
    e = _engine(server)
    assert (e.model, e.max_model_len, e.vocab_size, e.base_url.endswith("/v1")) == ("m", 64, 50, True)
    assert e.describe()["server_version"] == "test"
    server.reply["/v1/completions"] = (200, lambda b: {"choices": [_choice([5, 6], index=i)
                                                                   for i in range(len(b["prompt"]))]})
    out = e.generate([[7, 8, 9], "hi"], SamplingParams(max_tokens=2, temperature=0.5, top_k=4, seed=3, stop=("x",),
                                                       ignore_eos=True), Constraint("choice", ["a", "b"]))
    body = server.bodies[-1]
    # a mixed batch goes as ids; the text prompt was tokenized (here by the server's /tokenize)
    assert body["prompt"] == [[7, 8, 9], [3 + ord("h") % 50, 3 + ord("i") % 50]]
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["seed"], body["stop"]) == (2, 0.5, 4, 3, ["x"])
    assert body["ignore_eos"] is True and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["structured_outputs"] == {"choice": ["a", "b"]}
    assert [c.token_ids for c in out] == [[5, 6], [5, 6]] and [c.prompt_tokens for c in out] == [3, 2]


def test_structured_outputs_field():
    assert structured_outputs_field(Constraint("json_schema", {"type": "integer"})) == {"json": {"type": "integer"}}
    assert structured_outputs_field(Constraint("regex", "[0-9]+")) == {"regex": "[0-9]+"}
    with pytest.raises(ValueError):
        structured_outputs_field(Constraint("choice", "ab"))


def test_logprobs_parsed_by_token_id(server):
    e = _engine(server)
    lp = {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.1, -2.0],
          "top_logprobs": [{"token_id:5": -0.1, "token_id:7": -2.5}, {"token_id:1": -0.5}]}
    server.reply["/v1/completions"] = (200, {"choices": [_choice([5, 9], logprobs=lp)]})
    c = e.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=2))[0]
    assert c.logprobs == [{5: -0.1, 7: -2.5}, {1: -0.5, 9: -2.0}]  # the chosen token is always included


def test_http_400_over_context_is_context_limit_error(server):
    e = _engine(server)
    msg = "This model's maximum context length is 64 tokens. However, your prompt contains 70 input tokens"
    server.reply["/v1/completions"] = (400, {"error": {"message": msg, "type": "BadRequestError", "code": 400}})
    with pytest.raises(ContextLimitError, match="maximum context length is 64"):
        _engine(server, max_model_len=1000).generate([[1] * 70], SamplingParams(max_tokens=1))
    server.reply["/v1/completions"] = (400, {"error": {"message": "top_k must be -1 or at least 1"}})
    with pytest.raises(EngineError, match="HTTP 400: top_k must be") as info:
        e.generate([[1]], SamplingParams(max_tokens=1))
    assert not isinstance(info.value, ContextLimitError)
    server.reply["/v1/completions"] = (500, {"error": {"message": "boom"}})
    with pytest.raises(EngineError, match="HTTP 500: boom"):
        e.generate([[1]], SamplingParams(max_tokens=1))


def test_engine_rejects_what_the_server_would_cut(server):
    e = _engine(server)
    n_before = len(server.bodies)
    with pytest.raises(ContextLimitError, match=r"60 tokens \+ max_tokens 5 = 65 > max_model_len 64"):
        e.generate([[1] * 60], SamplingParams(max_tokens=5))
    assert len(server.bodies) == n_before  # rejected before sending
    # and if a server cuts anyway (the engine was told a bigger limit), the short 'length' is caught
    server.reply["/v1/completions"] = (200, {"choices": [_choice([4, 4], finish="length")]})
    with pytest.raises(ContextLimitError, match="stopped after 2 of max_tokens 5"):
        _engine(server, max_model_len=1000).generate([[1] * 62], SamplingParams(max_tokens=5))


def test_next_token_logprobs_needs_the_whole_vocabulary(server):
    e = _engine(server)
    full = {f"token_id:{i}": math.log(1 / 50) for i in range(50)}
    server.reply["/v1/completions"] = (200, {"choices": [{"index": 0, "logprobs": {"top_logprobs": [full]}}]})
    d = e.next_token_logprobs([1, 2])
    assert len(d) == 50 and server.bodies[-1]["logprobs"] == 50 and server.bodies[-1]["max_tokens"] == 1
    part = dict(list(full.items())[:20])
    server.reply["/v1/completions"] = (200, {"choices": [{"index": 0, "logprobs": {"top_logprobs": [part]}}]})
    with pytest.raises(EngineError, match="20 of 50 .*--max-logprobs >= 50"):
        e.next_token_logprobs([1, 2])
    bad = {k: v - 0.5 for k, v in full.items()}
    server.reply["/v1/completions"] = (200, {"choices": [{"index": 0, "logprobs": {"top_logprobs": [bad]}}]})
    with pytest.raises(EngineError, match="not a full distribution"):
        e.next_token_logprobs([1, 2])


def test_unreachable_and_unknown_model(server):
    with pytest.raises(EngineError, match="does not serve model 'x'"):
        _engine(server, model="x")
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    with pytest.raises(EngineError, match="unreachable"):
        OpenAIEngine(f"http://127.0.0.1:{port}")
