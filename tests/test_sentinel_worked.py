"""The sentinel's worked arithmetic (k3_fastpath.sentinel.worked): every equation of every worked text holds,
each text ends at the right value, and the training answers of both arithmetic tasks carry them."""

from __future__ import annotations

import math
import random
import re

import pytest

from k3_fastpath.sentinel import tasks, worked

_SIDE = re.compile(r"[\d+*\- ]+")


def equations(text: str) -> list[int]:
    """The value of each equation of a worked text (``head: eq, eq, ...`` or one ``x = y = z`` chain, sub-chains
    ``head: eq`` inside), asserting every side of each is digits with + - * and all sides are equal."""
    values = []
    for seg in text.split(", "):
        seg = seg.split(": ")[-1]
        if "=" not in seg:
            continue
        sides = [x.strip() for x in seg.split("=")]
        assert all(_SIDE.fullmatch(x) for x in sides), (seg, text)
        got = {eval(x) for x in sides}  # noqa: S307 - digits and + - * only (checked above)
        assert len(got) == 1, (seg, text)
        values.append(got.pop())
    return values


def check(op: str, a: int, b: int) -> str:
    """``worked``'s text for ``a op b``: its equations hold and it ends at the right value."""
    value, text = {"*": worked.mul, "/": worked.floor_div, "+": worked.add, "-": worked.sub}[op](a, b)
    vals = equations(text)
    if op == "/":
        assert value == a // b and a - b * value == a % b
        if value:  # the remainders end below the divisor, the quotient's parts add up
            rems = [int(s.split(" = ")[1]) for s in text.split(", ") if " - " in s]
            assert rems[-1] == a % b and (len(worked.place_parts(value)) == 1 or vals[-1] == value), text
    else:
        assert value == {"*": a * b, "+": a + b, "-": a - b}[op] and vals[-1] == value, text
    return text


def test_every_step_holds_and_ends_at_the_value_over_random_operands():
    rng = random.Random(7)
    for _ in range(2000):
        a, b = rng.randint(1, 99999), rng.randint(1, 9999)
        check("*", a, b)
        check("*", a, rng.randint(1, 9))
        check("+", a, b)
        check("-", a + b, b)
        check("/", a, rng.randint(1, 230))


def test_a_wrong_step_is_caught():
    """The checker can fail: one digit changed in a worked product."""
    _, text = worked.mul(174, 349)
    with pytest.raises(AssertionError):
        equations(text.replace("= 6960", "= 6970", 1))


def test_each_step_changes_one_place_value():
    """An addition or subtraction step adds or takes one nonzero digit at one place; a product step
    multiplies one digit (the forms the model is trained to repeat)."""
    assert worked.sub(448, 325)[1] == "448 - 325: 448 - 300 = 148, 148 - 20 = 128, 128 - 5 = 123"
    assert worked.add(52200, 6960)[1] == "52200 + 6960: 52200 + 6000 = 58200, 58200 + 900 = 59100, 59100 + 60 = 59160"
    assert worked.mul(48, 4)[1] == "48*4 = 40*4 + 8*4 = 160 + 32 = 192"
    assert worked.mul(20, 44)[1] == "20*44: 44*2 = 40*2 + 4*2 = 80 + 8 = 88, 44*20 = 880"
    assert worked.floor_div(1771, 7)[1] == ("1771/7: 7*200 = 1400, 1771 - 1400 = 371, 7*50 = 350, 371 - 350 = 21, "
                                            "7*3 = 21, 21 - 21 = 0, 200 + 50 + 3 = 253")
    for text in (worked.add(91234, 5678)[1], worked.sub(91234, 5678)[1]):
        for seg in text.split(": ")[1].split(", "):
            term = int(re.split(r" [+-] ", seg)[1].split(" = ")[0])
            assert len(worked.place_parts(term)) == 1, seg


@pytest.mark.parametrize("split", tasks.SPLITS)
def test_the_gsm8k_answers_work_every_calculation(split):
    n = 0
    for item in tasks.items("gsm8k", split, 0, 300):
        for calc, a, op, b, c in re.findall(r"<<((\d+) ?([*/+-]) ?(\d+)[^>]*)>>(\d+)", item.messages[-1]["content"]):
            assert calc == check(op, int(a), int(b)) and int(c) == {"*": int(a) * int(b), "/": int(a) // int(b),
                                                                   "+": int(a) + int(b), "-": int(a) - int(b)}[op]
            n += 1
    assert n > 600


@pytest.mark.parametrize("split", tasks.SPLITS)
def test_the_aime_solutions_carry_the_worked_arithmetic(split):
    """Per problem kind, the worked divisions, products and sums its solution must hold, read off the problem's
    numbers; repeated squaring keeps its own form (tests/test_sentinel_tasks.py)."""
    kinds = set()
    for item in tasks.items("aime25", split, 1, 200):
        problem, solution = item.record["problem"], item.messages[-1]["content"]
        nums = [int(x) for x in re.findall(r"\d+", problem)]
        if "exactly one" in problem:
            n, p, q = nums
            lcm = p * q // math.gcd(p, q)
            for d in (p, q, lcm):
                assert check("/", n, d) in solution
            assert check("*", 2, n // lcm) in solution and check("+", n // p, n // q) in solution
            kinds.add("inclusion-exclusion")
        elif "ordered pairs" in problem or "sequence" in problem:
            k = nums[0] if "ordered pairs" in problem else nums[5]
            even, odd = (k - 1, k) if (k - 1) % 2 == 0 else (k, k - 1)
            assert check("/", even, 2) in solution and check("*", even // 2, odd) in solution
            if "sequence" in problem:
                a, d = nums[1], nums[3]
                tri = (k - 1) * k // 2
                assert check("*", d, tri) in solution and check("+", d * tri, a) in solution
            kinds.add(problem[:10])
        elif "divisors" in problem:
            sums = [(p ** (e + 1) - 1) // (p - 1) for p, e in tasks._factor(nums[0])]
            sigma = sums[0]
            for s in sums[1:]:  # the product of the prime powers' sums, one worked product at a time
                assert check("*", sigma, s) in solution
                sigma *= s
            assert f"= {sigma}, and {sigma} mod 1000" in solution
            kinds.add("divisors")
    assert len(kinds) == 4
