"""What keeps a node from making progress, made visible: a failing component (the round loop,
the checkpoint writer) is logged with its cause, listed in /status, and flips health (admin
/healthz and the gRPC health service) to NOT_SERVING until it recovers. The components retry
with ``Backoff``; nothing fails silently and nothing spins."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("coterie.node")


class Backoff:
    """Exponential retry delays: first, 2×first, ... capped at ``cap`` seconds."""

    def __init__(self, first: float = 0.5, cap: float = 10.0):
        self.first, self.cap = first, cap
        self._next = first

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.first


class Failures:
    def __init__(self, on_health: Callable[[bool], None], note: Callable[[str, str], None]):
        self.active: dict[str, dict[str, Any]] = {}
        self._on_health = on_health  # called with False on the first failure, True when all recovered
        self._note = note  # (component, message) into the node's recent problems

    @property
    def healthy(self) -> bool:
        return not self.active

    def failed(self, component: str, exc: BaseException, retry_in: float | None) -> None:
        first = component not in self.active
        entry = self.active.setdefault(component, {"component": component, "since": time.time(), "attempts": 0})
        entry["attempts"] += 1
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["retry_in_s"] = retry_in
        then = f"retrying in {retry_in:.1f}s" if retry_in is not None else "not retrying"
        # the traceback once per outage; later attempts one line each
        log.error(
            "%s failed (attempt %d): %s; %s",
            component,
            entry["attempts"],
            entry["error"],
            then,
            exc_info=exc if first else None,
        )
        if first:
            self._note(component, f"{component} failing: {entry['error']}")
            if len(self.active) == 1:
                self._on_health(False)

    def recovered(self, component: str) -> None:
        entry = self.active.pop(component, None)
        if entry is None:
            return
        log.warning(
            "%s recovered after %d failed attempts over %.1fs",
            component,
            entry["attempts"],
            time.time() - entry["since"],
        )
        self._note(component, f"{component} recovered after {entry['attempts']} failed attempts")
        if not self.active:
            self._on_health(True)

    def view(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.active.values()]

    def summary(self) -> str:
        return "; ".join(f"{e['component']}: {e['error']}" for e in self.active.values())
