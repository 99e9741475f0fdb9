"""Issue 32, noisy evaluations: discovery that writes a peer off at its first low score (old:
``confirm=0``) against re-exploring peers scored low on fewer than ``confirm`` evaluations (new:
the default), side by side in one run, with a mate weighted in only ``--signal`` of its
evaluations (0.2 as FedFomo on 100 daemons) and with clean weights (1.0). Medians over seeds.

    nice -n 10 python bench/discovery_noisy.py --nodes 100 --seeds 0 1 2 --jobs 2
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor

from coterie.node.peering.discovery import DiscoverySettings
from coterie.node.peering.overlay_sim import simulate_discovery

ROUNDS = 30
VARIANTS = {"old (confirm=0)": 0, "new (confirm=3)": 3}


def one(args: tuple[int, float, str, int]) -> tuple[int, float, str, int, float, float]:
    n, signal, variant, seed = args
    s = DiscoverySettings(confirm=VARIANTS[variant])
    r = simulate_discovery(
        n, 10, ROUNDS, mode="discovery", seed=seed, settings=s, mate_signal=signal, checkpoints=(ROUNDS,)
    )
    return n, signal, variant, seed, r.mates_found[ROUNDS], r.mates_evaluated[ROUNDS]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[100])
    ap.add_argument("--signal", type=float, nargs="+", default=[0.2, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    work = [(n, p, v, s) for n in a.nodes for p in a.signal for v in VARIANTS for s in a.seeds]
    with ProcessPoolExecutor(a.jobs) as pool:
        results = list(pool.map(one, work))
    print(
        f"| nodes | mate signal | discovery | mates among top 9 at {ROUNDS} | mates evaluated by {ROUNDS} | per seed (top 9) |"
    )
    print("|---|---|---|---|---|---|")
    for n in a.nodes:
        for p in a.signal:
            for v in VARIANTS:
                rows = [r for r in results if r[:3] == (n, p, v)]
                top = statistics.median(r[4] for r in rows)
                ev = statistics.median(r[5] for r in rows)
                per = ", ".join(f"{r[4]:.2f}" for r in rows)
                print(f"| {n} | {p:g} | {v} | {top:.2f} | {ev:.2f} | {per} |")


if __name__ == "__main__":
    main()
