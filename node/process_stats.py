"""What the node's process holds right now: resident memory, open file descriptors, OS threads,
asyncio tasks. A node meant to run for a month must keep these flat (``bench/soak.py`` samples
them from ``/status``'s ``process``); prometheus_client's process collector exports memory and fds
too, but not tasks or threads, and a soak wants one place to read all of them."""

from __future__ import annotations

import asyncio
import os
import resource
from collections import Counter
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
TASK_KINDS = 32  # coroutine kinds /status names: a node runs ~20, so all of them, and a bound


def _proc_status_field(name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes() -> int | None:
    """Current resident set size (Linux: /proc/self/statm); None where the OS does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def process_view() -> dict[str, Any]:
    """``/status`` ``process``: call from the node's event loop (asyncio tasks are the loop's)."""
    try:
        running = asyncio.all_tasks()
    except RuntimeError:  # no running loop
        running = None
    tasks = None if running is None else len(running)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "rss_bytes": resident_bytes(),
        "peak_rss_bytes": peak,
        "open_fds": open_fds(),
        "threads": _proc_status_field("Threads"),
        "asyncio_tasks": tasks,
        # the commonest coroutines: when the count grows, which kind of task is piling up
        "asyncio_task_kinds": dict(Counter(map(_coroutine_name, running or ())).most_common(TASK_KINDS)),
    }


def _coroutine_name(task: asyncio.Task) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or type(coro).__name__
