"""Own files, real heterogeneity: a 6-node network where every node reads its own file, in two
groups whose files name the classes differently.

Every device records the same kind of sensor (Gaussian class clusters in ``DIM`` dimensions,
``CLASSES`` agreed by the network), but group B's devices were labelled by people who call the
classes by other names: what group A's files call "walk", group B's call "run", and so on (a
fixed permutation of the agreed names). Both groups' labels are valid class names, so every
node reads its file without error — the heterogeneity is in the files, as label permutation is
in the built-in partitioner, but nothing tells a node who is who. Group A writes a CSV folder
(train/val/test.csv), group B an npz with string labels (x, y, x_val, y_val, x_test, y_test).
Each node has few training samples (40), so learning with the right peers pays and averaging with
the wrong ones hurts; its test split is large (500) so the figures are not 4 points per sample.

    python bench/own_data.py --seeds 0,1,2,3,4 --strategies local,dpsgd,fedfomo,federico,oracle
    python bench/own_data.py                      # 3 seeds, local, dpsgd, fedfomo, federico
    python bench/own_data.py --seeds 0 --strategies local,fedfomo --rounds 10

Runs ``coterie run --backend inproc`` (real daemons in one process, real state dirs) per seed;
writes bench/results/own_data/seed<k>/ (run dirs, not committed), bench/results/own_data.json
(figures, the sizes and the full scenario of every seed) and bench/results/own_data.md (mean ± std over
seeds of the nodes' mean final test accuracy, per group).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
CLASSES = ["sit", "walk", "run", "cycle"]
B_NAMES = {"sit": "walk", "walk": "run", "run": "cycle", "cycle": "sit"}  # what group B calls each
NODES = 6
# Defaults: few training samples in many dimensions (peers of the right group help), a large test
# split given in the files (one node's accuracy moves by 0.2 points per sample, not 4)
DIM, TRAIN, VAL, TEST = 20, 40, 40, 500


def write_files(
    folder: Path, seed: int, dim: int = DIM, train: int = TRAIN, val: int = VAL, test: int = TEST
) -> list[int]:
    """One data set per node, its splits given in the files: n0..n2 (group A) a CSV folder
    ``n<i>/{train,val,test}.csv``, n3..n5 (group B) ``n<i>.npz`` with ``x``/``y``,
    ``x_val``/``y_val``, ``x_test``/``y_test``. Returns the groups."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    folder.mkdir(parents=True, exist_ok=True)
    means = np.random.default_rng([seed, 1]).normal(0, 0.5, (len(CLASSES), dim))  # the world: shared
    groups = []
    for i in range(NODES):
        group = 0 if i < NODES // 2 else 1
        rng = np.random.default_rng([seed, 2, i])
        splits = {}
        for split, n in (("train", train), ("val", val), ("test", test)):
            y = rng.integers(0, len(CLASSES), n)
            x = (means[y] + rng.normal(0, 1.0, (n, dim))).astype(np.float32)
            splits[split] = (x, [CLASSES[k] if group == 0 else B_NAMES[CLASSES[k]] for k in y])
        if group == 0:
            (folder / f"n{i}").mkdir(exist_ok=True)
            for split, (x, names) in splits.items():
                pcsv.write_csv(
                    pa.table({**{f"s{d}": x[:, d] for d in range(dim)}, "activity": names}),
                    folder / f"n{i}" / f"{split}.csv",
                )
        else:
            np.savez(
                folder / f"n{i}.npz",
                **{
                    f"{k}{suffix}": v
                    for split, suffix in (("train", ""), ("val", "_val"), ("test", "_test"))
                    for k, v in zip(("x", "y"), (splits[split][0], np.array(splits[split][1])), strict=True)
                },
            )
        groups.append(group)
    return groups


def scenario(seed: int, strategies: list[str], rounds: int, files: Path, groups: list[int]) -> dict:
    return {
        "name": "own-data-two-namings",
        "seed": seed,
        "nodes": NODES,
        "rounds": rounds,
        "strategy": strategies,
        "description": "6 nodes on their own files; group B's files name the classes by a permutation",
        "learner": {
            "data": str(files / "{node}"),
            "classes": CLASSES,
            "data_label": "activity",
            "model": "mlp",
            "model_params": {"hidden": [32]},
            "optimizer": "adam",
            "lr": 0.01,
            "local_steps": 10,
            "batch_size": 16,
            "device": "cpu",
        },
        "node": {"heartbeat_interval_s": 0.3, "start_timeout_s": 120, "log_level": "WARNING"},
        "overrides": [
            {
                "nodes": [i],
                "labels": {"cluster": str(g)},
                **({"learner": {"data": str(files / f"n{i}.npz")}} if g else {}),
            }
            for i, g in enumerate(groups)
        ],
    }


def own_group_share(weights, groups: list[int]) -> float | None:
    """Of the weight nodes put on peers (self excluded; each node's row averaged over its rounds),
    the share on peers of their own group (chance: 2/5 here): did the strategy find who names the
    classes as it does?"""
    if not weights:
        return None
    shares = []
    for i, row in enumerate(weights):
        if row is None:
            continue
        peers = [(w, groups[j] == groups[i]) for j, w in enumerate(row) if j != i]
        total = sum(w for w, _ in peers)
        if total > 0:
            shares.append(sum(w for w, same in peers if same) / total)
    return float(np.mean(shares)) if shares else None


def exported_accuracy(state_dir: Path, out: Path) -> float:
    """Accuracy, on the node's test split of its own file, of the model `coterie model export`
    writes from the node's state dir (node/modelfile.write_export): the personalised model a
    user takes away. The card's learner config rebuilds the node's data, the split included."""
    import torch

    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.torch_learner import build_learner
    from coterie.node.modelfile import load_model, write_export

    card = write_export(state_dir, out)
    model = load_model(out).model
    x, y = build_learner(LearnerConfig(**card["learner"]))._data["test"]
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--strategies", default="local,dpsgd,fedfomo,federico")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dim", type=int, default=DIM, help="features per sample")
    ap.add_argument("--train", type=int, default=TRAIN, help="training samples per node")
    ap.add_argument("--val", type=int, default=VAL, help="validation samples per node")
    ap.add_argument("--test", type=int, default=TEST, help="test samples per node")
    ap.add_argument("--name", default="own_data", help="results: bench/results/<name>.md/.json, <name>/seed<k>/")
    ap.add_argument("--from-runs", action="store_true", help="only summarise the run dirs already there")
    args = ap.parse_args()
    from coterie.lab.launch import run_scenario
    from coterie.lab.scenario import parse_scenario

    strategies = args.strategies.split(",")
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        base = OUT / args.name / f"seed{seed}"
        groups = write_files(base / "files", seed, args.dim, args.train, args.val, args.test)
        sc_dict = scenario(seed, strategies, args.rounds, base / "files", groups)
        t0 = time.time()
        if args.from_runs:
            res = json.loads((base / "run" / "results.json").read_text())
        else:
            res = run_scenario(parse_scenario(sc_dict), base / "run", backend="inproc")
        per = {}
        for s in strategies:
            nodes = res["strategies"][s]["nodes"]
            acc = [nodes[f"n{i}"]["test_acc"][-1] for i in range(NODES)]
            exported = [
                exported_accuracy(base / "run" / s / "nodes" / f"n{i}", base / "export" / s / f"n{i}.safetensors")
                for i in range(NODES)
            ]
            per[s] = {
                "mean": float(np.mean(acc)),
                "group_a": float(np.mean(acc[: NODES // 2])),
                "exported_mean": float(np.mean(exported)),
                "exported_nodes": exported,
                "group_b": float(np.mean(acc[NODES // 2 :])),
                "nodes": acc,
                "own_group_share": own_group_share(res["strategies"][s].get("mean_weights"), groups),
                "own_group_share_last": own_group_share(res["strategies"][s].get("final_weights"), groups),
            }
        runs[seed] = {
            "scenario": sc_dict,
            "files": {"dim": args.dim, "train": args.train, "val": args.val, "test": args.test, "seed": seed},
            "wall_s": None if args.from_runs else round(time.time() - t0, 1),
            "final_test_acc": per,
        }
        print(f"seed {seed}: " + ", ".join(f"{s} {v['mean']:.3f}" for s, v in per.items()), flush=True)
    table = {}
    for s in strategies:
        vals = np.array([r["final_test_acc"][s]["mean"] for r in runs.values()])
        ga = np.array([r["final_test_acc"][s]["group_a"] for r in runs.values()])
        gb = np.array([r["final_test_acc"][s]["group_b"] for r in runs.values()])
        diff = vals - np.array([r["final_test_acc"][strategies[0]]["mean"] for r in runs.values()])
        shares = [r["final_test_acc"][s]["own_group_share"] for r in runs.values()]
        last = [r["final_test_acc"][s].get("own_group_share_last") for r in runs.values()]
        exp = np.array([r["final_test_acc"][s]["exported_mean"] for r in runs.values()])
        table[s] = {
            "mean": float(vals.mean()),
            "std": float(vals.std(ddof=1)) if len(vals) > 1 else 0.0,
            "group_a": float(ga.mean()),
            "group_b": float(gb.mean()),
            "vs_first": float(diff.mean()),
            "vs_first_std": float(diff.std(ddof=1)) if len(diff) > 1 else 0.0,
            "own_group_share": None if None in shares else float(np.mean(shares)),
            "own_group_share_last": None if None in last else float(np.mean(last)),
            "exported": float(exp.mean()),
            "exported_std": float(exp.std(ddof=1)) if len(exp) > 1 else 0.0,
        }
    (OUT / f"{args.name}.json").write_text(json.dumps({"runs": runs, "summary": table}, indent=1))
    lines = [
        "# Own files, two label namings (bench/own_data.py)",
        "",
        f"{NODES} nodes, each on its own files ({args.train} train / {args.val} val / {args.test} test "
        f"samples, given in the files; {args.dim} features; classes {CLASSES}); "
        f"n0–n2 (group A) write a CSV folder (train/val/test.csv) with the agreed names, n3–n5 "
        f"(group B) npz (x, y, x_val, …) whose names are a "
        f"permutation of them ({B_NAMES}). {args.rounds} rounds, in-process backend, "
        f"seeds {args.seeds}. Mean final test accuracy over the nodes; mean ± std over seeds "
        f"(sample std).",
        "",
        f"`− {strategies[0]}`: the paired difference to {strategies[0]} on the same files and seed "
        f"(mean ± std over seeds). `own group`: share of the peer weight a node puts on peers of its "
        f"own group, averaged over the rounds (chance 2/5; 1 = found its group exactly; `last`: in the "
        f"last round, – where the strategy reports no weights then). In-process "
        f"networks pull asynchronously: a rerun of the same seed differs by a few points. "
        f"`exported`: the same nodes' models as `coterie model export` writes them from the state "
        f"dir (node/modelfile.py), their accuracy on each node's test split of its file (mean ± std "
        f"over seeds): what the node predicts with — its own model, or for FedeRiCo the mixture "
        f"Σ_j w_ij p(y|x; θ_j) of its own and peers' models (§2.1) it reports, every member in the "
        f"file. It should equal the reported accuracy (`coterie model export --own` gives "
        f"FedeRiCo's own model alone).",
        "",
        f"| strategy | mean ± std | − {strategies[0]} | exported | group A | group B | own group | last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s, v in table.items():
        share = "–" if v["own_group_share"] is None else f"{v['own_group_share']:.2f}"
        share += " | " + ("–" if v["own_group_share_last"] is None else f"{v['own_group_share_last']:.2f}")
        lines.append(
            f"| {s} | {v['mean']:.3f} ± {v['std']:.3f} | {v['vs_first']:+.3f} ± {v['vs_first_std']:.3f} "
            f"| {v['exported']:.3f} ± {v['exported_std']:.3f} | {v['group_a']:.3f} | {v['group_b']:.3f} | {share} |"
        )
    (OUT / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
