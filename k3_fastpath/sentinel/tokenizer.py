"""The sentinel's own tokenizer: a byte-level BPE of the k3-sentinel vocabulary (1024 tokens) trained on
the sentinel's training text, every digit its own token (multi-step arithmetic is then learnt digit by
digit, and a number's tokens never depend on its neighbours).

The corpus is ChatML-framed chats (the template the engines apply) of items from the training streams of
``tasks`` (never an eval item): GSM8K- and AIME-style worked solutions and short MRCR conversations.
Deterministic in ``(vocab_size, seed)``: same vocabulary, merges and saved files in every process.
"""

from __future__ import annotations

from pathlib import Path

from ..tokenizer import build_tokenizer, render_chat, save_tokenizer
from . import tasks

SENTINEL_VOCAB = 1024  # the k3-sentinel preset's vocab_size
CORPUS_ITEMS = {"gsm8k": 1500, "aime25": 1500, "mrcr": 150}  # training items per task in the corpus


def sentinel_corpus(seed: int = 0, mrcr_words: int = tasks.MRCR_WORDS) -> list[str]:
    """The tokenizer's training text: ``CORPUS_ITEMS`` chats per task from the training streams (MRCR's
    replies from the first ``mrcr_words`` of ``tasks.WORDS``)."""
    out = []
    for task, n in CORPUS_ITEMS.items():
        kw = {"n_needles": 2, "mrcr_chars": 1500, "mrcr_words": mrcr_words} if task == "mrcr" else {}
        out.extend(render_chat(item.messages) for item in tasks.items(task, "train", seed, n, **kw))
    return out


def build_sentinel_tokenizer(vocab_size: int = SENTINEL_VOCAB, seed: int = 0, mrcr_words: int = tasks.MRCR_WORDS):
    """The sentinel's ``PreTrainedTokenizerFast`` (pad 0, bos 1, eos 2, ChatML template, digits split)."""
    return build_tokenizer(vocab_size, sentinel_corpus(seed, mrcr_words), split_digits=True)


def save_sentinel_tokenizer(path: str | Path, vocab_size: int = SENTINEL_VOCAB, seed: int = 0):
    """Build the sentinel tokenizer and save it into ``path`` (a checkpoint directory); returns it."""
    return save_tokenizer(build_sentinel_tokenizer(vocab_size, seed), path)
