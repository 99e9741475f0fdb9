"""Divergence guard on a sine regression with plain SGD (issue 23 item 6).

8 nodes, 4 sine intervals of [−π, π] (2 nodes per interval), 100 points each (60 train), a small
MLP, plain SGD: D-PSGD's loss used to explode to 1e17–1e35 and then NaN within a few rounds, and the
nodes went on training on (and publishing) NaN. Here every node runs the node's divergence guard
as the daemon does (``RoundGuard`` around each round, the learner's ``StepGuard`` in every local
step). Reported per strategy: mean test MSE (FedeRiCo: its mixture prediction), how many rounds
ended non-finite (must be 0), how many divergences the guard rolled back, and the final
step-size scale.

In-process (bench/papers/inproc.py): real learners, barrier-synchronous rounds.

    python bench/divergence_sine.py --seeds 0 1 2 --rounds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "papers"))
from inproc import RESULTS, build  # noqa: E402

from coterie.node.learning.guard import RoundGuard, all_finite  # noqa: E402

NODES = 8
LEARNER = {
    "dataset": "sine",
    "dataset_params": {"num_samples": 2000, "noise": 0.1},
    "partition": "sine_intervals",
    "partition_params": {"samples_per_node": 100, "num_intervals": 4},
    "model": "mlp",
    "model_params": {"hidden": [32, 32]},
    "optimizer": "sgd",
    "lr": 0.1,
    "batch_size": 16,
    "local_steps": 10,
    "val_fraction": 0.2,
    "test_fraction": 0.2,
}
STRATEGIES = {"local": {}, "dpsgd": {}, "fedfomo": {}, "federico": {"local_steps": 10}}


def run(strategy: str, params: dict, seed: int, rounds: int, learner: dict) -> dict:
    hub = build(strategy, params, learner, NODES, seed)
    events: list[tuple[str, str, str]] = []
    guards = {
        nid: RoundGuard(n.learner, n.strategy, lambda w, m, nid=nid: events.append((nid, w, m)))
        for nid, n in hub.nodes.items()
    }
    non_finite = 0

    async def one_round(r: int) -> None:
        nonlocal non_finite
        for nid, n in hub.nodes.items():
            guards[nid].before_round()
            await n.strategy.run_round(r)
            guards[nid].after_round()
            non_finite += not all_finite(n.learner.get_params())
        for nid in hub.nodes:
            hub.publish(nid, r)

    for r in range(1, rounds + 1):
        asyncio.run(one_round(r))
    mse = [float(n.strategy.evaluate()["test_loss"]) for n in hub.nodes.values()]
    return {
        "mse_mean": float(np.mean(mse)),
        "mse": mse,
        "non_finite_rounds": non_finite,
        "divergences": len(events),
        "first_events": [list(e) for e in events[:3]],
        "lr_scale": [n.learner.step_guard.lr_scale for n in hub.nodes.values()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--lr", type=float, default=LEARNER["lr"])
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--federico", default="{}", help="FedeRiCo parameters over the defaults (JSON)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    STRATEGIES["federico"] = {**STRATEGIES["federico"], **json.loads(args.federico)}
    learner = {**LEARNER, "lr": args.lr}
    t0 = time.time()
    out: dict = {
        "config": {
            "nodes": NODES,
            "rounds": args.rounds,
            "seeds": args.seeds,
            "learner": learner,
            "strategies": STRATEGIES,
        },
        "results": {},
    }
    for name in args.strategies.split(","):
        rows = [run(name, STRATEGIES[name], s, args.rounds, learner) for s in args.seeds]
        out["results"][name] = {"per_seed": rows}
        m = [r["mse_mean"] for r in rows]
        print(
            f"{name:9s} MSE {np.mean(m):.4f} ± {np.std(m):.4f}  non-finite rounds "
            f"{sum(r['non_finite_rounds'] for r in rows)}  divergences {[r['divergences'] for r in rows]}",
            flush=True,
        )
    out["wall_s"] = round(time.time() - t0, 1)
    path = RESULTS / f"divergence_sine_lr{args.lr:g}{args.tag}.json"
    path.write_text(
        json.dumps(out, indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else str(o))
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
