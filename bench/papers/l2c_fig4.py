"""L2C Fig. 4 (l2c.txt §4): 15 nodes, the 10 classes randomly split into five two-class tasks, each
task given to three nodes. Claim: L2C and meta-L2C "produce mixing weights identifying the nodes
with the same task after 10 rounds"; at T0 = 10 each node keeps the top 10% of its neighbours.

Setting (scaled): MNIST-1D (not CIFAR-10), 150 samples per node (90 train), MLP [64, 64], Adam
lr 0.003, 10 local steps per round (paper: 5 epochs), 20 rounds; L2C/meta-L2C at the paper's
defaults (Adam lr 0.1, wd 0.01, T0 = 10, remove 90%). Alg. 1 is synchronous: rounds run behind a
barrier and every node mixes its neighbours' Δθ of the same iteration (round-aligned pulls).
In-process (bench/papers/inproc.py): real learners, the strategy harness's network.

    python bench/papers/l2c_fig4.py --seed 0
"""

from __future__ import annotations

import argparse

import numpy as np
from inproc import Run, build, clusters_of, drive, in_cluster_mass, timer

NODES = 15
LEARNER = {
    "dataset": "mnist1d",
    "dataset_params": {"num_samples": 4000},
    "partition": "class_groups",
    "partition_params": {"num_groups": 5, "classes_per_group": 2, "samples_per_node": 150},
    "model": "mlp",
    "model_params": {"hidden": [64, 64]},
    "optimizer": "adam",
    "lr": 0.003,
    "batch_size": 16,
    "local_steps": 10,
}


def kept_correct(hub, clusters: list[int]) -> float | None:
    ids = list(hub.nodes)
    picks = [
        (i, ids.index(k)) for i, n in enumerate(hub.nodes.values()) for k in (getattr(n.strategy, "_kept", None) or [])
    ]
    return None if not picks else float(np.mean([clusters[i] == clusters[j] for i, j in picks]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    clusters = clusters_of(LEARNER, NODES, args.seed)
    run = Run(
        "l2c_fig4",
        {
            "nodes": NODES,
            "rounds": args.rounds,
            "seed": args.seed,
            "learner": LEARNER,
            "strategies": {"l2c": {}, "meta-l2c": {}, "local": {}},
            "true_clusters": clusters,
            "harness": "in-process, barrier-synchronous rounds, round-aligned pulls",
        },
    )
    clock = timer()
    out: dict[str, dict] = {}
    for name in ("l2c", "meta-l2c", "local"):
        hub = build(name, {}, LEARNER, NODES, args.seed)
        rows = drive(hub, args.rounds)
        mass = {r["round"]: in_cluster_mass(np.array(r["W"]), clusters) for r in rows}
        acc = float(np.mean(list(rows[-1]["test_acc"].values())))
        out[name] = {
            "in_cluster_mass": mass,
            "kept_correct": kept_correct(hub, clusters),
            "kept_per_node": [len(getattr(n.strategy, "_kept", None) or []) for n in hub.nodes.values()]
            if name != "local"
            else None,
            "final_acc": acc,
        }
        if name != "local":
            run.rounds += [{**r, "strategy": name} for r in rows]
        print(name, {k: round(v, 3) for k, v in mass.items()}, "acc", round(acc, 3), flush=True)
    run.wall_s = clock()
    run.summary = out
    chance = 2 / 14
    for name in ("l2c", "meta-l2c"):
        o = out[name]
        m10 = o["in_cluster_mass"].get(10)
        run.claim(
            f"{name}: after 10 rounds the weights identify the nodes of the same task (Fig. 4)",
            f"in-cluster weight share {o['in_cluster_mass'][2]:.2f} at round 2 (the first aggregation), {m10:.2f} at round 10, "
            f"{o['in_cluster_mass'][args.rounds]:.2f} at round {args.rounds} (chance {chance:.2f}); "
            f"neighbours kept at T0: {100 * o['kept_correct']:.0f}% same task; accuracy "
            f"{100 * o['final_acc']:.1f}% vs local {100 * out['local']['final_acc']:.1f}%",
        )
    print("wrote", run.write())


if __name__ == "__main__":
    main()
