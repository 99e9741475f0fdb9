"""How long the torch learner's training steps take: the MNIST-1D MLP, CPU, one process.

The speed figure that used to be a wall-clock assertion in tests/test_learner.py (10 steps
under 1 s); a test checks that ten steps are taken, this prints how long they take.

    python bench/learner_steps.py [--steps 10] [--reps 20] [--seed 0] [--target-s 1.0]

Prints the median and spread of `--reps` timings of `train(steps=N)` after a warm-up, and the
ratio to `--target-s` (exit status 1 when the median is over it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-s", type=float, default=1.0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    cfg = LearnerConfig(
        dataset="mnist1d",
        dataset_params={"num_samples": 200},
        partition="iid",
        num_nodes=2,
        model="mlp",
        device="cpu",
        init_seed=args.seed,
        data_seed=args.seed,
    )
    lrn = build_learner(cfg)
    lrn.train(steps=2)  # warm-up: first-call allocations, lazy imports
    took = []
    for _ in range(args.reps):
        t = time.perf_counter()
        lrn.train(steps=args.steps)
        took.append(time.perf_counter() - t)
    med = statistics.median(took)
    report = {
        "config": cfg.model_dump(),
        "steps": args.steps,
        "reps": args.reps,
        "median_s": round(med, 4),
        "min_s": round(min(took), 4),
        "max_s": round(max(took), 4),
        "ms_per_step": round(1000 * med / max(args.steps, 1), 3),
        "target_s": args.target_s,
        "ratio_to_target": round(med / args.target_s, 3),
    }
    print(json.dumps(report, indent=2))
    return 0 if med <= args.target_s else 1


if __name__ == "__main__":
    raise SystemExit(main())
