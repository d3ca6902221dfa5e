"""Small seeded datasets in the real formats: ``python -m evals.data.make_synthetic --out DIR``.

Tests and CPU runs cannot fetch GSM8K, AIME25 or MRCR; these generators make stand-ins whose *format*
is the real one (field names, the ``#### <int>`` answer line, MRCR's JSON message list with its prefix
rule), so the same task YAMLs, loaders and scorers run on both. Content is generated, answers are
computed exactly:

- GSM8K: arithmetic word problems (2-3 steps) with GSM8K-style worked answers ending ``#### <int>``;
- AIME25: number-theory/counting problems whose answer is an integer in 0..999 (as a string, like
  math-ai/aime25);
- MRCR: multi-turn conversations in openai/mrcr's format: ``prompt`` is a JSON list of chat messages in
  which the same request ("write a poem about tapirs") appears ``n_needles`` times among distractors, the
  last user turn asks for the i-th one with a random prefix; ``answer`` = prefix + that response. The
  conversation grows to ``--mrcr-chars`` characters, so needles sit at any length.

The same ``--seed`` gives byte-identical files (``random.Random`` seeded with a string, no hash()
randomisation); ``DIR/MANIFEST.json`` lists each file's SHA-256.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from evals.data.sources import sha256_file

NAMES = ["Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "beads"]
FORMS = ["poem", "short story", "blog post", "haiku", "short essay", "social media post", "riddle", "limerick"]
TOPICS = ["tapirs", "rocks", "lighthouses", "glaciers", "bicycles", "owls", "volcanoes", "libraries", "kites",
          "harbors", "comets", "orchards"]
WORDS = ("amber quiet river stone morning lantern drift hollow meadow silver echo thread salt winter bloom "
         "cedar signal orbit ember tide velvet compass harbor dune prism willow static copper fern ribbon "
         "thunder garden mirror ladder canyon marble breeze quartz feather anchor").split()
ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}


def _ordinal(n: int) -> str:
    return ORDINALS.get(n, f"{n}th")


# ---------------------------------------------------------------- GSM8K
def _gsm8k_item(rng: random.Random) -> dict[str, str]:
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
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {total}"}


# ---------------------------------------------------------------- AIME
def _divisor_sum(n: int) -> int:
    return sum(d for d in range(1, n + 1) if n % d == 0)


def _aime_item(rng: random.Random, i: int) -> dict[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(3, 97), rng.randint(50, 2025)
        problem, ans = f"Find the remainder when ${a}^{{{b}}}$ is divided by $1000$.", pow(a, b, 1000)
    elif kind == 1:
        n, p, q = rng.randint(200, 2000), rng.randint(2, 9), rng.randint(10, 23)
        ans = sum(1 for k in range(1, n + 1) if (k % p == 0) != (k % q == 0))
        problem = (f"Find the number of positive integers $n \\le {n}$ that are divisible by exactly one of "
                   f"${p}$ and ${q}$.")
    elif kind == 2:
        n = rng.randint(100, 5000)
        ans = _divisor_sum(n) % 1000
        problem = f"Let $S$ be the sum of all positive divisors of ${n}$. Find the remainder when $S$ is divided by $1000$."
    elif kind == 3:
        n = rng.randint(50, 900)
        ans = (n * (n - 1) // 2) % 1000
        problem = (f"Let $N$ be the number of ordered pairs $(x, y)$ of positive integers with $x + y \\le {n}$. "
                   f"Find the remainder when $N$ is divided by $1000$.")
    else:
        a, d, k = rng.randint(1, 50), rng.randint(1, 9), rng.randint(20, 300)
        ans = (a + d * (k - 1) * k // 2) % 1000
        problem = (f"A sequence has $a_1 = {a}$ and $a_{{n+1}} = a_n + {d}n$ for $n \\ge 1$. "
                   f"Find the remainder when $a_{{{k}}}$ is divided by $1000$.")
    return {"id": f"synthetic-{i}", "problem": problem, "answer": str(ans)}


# ---------------------------------------------------------------- MRCR
def _text(rng: random.Random, form: str, topic: str, chars: int) -> str:
    """A made-up piece of writing of about ``chars`` characters, mentioning its topic once."""
    words = [rng.choice(WORDS) for _ in range(max(6, chars // 7))]
    words.insert(rng.randrange(len(words)), topic)
    lines = [" ".join(words[i:i + 8]).capitalize() + "." for i in range(0, len(words), 8)]
    return ("\n" if form in ("poem", "haiku", "limerick") else " ").join(lines)


def _mrcr_item(rng: random.Random, n_needles: int, n_chars: int) -> dict[str, Any]:
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
    # shuffle, keeping the needles' relative order meaningless (they are identical asks)
    rng.shuffle(asks)
    messages: list[dict[str, str]] = []
    needle_replies: list[tuple[int, str]] = []
    for f, t in asks:
        messages.append({"role": "user", "content": f"write a {f} about {t}"})
        reply = _text(rng, f, t, reply_chars)
        if (f, t) == (form, topic):
            needle_replies.append((len(messages), reply))
        messages.append({"role": "assistant", "content": reply})
    desired = rng.randint(1, n_needles)
    prefix = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") for _ in range(10))
    messages.append({"role": "user", "content": f"Prepend {prefix} to the {_ordinal(desired)} (1 indexed) {form} "
                                                f"about {topic}. Do not include any other text in your response."})
    msg_index, reply = needle_replies[desired - 1]
    prompt = json.dumps(messages, ensure_ascii=False)
    return {"prompt": prompt, "answer": prefix + reply, "random_string_to_prepend": prefix,
            "n_needles": n_needles, "desired_msg_index": msg_index, "total_messages": len(messages),
            "n_chars": sum(len(m["content"]) for m in messages)}


# ---------------------------------------------------------------- writing
def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def make_all(out: Path, seed: int = 0, gsm8k: int = 50, aime: int = 30, mrcr: int = 20,
             mrcr_chars: int = 2000, needles: tuple[int, ...] = (2, 4, 8)) -> dict[str, Any]:
    """Write every dataset under ``out``; returns the manifest (also written to ``out/MANIFEST.json``)."""
    if min(gsm8k, aime, mrcr) < 1 or mrcr_chars < 1:
        raise ValueError("every dataset needs at least one item and --mrcr-chars must be positive")
    out = Path(out)
    files: dict[str, list[dict[str, Any]]] = {}
    rng = random.Random(f"k3-gsm8k:{seed}")
    files["gsm8k/test.jsonl"] = [_gsm8k_item(rng) for _ in range(gsm8k)]
    rng = random.Random(f"k3-aime25:{seed}")
    files["aime25/test.jsonl"] = [_aime_item(rng, i) for i in range(aime)]
    for n in needles:
        rng = random.Random(f"k3-mrcr{n}:{seed}")
        files[f"mrcr/{n}needle.jsonl"] = [_mrcr_item(rng, n, mrcr_chars) for _ in range(mrcr)]
    for rel, rows in files.items():
        _write_jsonl(out / rel, rows)
    manifest = {"generator": "evals.data.make_synthetic", "seed": seed,
                "params": {"gsm8k": gsm8k, "aime": aime, "mrcr": mrcr, "mrcr_chars": mrcr_chars,
                           "needles": list(needles)},
                "files": {rel: {"rows": len(rows), "sha256": sha256_file(out / rel)} for rel, rows in files.items()}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.data.make_synthetic", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="directory to write (gsm8k/, aime25/, mrcr/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gsm8k", type=int, default=50, help="GSM8K-style items")
    p.add_argument("--aime", type=int, default=30, help="AIME-style items")
    p.add_argument("--mrcr", type=int, default=20, help="MRCR conversations per needle count")
    p.add_argument("--mrcr-chars", type=int, default=2000, help="MRCR conversation length in characters")
    args = p.parse_args(argv)
    try:
        m = make_all(args.out, args.seed, args.gsm8k, args.aime, args.mrcr, args.mrcr_chars)
    except (ValueError, OSError) as e:
        print(f"make_synthetic: {e}", file=sys.stderr)
        return 2
    for rel, info in sorted(m["files"].items()):
        print(f"{info['sha256']}  {info['rows']:>5} rows  {args.out / rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
