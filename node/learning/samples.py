"""What every reader of a node's own files returns: samples that still remember where each one
came from, so a bad one is named by file and row (or image), and the error they raise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class DataError(ValueError):
    """A node's own data cannot be used; the message names the file (and the row or image)."""


@dataclass
class Part:
    """Samples of one file (or one split of a loader's output), in file order."""

    x: np.ndarray  # (n, *input_shape), any numeric dtype
    y: np.ndarray  # labels as the file holds them: text or integers (classes), numbers (regression)
    source: str  # the file (or loader) they came from
    where: Callable[[int], str]  # sample i's place: "a.csv line 7", "imgs/cat/3.png"

    def __len__(self) -> int:
        return len(self.y)

    def take(self, idx: np.ndarray) -> Part:
        idx = np.asarray(idx, dtype=np.int64)
        return Part(self.x[idx], self.y[idx], self.source, lambda i: self.where(int(idx[i])))


def concat(parts: list[Part]) -> Part:
    """One part of several (a split spread over several files), each sample still named."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [len(p) for p in parts])

    def where(i: int) -> str:
        k = int(np.searchsorted(offsets, i, side="right")) - 1
        return parts[k].where(i - int(offsets[k]))

    return Part(
        np.concatenate([p.x for p in parts]),
        np.concatenate([p.y for p in parts]),
        ", ".join(p.source for p in parts),
        where,
    )
