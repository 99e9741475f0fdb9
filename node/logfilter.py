"""A logging filter for a daemon whose log lines often carry what peers sent.

- Every line is cut to ``MAX_LINE`` characters (but the node's own stack dumps, marked ``whole``).
- A warning repeated within ``WINDOW_S`` (the same text, digits aside) passes ``BURST`` times;
  the rest are counted and the next one that passes says how many were dropped.
- Whatever the text, one call site passes at most ``SITE_BURST`` warnings a window, so a flood of
  *different* bad requests (fuzzing) is bounded too.
A flood of bad requests costs a few lines a minute, not one per request."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

MAX_LINE = 2000
BURST = 3
SITE_BURST = 50
WINDOW_S = 60.0
MAX_KEYS = 4096
_DIGITS = re.compile(r"\d+")


class _Window:
    __slots__ = ("start", "count")

    def __init__(self, start: float):
        self.start, self.count = start, 0


class BoundedRepeats(logging.Filter):
    def __init__(
        self,
        *,
        max_line: int = MAX_LINE,
        burst: int = BURST,
        site_burst: int = SITE_BURST,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        self.max_line, self.burst, self.site_burst = max_line, burst, site_burst
        self.window_s, self.clock = window_s, clock
        self._windows: dict[tuple, _Window] = {}
        self._dropped: dict[tuple, int] = {}  # per site, since its last line that passed

    def _tick(self, key: tuple, now: float) -> int:
        w = self._windows.get(key)
        if w is None or now - w.start >= self.window_s:
            if len(self._windows) >= MAX_KEYS:
                self._windows.clear()
            w = self._windows[key] = _Window(now)
        w.count += 1
        return w.count

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "whole", False):  # the node's own diagnostics (stack dumps): never cut
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not take logging down
            msg = str(record.msg)
        if len(msg) > self.max_line:
            msg = msg[: self.max_line] + f"… [{len(msg)} chars]"
        record.msg, record.args = msg, None
        if record.levelno < logging.WARNING:
            return True
        site = (record.name, record.pathname, record.lineno)
        now = self.clock()
        same = self._tick(("msg", *site, _DIGITS.sub("#", msg[:300])), now)
        busy = self._tick(("site", *site), now)
        if same > self.burst or busy > self.site_burst:
            self._dropped[site] = self._dropped.get(site, 0) + 1
            return False
        dropped = self._dropped.pop(site, 0)
        if dropped:
            record.msg = f"{msg} [{dropped} similar lines dropped]"
        return True


def install_log_filter(logger: logging.Logger | None = None) -> BoundedRepeats:
    """Attach the filter to every handler of ``logger`` (default: the root logger), so records
    from any library pass through it."""
    f = BoundedRepeats()
    for h in (logger or logging.getLogger()).handlers:
        h.addFilter(f)
    return f
