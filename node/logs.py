"""How a node logs: text or JSON lines (python-json-logger), and a round log that does not flood.

A hand-started node may run many rounds a second; one INFO line per round then buries everything
else (and fills disks under a process supervisor). ``RoundLog`` writes a line per round only while
rounds are slow enough to read along, and otherwise one summary per ``summary_s``."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = "INFO", fmt: LogFormat = "text", stream: Any = None) -> None:
    """Root logging for a node process. JSON: one object per line with time, level, logger,
    message and any ``extra`` fields (e.g. ``round``)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    elif fmt == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # httpx logs every request at INFO; /network queries each peer whenever a dashboard polls
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


class RoundLog:
    """Per-round INFO lines while rounds are at least ``slow_s`` apart (fewer than 1/slow_s rounds
    a second); faster rounds are logged at DEBUG and summarised at INFO every ``summary_s``."""

    def __init__(self, log: logging.Logger, slow_s: float = 2.0, summary_s: float = 30.0, clock=time.monotonic):
        self.log, self.slow_s, self.summary_s, self.clock = log, slow_s, summary_s, clock
        self._last_round_t: float | None = None
        self._window_start: float | None = None
        self._window_first = 0
        self._window_n = 0

    def round_done(self, rnd: int, seconds: float, evaluation: dict[str, float]) -> None:
        now = self.clock()
        ev = ", ".join(f"{k}={v:.4f}" for k, v in evaluation.items())
        slow = self._last_round_t is None or now - self._last_round_t >= self.slow_s
        self._last_round_t = now
        if slow:
            self._flush(now, rnd - 1, None)
            self.log.info("round %d done in %.2fs: %s", rnd, seconds, ev, extra={"round": rnd})
            return
        self.log.debug("round %d done in %.2fs: %s", rnd, seconds, ev, extra={"round": rnd})
        if self._window_start is None:
            self._window_start, self._window_first, self._window_n = now, rnd, 0
        self._window_n += 1
        if now - self._window_start >= self.summary_s:
            self._flush(now, rnd, ev)

    def _flush(self, now: float, last: int, ev: str | None) -> None:
        if self._window_start is None or self._window_n == 0:
            self._window_start = None
            return
        span = max(now - self._window_start, 1e-9)
        self.log.info(
            "rounds %d-%d: %d rounds in %.1fs (%.1f/s)%s",
            self._window_first,
            last,
            self._window_n,
            span,
            self._window_n / span,
            f"; round {last}: {ev}" if ev else "",
            extra={"round": last},
        )
        self._window_start = None
        self._window_n = 0
