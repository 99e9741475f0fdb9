"""COBO at its defaults on a network it was not tuned for: the demo network (scenarios/demo.toml:
8 nodes, 2 label-permutation clusters of 4 on MNIST-1D, an MLP, Adam 0.003, 40 steps a round), run
as a new user would — ``strategy = ["local", "cobo"]`` and no COBO parameters — against the
defaults COBO had before (5 plain-SGD steps a round at its own lr 0.1, whatever the learner sets).

Each seed runs ``coterie run`` (in-process backend) on the two scenario files beside the results
(``bench/results/cobo_defaults/*.toml``); the per-run results.json (with its scenario) stays in
``--work``, and a summary (configs, per-seed accuracies, COBO's raw pair weights) goes to
``bench/results/cobo_defaults/summary.json`` and ``.md``.

    python bench/cobo_defaults.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "papers"))
from inproc import in_cluster_mass  # noqa: E402

HERE = Path(__file__).resolve().parent / "results" / "cobo_defaults"
RUNS = {"defaults": "demo_cobo.toml", "old_defaults": "demo_cobo_old_defaults.toml"}


def run(scenario: Path, seed: int, out: Path) -> dict:
    if not (out / "results.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "coterie.cli.main",
                "run",
                str(scenario),
                "--seed",
                str(seed),
                "--out",
                str(out),
                "--backend",
                "inproc",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return json.loads((out / "results.json").read_text())


def in_cluster(res: dict, strategy: str) -> float:
    ids, tc = res["node_ids"], res["true_clusters"]
    labels = [tc[i] if isinstance(tc, dict) else tc[k] for k, i in enumerate(ids)]
    return in_cluster_mass(np.array(res["strategies"][strategy]["final_weights"]), labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--work", default="/tmp/coterie_cobo_defaults", help="where the runs' own outputs go")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        row: dict = {"seed": seed}
        for label, toml in RUNS.items():
            res = run(HERE / toml, seed, Path(args.work) / f"{label}_s{seed}")
            for strat, s in res["strategies"].items():
                key = strat if strat == "local" else f"cobo_{label}"
                row[key] = {
                    "mean_test_acc": s["summary"]["mean_test_acc"],
                    "in_cluster_share": None if strat == "local" else in_cluster(res, strat),
                    "scenario": res["scenario"],
                }
                if strat == "cobo":  # the weights row is {self: 1} ∪ {k: w_ik}, normalised: w_ik = W[i,k] / W[i,i]
                    W = np.array(s["final_weights"])
                    raw = W / np.diag(W)[:, None]
                    row[key]["raw_w_mean"] = float(raw[~np.eye(len(W), dtype=bool)].mean())
        rows.append(row)
    cols = ["local", "cobo_defaults", "cobo_old_defaults"]
    stat = {
        c: (
            statistics.mean(100 * r[c]["mean_test_acc"] for r in rows),
            statistics.stdev(100 * r[c]["mean_test_acc"] for r in rows) if len(rows) > 1 else 0.0,
        )
        for c in cols
    }
    lines = [
        "# COBO at its defaults on the demo network",
        "",
        f"`python bench/cobo_defaults.py --seeds {args.seeds}` (in-process, 30 rounds; ± = sample std over the seeds; "
        "in-cluster = share of a node's peer weight on its cluster mates, chance 3/7 = 0.43; raw w = mean pair "
        "weight w_ij, which starts at 1).",
        "",
        "| seed | local | COBO defaults (learner's optimizer and steps) | in-cluster / raw w | COBO old defaults (5 plain-SGD steps, lr 0.1) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {100 * r['local']['mean_test_acc']:.1f} | {100 * r['cobo_defaults']['mean_test_acc']:.1f} | "
            f"{r['cobo_defaults']['in_cluster_share']:.2f} / {r['cobo_defaults']['raw_w_mean']:.2f} | {100 * r['cobo_old_defaults']['mean_test_acc']:.1f} |"
        )
    lines.append(
        f"| mean ± std | {stat['local'][0]:.1f} ± {stat['local'][1]:.1f} | "
        f"{stat['cobo_defaults'][0]:.1f} ± {stat['cobo_defaults'][1]:.1f} | | "
        f"{stat['cobo_old_defaults'][0]:.1f} ± {stat['cobo_old_defaults'][1]:.1f} |"
    )
    HERE.joinpath("summary.json").write_text(json.dumps({"seeds": seeds, "rows": rows}, indent=1))
    HERE.joinpath("summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
