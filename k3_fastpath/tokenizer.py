"""A tiny, deterministic, locally trained tokenizer for models made on the spot (k3-tiny, the tiny Llama).

Why: the verification stack needs a real Hugging Face tokenizer with a chat template for every engine
(the builtin generator, a vLLM server, lm-eval), and nothing may be downloaded. So we train one:

1. Generate text from ``random.Random(seed)``: English-like words built from syllables, numbers, JSON
   objects / arrays (keys, strings, integers, booleans, ``null``, every JSON punctuation mark) and
   ChatML-framed turns, so structured output (JSON, regexes over digits and words) is expressible in
   few tokens.
2. Train a byte-level BPE with ``tokenizers`` (all 256 byte symbols are in the alphabet, so any string
   encodes; nothing is ever unknown) to exactly ``vocab_size`` entries.
3. Wrap it as ``PreTrainedTokenizerFast`` with three special tokens at fixed ids, matching the k3-tiny
   preset (pad 0, bos 1, eos 2): ``<|endoftext|>`` (pad) = 0, ``<|im_start|>`` (bos) = 1,
   ``<|im_end|>`` (eos) = 2, and a ChatML chat template.

Same ``(vocab_size, seed)`` -> the same vocabulary and merges, and ``save_tiny_tokenizer`` writes
byte-identical files (tests/test_tokenizer.py checks this across processes with different hash seeds).
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2 in this order
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# ChatML; `add_generation_prompt` opens the assistant turn. No system prompt is injected.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)



@functools.cache
def _chat_template():
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # what transformers renders chat templates with

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def render_chat(messages, add_generation_prompt: bool = False) -> str:
    """``CHAT_TEMPLATE`` rendered over ``messages`` (what ``apply_chat_template(..., tokenize=False)`` gives),
    for text made before any tokenizer exists."""
    return _chat_template().render(messages=list(messages), add_generation_prompt=add_generation_prompt)


_BYTE_ALPHABET = 256
MIN_VOCAB = len(SPECIAL_TOKENS) + _BYTE_ALPHABET + 1  # at least one merge
MAX_VOCAB = 4096  # the default corpus yields ~4970 tokens at min_frequency 2; beyond that exactness fails

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
           "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl", "sp", "st", "th", "tr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rd", "st", "ck", "sh", "th"]
_FUNCTION_WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was",
                   "at", "by", "this", "from", "or", "be", "are", "not", "what", "how", "many", "answer"]
_KEYWORDS = ["true", "false", "null", "name", "age", "id", "items", "value", "type", "city", "count", "user",
             "assistant", "system", "yes", "no", "red", "green", "blue", "color", "score", "list"]


class _TextMaker:
    """Seeded generator of the training text (one instance per corpus; no global random state)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        # a Zipf-like lexicon: a few hundred invented words, drawn with weights 1/rank
        words = sorted({self._invent() for _ in range(600)})
        self.rng.shuffle(words)
        self.lexicon = _FUNCTION_WORDS + _KEYWORDS + words
        self.cum_weights = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(self.lexicon))))

    def _invent(self) -> str:
        r = self.rng
        return "".join(r.choice(_ONSETS) + r.choice(_NUCLEI) + r.choice(_CODAS) for _ in range(r.randint(1, 3)))

    def word(self) -> str:
        return self.rng.choices(self.lexicon, cum_weights=self.cum_weights)[0]

    def number(self) -> str:
        r = self.rng
        kind = r.random()
        if kind < 0.5:
            return str(r.randint(0, 99))
        if kind < 0.8:
            return str(r.randint(100, 99999))
        if kind < 0.9:
            return f"-{r.randint(1, 999)}"
        return f"{r.randint(0, 999)}.{r.randint(0, 99)}"

    def sentence(self) -> str:
        r = self.rng
        parts = []
        for _ in range(r.randint(4, 14)):
            parts.append(self.number() if r.random() < 0.12 else self.word())
        s = " ".join(parts)
        return s[0].upper() + s[1:] + r.choice([".", ".", ".", "?", "!", ",", ":"])

    def json_value(self, depth: int = 0) -> str:
        r = self.rng
        kind = r.random()
        if depth < 2 and kind < 0.15:
            return self.json_object(depth + 1)
        if depth < 2 and kind < 0.25:
            return "[" + ",".join(self.json_value(depth + 1) for _ in range(r.randint(0, 4))) + "]"
        if kind < 0.55:
            return '"' + " ".join(self.word() for _ in range(r.randint(1, 3))) + '"'
        if kind < 0.85:
            return self.number()
        return r.choice(["true", "false", "null"])

    def json_object(self, depth: int = 0) -> str:
        r = self.rng
        sep = r.choice([":", ": "])
        comma = r.choice([",", ", "])
        items = [f'"{self.word()}"{sep}{self.json_value(depth)}' for _ in range(r.randint(1, 4))]
        return "{" + comma.join(items) + "}"

    def chat_turn(self) -> str:
        r = self.rng
        role = r.choice(["user", "assistant", "system"])
        body = self.json_object() if r.random() < 0.3 else self.sentence()
        return f"{BOS_TOKEN}{role}\n{body}{EOS_TOKEN}\n"

    def document(self) -> str:
        r = self.rng
        kind = r.random()
        if kind < 0.45:
            return " ".join(self.sentence() for _ in range(r.randint(1, 5)))
        if kind < 0.75:
            return self.json_object()
        if kind < 0.9:
            return "".join(self.chat_turn() for _ in range(r.randint(1, 3)))
        a, b = r.randint(1, 999), r.randint(1, 999)
        return f"Question: what is {a} + {b}? Answer: {a + b}. #### {a + b}"


def tiny_corpus(seed: int = 0, n_docs: int = 3000) -> list[str]:
    """The seeded training text: ``n_docs`` short documents (prose, JSON, ChatML turns, arithmetic)."""
    maker = _TextMaker(seed)
    return [maker.document() for _ in range(n_docs)]


def _train(vocab_size: int, corpus: list[str], split_digits: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # one token per digit where asked: arithmetic then sees every number digit by digit
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tiny_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens (specials included),
    trained on seeded generated text, with a ChatML chat template. Deterministic in ``(vocab_size, seed)``."""
    return build_tokenizer(vocab_size, tiny_corpus(seed))


def build_tokenizer(vocab_size: int, corpus: list[str], *, split_digits: bool = False):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens (the three specials at
    ids 0-2, all 256 bytes, merges learnt from ``corpus``) with the ChatML template; ``split_digits`` makes
    every digit its own token. Deterministic in its arguments."""
    if not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be an int in [{MIN_VOCAB}, {MAX_VOCAB}] (3 special tokens + 256 bytes "
                         f"+ merges), got {vocab_size!r}")
    from transformers import PreTrainedTokenizerFast

    tok = _train(vocab_size, corpus, split_digits)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"tokenizer: training gave {got} tokens, not the {vocab_size} asked for "
                           f"(the corpus has too few distinct merges)")
    for want_id, text in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(text) != want_id:
            raise RuntimeError(f"tokenizer: {text} got id {tok.token_to_id(text)}, expected {want_id}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=1 << 20,
    )


def save_tiny_tokenizer(path: str | Path, vocab_size: int, seed: int = 0):
    """Build the tiny tokenizer and ``save_pretrained`` it into ``path`` (created); returns the tokenizer."""
    return save_tokenizer(build_tiny_tokenizer(vocab_size, seed), path)


def save_tokenizer(tokenizer, path: str | Path):
    """``save_pretrained`` a tokenizer of ``build_tokenizer`` into ``path`` (created), loadable by
    transformers 4.x and 5; returns the tokenizer."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    # transformers 5 names its class "TokenizersBackend", which transformers 4.x cannot resolve; the
    # portable name loads the same tokenizer.json under both
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return tokenizer
