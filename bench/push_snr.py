"""How much signal a DP-released FedeRiCo push carries: the measured reason its M-step cannot
use pushed gradients under the privacy defaults, and what the issue's remedies would buy.

A push is the gradient of a cluster mate's model θ_b on my data, released through the sampled
Gaussian mechanism (privacy/mechanisms.py): per-sample gradients clipped to C, summed, noise
N(0, (σC)²) per coordinate, divided by the expected batch B. Its signal is the clipped mean, its
noise norm σC√d/B. This trains a mate's model on *its* data (S1 node 1, the scenario's learner)
and, at several points of its training, differentiates it on node 0's data (same cluster) and
prints, per setting:

  default      σ = 2, C = 1, B = 64 (the shipped defaults)
  whole split  B = n (every sample, no subsampling amplification)
  adaptive C   C = the median per-sample norm (opacus' adaptive clipping targets a quantile)

the signal norm, the noise norm, their ratio (SNR), and the ε that S1's 30 rounds × 3 pushes
would cost at that setting (opacus' RDP accountant, δ = 1e-5). When every sample is clipped
(per-sample norms above C) the signal and the noise scale together and only B/σ moves the SNR.

    python bench/push_snr.py [--seed 0] [--steps 0,100,300,600]

Writes bench/results/push_snr.json (config included) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.privacy import accountant

ROOT = Path(__file__).resolve().parents[1]
RELEASES = 30 * 3  # S1: 30 rounds, a push to each of M = 3 sampled peers
DELTA = 1e-5


def s1_learner(index: int, seed: int):
    """S1's learner (scenarios/s1_label_permuted.toml) for node ``index``."""
    return build_learner(
        LearnerConfig(
            dataset="mnist1d",
            dataset_params={"num_samples": 8000},
            partition="label_permutation",
            partition_params={"num_clusters": 4, "samples_per_node": 500},
            num_nodes=12,
            node_index=index,
            model="cnn",
            model_params={"channels": [16, 32], "fc": 64},
            optimizer="adam",
            lr=0.003,
            batch_size=32,
            device="cpu",
            init_seed=seed,
            data_seed=seed,
        )
    )


def per_sample_norms(mine, params) -> torch.Tensor:
    """The norm of each training sample's gradient of ``params`` on ``mine``'s data (what the
    mechanism clips, and what adaptive clipping would set C from)."""
    x, y = mine._data["train"]
    p = {k: torch.as_tensor(v) for k, v in params.items()}

    def loss(ps, xi, yi):
        return mine._loss_fn(functional_call(mine._shadow, ps, (mine._x(xi.unsqueeze(0)),)), yi.unsqueeze(0), "sum")

    g = vmap(grad(loss), in_dims=(None, 0, 0))(p, x, y)
    return torch.cat([g[k].reshape(len(x), -1) for k in mine._names], 1).detach().norm(dim=1)


def setting(mine, params, clip: float, sigma: float, batch: int) -> dict[str, float]:
    """Signal (the clipped mean the mechanism's release has as its expectation, computed by the
    learner's own clipped sum, privacy/mechanisms.py's path), noise norm, SNR and ε."""
    n = mine.num_samples("train")
    total = mine.clipped_gradient_sum(params, "train", np.arange(n), clip)
    signal = math.sqrt(sum(float((t.double() ** 2).sum()) for t in total.values())) / n
    d = sum(t.numel() for t in total.values())
    noise = sigma * clip * math.sqrt(d) / batch
    eps = accountant.epsilon([(sigma, min(1.0, batch / n), RELEASES)], DELTA)
    return {
        "clip": clip,
        "sigma": sigma,
        "batch": batch,
        "signal": signal,
        "noise": noise,
        "snr": signal / noise,
        "epsilon_90_releases": eps,
        "d": d,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", default="0,100,300,600", help="the mate's local steps at which to measure")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "push_snr.json"))
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    mine, mate = s1_learner(0, args.seed), s1_learner(1, args.seed)  # nodes 0 and 1: one cluster
    n = mine.num_samples("train")
    rows, done = [], 0
    for step in sorted(int(s) for s in args.steps.split(",")):
        if step > done:
            mate.train(steps=step - done)
            done = step
        params = mate.get_params()
        med = float(per_sample_norms(mine, params).median())
        g, _ = mine.gradient(params, "train", None, "mean")
        exact = math.sqrt(sum(float((t.double() ** 2).sum()) for t in g.values()))
        for name, (c, s, b) in {
            "default": (1.0, 2.0, 64),
            "whole split": (1.0, 2.0, n),
            "adaptive C": (med, 2.0, 64),
            "whole split, σ=1": (1.0, 1.0, n),
        }.items():
            rows.append(
                {
                    "mate_steps": step,
                    "setting": name,
                    "exact_mean_grad_norm": exact,
                    "median_sample_norm": med,
                    **setting(mine, params, c, s, b),
                }
            )
    print(
        f"S1 seed {args.seed}: a cluster mate's model differentiated on node 0's {n} training samples, "
        f"d = {rows[0]['d']}; ε: {RELEASES} releases at δ = {DELTA}"
    )
    print(
        f"{'mate steps':>10} {'setting':>18} {'exact ‖g‖':>10} {'median ‖g_i‖':>12} {'signal':>8} "
        f"{'noise':>8} {'SNR':>7} {'ε':>8}"
    )
    for r in rows:
        print(
            f"{r['mate_steps']:>10} {r['setting']:>18} {r['exact_mean_grad_norm']:>10.3f} "
            f"{r['median_sample_norm']:>12.3f} {r['signal']:>8.3f} {r['noise']:>8.3f} {r['snr']:>7.3f} "
            f"{r['epsilon_90_releases']:>8.1f}"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "config": vars(args)
                | {"releases": RELEASES, "delta": DELTA, "scenario": "s1_label_permuted (nodes 0, 1)"},
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
