"""Stacks for a node that is stuck: every asyncio task's (which await it sits in) and every
thread's (what a worker is blocked on), written to the node's log. SIGUSR2 and the stall watch
use them; SIGUSR1's faulthandler dump (service.py) covers a blocked event loop."""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import threading
import traceback
from collections import Counter
from typing import Any

log = logging.getLogger("coterie.node")


WHOLE = {"whole": True}  # our own diagnostics: the log filter neither cuts nor drops them (logfilter.py)


def dump_tasks(why: str = "on SIGUSR2", limit: int = 12) -> None:
    """Log each asyncio task's stack: which await a stuck round sits in. The round loop first;
    tasks with no Python frame (gRPC's server handlers) counted by name, not listed."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # called off the event loop: no tasks to show
        return
    out, frameless = io.StringIO(), Counter[str]()
    for task in sorted(tasks, key=lambda t: (t.get_name() != "rounds", t.get_name())):
        chain = await_chain(task.get_coro(), limit)
        if not chain:
            frameless[task.get_name()] += 1
            continue
        out.write(f"--- {task.get_name()}\n" + "".join(f"  {line}\n" for line in chain))
    if frameless:
        out.write("--- no Python frame: " + ", ".join(f"{n} x{c}" for n, c in frameless.most_common()) + "\n")
    log.warning("asyncio tasks (%d), %s:\n%s", len(tasks), why, out.getvalue(), extra=WHOLE)


def await_chain(coro: Any, limit: int = 24) -> list[str]:
    """Where a suspended coroutine waits, outermost first: each coroutine in its ``await`` chain
    (Task.get_stack shows only the outermost frame of a suspended one), then what the innermost
    waits on (a future, a gRPC call...)."""
    out: list[str] = []
    while coro is not None and len(out) < limit:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
        if nxt is not None and not hasattr(nxt, "cr_frame") and not hasattr(nxt, "gi_frame"):
            out.append(f"waiting on {type(nxt).__module__}.{type(nxt).__qualname__}: {repr(nxt)[:160]}")
            break
        coro = nxt
    return out


def thread_stacks(limit: int = 12) -> str:
    """Every thread's stack, innermost frames last (as a traceback reads); idle pool workers
    (waiting for work) counted, not listed."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out, idle = [], 0
    for ident, frame in sys._current_frames().items():
        if frame.f_code.co_name == "_worker" and frame.f_code.co_filename.endswith("thread.py"):
            idle += 1
            continue
        out.append(f"--- thread {names.get(ident, ident)}")
        out.extend(line.rstrip() for line in traceback.format_stack(frame, limit=limit))
    out.append(f"--- {idle} idle pool workers")
    return "\n".join(out)
