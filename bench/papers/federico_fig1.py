"""FedeRiCo Fig. 1 (federico.txt §1): clients fit a linear model to a few noisy points on their own
interval of a sine curve. Claim: each client's weights concentrate on itself and the clients of the
adjacent intervals, and the personalised (mixture) predictions beat learning alone and the one
consensus model (FedAvg in the figure; D-PSGD here, serverless).

Setting (scaled): 8 clients, interval i of [−π, π] cut in 8, 100 noisy points each (60 train, 20
val, 20 test; y = sin x + N(0, 0.1²), ``--noise``); linear model, each client its own random θ⁰ (Alg. 1 l.1);
Adam lr 0.01; Alg. 1 as printed: one M-step gradient step per round, M = 3 neighbours, ε = 0.3,
β = 0.6, ℓ_ij summed over the local samples (eq. 3). Every strategy runs the same rounds on the
same shards; test MSE is computed on 200 fresh points per interval.
In-process (bench/papers/inproc.py): real learners, the strategy harness's network, barrier rounds.

    python bench/papers/federico_fig1.py --seed 0 --rounds 300
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch
from inproc import Run, build, drive, timer

NODES = 8


def fresh_points(hub, noise: float, points: int = 200, seed: int = 123):
    """(node id, node, x, y): fresh test points on each client's own interval, the same draw for
    every caller with the same seed."""
    rng = np.random.default_rng(seed)
    edges = np.linspace(-math.pi, math.pi, NODES + 1)
    for i, (nid, node) in enumerate(hub.nodes.items()):
        x = rng.uniform(edges[i], edges[i + 1], points)
        yield nid, node, x, np.sin(x) + noise * rng.standard_normal(points)


def fresh_mse(hub, noise: float) -> dict[str, float]:
    """Each client's test MSE on fresh points of its own interval (mixture prediction for
    FedeRiCo, the own model otherwise)."""
    out = {}
    for nid, node, x, y in fresh_points(hub, noise):
        lrn = node.learner
        saved = lrn._data["test"]
        lrn._data["test"] = (
            torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1),
            torch.as_tensor(y, dtype=torch.float32),
        )
        try:
            out[nid] = float(node.strategy.evaluate()["test_loss"])
        finally:
            lrn._data["test"] = saved
    return out


def least_squares_mse(hub, noise: float) -> dict[str, float]:
    """Each client's test MSE (the same fresh points as ``fresh_mse``) of the exact least-squares
    line on its own training points: local training run to convergence, with no optimiser in the
    way (a 400-step Adam run from a random θ⁰ stops short of it on the outer intervals)."""
    out = {}
    for nid, node, x, y in fresh_points(hub, noise):
        xtr, ytr = (t.numpy().astype(np.float64).ravel() for t in node.learner._data["train"])
        a, b = np.linalg.lstsq(np.c_[xtr, np.ones_like(xtr)], ytr, rcond=None)[0]
        out[nid] = float(np.mean((a * x + b - y) ** 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument(
        "--samples-per-node",
        type=int,
        default=100,
        help="points per client (60%% train); the paper's Fig. 1 has 'limited data'",
    )
    ap.add_argument("--noise", type=float, default=0.1, help="σ of y = sin x + N(0, σ²)")
    ap.add_argument(
        "--strategies",
        default="federico,local,dpsgd",
        help="which to run (federico and local are needed for the comparison)",
    )
    ap.add_argument("--federico-params", default="{}", help="JSON merged into FedeRiCo's parameters")
    ap.add_argument("--name", default="federico_fig1", help="results go to bench/results/papers_<name>.json")
    args = ap.parse_args()
    learner = {
        "dataset": "sine",
        "dataset_params": {"num_samples": 2000, "noise": args.noise},
        "partition": "sine_intervals",
        "partition_params": {"samples_per_node": args.samples_per_node},
        "model": "linear",
        "optimizer": "adam",
        "lr": 0.01,
        "batch_size": 32,
        "local_steps": 1,
        "val_fraction": 0.2,
        "test_fraction": 0.2,
    }
    fed = {
        "num_neighbours": 3,
        "eps": 0.3,
        "beta": 0.6,
        "loss_reduction": "sum",
        "local_steps": 1,
        "grad_samples": None,
        # Alg. 1 as printed: ℓ_ii is never measured (stays 0, l.3) and untried peers start at
        # L̂ = 0. The summed loss of a near-noiseless regression makes exp(0) a fair bar (a good
        # adjacent model's summed MSE is ~1); the node's defaults measure ℓ_ii instead
        # (docs/federico.md), which with a one-hot summed-loss E-step lets models be adopted
        # by other clients from the random start (seed 0: fidelity.md §3)
        "own_loss": "prior",
        "untried": "optimistic",
        **json.loads(args.federico_params),
    }
    run = Run(
        args.name,
        {
            "nodes": NODES,
            "rounds": args.rounds,
            "seed": args.seed,
            "learner": learner,
            "strategies": {
                k: v for k, v in (("federico", fed), ("local", {}), ("dpsgd", {})) if k in args.strategies.split(",")
            },
            "own_init": True,
            "harness": "in-process, barrier-synchronous rounds",
        },
    )
    clock = timer()
    mse: dict[str, dict[str, float]] = {}
    which = args.strategies.split(",")
    for name, params in (("federico", fed), ("local", {}), ("dpsgd", {})):
        if name not in which:
            continue
        hub = build(name, params, learner, NODES, args.seed, own_init=True)
        rows = drive(hub, args.rounds, every=max(1, args.rounds // 10), metric="test_loss")
        mse[name] = fresh_mse(hub, args.noise)
        if name == "local":
            mse["local_least_squares"] = least_squares_mse(hub, args.noise)
        if name == "federico":
            run.rounds = rows
            W = np.array(rows[-1]["W"])
            # how well each model fits each client's interval: M[i, j] = MSE of θ_j on D_i
            models = [n.learner.get_params() for n in hub.nodes.values()]
            M = np.array([[n.learner.loss(p, "train").loss for p in models] for n in hub.nodes.values()])
            # Alg. 1 l.21-24: every M-step applies the pushes that reached the node (one step a round here)
            pub = [n.strategy.public_state() for n in hub.nodes.values()]
            pushes = {
                "applied_per_node_round": sum(p["pushed_applied"] for p in pub) / (NODES * args.rounds),
                "dropped": int(sum(p["pushed_dropped"] for p in pub)),
            }
    run.wall_s = clock()
    idx = np.arange(NODES)
    near = np.abs(idx[:, None] - idx[None, :]) <= 1
    mass_near = float(np.mean((W * near).sum(1)))
    chance_near = float(np.mean(near.sum(1) / NODES))
    argmax_adjacent = float(np.mean([near[i, j] for i, j in enumerate((W - np.eye(NODES) * 9).argmax(1))]))
    means = {k: float(np.mean(list(v.values()))) for k, v in mse.items()}
    fit_weighted = float(np.mean((W * M).sum(1)))  # the MSE the weights' choice of models implies
    fit_uniform, fit_best = float(np.mean(M.mean(1))), float(np.mean(M.min(1)))
    beats = float(np.mean([mse["federico"][n] < mse["local"][n] for n in mse["local"]]))
    beats_ls = float(np.mean([mse["federico"][n] < mse["local_least_squares"][n] for n in mse["local"]]))
    run.summary = {
        "test_mse": means,
        "test_mse_per_node": mse,
        "weight_on_self_and_adjacent": mass_near,
        "uniform_weight_on_self_and_adjacent": chance_near,
        "top_peer_is_adjacent": argmax_adjacent,
        "federico_beats_local_share": beats,
        "federico_beats_local_least_squares_share": beats_ls,
        "model_fit_mse": {"weighted": fit_weighted, "uniform": fit_uniform, "best": fit_best},
        "pushes": pushes,
        "final_W": W.round(3).tolist(),
    }
    print(f"FedeRiCo Fig. 1 (seed {args.seed}, {args.rounds} rounds, {run.wall_s:.0f}s)")
    np.set_printoptions(precision=2, suppress=True, linewidth=160)
    print(W)
    run.claim(
        "weights concentrate on self and the adjacent intervals (Fig. 1 right)",
        f"weight on self+adjacent {mass_near:.2f} (uniform {chance_near:.2f}); the top peer is an "
        f"adjacent interval for {100 * argmax_adjacent:.0f}% of clients",
    )
    run.claim(
        "clients weight the models that fit their data (the right collaborators)",
        f"Σ_j w_ij·MSE(θ_j on D_i) = {fit_weighted:.4f} vs {fit_uniform:.4f} for uniform weights "
        f"(best single model {fit_best:.4f})",
    )
    run.claim(
        "personalised models fit each interval better than FedAvg's one model and than local",
        f"test MSE federico {means['federico']:.4f}, local {means['local']:.4f}, "
        f"dpsgd {means.get('dpsgd', float('nan')):.4f}; federico below local on {100 * beats:.0f}% of clients; "
        f"below the least-squares line on its own points (local run to convergence, "
        f"{means['local_least_squares']:.4f}) on {100 * beats_ls:.0f}%",
    )
    print("wrote", run.write())


if __name__ == "__main__":
    main()
