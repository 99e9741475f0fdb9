"""Issue 32's discovery figure: mates among a node's top-weighted peers, ``Discovery`` against a
uniform draw of the same number of candidates a round, at 1,000 nodes in clusters of 10, with and
without 10% of the nodes joining late, several seeds side by side (``simulate_discovery``).

    python bench/discovery_figure.py --nodes 1000 --seeds 0 1 --jobs 3
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor

from coterie.node.peering.overlay_sim import simulate_discovery

MARKS = (10, 20, 30)
LATE_ROUND = 10


def one(args: tuple[int, str, float, int]) -> tuple[int, str, float, int, dict, dict]:
    n, mode, late, seed = args
    rounds = LATE_ROUND + MARKS[-1] if late else MARKS[-1]
    r = simulate_discovery(n, 10, rounds, mode=mode, seed=seed, checkpoints=MARKS, late=late, late_round=LATE_ROUND)
    return n, mode, late, seed, r.mates_found, r.late_mates_found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    work = [(a.nodes, m, late, s) for late in (0.0, 0.1) for m in ("discovery", "uniform") for s in a.seeds]
    with ProcessPoolExecutor(a.jobs) as pool:
        results = list(pool.map(one, work))
    print("| nodes | late joiners | candidates from | who | round 10 | round 20 | round 30 | per seed at 30 |")
    print("|---|---|---|---|---|---|---|---|")
    for late in (0.0, 0.1):
        for mode in ("discovery", "uniform"):
            rows = [r for r in results if r[1] == mode and r[2] == late]
            groups = [("the others" if late else "all", 4)] + ([("late, rounds since joining", 5)] if late else [])
            for who, k in groups:
                med = [statistics.median(r[k][m] for r in rows) for m in MARKS]
                seeds = ", ".join(f"{r[k][MARKS[-1]]:.2f}" for r in rows)
                print(
                    f"| {a.nodes} | {late:.0%} | {mode} | {who} | "
                    + " | ".join(f"{x:.2f}" for x in med)
                    + f" | {seeds} |"
                )


if __name__ == "__main__":
    main()
