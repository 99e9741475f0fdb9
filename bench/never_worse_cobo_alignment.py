"""COBO's pair-weight signal on the sine networks, computed outside COBO (issue 33; helper nwsine).

For every pair of nodes (i, j) of a sine network: both models trained alone for ``--rounds``
rounds (the learner's steps per round, from the shared θ⁰, as each node's twin), the midpoint
z = (x_i + x_j) / 2, and ⟨∇f_i(z), ∇f_j(z)⟩ on each node's whole training split — the quantity
COBO's pair update w_ij ← clip_[0,1](w_ij + γ⟨·,·⟩) ascends (cobo.txt eq. 1/4). Printed as mean
over same-interval and other-interval pairs, per number of rounds trained; one JSON line per
(seed, rounds) to ``--out`` with the config.

    python bench/never_worse_cobo_alignment.py --network sine-adam --seeds 0,1,2 --rounds 0,1,3,15
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import never_worse as nw  # noqa: E402


def main() -> None:
    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.partition import node_data  # noqa: F401  (the learner loads it)
    from coterie.node.learning.torch_learner import TorchLearner
    from coterie.node.strategies import common as C

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", default="sine-adam", choices=[k for k in nw.NETWORKS if k.startswith("sine")])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", default="0,1,3,15")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    for seed in (int(s) for s in a.seeds.split(",")):
        sc = nw.scenario(a.network, "cobo", seed)
        learners = []
        for i in range(sc.nodes):
            cfg = LearnerConfig(**{**sc.learner, "num_nodes": sc.nodes, "node_index": i, "data_seed": sc.seed})
            learners.append(TorchLearner(cfg))
        cluster = [L.cluster if hasattr(L, "cluster") else i * 4 // sc.nodes for i, L in enumerate(learners)]
        done = 0
        for r in sorted(int(x) for x in a.rounds.split(",")):
            for L in learners:
                for _ in range(r - done):
                    L.train()
            done = r
            xs = [L.get_params() for L in learners]
            same, other = [], []
            for i in range(sc.nodes):
                for j in range(i + 1, sc.nodes):
                    z = C.lincomb([(0.5, xs[i]), (0.5, xs[j])], xs[i])
                    gi, _ = learners[i].gradient(z, "train")
                    gj, _ = learners[j].gradient(z, "train")
                    (same if cluster[i] == cluster[j] else other).append(C.dot(gi, gj))
            line = {
                "network": a.network,
                "seed": seed,
                "rounds_trained_alone": r,
                "ip_same": same,
                "ip_other": other,
                "ip_same_median": statistics.median(same),
                "ip_other_median": statistics.median(other),
                "other_positive": sum(1 for v in other if v > 0),
                "other_pairs": len(other),
                "learner": sc.learner,
            }
            print(
                f"{a.network} seed {seed} after {r:2d} rounds alone: same-interval ip median "
                f"{line['ip_same_median']:+.4f} [{min(same):+.4f}, {max(same):+.4f}]; other-interval "
                f"{line['ip_other_median']:+.4f} [{min(other):+.4f}, {max(other):+.4f}], "
                f"{line['other_positive']}/{len(other)} > 0",
                flush=True,
            )
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(line, default=str) + "\n")


if __name__ == "__main__":
    main()
