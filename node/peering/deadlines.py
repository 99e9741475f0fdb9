"""Deadlines that follow the peer: a call may take a small multiple of how long that peer's
calls of that kind have recently taken, never less than a floor and never more than the cap
(the node's ``request_timeout_s``). A frozen peer then costs a caller about ``mult ×`` its usual
latency, not the whole request timeout; a slow but steady one keeps its longer deadline."""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any


def quantile(samples, q: float) -> float:
    """The q-quantile (nearest rank) of a non-empty collection."""
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Deadlines:
    def __init__(
        self,
        cap_s: float,
        *,
        floor_s: float = 1.0,
        mult: float = 4.0,
        q: float = 0.99,
        window: int = 64,
        min_samples: int = 5,
    ):
        self.cap_s = cap_s
        self.floor_s = min(floor_s, cap_s)
        self.mult = mult
        self.q = q
        self.min_samples = min_samples
        self._by_peer: dict[tuple[str, str], deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self._by_kind: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=4 * window))

    def observe(self, peer: str, kind: str, seconds: float) -> None:
        """A call that succeeded, and how long it took (failures are not latencies)."""
        self._by_peer[(peer, kind)].append(seconds)
        self._by_kind[kind].append(seconds)

    def timeout(self, peer: str, kind: str) -> float:
        """The deadline for the next ``kind`` call to ``peer``: from its own history when there is
        enough of it, else from every peer's calls of that kind, else the cap."""
        samples = self._by_peer.get((peer, kind))
        if samples is None or len(samples) < self.min_samples:
            samples = self._by_kind.get(kind)
        if samples is None or len(samples) < self.min_samples:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.mult * quantile(samples, self.q)))

    def forget(self, peer: str) -> None:
        for kind in self._by_kind:  # (a peer's history exists only for kinds observed)
            self._by_peer.pop((peer, kind), None)


@dataclass
class Phase:
    """A round's exchange phase: its peer calls share one deadline, ``budget_s`` counted from
    the first call. Read by the round loop for the round record (``RoundRecord.timing``)."""

    budget_s: float
    first: float | None = None
    last: float | None = None
    calls: int = 0
    call_s: float = 0.0
    failed: int = 0
    abandoned: int = 0
    skipped: int = 0
    exchange_s: float = 0.0  # first call to last answer, once the phase is over

    def begin(self, now: float) -> float:
        """A call starts at ``now``: the seconds the phase has left for it."""
        if self.first is None:
            self.first = now
        return self.first + self.budget_s - now

    def ended(self, started: float, end: float, ok: bool = True) -> None:
        self.last = end
        self.calls += 1
        self.call_s += end - started
        self.failed += not ok

    def close(self) -> float | None:
        """The phase's length (None: it made no call, or none of its calls ended)."""
        if self.first is None or self.last is None:
            return None
        self.exchange_s = self.last - self.first
        return self.exchange_s

    def __getitem__(self, key: str) -> Any:  # (read as a mapping by older callers: phase["failed"])
        return getattr(self, key)


class RoundPace:
    """How long this node's rounds take (the median of the last ``window`` starts' intervals, 0
    until two): a node that remembers callers "for a while" must measure that in rounds, since a
    peer pulls once a round and rounds under load last far longer than membership's periods."""

    def __init__(self, window: int = 8):
        self._starts: deque[float] = deque(maxlen=window + 1)

    def tick(self, now: float | None = None) -> None:
        self._starts.append(time.monotonic() if now is None else now)

    def period_s(self) -> float:
        s = self._starts
        if len(s) < 2:
            return 0.0
        gaps = sorted(b - a for a, b in zip(s, list(s)[1:], strict=False))
        return gaps[len(gaps) // 2]
