"""The sentinel's tokenizer: the preset's vocabulary exactly, digits one token each, the chat rendering the
engines apply, and byte-identical files across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3_fastpath.presets import preset
from k3_fastpath.sentinel import tasks
from k3_fastpath.sentinel.tokenizer import SENTINEL_VOCAB, build_sentinel_tokenizer
from k3_fastpath.tokenizer import BOS_ID, EOS_ID, PAD_ID, render_chat

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return build_sentinel_tokenizer()


def test_the_vocabulary_is_the_presets_with_the_specials_at_their_ids(tok):
    cfg = preset("k3-sentinel").config
    assert len(tok) == SENTINEL_VOCAB == cfg.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)


def test_every_digit_is_its_own_token(tok):
    for text in ("#### 1234", "= <<17*23=391>>391", "2^{2025} mod 1000 = 625"):
        pieces = tok.convert_ids_to_tokens(tok(text)["input_ids"])
        digits = [p.lstrip("Ġ") for p in pieces if any(c.isdigit() for c in p)]
        assert digits and all(len(d) == 1 and d.isdigit() for d in digits), pieces


def test_the_chat_rendering_is_the_templates_and_round_trips(tok):
    for task, kw in (("gsm8k", {}), ("aime25", {}), ("mrcr", {"n_needles": 2, "mrcr_chars": 1200})):
        for item in tasks.items(task, "eval", 4, 5, **kw):
            text = render_chat(item.messages)
            assert text == tok.apply_chat_template(list(item.messages), tokenize=False)
            assert render_chat(item.messages[:-1], add_generation_prompt=True) == tok.apply_chat_template(
                list(item.messages[:-1]), tokenize=False, add_generation_prompt=True)
            assert text.count("<|im_start|>") == len(item.messages)
            assert tok.decode(tok(text)["input_ids"]) == text


_SAVE = ("import sys; from k3_fastpath.sentinel.tokenizer import save_sentinel_tokenizer; "
         "save_sentinel_tokenizer(sys.argv[1])")


def test_the_saved_files_are_byte_identical_across_processes(tmp_path):
    digests = []
    for i, hash_seed in enumerate(("0", "12345")):
        out = tmp_path / f"t{i}"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", _SAVE, str(out)], check=True, cwd=REPO, env=env)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())})
    assert digests[0] == digests[1] and "tokenizer.json" in digests[0]


@pytest.mark.parametrize("tier", ["standard", "full", str(REPO / "scripts/gpu/sentinel-evals.yaml")])
def test_every_tier_gives_the_sentinel_room_for_the_answers_it_was_trained_to_write(tok, tier):
    """Each eval of a tier that scores the sentinel has ``max_tokens`` at least the longest training-form
    answer (the worked solution, the prefixed needle) among the items it scores (GPU sizes, the first 200 at
    least): a cap below it would cut right answers short and score them wrong."""
    from verify.tiers import load_tier

    eos = 1  # the answer's end of turn
    for check in load_tier(tier).checks:
        params = check.params_for("cuda")
        if not check.id.startswith("evals.") or params.get("model") != "sentinel":
            continue
        task = check.id.removeprefix("evals.")
        if task == "mrcr":
            groups = [tasks.items("mrcr", "eval", 0, params["limit"], n_needles=k, mrcr_chars=n)
                      for k in params["needles"] for n in params.get("lengths") or [tasks.EVAL_MRCR_CHARS]]
        else:
            groups = [tasks.items(task, "eval", 0, max(params["limit"], 200))]
        longest = max(len(tok(it.messages[-1]["content"], add_special_tokens=False)["input_ids"]) + eos
                      for group in groups for it in group)
        assert params["max_tokens"] >= longest, (tier, check.id, params["max_tokens"], longest)


def _ambiguous_share(tok, item, context: int) -> float:
    """Of the needle's tokens, the share whose ``context`` preceding tokens also precede another token in
    some other message of the conversation (a copy keyed on that context could go wrong there)."""
    import json

    msgs = json.loads(item.record["prompt"])
    k = item.record["desired_msg_index"]
    ids = [tok(m["content"], add_special_tokens=False)["input_ids"] for m in msgs]
    follows: dict[tuple[int, ...], set[int]] = {}
    for i, seq in enumerate(ids):
        if i != k:
            for j in range(context, len(seq)):
                follows.setdefault(tuple(seq[j - context: j]), set()).add(seq[j])
    needle = ids[k]
    hits = [bool(follows.get(tuple(needle[j - context: j]), set()) - {needle[j]}) for j in range(context, len(needle))]
    return sum(hits) / len(hits)


@pytest.mark.parametrize("chars", [1500, 41000])
def test_an_mrcr_needle_is_copyable_from_its_last_four_tokens(tok, chars):
    """MRCR asks for a message repeated verbatim; its words come from a few dozen, so one token of context
    is almost never enough to know the next, but four are (<= 1% of the needle's tokens ambiguous, trained
    and scored lengths): the task can be solved by a short-context copy, so a sentinel that does not learn
    it (bundles/runs/2026-12-07-h100-session28: ~0%) is short of training, not of information."""
    items = tasks.items("mrcr", "eval", 0, 6, n_needles=2, mrcr_chars=chars)
    share = {c: sum(_ambiguous_share(tok, it, c) for it in items) / len(items) for c in (1, 4)}
    assert share[1] > 0.5 and share[4] <= 0.01, share
