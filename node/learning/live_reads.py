"""Reads of a live model without a copy and without its lock (issue 34): a sequence lock.

Every change to the live model runs inside ``writing()`` (with the learner's lock held, so writers
never overlap); the count is odd while one runs. A reader notes the count, reads the model's own
tensors, and keeps what it computed only if the count is still that even number: no write began
or ended meanwhile, so everything it read is one model. Otherwise (a write raced it) it runs
again on a copy taken under the learner's lock, as every evaluation of the live model used to —
a model-sized copy, now only when a write actually overlaps the read. Training never waits for
an evaluation, and an evaluation never sees a half-updated model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class LiveReads:
    def __init__(self) -> None:
        self._seq = 0  # odd while a write runs
        self._depth = 0  # nested writes (set_params inside a rollback) count once
        self.raced = 0  # reads a write overlapped, run again on a copy

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around every change to the live model; the caller holds the learner's lock."""
        if self._depth == 0:
            self._seq += 1
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._seq += 1

    def read(self, on_live: Callable[[], T], on_copy: Callable[[], T]) -> T:
        """``on_live()`` (reads the live tensors in place) if no write overlapped it, else
        ``on_copy()`` (reads a copy taken under the lock). An error raised while a write
        overlapped (autograd refuses a tensor changed in place under it) is that race, not a
        result: it too is run again on the copy."""
        seq = self._seq
        if seq % 2 == 0:
            try:
                out = on_live()
            except Exception:
                if self._seq == seq:
                    raise
            else:
                if self._seq == seq:
                    return out
        self.raced += 1
        return on_copy()
