"""Issue 32, noisy evaluations: how discovery ranks peers, side by side in one run — "running"
(a running score with memory 0.5: the old default) against "evidence" (evaluations that stood
out of the noise against those that did not: ``DiscoverySettings.ranking``) — with a mate
weighted in only ``--signal`` of its evaluations (0.2 as FedFomo on 100 daemons) and with clean
weights (1.0). Both re-explore peers scored low on fewer than ``confirm`` (3) evaluations,
by default once a node has evaluated 20% of the network (``DiscoverySettings.reexplore_after``;
0.0 until 2026-11-29: a fixed slot); ``--confirm 3 0`` runs each ranking at the default and
without re-exploring (``confirm=0, reexplore=0``); ``--reexplore-after 0 0.1`` adds each ranking
with a fixed re-explore slot (0) or re-exploring past that share (named so in the table, even
at the default); ``--confirm --collaborator-after 1 2`` runs each ranking asking and recommending
a peer after one evaluation (the rule before 2026-11-29) and after two (the default since).
``--late 0.1``: also runs with 10% of the nodes joining at round 10 (40 rounds: the others are
counted at round 30, the late ones 30 rounds after joining). Medians over seeds; the full config
and every run's figures go to ``--out`` (JSON) next to the table.

    nice -n 5 python bench/discovery_noisy.py --nodes 100 1000 --seeds 0 1 2 --jobs 1 --out bench/results/discovery_ranking.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

from coterie.node.peering.discovery import DiscoverySettings
from coterie.node.peering.overlay_sim import simulate_discovery

ROUNDS = 30
LATE_ROUND = 10
VARIANTS = {"running (old)": "running", "evidence (new)": "evidence"}


def variant_name(
    ranking: str,
    confirm: int | None = None,
    reexplore_after: float | None = None,
    collaborator_after: int | None = None,
) -> str:
    """The table's name: the ranking's, plus the setting that differs from the default (if any)."""
    name = next(v for v, r in VARIANTS.items() if r == ranking)
    if collaborator_after is not None:  # named even at the default: the default changed (1, then 2)
        return f"{name}, collaborator_after={collaborator_after}"
    if confirm is not None and confirm != DiscoverySettings().confirm:
        return f"{name}, confirm={confirm}"
    if reexplore_after is not None:  # named even at the default: the default changed (0.0, then 0.2)
        return f"{name}, reexplore_after={reexplore_after:g}"
    return name


def settings(variant: str) -> DiscoverySettings:
    name, _, setting = variant.partition(", ")
    key, _, value = setting.partition("=")
    if key == "confirm":
        c = int(value)
        return DiscoverySettings(ranking=VARIANTS[name], confirm=c, reexplore=min(c, DiscoverySettings().reexplore))
    if key == "reexplore_after":
        return DiscoverySettings(ranking=VARIANTS[name], reexplore_after=float(value))
    if key == "collaborator_after":
        return DiscoverySettings(ranking=VARIANTS[name], collaborator_after=int(value))
    return DiscoverySettings(ranking=VARIANTS[name])


def one(args: tuple[int, float, float, str, int]) -> dict:
    n, signal, late, variant, seed = args
    t = time.process_time()
    rounds = ROUNDS + (LATE_ROUND if late else 0)
    r = simulate_discovery(
        n,
        10,
        rounds,
        mode="discovery",
        seed=seed,
        settings=settings(variant),
        mate_signal=signal,
        late=late,
        late_round=LATE_ROUND,
        checkpoints=(ROUNDS,),
    )
    return {
        "nodes": n,
        "signal": signal,
        "late": late,
        "variant": variant,
        "seed": seed,
        "mates_top9": r.mates_found[ROUNDS],
        "mates_evaluated": r.mates_evaluated[ROUNDS],
        "late_mates_top9": r.late_mates_found.get(ROUNDS),
        "cpu_s": round(time.process_time() - t, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[100])
    ap.add_argument("--signal", type=float, nargs="+", default=[0.2, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--late", type=float, nargs="+", default=[0.0], help="shares of late joiners (0: none)")
    ap.add_argument(
        "--confirm", type=int, nargs="*", default=[DiscoverySettings().confirm], help="(none: only --reexplore-after's)"
    )
    ap.add_argument(
        "--reexplore-after",
        type=float,
        nargs="*",
        default=[],
        help="also run each ranking re-exploring only past this estimated share of the network evaluated",
    )
    ap.add_argument(
        "--collaborator-after",
        type=int,
        nargs="*",
        default=[],
        help="also run each ranking asking and recommending a peer only after this many evaluations (1: the old rule)",
    )
    ap.add_argument(
        "--rankings",
        nargs="+",
        choices=list(VARIANTS.values()),
        default=list(VARIANTS.values()),
        help="rankings to run",
    )
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", help="JSON file for the config and every run's figures")
    a = ap.parse_args()
    variants = [variant_name(r, confirm=c) for c in a.confirm for r in a.rankings]
    variants += [variant_name(r, reexplore_after=x) for x in a.reexplore_after for r in a.rankings]
    variants += [variant_name(r, collaborator_after=c) for c in a.collaborator_after for r in a.rankings]
    variants = list(dict.fromkeys(variants))  # the default given twice runs once
    work = [(n, p, lt, v, s) for n in a.nodes for lt in a.late for p in a.signal for v in variants for s in a.seeds]
    config = {
        "args": vars(a),
        "rounds": ROUNDS,
        "late_round": LATE_ROUND,
        "cluster_size": 10,
        "noise_sd": 0.2,
        "settings": {v: asdict(settings(v)) for v in variants},
        "python": platform.python_version(),
    }
    results: list[dict] = []
    with ProcessPoolExecutor(a.jobs) as pool:
        for r in pool.map(one, work):
            results.append(r)
            print(json.dumps(r), flush=True)
            if a.out:  # after every run: a long grid cut short keeps what it measured
                write(a.out, {"config": config, "runs": results, "table": []})
    lines = [
        f"| nodes | late | mate signal | ranking | mates among top 9 at {ROUNDS} | mates evaluated by {ROUNDS}"
        f" | late joiners' top 9, {ROUNDS} rounds after joining | per seed (top 9) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in a.nodes:
        for lt in a.late:
            for p in a.signal:
                for v in variants:
                    rows = [r for r in results if (r["nodes"], r["late"], r["signal"], r["variant"]) == (n, lt, p, v)]
                    top = statistics.median(r["mates_top9"] for r in rows)
                    ev = statistics.median(r["mates_evaluated"] for r in rows)
                    late = f"{statistics.median(r['late_mates_top9'] for r in rows):.2f}" if lt else "-"
                    per = ", ".join(f"{r['mates_top9']:.2f}" for r in rows)
                    lines.append(f"| {n} | {lt:.0%} | {p:g} | {v} | {top:.2f} | {ev:.2f} | {late} | {per} |")
    print("\n".join(lines))
    if a.out:
        write(a.out, {"config": config, "runs": results, "table": lines})


def write(path: str, doc: dict) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
