"""Gradients peers pushed to this node (FedeRiCo's M-step), kept until the next round drains them."""

from __future__ import annotations

from ..strategies.base import PushedGradient

MAX_PUSHED = 256  # queued pushes kept between two rounds; the oldest are dropped first


class PushInbox:
    def __init__(self, maxlen: int = MAX_PUSHED):
        self.maxlen = maxlen
        self._items: list[PushedGradient] = []

    def put(self, item: PushedGradient) -> None:
        self._items.append(item)
        del self._items[: -self.maxlen]

    def drain(self) -> list[PushedGradient]:
        out, self._items = self._items, []
        return out

    def __len__(self) -> int:
        return len(self._items)
