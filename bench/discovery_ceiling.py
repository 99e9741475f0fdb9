"""Issue 32 item 3, the ceiling before tuning: how many cluster mates a node *could* have among
its top-weighted peers by round r, given the links found so far, against how many it has.

``simulate_discovery`` (clusters of 10, 5 candidates a round, noise N(0, 0.2)); per cluster, the
graph of *found* links: node i evaluated mate j and right after j stood out among i's scores
(``Discovery._standing_out``: what i's strategy weights now, the gate for keeping a peer). Recommendations only travel along found links (a collaborator answers with its
own collaborators and with peers that asked it, which weight it), so they never join two of these
components: a node can learn of a mate only inside its component, which grows only by a first
contact drawn blindly. Per round, means over the nodes present from the start:

- ``component``: mates in the node's component of the found graph (the propagation bound);
- ``chance_component``: the same over the links found by a blind draw alone;
- ``top9``: mates among its 9 best-ranked peers (issue 32's figure);
- ``blind``: its candidates a round drawn blindly from its view, ``blind_repeats`` those it had
  drawn blindly before, ``blind_distinct``: the distinct peers it drew blindly so far — how many
  peers it met by chance;
- ``hinted`` / ``hinted_mates``: the peers it first evaluated on a hint so far (not drawn blindly:
  recommended, a peer that asked it, or re-explored), and the cluster mates among them.

Also the analytic bound for the component: if every node drew ``e`` peers a round uniformly
without repeats from the N-1 others, mate i and mate j are linked by round r with probability
p = 1 - (1 - e r / (N-1))^2, and the mates in a node's component are those of G(10, p)
(Monte Carlo, ``--bound-trials``).

    nice -n 5 python bench/discovery_ceiling.py --nodes 1000 --seeds 0 1 2 --rounds 60 --collaborator-after 1 2 \
        --out bench/results/discovery_ceiling.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict

from coterie.node.fsutil import atomic_write_json
from coterie.node.peering.discovery import Discovery, DiscoverySettings
from coterie.node.peering.overlay_sim import cluster_of, simulate_discovery

CLUSTER = 10


class Components:
    """Union-find over node ids."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb

    def mates(self, nodes: list[str]) -> float:
        """Mean over ``nodes`` of the other nodes in its component."""
        size = Counter(self.find(n) for n in nodes)
        return sum(size[self.find(n)] - 1 for n in nodes) / max(1, len(nodes))


def one(n: int, seed: int, rounds: int, signal: float, collaborator_after: int) -> dict:
    settings = DiscoverySettings(collaborator_after=collaborator_after)
    t = time.process_time()
    ids = [f"node-{i:05d}" for i in range(n)]
    found, chance = Components(), Components()
    blind_seen: dict[str, set[str]] = {i: set() for i in ids}
    evaluated: dict[str, set[str]] = {i: set() for i in ids}
    hinted = Counter()  # over all rounds so far
    per_round: dict[int, Counter] = {}
    discs: dict[str, Discovery] = {}

    def watch(r: int, i: str, cands: list[str], blind: set[str], d: Discovery) -> None:
        discs[i] = d
        c = per_round.setdefault(r, Counter())
        c["nodes"] += 1
        c["blind"] += len(blind)
        c["blind_repeats"] += len(blind & blind_seen[i])
        blind_seen[i] |= blind
        mine = cluster_of(i, CLUSTER)
        for p in cands:  # first evaluated, not drawn blindly: a hint (or a re-explored peer)
            if p not in blind and p not in evaluated[i]:
                c["hinted"] += 1
                c["hinted_mates"] += cluster_of(p, CLUSTER) == mine
        evaluated[i].update(cands)
        out = set(d._standing_out())
        for p in cands:
            if cluster_of(p, CLUSTER) == mine and p in out:
                found.join(i, p)
                if p in blind:
                    chance.join(i, p)

    series: list[dict] = []

    def checkpoint(r: int) -> None:
        c = per_round[r]
        hinted.update({k: c[k] for k in ("hinted", "hinted_mates")})
        present = [i for i in ids if i in discs]
        top9 = sum(
            cluster_of(p, CLUSTER) == cluster_of(i, CLUSTER) for i in present for p in discs[i].best(CLUSTER - 1)
        ) / len(present)
        series.append(
            {
                "round": r,
                "component": round(found.mates(present), 3),
                "chance_component": round(chance.mates(present), 3),
                "top9": round(top9, 3),
                "blind": round(c["blind"] / c["nodes"], 3),
                "blind_repeats": round(c["blind_repeats"] / c["nodes"], 3),
                "blind_distinct": round(sum(len(blind_seen[i]) for i in present) / len(present), 2),
                # peers first evaluated on a hint so far, and the cluster mates among them
                "hinted": round(hinted["hinted"] / len(present), 2),
                "hinted_mates": round(hinted["hinted_mates"] / len(present), 2),
            }
        )

    # the simulation calls ``watch`` per node; a round's figures are taken once its last node is in
    last = ids[-1]

    def watch_and_mark(r: int, i: str, cands: list[str], blind: set[str], d: Discovery) -> None:
        watch(r, i, cands, blind, d)
        if i == last:
            checkpoint(r)

    res = simulate_discovery(
        n,
        CLUSTER,
        rounds,
        mode="discovery",
        seed=seed,
        settings=settings,
        mate_signal=signal,
        checkpoints=(10, 20, 30, 40, 50, 60),
        watch=watch_and_mark,
    )
    # the top 9 the simulation itself reports must agree with the diagnostic's (same ranking)
    for r, v in res.mates_found.items():
        assert abs(v - series[r - 1]["top9"]) < 1e-9, (r, v, series[r - 1]["top9"])
    counters = Counter()
    for d in discs.values():
        counters.update(asdict(d.counters))
    return {
        "nodes": n,
        "seed": seed,
        "signal": signal,
        "collaborator_after": collaborator_after,
        "series": series,
        "counters_per_node": {k: round(v / n, 2) for k, v in counters.items()},
        "cpu_s": round(time.process_time() - t, 1),
    }


def bound(n: int, e: int, r: int, trials: int, rng: random.Random) -> float:
    """Mean mates in a node's component of G(CLUSTER, p), each node drawing ``e`` a round."""
    q = min(1.0, e * r / (n - 1))
    p = 1 - (1 - q) ** 2
    total = 0.0
    for _ in range(trials):
        comp = Components()
        for a in range(CLUSTER):
            for b in range(a + 1, CLUSTER):
                if rng.random() < p:
                    comp.join(str(a), str(b))
        total += comp.mates([str(a) for a in range(CLUSTER)])
    return total / trials


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--signal", type=float, default=1.0)
    ap.add_argument(
        "--collaborator-after",
        type=int,
        nargs="+",
        default=[DiscoverySettings().collaborator_after],
        help="evaluations before a peer is asked and recommended (1: the rule before 2026-11-29)",
    )
    ap.add_argument("--bound-trials", type=int, default=4000)
    ap.add_argument("--out", help="JSON file for the config and every run's figures")
    a = ap.parse_args()
    config = {"args": vars(a), "settings": asdict(DiscoverySettings()), "cluster_size": CLUSTER, "noise_sd": 0.2}
    config["python"] = platform.python_version()
    rng = random.Random(0)
    bounds = {
        str(n): {
            f"e={e}": {r: round(bound(n, e, r, a.bound_trials, rng), 2) for r in (10, 20, 30, 40, 60)}
            for e in range(1, 6)
        }
        for n in a.nodes
    }
    runs: list[dict] = []
    for n in a.nodes:
        for ca in a.collaborator_after:
            for seed in a.seeds:
                runs.append(one(n, seed, a.rounds, a.signal, ca))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "series"}), flush=True)
                if a.out:  # after every run: a grid cut short keeps what it measured
                    atomic_write_json(a.out, {"config": config, "bound": bounds, "runs": runs})
    for n, ca in ((n, ca) for n in a.nodes for ca in a.collaborator_after):
        rows = [r for r in runs if r["nodes"] == n and r["collaborator_after"] == ca]
        print(f"\n{n} nodes, signal {a.signal}, collaborator_after={ca}, medians of seeds {a.seeds}")
        print(
            "| round | mates in component | by chance links alone | mates among top 9 | blind draws a round"
            " | of which repeats | distinct peers drawn blindly so far | first evaluated on a hint so far (mates) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for k in range(len(rows[0]["series"])):
            rd = rows[0]["series"][k]["round"]
            if rd % 5 and rd != 1:
                continue
            med = {f: statistics.median(r["series"][k][f] for r in rows) for f in rows[0]["series"][k] if f != "round"}
            print(
                f"| {rd} | {med['component']:.2f} | {med['chance_component']:.2f} | {med['top9']:.2f} | {med['blind']:.2f}"
                f" | {med['blind_repeats']:.2f} | {med['blind_distinct']:.1f} | {med['hinted']:.1f} ({med['hinted_mates']:.2f}) |"
            )
        print("bound (uniform, without repeats):", json.dumps(bounds[str(n)]))


if __name__ == "__main__":
    main()
