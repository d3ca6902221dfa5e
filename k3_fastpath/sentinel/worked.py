"""Worked arithmetic for the sentinel's training answers: no step asks for a multi-digit result in one go.

The trained sentinel (bundles/runs/2026-12-07-h100-session28) gets its methods right and its one-shot
arithmetic wrong: every wrong GSM8K-style answer is a subtraction with a borrow (``448 - 325 = 183``), every
wrong AIME-style answer a floor division, a 3-digit product or a sum done in one step. Each function here
returns ``(value, text)``: ``text`` a chain of equations that each hold, written so that every step changes
one place value (or multiplies one digit):

- ``mul``: a one-digit factor times the other's place values (``48*4 = 40*4 + 8*4 = 160 + 32 = 192``); two
  multi-digit factors as the longer times each place value of the shorter, each such product worked the
  same way and shifted (``174*349: 174*3 = ... = 522, 174*300 = 52200, ...``), then added (``add``);
- ``add`` / ``sub``: the second operand's place values one at a time (``136 - 37: 136 - 30 = 106, 106 - 7 =
  99``); a second operand of one nonzero digit stays one step;
- ``floor_div``: long division over the quotient's place values, the divisor's products and the
  remainders written (``1771/7: 7*200 = 1400, 1771 - 1400 = 371, ..., 200 + 50 + 3 = 253``), ending at a
  remainder below the divisor (0 for an exact division).

``tests/test_sentinel_worked.py`` evaluates every equation of these texts and of the answers the generators write.
"""

from __future__ import annotations


def place_parts(n: int) -> list[int]:
    """``n``'s nonzero digits at their place values, highest first (240 -> [200, 40]; 0 -> [])."""
    s = str(n)
    return [int(d) * 10 ** (len(s) - 1 - i) for i, d in enumerate(s) if d != "0"]


def _by_digit(a: int, d: int) -> str:
    """``a*d`` for a one-digit ``d`` (or ``a``) by place values: ``a*d = p1*d + p2*d = v1 + v2 = c``."""
    big, small = (a, d) if d < 10 else (d, a)
    parts = place_parts(big)
    if len(parts) < 2:
        return f"{a}*{d} = {a * d}"
    return (f"{a}*{d} = {' + '.join(f'{p}*{small}' for p in parts)} = "
            f"{' + '.join(str(p * small) for p in parts)} = {a * d}")


def _by_places(a: int, b: int, sign: int) -> tuple[int, str]:
    """``a + sign * b`` adding (``sign`` 1) or subtracting (-1) ``b``'s place values one at a time."""
    op, parts = "+" if sign > 0 else "-", place_parts(b)
    if len(parts) < 2:
        return a + sign * b, f"{a} {op} {b} = {a + sign * b}"
    steps, acc = [], a
    for p in parts:
        steps.append(f"{acc} {op} {p} = {acc + sign * p}")
        acc += sign * p
    return acc, f"{a} {op} {b}: " + ", ".join(steps)


def add(a: int, b: int) -> tuple[int, str]:
    """``a + b`` adding ``b``'s place values one at a time."""
    return _by_places(a, b, 1)


def sub(a: int, b: int) -> tuple[int, str]:
    """``a - b`` subtracting ``b``'s place values one at a time."""
    return _by_places(a, b, -1)


def mul(a: int, b: int) -> tuple[int, str]:
    """``a * b``: by one digit directly (``_by_digit``), else the longer factor times each place value of
    the shorter (each a one-digit product, shifted), the partial products added left to right."""
    if a < 10 or b < 10:
        return a * b, _by_digit(a, b)
    big, small = (a, b) if len(place_parts(a)) >= len(place_parts(b)) else (b, a)
    steps, partials = [], []
    for p in place_parts(small):
        digit, zeros = int(str(p)[0]), len(str(p)) - 1
        steps.append(_by_digit(big, digit))
        if zeros:
            steps.append(f"{big}*{p} = {big * p}")
        partials.append(big * p)
    acc = partials[0]
    for v in partials[1:]:
        total, text = add(acc, v)
        steps.append(text)
        acc = total
    return acc, f"{a}*{b}: " + ", ".join(steps)


def floor_div(a: int, b: int) -> tuple[int, str]:
    """``a // b`` by long division over the quotient's place values (remainder ``a % b`` left at the end)."""
    q = a // b
    parts, left, steps = place_parts(q), a, []
    for p in parts:
        steps.append(f"{b}*{p} = {b * p}, {left} - {b * p} = {left - b * p}")
        left -= b * p
    if not parts:
        return 0, f"{a}/{b}: {a} < {b}, so 0"
    tail = f", {' + '.join(map(str, parts))} = {q}" if len(parts) > 1 else ""
    return q, f"{a}/{b}: " + ", ".join(steps) + tail
