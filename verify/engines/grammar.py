"""Structured output for the builtin engine through xgrammar token bitmasks.

A ``Constraint`` (JSON schema, regex, or a choice among strings) is compiled once per tokenizer into an
xgrammar ``CompiledGrammar`` over the tokenizer's vocabulary (byte-level tokens, so any string the
grammar accepts is reachable). Each request then gets its own ``GrammarConstraint``, the generator's
``TokenConstraint``: before every sampling step it fills the packed bitmask of the tokens that keep the
output a prefix of some accepted string, after it the matcher advances by the chosen token. Under
speculative decoding the generator advances it along a draft for each verify row's bitmask and rolls it
back (``rollback``) before taking the tokens the verify step emits.

Stop tokens (the engine's EOS) are allowed by the bitmask only where the grammar accepts the output as
complete, and the request ends when the matcher accepts one (``is_terminated``). So a constrained
output either validates or ran out of ``max_tokens`` (``finish_reason == "length"``), never anything
else.

Choices compile to an EBNF alternation of JSON-escaped string literals; JSON schemas compile without
free whitespace and with compact separators, the way a server with ``disable_any_whitespace`` emits them
(bounded schemas then finish in few tokens even from random weights).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from verify.engines.base import Constraint, EngineError

XGRAMMAR_HINT = "structured output needs xgrammar: pip install 'k3-verify[eval]' (or scripts/bootstrap --eval)"


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise EngineError(f"{XGRAMMAR_HINT} ({e})") from None
    return xgrammar


def xgrammar_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("xgrammar")
    except metadata.PackageNotFoundError:
        return None


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b" | ...`` with each choice a JSON-escaped literal (quotes, backslashes, newlines)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise EngineError(f"a choice constraint needs a non-empty list of non-empty strings, got {choices!r}")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def constraint_key(constraint: Constraint) -> str:
    return json.dumps([constraint.kind, constraint.spec], sort_keys=True, ensure_ascii=False)


class GrammarConstraint:
    """One request's grammar state: an xgrammar matcher behind the generator's ``TokenConstraint`` API."""

    def __init__(self, matcher: Any, constraint: Constraint) -> None:
        self.matcher = matcher
        self.constraint = constraint

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(bitmask.view(1, -1))

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (the matcher keeps every step: unlimited rollback)."""
        self.matcher.rollback(int(num_tokens))


class GrammarCompiler:
    """Compiles ``Constraint``s for one tokenizer (cached by constraint) and hands out per-request matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info)
        self._cache: dict[str, Any] = {}

    def compile(self, constraint: Constraint) -> Any:
        key = constraint_key(constraint)
        if key not in self._cache:
            self._cache[key] = self._compile(constraint)
        return self._cache[key]

    def _compile(self, c: Constraint) -> Any:
        try:
            if c.kind == "json_schema":
                spec = c.spec if isinstance(c.spec, str) else json.dumps(c.spec)
                return self._compiler.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
            if c.kind == "regex":
                if not isinstance(c.spec, str):
                    raise EngineError(f"a regex constraint needs a string, got {type(c.spec).__name__}")
                return self._compiler.compile_regex(c.spec)
            if c.kind == "choice":
                return self._compiler.compile_grammar(choice_ebnf(list(c.spec)))
        except EngineError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError on a bad spec
            raise EngineError(f"xgrammar cannot compile the {c.kind} constraint: {type(e).__name__}: {e}") from e
        raise EngineError(f"unknown constraint kind {c.kind!r}: json_schema, regex or choice")

    def matcher(self, constraint: Constraint) -> GrammarConstraint:
        return GrammarConstraint(self._xgr.GrammarMatcher(self.compile(constraint)), constraint)
