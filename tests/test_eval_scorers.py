"""Scorers (GSM8K / AIME integer extraction with its failures, MRCR prefix rule + SequenceMatcher), the
synthetic data generators (real formats, exact answers checked independently, byte-identical per seed),
and the task YAMLs as lm-eval indexes them."""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
from decimal import Decimal
from difflib import SequenceMatcher
from pathlib import Path

import pytest

from evals import utils
from evals.data import sources
from evals.data.make_synthetic import make_all

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- GSM8K
@pytest.mark.parametrize("text,value,rule", [
    ("She has 5 + 18 = 23 shells.\n#### 23", 23, "####"),
    ("#### 1,234", 1234, "####"),
    ("so 3, then 7.\n#### $1,050.00", 1050, "####"),
    ("The answer is 42.", 42, "answer is"),
    ("The answer is: **-7**", -7, "answer is"),
    ("Thus \\boxed{17} apples", 17, "boxed"),
    ("3 apples and 5 pears make 8", 8, "last number"),
    ("it costs 12.5 dollars", Decimal("12.5"), "last number"),
    ("12.0", 12, "last number"),
    ("no digits at all", None, "none"),
    ("", None, "none"),
])
def test_gsm8k_extraction(text, value, rule) -> None:
    assert utils.extract_gsm8k(text) == (value, rule)


def test_gsm8k_scoring_and_failures() -> None:
    doc = {"answer": "Step.\n#### 1,050"}
    assert utils.gsm8k_gold(doc["answer"]) == 1050
    assert utils.score_gsm8k("so #### 1050", doc) == {"score": 1, "extracted": 1050, "rule": "####", "extraction_failed": False}
    assert utils.score_gsm8k("1050.0", doc)["score"] == 1
    assert utils.score_gsm8k("1050.5", doc) == {"score": 0, "extracted": "1050.5", "rule": "last number",
                                                "extraction_failed": False}
    assert utils.score_gsm8k("I do not know", doc) == {"score": 0, "extracted": None, "rule": "none",
                                                       "extraction_failed": True}
    with pytest.raises(ValueError, match="without '####'"):
        utils.gsm8k_gold("42")
    # lm-eval hook: one response (take_first) or all repeats
    assert utils.process_gsm8k(doc, ["#### 1050"]) == {"exact_match": 1.0, "extraction_failed": 0.0}
    assert utils.process_gsm8k(doc, [["#### 1050", "none", "#### 3", "x"]]) == {"exact_match": 0.25, "extraction_failed": 0.5}


# ---------------------------------------------------------------- AIME
@pytest.mark.parametrize("text,value,rule", [
    ("so the sum is 70 and \\boxed{070}", 70, "boxed"),
    ("\\boxed{12} then later \\boxed{ 345 }", 345, "boxed"),
    ("\\boxed{\\frac{1}{2}} and 5", None, "boxed non-integer"),
    ("The answer is 204.", 204, "answer is"),
    ("#### 9", 9, "####"),
    ("we get 3 and then 999", 999, "last integer"),
    ("nothing here", None, "none"),
])
def test_aime_extraction(text, value, rule) -> None:
    assert utils.extract_aime(text) == (value, rule)


def test_aime_scoring_over_repeats() -> None:
    doc = {"answer": "70"}
    assert utils.score_aime("\\boxed{70}", doc)["score"] == 1
    assert utils.score_aime("\\boxed{71}", doc)["score"] == 0
    assert utils.score_aime("\\boxed{x}", doc)["extraction_failed"]
    assert utils.process_aime(doc, [["\\boxed{70}", "\\boxed{70}", "\\boxed{1}", "no"]]) == {
        "exact_match": 0.5, "extraction_failed": 0.25}
    assert utils.keep_all_repeats([("a", "b"), ("c",)], [{}, {}]) == [["a", "b"], ["c"]]


# ---------------------------------------------------------------- MRCR
def openai_grade(response: str, answer: str, prefix: str) -> float:
    """openai/mrcr's published grader, written out independently."""
    if not response.startswith(prefix):
        return 0
    return float(SequenceMatcher(None, response[len(prefix):], answer[len(prefix):]).ratio())


def test_mrcr_prefix_rule_and_sequence_matcher(seed) -> None:
    rng = random.Random(seed)
    prefix = "".join(rng.choice("abcXYZ019") for _ in range(10))
    body = " ".join(rng.choice(["owl", "stone", "tide", "ember", "quiet"]) for _ in range(30))
    doc = {"answer": prefix + body, "random_string_to_prepend": prefix}
    assert utils.score_mrcr(prefix + body, doc) == {"score": 1.0, "extracted": None, "rule": "prefix",
                                                    "extraction_failed": False}
    missing = utils.score_mrcr(body, doc)
    assert missing["score"] == 0.0 and missing["extraction_failed"] and missing["rule"] == "prefix missing"
    assert utils.score_mrcr(" " + prefix + body, doc)["score"] == 0.0  # the prefix must come first, exactly
    for _ in range(20):
        words = body.split()
        k = rng.randrange(len(words))
        mutated = prefix + " ".join(words[:k] + ["tapir"] + words[k + 1:][: rng.randrange(len(words))])
        got = utils.score_mrcr(mutated, doc)["score"]
        assert got == pytest.approx(openai_grade(mutated, doc["answer"], prefix))
        assert 0 < got < 1
    assert utils.process_mrcr(doc, [prefix + body]) == {"score": 1.0, "prefix_missing": 0.0}


def test_expand_conversation() -> None:
    conv = [{"role": "user", "content": "write a poem about owls"}, {"role": "assistant", "content": "Owls."},
            {"role": "user", "content": "Prepend x to the 1st poem"}]
    wrapped = [{"role": "system", "content": "be brief"}, {"role": "user", "content": json.dumps(conv)}]
    assert utils.expand_conversation(wrapped) == [wrapped[0], *conv]
    plain = [{"role": "user", "content": "[{not json"}]
    assert utils.expand_conversation(plain) == plain
    assert utils.expand_conversation([{"role": "user", "content": "[1, 2]"}])[0]["content"] == "[1, 2]"
    with pytest.raises(ValueError, match="JSON list"):
        utils.mrcr_doc_to_text({"prompt": json.dumps({"role": "user"})})


# ---------------------------------------------------------------- synthetic data
def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def test_generator_is_deterministic_per_seed(tmp_path, seed) -> None:
    s = seed % 1000
    a = make_all(tmp_path / "a", seed=s, gsm8k=20, aime=10, mrcr=3, mrcr_chars=400)
    b = make_all(tmp_path / "b", seed=s, gsm8k=20, aime=10, mrcr=3, mrcr_chars=400)
    c = make_all(tmp_path / "c", seed=s + 1, gsm8k=20, aime=10, mrcr=3, mrcr_chars=400)
    assert _tree_hash(tmp_path / "a") == _tree_hash(tmp_path / "b") and a == b
    assert all(a["files"][f]["sha256"] != c["files"][f]["sha256"] for f in a["files"])
    for rel, info in a["files"].items():
        assert info["sha256"] == sources.sha256_file(tmp_path / "a" / rel)


def test_generator_cli_is_byte_identical_across_processes(tmp_path) -> None:
    """A different PYTHONHASHSEED per process must not change a byte (no hash()-dependent ordering)."""
    outs = []
    for i, hashseed in enumerate(("1", "2")):
        out = tmp_path / f"o{i}"
        subprocess.run([sys.executable, "-m", "evals.data.make_synthetic", "--out", str(out), "--seed", "5",
                        "--gsm8k", "5", "--aime", "5", "--mrcr", "2", "--mrcr-chars", "300"],
                       check=True, cwd=ROOT, env={"PYTHONHASHSEED": hashseed, "PATH": "/usr/bin:/bin"},
                       capture_output=True)
        outs.append(_tree_hash(out))
    assert outs[0] == outs[1]
    r = subprocess.run([sys.executable, "-m", "evals.data.make_synthetic", "--out", str(tmp_path / "z"), "--gsm8k", "0"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("make_synthetic:")


def test_synthetic_formats_and_answers_are_right(tmp_path, seed) -> None:
    make_all(tmp_path, seed=seed % 1000, gsm8k=40, aime=40, mrcr=6, mrcr_chars=900)
    rows = sources.read_rows(sources.resolve("gsm8k", tmp_path))
    assert len(rows) == 40
    for r in rows:
        assert set(r) == {"question", "answer", "solution"} and re.search(r"\n#### -?\d+$", r["answer"])
        assert utils.score_gsm8k(r["solution"], r)["score"] == 1  # the sentinel's worked answer scores right
        # every <<a op b=c>> calculator annotation is right, and the last one is the gold answer
        calcs = re.findall(r"<<(\d+)([-+*/])(\d+)=(\d+)>>", r["answer"])
        for a, op, b, c in calcs:
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b),
                    "/": int(a) / int(b)}[op] == int(c), r
        assert int(calcs[-1][3]) == utils.gsm8k_gold(r["answer"])
        assert utils.score_gsm8k(r["answer"], r)["score"] == 1  # the worked answer scores itself right
    for r in sources.read_rows(sources.resolve("aime25", tmp_path)):
        assert set(r) == {"id", "problem", "answer", "solution"} and 0 <= int(r["answer"]) <= 999
        assert utils.score_aime(r["solution"], r)["score"] == 1
        if m := re.match(r"Find the remainder when \$(\d+)\^\{(\d+)\}\$", r["problem"]):
            assert int(r["answer"]) == pow(int(m[1]), int(m[2]), 1000)
        if m := re.search(r"x \+ y \\le (\d+)", r["problem"]):
            n = int(m[1])
            assert int(r["answer"]) == sum(1 for x in range(1, n) for y in range(1, n - x + 1)) % 1000
    for n in (2, 4, 8):
        rows = sources.read_rows(sources.resolve(f"mrcr{n}", tmp_path))
        for r in rows:
            msgs = json.loads(r["prompt"])
            assert r["n_needles"] == n and r["total_messages"] == len(msgs) and r["n_chars"] >= 900
            ask = re.match(r"Prepend (\w{10}) to the (\d+)\w\w \(1 indexed\) (.+?) about (\w+)\.", msgs[-1]["content"])
            assert ask and ask[1] == r["random_string_to_prepend"]
            needle = f"write a {ask[3]} about {ask[4]}"
            hits = [i + 1 for i, m in enumerate(msgs) if m["role"] == "user" and m["content"] == needle]
            assert len(hits) == n and r["desired_msg_index"] == hits[int(ask[2]) - 1]
            assert r["answer"] == ask[1] + msgs[r["desired_msg_index"]]["content"]
            assert [m["role"] for m in msgs[:-1]] == ["user", "assistant"] * ((len(msgs) - 1) // 2)


def test_data_sources_errors(tmp_path) -> None:
    with pytest.raises(sources.DataError, match="does not exist"):
        sources.resolve("gsm8k", tmp_path / "nope")
    with pytest.raises(sources.DataError, match="make_synthetic"):
        sources.resolve("gsm8k", tmp_path)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(sources.DataError, match="test.jsonl:2: not JSON"):
        sources.read_rows(sources.resolve("gsm8k", tmp_path))
    with pytest.raises(sources.DataError, match="2, 4 or 8"):
        sources.kind_for("mrcr", 3)


def test_task_yamls_are_indexed_by_lm_eval() -> None:
    pytest.importorskip("lm_eval", reason="needs_eval_extra: scripts/bootstrap --eval")
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(ROOT / "evals"), include_defaults=False)
    assert {"k3_gsm8k", "k3_aime25", "k3_mrcr_2needle", "k3_mrcr_4needle", "k3_mrcr_8needle"} <= set(tm.all_subtasks)
    assert set(tm.task_index["k3_mrcr"].tags) == {"k3_mrcr_2needle", "k3_mrcr_4needle", "k3_mrcr_8needle"}
