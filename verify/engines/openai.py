"""The ``openai`` engine: any OpenAI-compatible server (vLLM in practice), through its HTTP API.

Why plain ``urllib``: the engine needs four endpoints and nothing else, so it adds no dependency and
behaves the same in the CPU image, on a GPU host and in CI.

How each ``Engine`` method maps onto the server:
- ``generate``: ``POST /v1/completions`` with every prompt in one request (text or token ids),
  ``return_token_ids`` for the generated ids and ``return_tokens_as_token_ids`` so logprob keys are
  ``token_id:N`` (exact ids, never a lossy string round trip).
- ``chat``: ``POST /v1/chat/completions`` (the server applies the model's chat template).
- constraints: vLLM's ``structured_outputs`` request field, ``{"json": schema}`` / ``{"regex": ...}`` /
  ``{"choice": [...]}``. With random weights a JSON schema must be bounded to give parseable output
  (../shared/design/SERVICES.md).
- ``next_token_logprobs``: one greedy token with ``logprobs = vocab size`` (the server must run with
  ``--max-logprobs`` >= the vocabulary; ``launch_vllm`` does that); the result must hold every token
  and sum to 1, else ``EngineError``.
- logprobs are what the server reports; vLLM's default ``logprobs_mode`` is ``raw_logprobs`` (the
  log-softmax of the raw logits, before temperature / top-k / top-p), which is the ``Engine`` contract.

Context limit (the part servers get wrong): vLLM rejects a prompt longer than ``max_model_len`` (HTTP
400, turned into ``ContextLimitError`` with the server's message), but it does NOT reject
prompt + max_tokens over the limit: it silently cuts the completion short with ``finish_reason=length``.
The engine knows ``max_model_len`` from ``/v1/models`` and the prompt length from the tokenizer, so it
raises ``ContextLimitError`` before sending such a request; as a second line, a response that ended on
``length`` with fewer tokens than ``max_tokens`` is also turned into ``ContextLimitError``.

A completion that ended on the EOS token reports it in ``extra["stop_token"]``, not in ``token_ids``
(the builtin engine's convention), and its logprobs are trimmed to match. With a tokenizer, ``text`` is
decoded here from ``token_ids`` (cut at the first stop string, as the server cuts): vLLM's own text can
carry bytes of a token-id prompt that ended inside a UTF-8 sequence. The server's text is kept in
``extra["server_text"]`` when it differs.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from verify.engines.base import (
    Completion,
    Constraint,
    ContextLimitError,
    EngineError,
    SamplingParams,
    model_vocab_size,
)

__all__ = ["OpenAIEngine", "structured_outputs_field"]

_CONTEXT_MESSAGE = re.compile(r"maximum context length|max_model_len|context length|too long|"
                              r"longer than the maximum|exceeds the model", re.IGNORECASE)
_TOKEN_KEY = re.compile(r"^token_id:(-?\d+)$")


def _token_id(key: str) -> int:
    m = _TOKEN_KEY.match(key)
    if not m:
        raise EngineError(f"server returned logprob key {key!r}, expected 'token_id:N' "
                          "(does it honour return_tokens_as_token_ids?)")
    return int(m.group(1))


def structured_outputs_field(constraint: Constraint) -> dict[str, Any]:
    """The vLLM ``structured_outputs`` request field for a ``Constraint``."""
    if constraint.kind == "json_schema":
        if not isinstance(constraint.spec, dict):
            raise ValueError("a json_schema constraint needs a dict (the JSON schema)")
        return {"json": constraint.spec}
    if constraint.kind == "regex":
        if not isinstance(constraint.spec, str):
            raise ValueError("a regex constraint needs a str")
        return {"regex": constraint.spec}
    if constraint.kind == "choice":
        if not isinstance(constraint.spec, (list, tuple)) or not all(isinstance(c, str) for c in constraint.spec):
            raise ValueError("a choice constraint needs a list of strings")
        return {"choice": list(constraint.spec)}
    raise ValueError(f"unknown constraint kind {constraint.kind!r}")


def _logsumexp(values: list[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


class OpenAIEngine:
    """An ``Engine`` over an OpenAI-compatible server at ``base_url`` (``http://host:port`` or ``.../v1``).

    ``model``: the served model name (default: the server's only model). ``tokenizer_dir``: the model's
    HF tokenizer (default: the model's ``root`` directory from ``/v1/models`` when it is local; else
    the server's ``/tokenize`` endpoints). ``server``: a launched ``VLLMServer`` this engine owns
    (``close()`` stops it)."""

    def __init__(self, base_url: str, model: str | None = None, tokenizer_dir: str | Path | None = None, *,
                 name: str | None = None, timeout_s: float = 300.0, max_model_len: int | None = None,
                 vocab_size: int | None = None, server: Any = None) -> None:
        url = base_url.rstrip("/")
        self.root_url = url[:-3] if url.endswith("/v1") else url
        self.base_url = self.root_url + "/v1"
        self.timeout_s = timeout_s
        self._server = server
        self.name = name or f"openai:{self.root_url}"
        models = self._request("GET", "/v1/models").get("data") or []
        if not models:
            raise EngineError(f"{self.base_url}/models lists no model")
        ids = [m.get("id") for m in models]
        if model is None:
            if len(models) > 1:
                raise EngineError(f"server serves {len(models)} models ({', '.join(map(str, ids))}); name one")
            entry = models[0]
        else:
            found = [m for m in models if m.get("id") == model]
            if not found:
                raise EngineError(f"server does not serve model {model!r}; it serves {', '.join(map(str, ids))}")
            entry = found[0]
        self.model = str(entry["id"])
        self._max_model_len = max_model_len or entry.get("max_model_len")
        if not isinstance(self._max_model_len, int) or self._max_model_len < 1:
            raise EngineError(f"server reports no max_model_len for {self.model!r}; pass max_model_len=")
        root = entry.get("root")
        if tokenizer_dir is None and isinstance(root, str) and (Path(root) / "tokenizer_config.json").is_file():
            tokenizer_dir = root
        self.tokenizer_dir = str(tokenizer_dir) if tokenizer_dir is not None else None
        self._tokenizer = None
        if self.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        self._vocab_size = vocab_size or self._vocab_from_config() or (len(self._tokenizer) if self._tokenizer else None)
        self._server_version = self._request("GET", "/version", default={}).get("version")

    # -- plumbing
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, default: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.root_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw_ok = resp.read().decode(errors="replace")
            try:
                return json.loads(raw_ok)
            except ValueError:
                if default is not None:
                    return default
                raise EngineError(f"{method} {path}: the server's answer is not JSON: {raw_ok[:200]!r}") from None
        except urllib.error.HTTPError as e:
            if default is not None:
                return default
            raw = e.read().decode(errors="replace")
            try:
                payload = json.loads(raw)
                err = payload.get("error", payload)
                message = err.get("message") if isinstance(err, dict) else str(err)
            except (ValueError, AttributeError):
                message = raw
            message = " ".join(str(message or raw).split())[:500]
            if e.code == 400 and _CONTEXT_MESSAGE.search(message):
                raise ContextLimitError(f"{self._who()}: server rejected the request: {message}") from None
            raise EngineError(f"{method} {path}: HTTP {e.code}: {message}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            if default is not None:
                return default
            raise EngineError(f"{method} {self.root_url}{path}: server unreachable: {e}") from None

    def _who(self) -> str:
        return getattr(self, "model", None) or self.root_url

    def _vocab_from_config(self) -> int | None:
        return model_vocab_size(self.tokenizer_dir) if self.tokenizer_dir is not None else None

    # -- Engine properties and tokenizer
    @property
    def max_model_len(self) -> int:
        return int(self._max_model_len)

    @property
    def vocab_size(self) -> int:
        if not self._vocab_size:
            raise EngineError(f"vocab size of {self.model!r} unknown: give tokenizer_dir= or vocab_size=")
        return int(self._vocab_size)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` alone (no special tokens added)."""
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._tokenizer is not None:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))
        out = self._request("POST", "/tokenize", {"model": self.model, "prompt": text,
                                                   "add_special_tokens": add_special_tokens})
        return [int(t) for t in out["tokens"]]

    def detokenize(self, ids: list[int]) -> str:
        if self._tokenizer is not None:
            return self._tokenizer.decode(list(ids))
        return str(self._request("POST", "/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"])

    # -- requests
    def _sampling_body(self, params: SamplingParams) -> dict[str, Any]:
        if params.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {params.max_tokens}")
        body: dict[str, Any] = {"model": self.model, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "top_p": params.top_p,
                                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if getattr(params, "ignore_eos", False):
            body["ignore_eos"] = True
        return body

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len > self.max_model_len:
            raise ContextLimitError(f"{self.model}: prompt of {prompt_len} tokens > max_model_len "
                                    f"{self.max_model_len}")
        if prompt_len + max_tokens > self.max_model_len:
            raise ContextLimitError(
                f"{self.model}: prompt of {prompt_len} tokens + max_tokens {max_tokens} = "
                f"{prompt_len + max_tokens} > max_model_len {self.max_model_len} (rejected by the engine: the "
                "server would cut the completion short with finish_reason=length instead)")

    def _check_not_cut(self, finish_reason: str, n_generated: int, params: SamplingParams, prompt_len: int) -> None:
        if finish_reason == "length" and n_generated < params.max_tokens:
            raise ContextLimitError(
                f"{self.model}: the server stopped after {n_generated} of max_tokens {params.max_tokens} with "
                f"finish_reason=length (prompt {prompt_len} tokens, max_model_len {self.max_model_len}): "
                "the request did not fit the context")

    def _finish(self, server_text: str, token_ids: list[int], finish_reason: str, prompt_tokens: int,
                logprobs: list[dict[int, float]] | None, extra: dict[str, Any], stop: tuple[str, ...]) -> Completion:
        eos = getattr(self._tokenizer, "eos_token_id", None) if self._tokenizer is not None else None
        if finish_reason == "stop" and token_ids and eos is not None and token_ids[-1] == eos:
            extra["stop_token"] = token_ids[-1]
            token_ids = token_ids[:-1]
            if logprobs is not None:
                logprobs = logprobs[:len(token_ids)]
        text = server_text
        if self._tokenizer is not None:
            # the tokens are the ground truth: vLLM's incremental detokenizer can prepend bytes of a token-id
            # prompt whose tail is an incomplete UTF-8 sequence (seen: 'si[yt\ufffd<\ufffd\ufffdbeta' for
            # the tokens of 'beta'). Decode here, and cut at the first stop string as the server does.
            text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in stop if s and s in text]
            if cuts:
                text = text[:min(cuts)]
            if text != server_text:
                extra["server_text"] = server_text
        return Completion(text=text, token_ids=token_ids, finish_reason=finish_reason,
                          prompt_tokens=prompt_tokens, logprobs=logprobs, extra=extra)

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams,
                 constraint: Constraint | None = None) -> list[Completion]:
        if not prompts:
            return []
        encoded = [list(map(int, p)) if isinstance(p, (list, tuple)) else self._encode(p, add_special_tokens=True)
                   for p in prompts]
        lengths = [len(ids) for ids in encoded]
        for n in lengths:
            self._check_fits(n, params.max_tokens)
        body = self._sampling_body(params)
        # the server takes all-text or all-ids batches; a mixed batch goes as ids
        all_text = all(isinstance(p, str) for p in prompts)
        body["prompt"] = list(prompts) if all_text else encoded
        if params.logprobs > 0:
            body["logprobs"] = params.logprobs
        if constraint is not None:
            body["structured_outputs"] = structured_outputs_field(constraint)
        resp = self._request("POST", "/v1/completions", body)
        choices = sorted(resp.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise EngineError(f"asked for {len(prompts)} completions, server returned {len(choices)}")
        out = []
        for prompt_len, c in zip(lengths, choices, strict=True):
            token_ids = [int(t) for t in (c.get("token_ids") or [])]
            finish = c.get("finish_reason") or "length"
            self._check_not_cut(finish, len(token_ids), params, prompt_len)
            lps = self._completion_logprobs(c.get("logprobs")) if params.logprobs > 0 else None
            if lps is not None and len(lps) != len(token_ids):
                raise EngineError(f"server returned {len(lps)} logprob positions for {len(token_ids)} tokens")
            out.append(self._finish(c.get("text", ""), token_ids, "stop" if finish == "stop" else "length",
                                    prompt_len, lps, {"server_finish_reason": finish,
                                                      "stop_reason": c.get("stop_reason")}, params.stop))
        return out

    @staticmethod
    def _completion_logprobs(lp: dict[str, Any] | None) -> list[dict[int, float]]:
        if not lp:
            raise EngineError("asked for logprobs, the server returned none")
        tokens, chosen, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
        if not len(tokens) == len(chosen) == len(tops):
            raise EngineError(f"malformed logprobs: {len(tokens)} tokens, {len(chosen)} logprobs, {len(tops)} top-n")
        rows = []
        for tok, tok_lp, top in zip(tokens, chosen, tops, strict=True):
            row = {_token_id(k): float(v) for k, v in (top or {}).items()}
            row.setdefault(_token_id(tok), float(tok_lp))
            rows.append(row)
        return rows

    def chat(self, messages: list[dict[str, str]], params: SamplingParams,
             constraint: Constraint | None = None) -> Completion:
        if self._tokenizer is not None and getattr(self._tokenizer, "chat_template", None):
            rendered = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            self._check_fits(len(self._encode(rendered, add_special_tokens=False)), params.max_tokens)
        body = self._sampling_body(params)
        body["messages"] = messages
        if params.logprobs > 0:
            body["logprobs"] = True
            body["top_logprobs"] = params.logprobs
        if constraint is not None:
            body["structured_outputs"] = structured_outputs_field(constraint)
        resp = self._request("POST", "/v1/chat/completions", body)
        choices = resp.get("choices") or []
        if len(choices) != 1:
            raise EngineError(f"asked for one chat completion, server returned {len(choices)}")
        c = choices[0]
        prompt_tokens = int((resp.get("usage") or {}).get("prompt_tokens") or len(resp.get("prompt_token_ids") or []))
        token_ids = [int(t) for t in (c.get("token_ids") or [])]
        finish = c.get("finish_reason") or "length"
        self._check_not_cut(finish, len(token_ids), params, prompt_tokens)
        lps = None
        if params.logprobs > 0:
            content = (c.get("logprobs") or {}).get("content")
            if content is None:
                raise EngineError("asked for logprobs, the server returned none")
            lps = []
            for pos in content:
                row = {_token_id(t["token"]): float(t["logprob"]) for t in pos.get("top_logprobs") or []}
                row.setdefault(_token_id(pos["token"]), float(pos["logprob"]))
                lps.append(row)
        text = (c.get("message") or {}).get("content") or ""
        return self._finish(text, token_ids, "stop" if finish == "stop" else "length", prompt_tokens, lps,
                            {"server_finish_reason": finish, "stop_reason": c.get("stop_reason")}, params.stop)

    def next_token_logprobs(self, prompt: str | list[int]) -> dict[int, float]:
        """Every token's log-probability after ``prompt`` (one greedy step, logprobs = vocab size)."""
        v = self.vocab_size
        body = {"model": self.model, "prompt": [list(map(int, prompt))] if isinstance(prompt, list) else prompt,
                "max_tokens": 1, "temperature": 0.0, "logprobs": v, "return_tokens_as_token_ids": True}
        try:
            resp = self._request("POST", "/v1/completions", body)
        except ContextLimitError:
            raise
        except EngineError as e:
            raise EngineError(f"{e} (the full next-token distribution needs a server started with "
                              f"--max-logprobs >= {v})") from None
        lp = (resp.get("choices") or [{}])[0].get("logprobs") or {}
        top = (lp.get("top_logprobs") or [None])[0]
        if not top:
            raise EngineError("server returned no logprobs for the next token")
        dist = {_token_id(k): float(val) for k, val in top.items()}
        if len(dist) < v or any(not 0 <= t < v for t in dist):
            raise EngineError(f"server returned {len(dist)} of {v} next-token logprobs "
                              f"(start it with --max-logprobs >= {v})")
        total = _logsumexp(list(dist.values()))
        if abs(total) > 1e-3:
            raise EngineError(f"next-token logprobs sum to exp({total:.4g}) != 1: not a full distribution")
        return dist

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"engine": "openai", "name": self.name, "base_url": self.base_url, "model": self.model,
                             "max_model_len": self.max_model_len, "vocab_size": self._vocab_size,
                             "tokenizer_dir": self.tokenizer_dir, "server_version": self._server_version}
        if self._server is not None:
            d["server"] = self._server.describe()
        return d

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()

