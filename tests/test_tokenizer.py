"""The tiny locally trained tokenizer: exact size, fixed special ids, lossless, deterministic, ChatML."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="needs tokenizers/transformers (scripts/bootstrap --eval)")
pytest.importorskip("transformers", reason="needs tokenizers/transformers (scripts/bootstrap --eval)")

from k3_fastpath.tokenizer import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    EOS_TOKEN,
    MAX_VOCAB,
    MIN_VOCAB,
    PAD_ID,
    build_tiny_tokenizer,
    save_tiny_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok512():
    return build_tiny_tokenizer(512, seed=0)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("vocab", [MIN_VOCAB, 512, 1000, MAX_VOCAB])
def test_exact_vocab_size_and_special_ids(vocab):
    tok = build_tiny_tokenizer(vocab, seed=3)
    assert len(tok) == vocab
    assert max(tok.get_vocab().values()) == vocab - 1
    # k3-tiny's ids: pad 0, bos 1, eos 2
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("bad", [0, MIN_VOCAB - 1, MAX_VOCAB + 1, 512.0])
def test_bad_vocab_size_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="vocab_size must be an int"):
        build_tiny_tokenizer(bad)


def test_lossless_on_random_text(tok512):
    """Byte-level BPE: any string (random unicode, JSON, digits) round-trips exactly."""
    rng = random.Random(os.urandom(8))
    alphabet = 'abcXYZ0123456789 {}[]":,.-_\n\téß中文😀\\'
    for _ in range(50):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        ids = tok512.encode(s, add_special_tokens=True)
        assert all(0 <= i < 512 for i in ids)
        assert tok512.decode(ids) == s
        assert EOS_ID not in ids  # nothing is added implicitly


def test_common_text_compresses(tok512):
    """Merges were learned from the JSON/prose corpus: structured text takes fewer tokens than bytes."""
    s = '{"name": "the answer", "age": 42, "items": [true, false, null]}'
    assert len(tok512.encode(s)) < 0.6 * len(s.encode())


def test_chat_template_is_chatml(tok512):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": 'say {"a": 1}'}]
    text = tok512.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"
    assert text == expected
    ids = tok512.encode(text, add_special_tokens=False)
    assert ids.count(BOS_ID) == 3 and ids.count(EOS_ID) == 2
    assert tok512.decode(ids) == expected
    assert EOS_TOKEN == tok512.eos_token


def test_saved_files_byte_identical_across_processes(tmp_path):
    """Same (vocab, seed) -> byte-identical files, also from another process with another hash seed;
    another seed -> another vocabulary."""
    a = tmp_path / "a"
    save_tiny_tokenizer(a, 512, seed=7)
    b = tmp_path / "b"
    code = f"from k3_fastpath.tokenizer import save_tiny_tokenizer; save_tiny_tokenizer({str(b)!r}, 512, seed=7)"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "TOKENIZERS_PARALLELISM": "true"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)
    fa, fb = _files(a), _files(b)
    assert "tokenizer.json" in fa and fa.keys() == fb.keys()
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between two builds of the same seed"
    c = tmp_path / "c"
    save_tiny_tokenizer(c, 512, seed=8)
    assert _files(c)["tokenizer.json"] != fa["tokenizer.json"]


def test_saved_dir_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = save_tiny_tokenizer(tmp_path, 600, seed=1)
    # the portable class name (transformers 5 would write "TokenizersBackend", unknown to 4.x)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(loaded) == 600
    s = "Question: what is 12 + 30? Answer: 42."
    assert loaded.encode(s) == tok.encode(s)
    assert loaded.chat_template == tok.chat_template
