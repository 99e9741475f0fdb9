"""Time of one model distance (FedFomo's ‖θ_n − θ_base‖₁, ``common.distance``) against the
whole-tensor formula it replaced (``l1_norm(sub(a, b))``: the difference, its float64 copy and
that copy's absolute value, each model-sized), side by side in one process, alternating, on the
~21 MB MLP's parameters (40-2280-2280-10) and S1's small CNN-sized parameter set (~24 k). Prints
the median time of each and the median of the per-pair ratios; writes every timing and the full
config to ``--out``. (Peak memory: ``tests/test_model_distance.py``, 5-7 model sizes → ≤ 0.25.)

    python bench/model_distance.py --seed 0 --pairs 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from coterie.node.strategies import common as C

SHAPES = {
    "mlp-21MB": [(2280, 40), (2280,), (2280, 2280), (2280,), (10, 2280), (10,)],
    "cnn-24k": [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 288), (64,), (10, 64), (10,)],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a node's learner.torch_threads)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "model_distance.json")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    ways = {"whole tensor": lambda a, b: C.l1_norm(C.sub(a, b)), "chunked": C.distance}
    result: dict = {"config": vars(args) | {"out": str(args.out), "shapes": SHAPES}, "models": {}}
    for model, shapes in SHAPES.items():
        a = {f"t{i}": torch.randn(s) for i, s in enumerate(shapes)}
        b = {f"t{i}": torch.randn(s) for i, s in enumerate(shapes)}
        reps = 1 if model.startswith("mlp") else 200  # calls per timing
        times: dict[str, list[float]] = {w: [] for w in ways}
        for pair in range(args.pairs):
            order = list(ways) if pair % 2 == 0 else list(reversed(ways))
            for w in order:
                t = time.perf_counter()
                for _ in range(reps):
                    ways[w](a, b)
                times[w].append((time.perf_counter() - t) / reps)
        ratios = [c / w for c, w in zip(times["chunked"], times["whole tensor"], strict=True)]
        med = {w: statistics.median(ts) * 1e3 for w, ts in times.items()}
        print(
            f"{model}: whole tensor {med['whole tensor']:.3f} ms, chunked {med['chunked']:.3f} ms, "
            f"chunked / whole per pair median {statistics.median(ratios):.2f}"
        )
        result["models"][model] = {"ms": times, "median_ms": med, "ratio_median": statistics.median(ratios)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
