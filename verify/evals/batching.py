"""How chats go to an engine call, for the lm-eval adapter and the likelihood check alike: at most ``BATCH``
requests and ``BATCH_CHARS`` prompt characters a call (a batch is prefilled as one right-padded block, so
long conversations, MRCR at ~32K tokens, go a few at a time; one longer prompt goes alone). No lm-eval here."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

BATCH = 64  # requests per engine call: the fast path's largest decode bucket (the eager reference's step on
# the sentinel, launch-bound on a GPU: ~86 ms at 64 rows, ~38 ms at one on an H100, bundles of sessions 29 / 28)
BATCH_CHARS = 200_000  # prompt characters per engine call: ~40K tokens of MRCR chat (~5 characters a token)

T = TypeVar("T")


def batched(items: Sequence[T], chars_of: Callable[[T], int], size: int = BATCH) -> Iterator[list[T]]:
    """``items`` in order, ``size`` at most a batch and at most ``BATCH_CHARS`` prompt characters
    (``chars_of(item)``) unless one item alone is longer."""
    batch: list[T] = []
    chars = 0
    for item in items:
        n = chars_of(item)
        if batch and (len(batch) == size or chars + n > BATCH_CHARS):
            yield batch
            batch, chars = [], 0
        batch.append(item)
        chars += n
    if batch:
        yield batch
