"""Run ``coterie`` under tracemalloc, for hunting a slow leak in a real daemon:
``python memprobe.py OUT.json [--start-s S] [--base-s S] [--every-s S] -m coterie.cli.main node start ...``
(``bench/soak.py --memprobe`` runs node n0 so).

Tracing starts after ``--start-s``; after ``--base-s`` (the bounded caches filled: history tail, loop-lag samples) it takes a baseline
snapshot and a count of live objects by type; then every ``--every-s`` it writes to OUT.json what
grew since the baseline: the top allocation sites by bytes (tracebacks of up to 6 frames), the
object types whose counts rose, traced memory and RSS. A thread does it, so the daemon's own code
runs unchanged (if ~2x slower: tracemalloc hooks every allocation)."""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import runpy
import sys
import threading
import time
import tracemalloc

FRAMES = 6
TOP = 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def type_counts() -> collections.Counter[str]:
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def probe(out: str, start_s: float, base_s: float, every_s: float) -> None:
    t0 = time.monotonic()
    time.sleep(start_s)
    # tracing from the start makes imports too slow to come up in time on a loaded machine; only
    # what is allocated after this is traced, and the baseline waits until the caches have cycled
    tracemalloc.start(FRAMES)
    time.sleep(max(0.0, base_s - start_s))
    filters = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    base = tracemalloc.take_snapshot().filter_traces(filters)
    base_types, base_rss, base_t = type_counts(), rss_bytes(), time.monotonic()
    while True:
        time.sleep(every_s)
        snap = tracemalloc.take_snapshot().filter_traces(filters)
        types = type_counts()
        diff = snap.compare_to(base, "traceback")
        grown = sorted(((t, types[t] - base_types.get(t, 0)) for t in types), key=lambda kv: -kv[1])
        report = {
            "pid": os.getpid(),
            "t_s": round(time.monotonic() - t0, 1),
            "since_base_s": round(time.monotonic() - base_t, 1),
            "traced_now": tracemalloc.get_traced_memory()[0],
            "traced_growth": sum(s.size_diff for s in diff),
            "rss_growth": rss_bytes() - base_rss,
            "top": [
                {
                    "size_diff": s.size_diff,
                    "count_diff": s.count_diff,
                    "size": s.size,
                    "trace": [f"{fr.filename}:{fr.lineno}" for fr in s.traceback],
                }
                for s in diff[:TOP]
            ],
            "types_grown": [[t, d, types[t]] for t, d in grown[:TOP] if d > 0],
        }
        tmp = f"{out}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--start-s", type=float, default=60.0, help="when to start tracing")
    ap.add_argument("--base-s", type=float, default=300.0, help="when to take the baseline")
    ap.add_argument("--every-s", type=float, default=60.0)
    ap.add_argument("-m", dest="module", required=True)
    args, rest = ap.parse_known_args()
    threading.Thread(target=probe, args=(args.out, args.start_s, args.base_s, args.every_s), daemon=True).start()
    if rest and os.path.basename(rest[0]).startswith("python"):  # netlab's wrap: the interpreter follows
        rest = rest[1:]
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
