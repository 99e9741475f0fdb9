"""Structure before pruning (issue 23 item 4): do L2C, meta-L2C and SCool find their collaborators
*before* their pruning round T0 cuts the graph down to a few peers?

After pruning, with clusters of 3 and 2 peers kept, the in-cluster share is 1.0 by construction
once the ranking is right, so the figure that shows whether the learned weights carry structure
is the row at T0, before any peer is dropped. Per strategy and seed this records:
  - ``t0``: the in-cluster share of the full row the strategy held when it pruned (L2C:
    softmax(α) over self and every neighbour; meta-L2C / SCool: that round's row), and the share
    of the kept peers that are true collaborators (the ranking);
  - ``after``: the in-cluster share averaged over the rounds after pruning;
  - the final test accuracy, against ``local`` and ``oracle`` on the same partitions and seeds,
    and the share of the oracle's gain over local (issue 23 item 5 asks ≥ 75%).
Chance = (c − 1)/(n − 1). Scenario: S1 (scenarios/s1_label_permuted.toml: 12 nodes = 4
label-permutation clusters × 3, MNIST-1D, small CNN), in-process (bench/papers/inproc.py: real
learners, barrier-synchronous rounds, round-aligned pulls).

    nice -n 10 python bench/structure_bench.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent / "papers"))

from inproc import RESULTS, ROOT, build, clusters_of, drive, in_cluster_mass, timer  # noqa: E402

from coterie.node.strategies import common as C  # noqa: E402

SCENARIO = ROOT / "scenarios" / "s1_label_permuted.toml"
# name in the table -> (registered strategy, params on top of the scenario's)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "local": ("local", {}),
    "oracle": ("oracle", {}),
    "l2c": ("l2c", {}),
    "meta-l2c": ("meta-l2c", {}),
    "scool-attention": ("scool-attention", {}),
    "scool-sbm (blocks estimated)": ("scool-sbm", {"num_blocks": "auto"}),
    "scool-sbm (blocks told: 4)": ("scool-sbm", {"num_blocks": 4}),
}


def full_row(strategy: Any) -> dict[str, float]:
    """The strategy's row over self and *every* candidate at this moment (pruned ones included)."""
    if strategy.name == "l2c":
        ids = list(strategy._alpha)
        return dict(zip(ids, C.softmax([strategy._alpha[p] for p in ids]).tolist(), strict=True))
    return dict(strategy._row)


def share(row: dict[str, float], me: str, clusters: dict[str, int]) -> float | None:
    peer = {p: v for p, v in row.items() if p != me}
    tot = sum(peer.values())
    return None if tot <= 0 else sum(v for p, v in peer.items() if clusters[p] == clusters[me]) / tot


def run_one(
    name: str, seed: int, rounds: int, learner: dict[str, Any], nodes: int, scenario_params: dict[str, Any]
) -> dict[str, Any]:
    strat, extra = VARIANTS[name]
    params = {**scenario_params.get(strat, {}), **extra}
    if strat == "scool-sbm" and "num_blocks" not in extra:
        params.pop("num_blocks", None)
    hub = build(strat, params, learner, nodes, seed)
    ids = list(hub.nodes)
    cl_list = clusters_of(learner, nodes, seed)
    cl = dict(zip(ids, cl_list, strict=True))
    t0_share: dict[str, float | None] = {}
    kept_ok: dict[str, float] = {}
    t0_round: dict[str, int] = {}
    per_round: list[dict[str, Any]] = []
    for r in range(1, rounds + 1):
        row_rec = drive(hub, 1, start=r)[0]
        W = np.array(row_rec["W"])
        pruned_now = {}
        for nid, n in hub.nodes.items():
            s = n.strategy
            kept = getattr(s, "_kept", None)
            if kept is not None and nid not in t0_round:
                t0_round[nid] = r
                t0_share[nid] = share(full_row(s), nid, cl)
                kept_ok[nid] = float(np.mean([cl[k] == cl[nid] for k in kept])) if kept else 0.0
            pruned_now[nid] = kept is not None
        per_round.append(
            {
                "round": r,
                "in_cluster": in_cluster_mass(W, cl_list),
                "pruned": sum(pruned_now.values()),
                "acc": float(np.mean(list(row_rec["test_acc"].values()))),
            }
        )
    after = [
        p["in_cluster"]
        for p in per_round
        if p["pruned"] == len(ids) and p["round"] > max(t0_round.values(), default=rounds)
    ]
    vals = [v for v in t0_share.values() if v is not None]
    out: dict[str, Any] = {
        "variant": name,
        "strategy": strat,
        "params": params,
        "seed": seed,
        "final_acc": per_round[-1]["acc"],
        "rounds": per_round,
        "t0_round": sorted(set(t0_round.values())),
        "t0_share": float(np.mean(vals)) if vals else None,
        "t0_share_per_node": t0_share,
        "kept_correct": float(np.mean(list(kept_ok.values()))) if kept_ok else None,
        "after_share": float(np.mean(after)) if after else None,
        "chance": float(np.mean([(cl_list.count(c) - 1) / (nodes - 1) for c in cl_list])),
    }
    if strat == "scool-sbm":
        out["blocks"] = sorted({int(n.strategy.num_blocks) for n in hub.nodes.values()})
        out["blocks_per_node"] = [int(n.strategy.num_blocks) for n in hub.nodes.values()]
    return out


def ci95(x: list[float]) -> tuple[float, float]:
    a = np.asarray(x, dtype=float)
    if len(a) < 2:
        return float(a.mean()), 0.0
    from scipy import stats

    return float(a.mean()), float(stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a)))


def markdown(runs: list[dict[str, Any]], config: dict[str, Any]) -> str:
    def cell(vals: list[float | None], pct: bool = False) -> str:
        v = [x for x in vals if x is not None]
        if not v:
            return "–"
        m, h = ci95(v)
        return f"{100 * m:.1f} ± {100 * h:.1f}" if pct else f"{m:.2f} ± {h:.2f}"

    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    loc = {r["seed"]: r["final_acc"] for r in by.get("local", [])}
    orc = {r["seed"]: r["final_acc"] for r in by.get("oracle", [])}
    chance = runs[0]["chance"]
    lines = [
        f"Seeds {config['seeds']}, {config['rounds']} rounds, mean ± 95% CI (t, over seeds). "
        f"Chance in-cluster share {chance:.2f}; 2× chance = {2 * chance:.2f}.",
        "",
        "| strategy | T0 (round) | in-cluster share at T0 (before pruning) | kept peers in-cluster at T0 | "
        "in-cluster share after pruning | final acc % | share of oracle's gain over local | blocks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in by.items():
        # the ratio means nothing where the oracle itself has not gained (≥ 1 point) yet
        gains = [
            (r["final_acc"] - loc[r["seed"]]) / (orc[r["seed"]] - loc[r["seed"]])
            for r in rs
            if r["seed"] in loc and r["seed"] in orc and orc[r["seed"]] - loc[r["seed"]] >= 0.01
        ]
        t0r = sorted({x for r in rs for x in r["t0_round"]})
        blocks = sorted({b for r in rs for b in r.get("blocks_per_node", [])})
        lines.append(
            f"| {name} | {','.join(map(str, t0r)) or '–'} | {cell([r['t0_share'] for r in rs])} | "
            f"{cell([r['kept_correct'] for r in rs])} | {cell([r['after_share'] for r in rs])} | "
            f"{cell([r['final_acc'] for r in rs], True)} | "
            f"{cell(gains, True) + '%' if gains and name not in ('local', 'oracle') else '–'} | "
            f"{','.join(map(str, blocks)) or '–'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=None, help="default: the scenario's")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=RESULTS / "structure.json")
    ap.add_argument(
        "--collect",
        type=Path,
        nargs="*",
        default=None,
        help="merge these partial result files (runs split over processes) into --out and its .md",
    )
    args = ap.parse_args()
    if args.collect is not None:
        parts = [json.loads(f.read_text()) for f in args.collect]
        config = {**parts[0]["config"], "variants": {k: v for p in parts for k, v in p["config"]["variants"].items()}}
        runs = [r for p in parts for r in p["runs"]]
        config["seeds"] = sorted({r["seed"] for r in runs})
        args.out.write_text(json.dumps({"config": config, "runs": runs}, indent=1, default=float))
        md = markdown(runs, config)
        args.out.with_suffix(".md").write_text(md)
        print(md)
        return 0
    sc = tomllib.loads(SCENARIO.read_text())
    learner = {k: v for k, v in sc["learner"].items() if k != "device"}
    nodes, rounds = int(sc["nodes"]), int(args.rounds or sc["rounds"])
    seeds = [int(s) for s in args.seeds.split(",")]
    config = {
        "scenario": str(SCENARIO.relative_to(ROOT)),
        "nodes": nodes,
        "rounds": rounds,
        "seeds": seeds,
        "learner": learner,
        "strategy_params": sc.get("strategy_params", {}),
        "variants": {v: VARIANTS[v] for v in args.variants.split(",")},
        "harness": "in-process (bench/papers/inproc.py), barrier-synchronous rounds, round-aligned pulls",
    }
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = [r for r in old.get("runs", []) if not (r["variant"] in config["variants"] and r["seed"] in seeds)]
    clock = timer()
    for seed in seeds:
        for name in args.variants.split(","):
            t = timer()
            r = run_one(name, seed, rounds, learner, nodes, sc.get("strategy_params", {}))
            r["wall_s"] = t()
            runs.append(r)
            print(
                f"seed {seed} {name}: T0 share {r['t0_share']} kept-ok {r['kept_correct']} after "
                f"{r['after_share']} acc {r['final_acc']:.3f} blocks {r.get('blocks_per_node')} "
                f"({r['wall_s']:.0f}s)",
                flush=True,
            )
            args.out.write_text(json.dumps({"config": config, "runs": runs}, indent=1, default=float))
    print(markdown(runs, {**config, "seeds": sorted({r["seed"] for r in runs})}))
    print(f"wall {clock():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
