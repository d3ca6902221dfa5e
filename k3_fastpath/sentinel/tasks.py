"""Seeded task generators in the real eval formats, for the eval files and for the sentinel's training data.

Three tasks, each item computed exactly from a ``random.Random`` seeded with a string (no ``hash()``
randomisation, so the same seed gives the same items in every process):

- ``gsm8k``: arithmetic word problems (2-3 steps) whose answer field is a GSM8K-style worked solution with
  ``<<a*b=c>>`` annotations ending ``#### <int>``; the answer the sentinel is trained to give works each
  calculation in it one place value at a time (``worked_gsm8k``, ``worked``) and is the row's ``solution``;
- ``aime25``: number-theory / counting problems with an integer answer in 0..999 (a string, as in
  math-ai/aime25); the worked solution (repeated squaring, inclusion-exclusion, the divisor-sum formula,
  triangular numbers; its divisions, products and sums worked by ``worked``) is the training target and
  the row's ``solution``;
- ``mrcr``: openai/mrcr-format conversations: the same request appears ``n_needles`` times among
  distractors, the last user turn asks for the i-th one prefixed with a random string;
- ``copy`` (training only, no eval file, not in the default mix): a piece of MRCR-style writing in the user
  turn, the answer that text word for word: every answer token a copy, a denser copy signal than MRCR's
  one needle a conversation (``train.TrainPlan.mix`` says what it did).

Each generator yields ``TaskItem``: ``record`` is the eval file's row (the fields the loader and scorers
read; GSM8K and AIME rows also hold the ``solution`` the sentinel is trained to write, whose likelihood
``likelihood.gold_answers`` scores; the generative evals never read it), ``messages`` the chat the model
sees with the answer it should give as the last (assistant) turn.
The eval split's streams are the ones ``evals.data.make_synthetic`` writes (the same items at any count);
the training split's streams are named apart, and ``train_items`` also drops any item whose prompt is in a
given eval set, so training and eval items are disjoint by construction and by check.
The prompts are the eval tasks' own (``evals/utils.py`` renders them with the functions here).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import worked

TASKS = ("gsm8k", "aime25", "mrcr")  # the eval tasks (each has eval files)
TRAIN_TASKS = (*TASKS, "copy")  # what a training mix may draw
# the tasks whose prompts reach a model through its chat template (K3 is a chat model, and its GSM8K / AIME
# numbers are chat numbers): the eval runner sends these as chats (``verify/evals/runner.py``) and the
# sentinel trains on the same rendering (``rows.item_row``); any other task is a plain completion of its
# prompt text
CHAT_TASKS = frozenset(TRAIN_TASKS)
SPLITS = ("eval", "train")
EVAL_NEEDLES = (2, 4, 8)  # the MRCR files an eval set holds, one per needle count
EVAL_MRCR_CHARS = 2000  # their conversations' length in characters
COPY_WORDS = (4, 64)  # a copy item's text: words, drawn uniformly

NAMES = ["Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "beads"]
FORMS = ["poem", "short story", "blog post", "haiku", "short essay", "social media post", "riddle", "limerick"]
TOPICS = ["tapirs", "rocks", "lighthouses", "glaciers", "bicycles", "owls", "volcanoes", "libraries", "kites",
          "harbors", "comets", "orchards"]
WORDS = ("amber quiet river stone morning lantern drift hollow meadow silver echo thread salt winter bloom "
         "cedar signal orbit ember tide velvet compass harbor dune prism willow static copper fern ribbon "
         "thunder garden mirror ladder canyon marble breeze quartz feather anchor "
         "acorn adobe agate alder almond alpine amulet apricot arbor archer arrow ash aspen atlas attic "
         "autumn aurora badger bamboo banner barley barn basalt basin beacon beech beetle bell berry birch "
         "bison blossom bluff bonfire boulder bramble brass bridge brook bucket buckle burrow butter cabin "
         "cactus camel candle canoe canvas cargo carpet castle cavern cellar chalk chapel cherry chimney "
         "cinder citadel clay cliff clover cobalt cocoa compost coral cottage cotton cradle crater creek "
         "crescent cricket crystal cypress daisy dawn delta desert dew dolphin dove dragon drum dusk eagle "
         "easel ebony elm emerald engine falcon fawn fiddle fig fjord flame flannel flint flute fog forest "
         "fossil fountain fox frost galaxy garnet gazelle geyser ginger glade glass glen goblet gorge granite "
         "grape gravel grove gull hammer harp hawk hazel heather hedge helmet heron hickory hill honey "
         "horizon iris island ivory ivy jade jasmine jasper jetty juniper kelp kettle kiln lagoon lake lark "
         "lava lemon lilac lily linen lotus lynx magnet mango maple marsh mast meteor mill mint mist moss "
         "moth mountain mulberry nectar nest nickel nutmeg oak oasis ocean olive onyx opal orchid otter "
         "paddle palm panther paper parrot pasture peach pearl pebble pepper petal pine plum pollen pond "
         "poplar poppy porch prairie pumpkin quill quilt rain raven reed reef ridge robin rope rose ruby rust "
         "saddle saffron sage sail sapphire satin scarf shadow shore shrub sky slate sled smoke snow sonnet "
         "sparrow spice spruce stable star storm straw stream summit sun swan sycamore tangerine teak temple "
         "thistle thorn tiger timber topaz torch tower trail tulip tundra turtle valley vapor vine violet "
         "walnut wave wheat whistle wick wind wolf wren yarrow zephyr zinc bright calm dim distant gentle "
         "golden hidden lonely narrow pale rapid rough scarlet shallow sleepy slow smooth soft steep swift "
         "tall tender vast warm wild wooden crimson dusty faint frozen gleaming humble misty silent sunny "
         "tiny ancient brave clever curious eager fierce fragile graceful hasty jolly keen lively mellow "
         "nimble proud restless rustic sturdy subtle weary woven").split()
# the MRCR replies' lexicon: the first MRCR_WORDS of WORDS (the eval files' and the default training data's)
MRCR_WORDS = 40
ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}
_PREFIX_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@dataclass(frozen=True)
class TaskItem:
    """One generated item: the eval row and the chat (prompt turns, then the answer turn)."""

    task: str
    record: dict[str, Any]
    messages: tuple[dict[str, str], ...]

    @property
    def prompt_key(self) -> str:
        return prompt_key(self.task, self.record)


def prompt_key(task: str, record: dict[str, Any]) -> str:
    """What identifies an item's question, read from its eval row (the disjointness check compares these)."""
    return record[{"gsm8k": "question", "aime25": "problem", "mrcr": "prompt", "copy": "text"}[task]]


# ---------------------------------------------------------------- prompts (the eval tasks' own)
def gsm8k_prompt(doc: dict[str, Any]) -> str:
    return ("Solve the math word problem. Show your steps, then give the final answer as an integer on a "
            f"last line of the form '#### <answer>'.\n\nQuestion: {doc['question']}\nAnswer:")


def aime_prompt(doc: dict[str, Any]) -> str:
    return ("Solve the problem. The answer is an integer from 0 to 999; put it in \\boxed{} at the end.\n\n"
            f"Problem: {doc['problem']}\nSolution:")


def _ordinal(n: int) -> str:
    return ORDINALS.get(n, f"{n}th")


def stream(task: str, split: str, seed: int, n_needles: int | None = None) -> random.Random:
    """The seeded stream of ``task`` (``mrcr`` per needle count) in ``split``: eval streams are those the
    eval files were always made from; training streams are named apart."""
    if task not in TRAIN_TASKS or split not in SPLITS or (split == "eval" and task not in TASKS):
        raise ValueError(f"unknown task/split {task!r}/{split!r}: tasks {TASKS} (training also {TRAIN_TASKS}), "
                         f"splits {SPLITS}")
    if (task == "mrcr") != (n_needles is not None):
        raise ValueError("n_needles is required for mrcr and only for mrcr")
    name = f"mrcr{n_needles}" if task == "mrcr" else task
    return random.Random(f"k3-{name}:{seed}" if split == "eval" else f"k3-sentinel-train:{name}:{seed}")


# ---------------------------------------------------------------- GSM8K
def gsm8k_item(rng: random.Random) -> TaskItem:
    name = rng.choice(NAMES)
    kind = rng.randrange(4)
    if kind == 0:
        item = rng.choice(ITEMS)
        a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(2, 12)
        bc, total = b * c, a + b * c
        q = f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack. How many {item} does {name} have now?"
        steps = [f"The packs hold {b} * {c} = <<{b}*{c}={bc}>>{bc} {item}.",
                 f"{name} now has {a} + {bc} = <<{a}+{bc}={total}>>{total} {item}."]
    elif kind == 1:
        rate, hours, days = rng.randint(8, 30), rng.randint(2, 8), rng.randint(2, 6)
        earned = rate * hours * days
        spent = rng.randint(1, earned - 1)
        total = earned - spent
        q = (f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
             f"Then {name} spends ${spent} on a bike. How many dollars does {name} have left?")
        steps = [f"Per day {name} earns {rate} * {hours} = <<{rate}*{hours}={rate * hours}>>{rate * hours} dollars.",
                 f"Over {days} days that is {rate * hours} * {days} = <<{rate * hours}*{days}={earned}>>{earned} dollars.",
                 f"After the bike {name} has {earned} - {spent} = <<{earned}-{spent}={total}>>{total} dollars."]
    elif kind == 2:
        per_box, boxes, eaten = rng.randint(3, 12), rng.randint(4, 20), rng.randint(1, 30)
        made = per_box * boxes + eaten
        total = boxes
        q = (f"A baker makes {made} cookies. {eaten} of them break, and the rest are packed into boxes of "
             f"{per_box}. How many boxes are filled?")
        steps = [f"Unbroken cookies: {made} - {eaten} = <<{made}-{eaten}={made - eaten}>>{made - eaten}.",
                 f"Boxes: {made - eaten} / {per_box} = <<{made - eaten}/{per_box}={total}>>{total}."]
    else:
        older, young, later = rng.randint(2, 30), rng.randint(3, 40), rng.randint(1, 15)
        other = rng.choice([n for n in NAMES if n != name])
        now = young + older
        total = now + later
        q = f"{name} is {older} years older than {other}. {other} is {young} years old. How old will {name} be in {later} years?"
        steps = [f"{name} is {young} + {older} = <<{young}+{older}={now}>>{now} years old now.",
                 f"In {later} years {name} will be {now} + {later} = <<{now}+{later}={total}>>{total}."]
    answer = "\n".join(steps) + f"\n#### {total}"
    record = {"question": q, "answer": answer, "solution": worked_gsm8k(answer)}
    return TaskItem("gsm8k", record, ({"role": "user", "content": gsm8k_prompt(record)},
                                      {"role": "assistant", "content": record["solution"]}))


_CALC = re.compile(r"<<(\d+)([*/+-])(\d+)=(\d+)>>")
_WORK = {"*": worked.mul, "/": worked.floor_div, "+": worked.add, "-": worked.sub}


def worked_gsm8k(answer: str) -> str:
    """A GSM8K answer with each ``<<a op b=c>>`` worked one place value at a time (``worked``): the sentinel's
    training answer (the eval row keeps GSM8K's own form; the scorer reads ``#### n`` only), so no step asks
    the model for a multi-digit product, quotient, sum or difference in one go."""
    def work(m: re.Match) -> str:
        value, text = _WORK[m[2]](int(m[1]), int(m[3]))
        if value != int(m[4]):
            raise ValueError(f"<<{m[0]}>>: worked to {value}")
        return f"<<{text}>>"

    return _CALC.sub(work, answer)


# ---------------------------------------------------------------- AIME
def _pow_mod_steps(a: int, b: int, m: int) -> tuple[int, list[str]]:
    """a^b mod m by repeated squaring, one line per squaring and per multiplication."""
    bits = bin(b)[2:]
    steps = [f"Write {b} in binary: {bits}. Square {a} repeatedly modulo {m}."]
    sq, powers = a % m, []
    for i in range(len(bits)):
        if i:
            nxt = sq * sq % m
            steps.append(f"{a}^{1 << i} = {sq}^2 = {sq * sq} = {nxt} (mod {m}).")
            sq = nxt
        else:
            steps.append(f"{a}^1 = {sq} (mod {m}).")
        if bits[-1 - i] == "1":
            powers.append((1 << i, sq))
    acc = powers[0][1]
    for e, v in powers[1:]:
        nxt = acc * v % m
        steps.append(f"Multiply by {a}^{e}: {acc} * {v} = {acc * v} = {nxt} (mod {m}).")
        acc = nxt
    return acc, steps


def _factor(n: int) -> list[tuple[int, int]]:
    out, p = [], 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n, e = n // p, e + 1
        if e:
            out.append((p, e))
        p += 1
    if n > 1:
        out.append((n, 1))
    return out


def _triangle(n: int) -> tuple[int, str]:
    """``(n - 1) * n / 2`` worked: the even factor halved, then the product (one sentence)."""
    even, odd = (n - 1, n) if (n - 1) % 2 == 0 else (n, n - 1)
    half, t_half = worked.floor_div(even, 2)
    tri, t_mul = worked.mul(half, odd)
    return tri, f"Halve {even}: {t_half}, so {even}/2 = {half}. Then {t_mul}."


def aime_item(rng: random.Random, i: int) -> TaskItem:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(3, 97), rng.randint(50, 2025)
        problem = f"Find the remainder when ${a}^{{{b}}}$ is divided by $1000$."
        ans, steps = _pow_mod_steps(a, b, 1000)
    elif kind == 1:
        n, p, q = rng.randint(200, 2000), rng.randint(2, 9), rng.randint(10, 23)
        lcm = p * q // math.gcd(p, q)
        problem = (f"Find the number of positive integers $n \\le {n}$ that are divisible by exactly one of "
                   f"${p}$ and ${q}$.")
        (mp, tp), (mq, tq), (mb, tb) = (worked.floor_div(n, x) for x in (p, q, lcm))
        both, t2 = worked.mul(2, mb)
        total, ts = worked.add(mp, mq)
        ans, td = worked.sub(total, both)
        steps = [f"Multiples of {p}: {tp}, so floor({n}/{p}) = {mp}.",
                 f"Multiples of {q}: {tq}, so floor({n}/{q}) = {mq}.",
                 f"Multiples of both, i.e. of lcm({p}, {q}) = {lcm}: {tb}, so floor({n}/{lcm}) = {mb}.",
                 f"Exactly one: {mp} + {mq} - 2 * {mb}. {t2}. {ts}. {td}. So {ans}."]
    elif kind == 2:
        n = rng.randint(100, 5000)
        fac = _factor(n)
        sums = [(p ** (e + 1) - 1) // (p - 1) for p, e in fac]
        steps = [f"{n} = " + " * ".join(f"{p}^{e}" for p, e in fac) + "."]
        for (p, e), s in zip(fac, sums, strict=True):
            steps.append(f"The divisors' sum over {p}^{e} is ({p}^{e + 1} - 1) / ({p} - 1) = {s}.")
        sigma = sums[0]
        for s in sums[1:]:
            prod, text = worked.mul(sigma, s)
            steps.append(f"{text}.")
            sigma = prod
        ans = sigma % 1000
        steps.append(f"S = {' * '.join(map(str, sums))} = {sigma}, and {sigma} mod 1000 = {ans}.")
        problem = f"Let $S$ be the sum of all positive divisors of ${n}$. Find the remainder when $S$ is divided by $1000$."
    elif kind == 3:
        n = rng.randint(50, 900)
        tri, work = _triangle(n)
        ans = tri % 1000
        problem = (f"Let $N$ be the number of ordered pairs $(x, y)$ of positive integers with $x + y \\le {n}$. "
                   f"Find the remainder when $N$ is divided by $1000$.")
        steps = [f"For x + y = s there are s - 1 pairs, so N = 1 + 2 + ... + {n - 1} = {n - 1} * {n} / 2.", work,
                 f"N = {tri}, and {tri} mod 1000 = {ans}."]
    else:
        a, d, k = rng.randint(1, 50), rng.randint(1, 9), rng.randint(20, 300)
        tri, work = _triangle(k)
        scaled, t_mul = worked.mul(d, tri)
        val, t_add = worked.add(scaled, a)
        ans = val % 1000
        problem = (f"A sequence has $a_1 = {a}$ and $a_{{n+1}} = a_n + {d}n$ for $n \\ge 1$. "
                   f"Find the remainder when $a_{{{k}}}$ is divided by $1000$.")
        steps = [f"a_{k} = {a} + {d} * (1 + 2 + ... + {k - 1}) = {a} + {d} * ({k - 1} * {k} / 2).", work,
                 f"{t_mul}. {t_add}. So a_{k} = {val}, and {val} mod 1000 = {ans}."]
    record = {"id": f"synthetic-{i}", "problem": problem, "answer": str(ans),
              "solution": " ".join(steps) + f" The answer is \\boxed{{{ans}}}."}
    return TaskItem("aime25", record, ({"role": "user", "content": aime_prompt(record)},
                                       {"role": "assistant", "content": record["solution"]}))


# ---------------------------------------------------------------- MRCR
def _text(rng: random.Random, form: str, topic: str, chars: int, lexicon: int) -> str:
    """A made-up piece of writing of about ``chars`` characters from the first ``lexicon`` of ``WORDS``,
    mentioning its topic once."""
    words = [rng.choice(WORDS[:lexicon]) for _ in range(max(6, chars // 7))]
    words.insert(rng.randrange(len(words)), topic)
    lines = [" ".join(words[i:i + 8]).capitalize() + "." for i in range(0, len(words), 8)]
    return ("\n" if form in ("poem", "haiku", "limerick") else " ").join(lines)


def mrcr_item(rng: random.Random, n_needles: int, n_chars: int, lexicon: int = MRCR_WORDS) -> TaskItem:
    if not 1 <= lexicon <= len(WORDS):
        raise ValueError(f"an MRCR lexicon is 1..{len(WORDS)} words, got {lexicon}")
    form, topic = rng.choice(FORMS), rng.choice(TOPICS)
    reply_chars = max(40, min(400, n_chars // (3 * n_needles)))
    asks: list[tuple[str, str]] = [(form, topic)] * n_needles
    total = n_needles * (reply_chars + 30)
    while total < n_chars or len(asks) < 2 * n_needles:
        # distractors share the form or the topic half of the time: the model must tell them apart
        f = form if rng.random() < 0.25 else rng.choice(FORMS)
        t = topic if (f != form and rng.random() < 0.5) else rng.choice([x for x in TOPICS if x != topic])
        asks.append((f, t))
        total += reply_chars + 30
    rng.shuffle(asks)
    messages: list[dict[str, str]] = []
    needle_replies: list[tuple[int, str]] = []
    for f, t in asks:
        messages.append({"role": "user", "content": f"write a {f} about {t}"})
        reply = _text(rng, f, t, reply_chars, lexicon)
        if (f, t) == (form, topic):
            needle_replies.append((len(messages), reply))
        messages.append({"role": "assistant", "content": reply})
    desired = rng.randint(1, n_needles)
    prefix = "".join(rng.choice(_PREFIX_ALPHABET) for _ in range(10))
    messages.append({"role": "user", "content": f"Prepend {prefix} to the {_ordinal(desired)} (1 indexed) {form} "
                                                f"about {topic}. Do not include any other text in your response."})
    msg_index, reply = needle_replies[desired - 1]
    record = {"prompt": json.dumps(messages, ensure_ascii=False), "answer": prefix + reply,
              "random_string_to_prepend": prefix, "n_needles": n_needles, "desired_msg_index": msg_index,
              "total_messages": len(messages), "n_chars": sum(len(m["content"]) for m in messages)}
    return TaskItem("mrcr", record, (*messages, {"role": "assistant", "content": record["answer"]}))


def copy_item(rng: random.Random, lexicon: int = MRCR_WORDS) -> TaskItem:
    """A ``copy`` item: MRCR-style text of ``COPY_WORDS`` words in the user turn, the answer that text."""
    form, topic = rng.choice(FORMS), rng.choice(TOPICS)
    text = _text(rng, form, topic, 7 * rng.randint(*COPY_WORDS), lexicon)
    record = {"text": text, "answer": text}
    return TaskItem("copy", record, ({"role": "user", "content": f"Repeat this {form} word for word.\n\n{text}"},
                                     {"role": "assistant", "content": text}))


# ---------------------------------------------------------------- item streams
def _next(task: str, rng: random.Random, i: int, n_needles: int | None, mrcr_chars: int, mrcr_words: int
          ) -> TaskItem:
    if task == "gsm8k":
        return gsm8k_item(rng)
    if task == "aime25":
        return aime_item(rng, i)
    if task == "copy":
        return copy_item(rng, mrcr_words)
    return mrcr_item(rng, n_needles, mrcr_chars, mrcr_words)


def items(task: str, split: str, seed: int, n: int, *, n_needles: int | None = None,
          mrcr_chars: int = EVAL_MRCR_CHARS, mrcr_words: int = MRCR_WORDS) -> list[TaskItem]:
    """The first ``n`` items of ``task``'s stream in ``split``."""
    rng = stream(task, split, seed, n_needles)
    return [_next(task, rng, i, n_needles, mrcr_chars, mrcr_words) for i in range(n)]


def eval_prompt_keys(task: str, seeds: tuple[int, ...], n: int) -> set[str]:
    """The prompt keys of the first ``n`` items of every eval file of ``task`` (MRCR: each of
    ``EVAL_NEEDLES`` at ``EVAL_MRCR_CHARS``) made with each of ``seeds``; none for a training-only task."""
    if task not in TASKS:
        return set()
    needles = EVAL_NEEDLES if task == "mrcr" else (None,)
    return {t.prompt_key for s in seeds for k in needles for t in items(task, "eval", s, n, n_needles=k)}


def train_streams(task: str, seed: int, exclude: set[str], needles: tuple[int, ...], mrcr_chars: int,
                  mrcr_words: int = MRCR_WORDS) -> list[Iterator[TaskItem]]:
    """``task``'s training streams under ``seed`` (``train_items``): one for GSM8K / AIME, one per needle
    count of ``needles`` for MRCR (conversations of ``mrcr_chars``, replies from ``mrcr_words`` words; ``copy``'s
    texts from those words too)."""
    if task != "mrcr":
        return [train_items(task, seed, exclude, mrcr_words=mrcr_words)]
    return [train_items(task, seed, exclude, n_needles=n, mrcr_chars=mrcr_chars, mrcr_words=mrcr_words)
            for n in needles]


def train_items(task: str, seed: int, exclude: set[str], *, n_needles: int | None = None,
                mrcr_chars: int = EVAL_MRCR_CHARS, mrcr_words: int = MRCR_WORDS) -> Iterator[TaskItem]:
    """An endless stream of training items of ``task``, skipping every item whose ``prompt_key`` is in
    ``exclude`` (the eval sets' keys): no eval question is ever trained on."""
    rng = stream(task, "train", seed, n_needles)
    i = 0
    while True:
        item = _next(task, rng, i, n_needles, mrcr_chars, mrcr_words)
        i += 1
        if item.prompt_key not in exclude:
            yield item
