"""Recent problems with peers, for ``/status`` and the rejected-input counter."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any


class ProblemLog:
    def __init__(self, maxlen: int = 50, on_rejected: Callable[[], None] | None = None):
        self._items: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._on_rejected = on_rejected

    def note(self, who: str, message: str, rejected: bool = False) -> None:
        self._items.append({"t": time.time(), "peer": who, "message": message, "rejected": rejected})
        if rejected and self._on_rejected is not None:
            self._on_rejected()

    def recent(self, n: int = 10) -> list[dict[str, Any]]:
        return list(self._items)[-n:]
