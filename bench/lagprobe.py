"""Run ``coterie`` with an event-loop lag sampler, for benchmarks that compare code versions that
do not all measure their own loop (the baseline): ``python lagprobe.py OUT.json node start ...``.

Every asyncio loop the process runs gets a task that asks to wake every 20 ms and adds up by how
much it overslept (``lag``: wall clock, so on a busy machine it also counts waiting for a CPU), and
by how much the loop thread's own CPU time between two wake-ups exceeded 20 ms (``busy``: work done
on the loop itself that kept it from its other callbacks; waiting for a CPU or the GIL does not
count). Sums and maxima go to OUT.json once a second and at exit. Nothing else in the process
changes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

INTERVAL_S = 0.02


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    stats = {
        "lag_total_s": 0.0,
        "lag_max_s": 0.0,
        "busy_total_s": 0.0,
        "busy_max_s": 0.0,
        "sampled_s": 0.0,
        "pid": os.getpid(),
    }

    async def sampler() -> None:
        loop = asyncio.get_running_loop()
        start = last_dump = loop.time()
        cpu = time.thread_time()
        while True:
            due = loop.time() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            now, cpu_now = loop.time(), time.thread_time()
            late = max(0.0, now - due)
            busy = max(0.0, cpu_now - cpu - INTERVAL_S)
            cpu = cpu_now
            stats["lag_total_s"] += late
            stats["lag_max_s"] = max(stats["lag_max_s"], late)
            stats["busy_total_s"] += busy
            stats["busy_max_s"] = max(stats["busy_max_s"], busy)
            stats["sampled_s"] = now - start
            if now - last_dump >= 1.0:
                last_dump = now
                dump()

    def dump() -> None:
        tmp = f"{out}.tmp"
        with open(tmp, "w") as f:
            json.dump({**stats, "t": time.time()}, f)
        os.replace(tmp, out)

    real_run = asyncio.run

    def run(main_coro, **kw):
        async def wrapped():
            task = asyncio.ensure_future(sampler())
            try:
                return await main_coro
            finally:
                task.cancel()
                dump()

        return real_run(wrapped(), **kw)

    asyncio.run = run
    sys.argv = ["coterie", *args]
    from coterie.cli.main import app

    app()


if __name__ == "__main__":
    main()
