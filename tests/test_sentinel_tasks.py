"""The sentinel's task generators (k3_fastpath.sentinel.tasks): eval files unchanged, answers exact,
worked solutions that score as the gold answer, training items disjoint from the eval sets."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from evals.data.make_synthetic import make_all
from evals.utils import aime_gold, extract_aime, extract_gsm8k, gsm8k_gold
from k3_fastpath.sentinel import tasks

# the eval files (seed 3, 4 MRCR items): bundles name their data by these digests, so a change to a generator
# must show up here. The GSM8K and AIME rows hold the sentinel's training answer as `solution` (for
# likelihood.gold_answers); without it their files are byte for byte the earlier ones (EARLIER_SEED3)
PINNED_SEED3 = {
    "aime25/test.jsonl": "a8fc5280ea1e20e1d8ebd53930d443ade0fc23f420f2b866900f3c88c5997bb7",
    "gsm8k/test.jsonl": "c1805b58c56f6e7e4129a5aaa21b91f41502b3933caacf5fcb2aafd907ad7620",
    "mrcr/2needle.jsonl": "e4accd429b77fa2517fdc0ad3077acae20465800169b868688d5725356e75b19",
    "mrcr/4needle.jsonl": "977e60a7b7bd25342f9cf84ddc84ef2b490e096ab94640de4b43e1f6d7542886",
    "mrcr/8needle.jsonl": "4ddbc5dc7485ad12086cd5289ef795ec4284d0e571e37ac52d20e85b2831bb34",
}
EARLIER_SEED3 = {"aime25/test.jsonl": "d9780705e00cc8f0b0892673649edc1964f86bb08777f187c6e4e005073a86a2",
                 "gsm8k/test.jsonl": "4d12d8136bae031e3aad387df41af3dd9988fe10e839d1d284c48444a79d6c08"}


def test_the_eval_files_are_byte_identical_to_the_pinned_digests(tmp_path):
    manifest = make_all(tmp_path, seed=3, mrcr=4)
    assert {rel: f["sha256"] for rel, f in manifest["files"].items()} == PINNED_SEED3
    for rel, digest in PINNED_SEED3.items():
        assert hashlib.sha256((tmp_path / rel).read_bytes()).hexdigest() == digest
    for rel, digest in EARLIER_SEED3.items():  # the same items as before the rows held their solution
        rows = [json.loads(line) for line in (tmp_path / rel).read_text(encoding="utf-8").splitlines()]
        text = "".join(json.dumps({k: v for k, v in r.items() if k != "solution"}, ensure_ascii=False,
                                  sort_keys=True) + "\n" for r in rows)
        assert hashlib.sha256(text.encode()).hexdigest() == digest


@pytest.mark.parametrize("split", tasks.SPLITS)
def test_gsm8k_worked_answers_score_as_their_gold(split):
    """The training answer is the eval row's with each calculation worked (every step checked in
    tests/test_sentinel_worked.py); outside the ``<<...>>`` it is the row's text, and it extracts as the gold."""
    for item in tasks.items("gsm8k", split, 0, 300):
        target = item.messages[-1]["content"]
        assert item.messages[-1]["role"] == "assistant"
        assert re.sub(r"<<[^>]*>>", "", target) == re.sub(r"<<[^>]*>>", "", item.record["answer"])
        value, rule = extract_gsm8k(target)
        assert (value, rule) == (gsm8k_gold(item.record["answer"]), "####")


def _aime_brute_force(problem: str) -> int:
    """Each AIME kind's answer from its definition (no formula shared with the generator)."""
    nums = [int(x) for x in __import__("re").findall(r"\d+", problem)]
    if problem.startswith("Find the remainder when"):
        return pow(nums[0], nums[1], 1000)
    if "divisible by exactly one" in problem:
        n, p, q = nums
        return sum(1 for k in range(1, n + 1) if (k % p == 0) != (k % q == 0))
    if "sum of all positive divisors" in problem:
        n = nums[0]
        return sum(d for d in range(1, n + 1) if n % d == 0) % 1000
    if "ordered pairs" in problem:
        n = nums[0]
        return sum(1 for x in range(1, n) for y in range(1, n) if x + y <= n) % 1000
    _, a1, _, d, _, k, _ = nums[:7]
    a = a1
    for i in range(1, k):
        a += d * i
    return a % 1000


@pytest.mark.parametrize("split", tasks.SPLITS)
def test_aime_answers_are_exact_and_the_worked_solutions_box_them(split):
    kinds = set()
    for item in tasks.items("aime25", split, 1, 120):
        gold = aime_gold(item.record["answer"])
        assert 0 <= gold <= 999 and gold == _aime_brute_force(item.record["problem"])
        solution = item.messages[-1]["content"]
        assert extract_aime(solution) == (gold, "boxed")
        # the row holds the solution for likelihood.gold_answers; the eval's prompt is the problem alone
        assert item.record.keys() == {"id", "problem", "answer", "solution"} and item.record["solution"] == solution
        assert solution not in tasks.aime_prompt(item.record)
        kinds.add(item.record["problem"][:20])
    assert len(kinds) == 5


def test_the_repeated_squaring_lines_are_each_right():
    a, b = 37, 1337
    ans, steps = tasks._pow_mod_steps(a, b, 1000)
    assert ans == pow(a, b, 1000)
    for line in steps[2:]:
        if line.startswith(f"{a}^"):
            e = int(line.split("^")[1].split(" ")[0])
            assert line.endswith(f"= {pow(a, e, 1000)} (mod 1000).")


def test_mrcr_answers_are_the_prefixed_needle_and_the_last_turn():
    for item in tasks.items("mrcr", "train", 2, 20, n_needles=4, mrcr_chars=3000):
        msgs = json.loads(item.record["prompt"])
        assert list(item.messages[:-1]) == msgs
        needle = msgs[item.record["desired_msg_index"]]
        assert needle["role"] == "assistant"
        assert item.record["answer"] == item.record["random_string_to_prepend"] + needle["content"]
        assert item.messages[-1] == {"role": "assistant", "content": item.record["answer"]}
        assert item.record["n_chars"] >= 3000


def test_an_mrcr_lexicon_is_the_first_n_words():
    """``mrcr_words`` picks the replies' lexicon; the default is the eval files' (same items, same bytes)."""
    kw = {"n_needles": 2, "mrcr_chars": 1500}
    assert ([t.record for t in tasks.items("mrcr", "eval", 0, 3, **kw)]
            == [t.record for t in tasks.items("mrcr", "eval", 0, 3, **kw, mrcr_words=tasks.MRCR_WORDS)])

    def reply_words(n: int) -> set[str]:
        recs = [t.record for t in tasks.items("mrcr", "train", 0, 20, **kw, mrcr_words=n)]
        return {w.strip(".").lower() for r in recs for w in r["answer"][10:].split()} - set(tasks.TOPICS)

    assert reply_words(12) <= set(tasks.WORDS[:12]) and len(reply_words(12)) == 12
    wide = reply_words(len(tasks.WORDS))
    assert wide <= set(tasks.WORDS) and len(wide - set(tasks.WORDS[:tasks.MRCR_WORDS])) > 100
    assert len(set(tasks.WORDS)) == len(tasks.WORDS)  # a word twice would weigh double
    for bad in (0, len(tasks.WORDS) + 1):
        with pytest.raises(ValueError, match="MRCR lexicon"):
            tasks.items("mrcr", "train", 0, 1, **kw, mrcr_words=bad)


def test_copy_items_answer_their_text_word_for_word_and_train_only():
    """``copy`` (training only): the answer is the user turn's text, from the lexicon, ``COPY_WORDS`` long."""
    lengths = []
    for item in tasks.items("copy", "train", 3, 200, mrcr_words=12):
        user, answer = item.messages[0]["content"], item.messages[-1]["content"]
        assert user.endswith("\n\n" + answer) and item.record["answer"] == answer == item.prompt_key
        words = {w.strip(".").lower() for w in answer.split()}
        assert words - set(tasks.TOPICS) <= set(tasks.WORDS[:12])
        lengths.append(len(answer.split()) - 1)  # the topic, inserted once
    lo, hi = tasks.COPY_WORDS
    assert min(lengths) <= lo + 2 and max(lengths) >= hi - 2 and all(lo <= n <= hi for n in lengths)
    assert tasks.eval_prompt_keys("copy", (0,), 10) == set()  # no eval file, nothing to exclude
    with pytest.raises(ValueError, match="unknown task"):
        tasks.stream("copy", "eval", 0)


def test_training_items_never_repeat_an_eval_question():
    for task, kw in (("gsm8k", {}), ("aime25", {}), ("mrcr", {"n_needles": 2, "mrcr_chars": 800})):
        n_eval = 20 if task == "mrcr" else 400
        exclude = {t.prompt_key for t in tasks.items(task, "eval", 0, n_eval, **kw)}
        stream = tasks.train_items(task, 0, exclude, **kw)
        seen = [next(stream).prompt_key for _ in range(50 if task == "mrcr" else 2000)]
        assert not exclude & set(seen)
    # the filter does its work: excluding the stream's own first items makes it skip them
    first = [t.prompt_key for t in tasks.items("gsm8k", "train", 0, 5)]
    assert next(tasks.train_items("gsm8k", 0, set(first))).prompt_key == tasks.items("gsm8k", "train", 0, 6)[5].prompt_key


def test_the_splits_are_different_streams():
    ev = [t.record for t in tasks.items("gsm8k", "eval", 0, 50)]
    tr = [t.record for t in tasks.items("gsm8k", "train", 0, 50)]
    assert ev != tr and ev == [t.record for t in tasks.items("gsm8k", "eval", 0, 50)]


def test_bad_streams_are_refused():
    with pytest.raises(ValueError, match="unknown task"):
        tasks.stream("math", "eval", 0)
    with pytest.raises(ValueError, match="n_needles"):
        tasks.stream("mrcr", "eval", 0)
    with pytest.raises(ValueError, match="n_needles"):
        tasks.stream("gsm8k", "train", 0, n_needles=2)


def test_every_eval_file_row_the_tiers_make_is_in_the_training_exclusion(tmp_path):
    """The eval check writes ``make_all(seed=run seed)``; training excludes these keys (EVAL_SEEDS, EVAL_EXCLUDE)."""
    from k3_fastpath.sentinel.train import EVAL_EXCLUDE, EVAL_SEEDS

    manifest = make_all(tmp_path, seed=EVAL_SEEDS[0])
    for rel in manifest["files"]:
        task = rel.split("/")[0]
        keys = tasks.eval_prompt_keys(task, EVAL_SEEDS, EVAL_EXCLUDE[task])
        rows = [json.loads(line) for line in (tmp_path / rel).read_text().splitlines()]
        assert rows and all(tasks.prompt_key(task, r) in keys for r in rows), rel
    # and a row of another seed is not (the test can fail)
    other = tasks.items("gsm8k", "eval", 99, 1)[0]
    assert other.prompt_key not in tasks.eval_prompt_keys("gsm8k", EVAL_SEEDS, 50)
