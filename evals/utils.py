"""Scorers and dataset loaders that the task YAMLs in ``evals/`` name with ``!function utils.<name>``.

lm-eval imports this file by path when it reads a YAML; ``verify.evals`` (the runner and the bundle
rescorer) imports the same functions as ``evals.utils``, so the score in a bundle and the score a
maintainer recomputes offline come from one implementation. Pure Python: no lm-eval, no torch.

Scoring rules:

- GSM8K: the gold answer is the integer after ``####``. From the response, the first rule that finds a
  number wins: the last ``#### <n>``; the last "answer is <n>"; the last ``\\boxed{<n>}``; the last number
  anywhere ("flexible extract"). Commas and a leading ``$`` are dropped; ``12.0`` equals 12, ``12.5``
  never equals an integer. No number at all is an *extraction failure* (scored 0, counted separately).
- AIME: the answer is an integer 0..999. If the response has a ``\\boxed{...}``, the last one decides
  (its content must be an integer, else extraction failure); otherwise "answer is <n>", ``#### <n>``,
  then the last integer. ``070`` equals 70.
- MRCR (openai/mrcr's grader): a response that does not start with ``random_string_to_prepend`` scores
  0 (counted as a prefix miss); otherwise the prefix is removed from both and the score is
  ``difflib.SequenceMatcher(None, response, answer).ratio()``.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from difflib import SequenceMatcher
from typing import Any

from k3_fastpath.sentinel import tasks

# ---------------------------------------------------------------- number extraction
_NUM = r"-?\$?\d[\d,]*(?:\.\d+)?"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####\s*(" + _NUM + ")")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*\**\s*(" + _NUM + ")", re.IGNORECASE)
_INT_RE = re.compile(r"-?\d+")


def parse_number(token: str) -> int | Decimal | None:
    """``"$1,234"`` -> 1234, ``"12.0"`` -> 12, ``"12.5"`` -> Decimal('12.5'); None if not a number."""
    t = token.strip().replace(",", "").replace("$", "")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    return int(d) if d == d.to_integral_value() else d


def _last(regex: re.Pattern, text: str) -> str | None:
    found = regex.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` is whole)."""
    start = text.rfind("\\boxed")
    while start >= 0:
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j]
        start = text.rfind("\\boxed", 0, start)  # unclosed or bare: try an earlier one
    return None


def extract_gsm8k(text: str) -> tuple[int | Decimal | None, str]:
    """(number, rule that found it) or (None, "none") for an extraction failure."""
    for rule, find in (("####", lambda t: _last(_HASH_RE, t)), ("answer is", lambda t: _last(_ANSWER_IS_RE, t)),
                       ("boxed", last_boxed), ("last number", lambda t: _last(_NUM_RE, t))):
        tok = find(text)
        if tok is not None:
            value = parse_number(tok)
            if value is not None:
                return value, rule
    return None, "none"


def extract_aime(text: str) -> tuple[int | None, str]:
    """(integer, rule) or (None, "none"|"boxed non-integer") for an extraction failure."""
    boxed = last_boxed(text)
    if boxed is not None:
        value = parse_number(boxed)
        return (value, "boxed") if isinstance(value, int) else (None, "boxed non-integer")
    for rule, regex in (("answer is", _ANSWER_IS_RE), ("####", _HASH_RE)):
        tok = _last(regex, text)
        if tok is not None and isinstance(value := parse_number(tok), int):
            return value, rule
    tok = _last(_INT_RE, text)
    return (int(tok), "last integer") if tok is not None else (None, "none")


def gsm8k_gold(answer: str) -> int:
    """The integer after ``####`` in a GSM8K ``answer`` field."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    value = parse_number(answer.rsplit("####", 1)[1])
    if not isinstance(value, int):
        raise ValueError(f"GSM8K gold answer is not an integer: {answer.rsplit('####', 1)[1].strip()!r}")
    return value


def aime_gold(answer: Any) -> int:
    value = parse_number(str(answer))
    if not isinstance(value, int):
        raise ValueError(f"AIME gold answer is not an integer: {answer!r}")
    return value


# ---------------------------------------------------------------- per-response scores
def score_gsm8k(response: str, target: dict[str, Any]) -> dict[str, Any]:
    value, rule = extract_gsm8k(response)
    gold = gsm8k_gold(target["answer"])
    return {"score": int(value is not None and value == gold), "extracted": _jsonable(value), "rule": rule,
            "extraction_failed": value is None}


def score_aime(response: str, target: dict[str, Any]) -> dict[str, Any]:
    value, rule = extract_aime(response)
    gold = aime_gold(target["answer"])
    return {"score": int(value is not None and value == gold), "extracted": value, "rule": rule,
            "extraction_failed": value is None}


def score_mrcr(response: str, target: dict[str, Any]) -> dict[str, Any]:
    prefix = target["random_string_to_prepend"]
    if not response.startswith(prefix):
        return {"score": 0.0, "extracted": None, "rule": "prefix missing", "extraction_failed": True}
    ratio = SequenceMatcher(None, response.removeprefix(prefix), target["answer"].removeprefix(prefix)).ratio()
    return {"score": float(ratio), "extracted": None, "rule": "prefix", "extraction_failed": False}


SCORERS = {"gsm8k": score_gsm8k, "aime25": score_aime, "mrcr": score_mrcr}
# which doc fields a scorer needs: what the bundle keeps per sample so the rescorer can re-score offline
TARGET_FIELDS = {"gsm8k": ("answer",), "aime25": ("answer",), "mrcr": ("answer", "random_string_to_prepend")}


def target_fields(dataset: str, doc: dict[str, Any]) -> dict[str, Any]:
    return {k: doc[k] for k in TARGET_FIELDS[dataset]}


def _jsonable(value: int | Decimal | None) -> int | str | None:
    return str(value) if isinstance(value, Decimal) else value


def _responses(results: list) -> list[str]:
    """lm-eval hands process_results ``[filtered]``: a string (take_first) or a list of repeats (keep_all)."""
    first = results[0]
    return [str(r) for r in first] if isinstance(first, (list, tuple)) else [str(first)]


def _process(dataset: str, doc: dict[str, Any], results: list, score_key: str, fail_key: str) -> dict[str, float]:
    scored = [SCORERS[dataset](r, doc) for r in _responses(results)]
    n = len(scored)
    return {score_key: sum(s["score"] for s in scored) / n,
            fail_key: sum(s["extraction_failed"] for s in scored) / n}


# ---------------------------------------------------------------- lm-eval hooks (named in the YAMLs)
def process_gsm8k(doc: dict[str, Any], results: list) -> dict[str, float]:
    return _process("gsm8k", doc, results, "exact_match", "extraction_failed")


def process_aime(doc: dict[str, Any], results: list) -> dict[str, float]:
    """exact_match = this problem's mean over its repeats (the per-problem score that gets paired)."""
    return _process("aime25", doc, results, "exact_match", "extraction_failed")


def process_mrcr(doc: dict[str, Any], results: list) -> dict[str, float]:
    return _process("mrcr", doc, results, "score", "prefix_missing")


def keep_all_repeats(resps: list, docs: list) -> list:
    """lm-eval filter (``function: custom``): keep every repeat's response instead of the first."""
    return [list(r) for r in resps]


def gsm8k_doc_to_text(doc: dict[str, Any]) -> str:
    """The prompt the sentinel is trained on too (``k3_fastpath.sentinel.tasks``: one place for it)."""
    return tasks.gsm8k_prompt(doc)


def aime_doc_to_text(doc: dict[str, Any]) -> str:
    return tasks.aime_prompt(doc)


def mrcr_doc_to_text(doc: dict[str, Any]) -> str:
    """The conversation itself, as openai/mrcr stores it: a JSON list of chat messages. Chat-capable model
    adapters (``verify.evals.lm_adapter``) unpack it into real turns; see ``expand_conversation``."""
    messages = json.loads(doc["prompt"])
    if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                 for m in messages):
        raise ValueError("an MRCR prompt must be a JSON list of {role, content} messages")
    return doc["prompt"]


def expand_conversation(chat_history: list[dict[str, Any]]) -> list[dict[str, str]]:
    """lm-eval wraps doc_to_text as one user message; when that text is a JSON message list (MRCR),
    return the conversation it holds (after any system message lm-eval put first). Else unchanged."""
    if chat_history and chat_history[-1].get("role") == "user":
        content = chat_history[-1].get("content")
        if isinstance(content, str) and content.startswith("[{"):
            try:
                inner = json.loads(content)
            except json.JSONDecodeError:
                return chat_history
            if isinstance(inner, list) and inner and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in inner):
                return [*chat_history[:-1], *({"role": m["role"], "content": m["content"]} for m in inner)]
    return chat_history


PROMPTS = {"gsm8k": gsm8k_doc_to_text, "aime25": aime_doc_to_text}  # the single-turn tasks' prompts


def gold_answer(dataset: str, doc: dict[str, Any]) -> str | None:
    """The reference answer ``likelihood.gold_answers`` scores: the row's ``solution`` (the synthetic rows':
    what the sentinel is trained to write), else GSM8K's worked ``answer`` or MRCR's prefixed ``answer``;
    None for an AIME row without a solution (math-ai/aime25 holds the integer only)."""
    if isinstance(doc.get("solution"), str) and doc["solution"]:
        return doc["solution"]
    return doc["answer"] if dataset in ("gsm8k", "mrcr") else None


# ---------------------------------------------------------------- dataset loading (custom_dataset)
def load_k3_dataset(dataset: str, n_needles: int | None = None, data_dir: str | None = None, **_: Any):
    """lm-eval ``custom_dataset``: the ``test`` split of ``dataset`` from ``data_dir`` (lm-eval passes the
    task metadata, e.g. ``--metadata '{"data_dir": "DIR"}'``) or, without one, from the offline HF cache."""
    import datasets

    from evals.data.sources import kind_for, read_rows, resolve

    source = resolve(kind_for(dataset, n_needles), data_dir)
    rows = read_rows(source)
    if dataset == "mrcr":
        rows = [r for r in rows if int(r.get("n_needles", n_needles)) == n_needles]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
