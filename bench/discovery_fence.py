"""Discovery's standout bar with and without the interquartile fence (``DiscoverySettings.fence``),
side by side in ``simulate_discovery`` (N nodes in clusters of 10, 5 candidates a round, 30 rounds;
a mate weighted 1 in ``signal`` of its evaluations, noise N(0, 0.2) clipped at 0). "without": the
fence never applies (``fence_after`` past any node's scores: the bar before the fence, exactly);
"fence F": the fence at F interquartile ranges, from ``fence_after`` (30) peers scored.

Per run: mates among the top 9 at rounds 10/20/30 (the in-process figure of bench/results/scale.md),
and at round 30 the mates among the round's candidates, the nodes with none, the mates among the
node's collaborators. The simulation is deterministic per seed.

    nice -n 5 python bench/discovery_fence.py --nodes 100 --seeds 0 1 2 --fence 20 --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coterie.node.peering.discovery import Discovery, DiscoverySettings
from coterie.node.peering.overlay_sim import cluster_of, simulate_discovery

NEVER = 10**9  # fence_after: the fence never applies


def one(n: int, signal: float, seed: int, settings: DiscoverySettings) -> dict[str, Any]:
    at30: dict[str, tuple[int, int]] = {}

    def watch(r: int, node: str, cands: list[str], blind: set[str], d: Discovery) -> None:
        if r == 30:
            mine = cluster_of(node, 10)
            at30[node] = (
                sum(cluster_of(p, 10) == mine for p in cands),
                sum(cluster_of(p, 10) == mine for p in d.collaborators(9)),
            )

    t0 = time.time()
    res = simulate_discovery(n, 10, 30, mode="discovery", seed=seed, settings=settings, mate_signal=signal, watch=watch)
    return {
        "top9": {str(k): round(v, 3) for k, v in res.mates_found.items()},
        "mates_in_candidates_30": round(statistics.mean(a for a, _ in at30.values()), 3),
        "nodes_without_mate_in_candidates_30": sum(a == 0 for a, _ in at30.values()),
        "mates_in_collaborators_30": round(statistics.mean(b for _, b in at30.values()), 3),
        "s": round(time.time() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[100])
    ap.add_argument("--signals", type=float, nargs="+", default=[1.0, 0.2])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--fence", type=float, nargs="+", default=[20.0], help="fences to compare with none")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    variants = {"without": DiscoverySettings(fence_after=NEVER)}
    variants.update({f"fence {f:g}": DiscoverySettings(fence=f) for f in args.fence})
    rows = []
    for n in args.nodes:
        for signal in args.signals:
            for seed in args.seeds:
                for name, settings in variants.items():
                    row = {
                        "nodes": n,
                        "signal": signal,
                        "seed": seed,
                        "variant": name,
                        **one(n, signal, seed, settings),
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    config = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    config["settings"] = {name: asdict(s) for name, s in variants.items()}
    args.out.write_text(json.dumps({"config": config, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
