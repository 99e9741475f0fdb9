"""How late this node's event loop runs: a task that asks to wake every ``interval_s`` and
records by how much it overslept. Long lateness means the loop was blocked (work done on it, a
GC pause, the process stopped): membership treats probes that failed meanwhile as inconclusive,
and the round loop reports the stall per round."""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopLag:
    def __init__(self, interval_s: float = 0.05, keep: int = 4096):
        self.interval_s = interval_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=keep)  # (woke at, lateness s)
        self.total_s = 0.0  # summed lateness since start (monotone: differences give a window's stall)
        self.max_s = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            late = max(0.0, loop.time() - due)
            self.samples.append((time.monotonic(), late))
            self.total_s += late
            self.max_s = max(self.max_s, late)

    def worst_since(self, t: float) -> float:
        """Largest lateness observed at or after monotonic time ``t``, including a stall still
        going on (time since the sampler last woke, beyond its interval)."""
        worst = 0.0
        for at, late in reversed(self.samples):
            if at < t:
                break
            worst = max(worst, late)
        if self.samples:
            worst = max(worst, time.monotonic() - self.samples[-1][0] - self.interval_s)
        return worst
