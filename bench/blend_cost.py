"""What choosing α costs a check (issue 33, reference.predict = "blend"): ``LocalReference.judge``
with the blend against the binary back-off (``"choose"``), interleaved call for call in one process,
for a node predicting with its own model and with a 5-member mixture (FedeRiCo-like), beside one
round of local training for scale. Medians of ``--repeats`` calls; its config and figures go into
bench/results/blend_cost.json under its seed (other seeds' entries kept).

    for s in 0 1 2; do nice -n 5 python bench/blend_cost.py --seed $s --repeats 30; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "blend_cost.json"


def main() -> None:
    from coterie.node.config import ReferenceConfig
    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.torch_learner import build_learner
    from coterie.node.local_reference import LocalReference

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    sys.path.insert(0, str(ROOT / "bench"))
    import never_worse as nw

    # a digits-perm node of bench/never_worse.py
    learner_cfg = {**nw.NETWORKS["digits-perm"][0]()["learner"], "num_nodes": 8, "data_seed": a.seed}
    learner = build_learner(LearnerConfig(**learner_cfg))
    refs = {
        rule: LocalReference(ReferenceConfig(predict=rule, patience=10**6), learner, "federico")
        for rule in ("choose", "blend")
    }
    for r in refs.values():
        r.train(1)
    learner.train()
    own = learner.get_params()
    mixture = [(f"n{k}", 0.2, {n: v + 0.01 * k for n, v in own.items()}) for k in range(5)]
    times: dict[str, list[float]] = {}
    for rep in range(a.repeats):
        for members_name, members in (("own model", None), ("5-member mixture", mixture)):
            for rule, ref in refs.items():  # interleaved: the machine's noise hits both alike
                t0 = time.perf_counter()
                ref.judge(rep + 1, {"test_acc": 0.5, "test_loss": 1.0}, members)
                times.setdefault(f"judge {rule}, {members_name}", []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        learner.train()
        times.setdefault("one round of local training (20 steps)", []).append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    ratios = {m: med[f"judge blend, {m}"] / med[f"judge choose, {m}"] for m in ("own model", "5-member mixture")}
    result = {
        "config": {**vars(a), "learner": learner_cfg, "val_samples": learner.num_samples("val")},
        "median_ms": med,
        "blend_over_choose": ratios,
        "spread_ms": {k: [min(v) * 1000, max(v) * 1000] for k, v in times.items()},
    }
    runs = json.loads(OUT.read_text()) if OUT.exists() else {}
    runs[str(a.seed)] = result
    OUT.write_text(json.dumps(runs, indent=1) + "\n")
    print(json.dumps({"seed": a.seed, "median_ms": med, "blend_over_choose": ratios}))


if __name__ == "__main__":
    main()
