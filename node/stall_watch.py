"""A round that stops making progress is a failure, not silence. The round loop names the phase
it is in (``Progress``); a watch task flags a phase that has lasted longer than
``round_stall_s`` and 10× the longest of the recent rounds: it is logged once with every asyncio
task's and thread's stack (what the round waits on), listed in /status, flips health, and under
systemd (once the node has rounds to compare with) stops the watchdog pings so the manager
restarts the node. Progress clears it.

Why: every await in a round is bounded by its own deadline, but a worker thread or a lock that
never returns would leave a node quietly stuck (once seen in CI: a daemon at round 9 for minutes
without a log line while its peers ran hundreds of rounds)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from .failures import Failures
from .stacks import WHOLE, dump_tasks, thread_stacks

log = logging.getLogger("coterie.node")

RECENT_ROUNDS = 50  # the longest of these sets the bar (a slow device's rounds are not stalls)
LONGEST_ROUND_MULT = 10.0


class RoundStalled(Exception):
    pass


@dataclass(frozen=True)
class Progress:
    round: int
    phase: str
    since: float  # time.monotonic() when the phase began


class StallWatch:
    """Reads ``progress()`` every ``check_s``; ``round_done(seconds)`` feeds the recent rounds."""

    def __init__(self, failures: Failures, stall_s: float, check_s: float | None = None):
        self.failures = failures
        self.retune(stall_s, check_s)
        self.at: Progress | None = None  # None: not in a round (between runs, or done)
        self.stalled: Progress | None = None
        self._recent: deque[float] = deque(maxlen=RECENT_ROUNDS)

    def retune(self, stall_s: float, check_s: float | None = None) -> None:
        """(At start, and on a SIGHUP reload.) ``stall_s``: 0 = never."""
        self.stall_s = stall_s
        self.check_s = check_s if check_s is not None else max(0.2, min(10.0, stall_s / 4))

    def enter(self, rnd: int, phase: str) -> None:
        self.at = Progress(rnd, phase, time.monotonic())
        self._moved()

    def leave(self) -> None:
        self.at = None
        self._moved()

    def _moved(self) -> None:
        if self.stalled is not None and self.at != self.stalled:  # the round moved on: cleared at once
            log.warning("round %d is moving again (it was stalled in %r)", self.stalled.round, self.stalled.phase)
            self.stalled = None
            self.failures.recovered("round-stall")

    def round_done(self, seconds: float) -> None:
        self._recent.append(seconds)

    def view(self) -> dict[str, Any] | None:
        at = self.at
        if at is None:
            return None
        return {
            "round": at.round,
            "phase": at.phase,
            "for_s": round(time.monotonic() - at.since, 3),
            "stalled": self.stalled is not None,
            "stall_after_s": round(self.limit_s(), 1),
        }

    @property
    def restart_worthy(self) -> bool:
        """Stalled past a bar set by rounds this node has run: under systemd, worth a restart. A
        first round has no such bar (a slow device's first round may just be long): reported, and
        the watchdog keeps being fed."""
        return self.stalled is not None and bool(self._recent)

    def limit_s(self) -> float:
        return max(self.stall_s, LONGEST_ROUND_MULT * max(self._recent, default=0.0))

    def check(self, now: float | None = None) -> None:
        at, now = self.at, time.monotonic() if now is None else now
        if at is None or self.stall_s <= 0 or self.stalled is not None or now - at.since < self.limit_s():
            return
        self.stalled = at
        self.failures.failed(
            "round-stall",
            RoundStalled(
                f"round {at.round} has made no progress in {at.phase!r} for {now - at.since:.0f}s "
                f"(limit {self.limit_s():.0f}s: round_stall_s, or 10x the longest recent round)"
            ),
            None,
        )
        dump_tasks("on a stalled round")  # which await the round sits in
        log.warning("threads, on a stalled round:\n%s", thread_stacks(), extra=WHOLE)  # and what each thread does

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)  # a poll of a timestamp, not a wait for an event
            self.check()
