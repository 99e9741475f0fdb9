"""FedFomo Fig. 2a (fedfomo.txt §4): 15 clients drawn from 5 latent distributions (3 each). Claim,
qualitative: starting from the diagonal affinity P, FedFomo up-weights the clients of the same
distribution "without knowledge of client datasets" (Fig. 2: P over rounds, lighter = higher).

Setting (scaled): 15 clients = 5 label-permutation distributions × 3 on MNIST-1D (the clients of a
distribution share the input→label map; the others' models are wrong for them), 500 samples per
client (300 train), S1's small 1-D CNN, Adam lr 0.003, 20 local steps per round (paper: 5 epochs),
20 rounds; FedFomo at its defaults (M = 5 models downloaded, ε = 0.3 decaying by 0.05 per round,
L1 distance). Reported: the affinity P (what the figure plots; signed, so ranked: AUROC of P_ij
against "same distribution", and mean P on same- vs other-distribution clients) and the weights
the updates actually used (``weights()``), as the in-cluster share of the weight on peers.
In-process (bench/papers/inproc.py), barrier rounds.

    python bench/papers/fedfomo_fig2.py --seed 0
"""

from __future__ import annotations

import argparse

import numpy as np
from inproc import Run, build, clusters_of, drive, in_cluster_mass, timer

NODES = 15
LEARNER = {
    "dataset": "mnist1d",
    "dataset_params": {"num_samples": 8000},
    "partition": "label_permutation",
    "partition_params": {"num_clusters": 5, "samples_per_node": 500},
    "model": "cnn",
    "model_params": {"channels": [16, 32], "fc": 64},
    "optimizer": "adam",
    "lr": 0.003,
    "batch_size": 32,
    "local_steps": 20,
}


def affinity(s) -> dict:
    return s.public_state()["affinity"]


def auroc(P: np.ndarray, clusters: list[int]) -> float:
    c = np.asarray(clusters)
    off = ~np.eye(len(c), dtype=bool)
    same = (c[:, None] == c[None, :])[off]
    v = P[off]
    pos, neg = v[same], v[~same]
    return float(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    clusters = clusters_of(LEARNER, NODES, args.seed)
    run = Run(
        "fedfomo_fig2",
        {
            "nodes": NODES,
            "rounds": args.rounds,
            "seed": args.seed,
            "learner": LEARNER,
            "strategies": {"fedfomo": {}, "local": {}},
            "true_clusters": clusters,
            "harness": "in-process, barrier-synchronous rounds",
        },
    )
    clock = timer()
    hub = build("fedfomo", {}, LEARNER, NODES, args.seed)
    ids = list(hub.nodes)
    rows = drive(hub, args.rounds, state=affinity)
    local = build("local", {}, LEARNER, NODES, args.seed)
    lrows = drive(local, args.rounds, every=args.rounds)
    run.wall_s = clock()

    def P(row):
        return np.array([[row["state"][a].get(b, 0.0) for b in ids] for a in ids])

    used = {r["round"]: in_cluster_mass(np.array(r["W"]), clusters) for r in rows}
    aff = {r["round"]: auroc(P(r), clusters) for r in rows}
    c = np.asarray(clusters)
    same = (c[:, None] == c[None, :]) & ~np.eye(NODES, dtype=bool)
    other = c[:, None] != c[None, :]
    Pf = P(rows[-1])
    p_same, p_other = float(Pf[same].mean()), float(Pf[other].mean())
    acc = float(np.mean(list(rows[-1]["test_acc"].values())))
    lacc = float(np.mean(list(lrows[-1]["test_acc"].values())))
    beats = float(np.mean([rows[-1]["test_acc"][n] > lrows[-1]["test_acc"][n] for n in ids]))
    run.rounds = rows
    run.summary = {
        "affinity_auroc": aff,
        "final_mean_P_same": p_same,
        "final_mean_P_other": p_other,
        "in_cluster_used_weights": used,
        "final_acc": acc,
        "local_acc": lacc,
        "beats_local_share": beats,
        "final_P": P(rows[-1]).round(3).tolist(),
    }
    np.set_printoptions(precision=2, suppress=True, linewidth=200)
    print(P(rows[-1]))
    chance = 2 / 14
    r = args.rounds
    run.claim(
        "FedFomo up-weights the clients of the same distribution over the rounds (Fig. 2, P)",
        f"AUROC of P against same-distribution: {aff[1]:.2f} after round 1, {aff[min(5, r)]:.2f} after "
        f"round {min(5, r)}, {aff[r]:.2f} after round {r} (0.5 = no structure); final mean P "
        f"{p_same:.2f} on same-distribution clients, {p_other:.2f} on the others",
    )
    mean_used = float(np.nanmean([v for v in used.values()]))
    run.claim(
        "(the weights the updates used)",
        f"in-cluster share of the peer weight, mean over rounds that used a peer: {mean_used:.2f} "
        f"(chance {chance:.2f}); accuracy "
        f"{100 * acc:.1f}% vs local {100 * lacc:.1f}%, above local on {100 * beats:.0f}% of clients",
    )
    print("wrote", run.write())


if __name__ == "__main__":
    main()
