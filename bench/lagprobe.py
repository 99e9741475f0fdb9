"""Run ``coterie`` with an event-loop lag sampler, for benchmarks that compare code versions that
do not all measure their own loop (the baseline): ``python lagprobe.py OUT.json node start ...``.

Every asyncio loop the process runs gets a task that asks to wake every 20 ms and adds up by how
much it overslept; the sum, the maximum and the time sampled go to OUT.json once a second and at
exit. Nothing else in the process changes."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

INTERVAL_S = 0.02


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    stats = {"lag_total_s": 0.0, "lag_max_s": 0.0, "sampled_s": 0.0, "pid": os.getpid()}

    async def sampler() -> None:
        loop = asyncio.get_running_loop()
        start = last_dump = loop.time()
        while True:
            due = loop.time() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            now = loop.time()
            late = max(0.0, now - due)
            stats["lag_total_s"] += late
            stats["lag_max_s"] = max(stats["lag_max_s"], late)
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
