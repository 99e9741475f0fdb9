"""The public strategy benchmark: S1 label-permuted clusters, S2 class groups, S3 noisy nodes.

Runs ``coterie run`` (real daemons on loopback) for every strategy on identical partitions and
seeds, then reports per strategy: mean and worst-10% node accuracy, share of nodes beating
``local``, in-cluster weight mass (chance = (c-1)/(n-1)), AUROC of weights against the true
adjacency, weight on the noisy nodes (S3), bytes per node per round and wall time.

    python bench/strategy_bench.py                      # all three scenarios, all strategies
    python bench/strategy_bench.py --scenarios s1 --strategies local,fedfomo --rounds 10
    python bench/strategy_bench.py --seeds 0,1,2 --backend inproc   # the headline: mean ± 95% CI

Several seeds (data, initialisation and peer sampling all follow the seed) write
bench/results/<scenario>/seed<k>/ (run directories, not committed), bench/results/seeds.json
(every seed's metrics and the exact configuration) and bench/results/seeds.md: per cell the mean
± the 95% confidence half-width (Student t over the seeds), the paired gain over local, the
share of the oracle's gain, and the claims that do not hold in every seed.

Writes bench/results/<scenario>/ (the coterie run directory: node state and logs, not committed),
bench/results/<scenario>_results.json (its results.json), bench/results/summary.json,
bench/results/summary.md and PNG heatmaps of the weight matrices over rounds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"s1": "s1_label_permuted.toml", "s2": "s2_class_groups.toml", "s3": "s3_noisy_nodes.toml"}
WINDOW = 0.5  # weights averaged over the last half of the rounds (sampling strategies vary per round)


def clusters_of(res: dict, strategy: str) -> list[int]:
    """Ground truth: a node's `cluster` label where the scenario sets one, else the partitioner's."""
    cfgs = res["strategies"][strategy]["node_configs"]
    truth = res.get("true_clusters") or [0] * len(res["node_ids"])
    return [int(cfgs[n].get("labels", {}).get("cluster", truth[i])) for i, n in enumerate(res["node_ids"])]


def late_weights(s: dict, n: int) -> np.ndarray:
    mats = [m for m in s["weights"]["matrices"]]
    start = int(len(mats) * (1 - WINDOW))
    W = np.zeros((n, n))
    count = np.zeros(n)
    for m in mats[start:]:
        for i, row in enumerate(m):
            if row is not None:
                W[i] += row
                count[i] += 1
    return W / np.maximum(count, 1)[:, None]


def auroc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    pos, neg = scores[labels], scores[~labels]
    if len(pos) == 0 or len(neg) == 0:
        return None
    ranks = np.argsort(np.argsort(np.concatenate([pos, neg]), kind="stable"), kind="stable") + 1.0
    allv = np.concatenate([pos, neg])  # average ranks of ties
    for v in np.unique(allv):
        idx = allv == v
        ranks[idx] = ranks[idx].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def mixture_corr(W: np.ndarray, mix: np.ndarray) -> float | None:
    """Partition "mixture": Pearson correlation, over the off-diagonal pairs, of the learned
    weights with the true overlap of two nodes' data, π_i·π_j (the chance that a sample of i and
    one of j come from the same component)."""
    off = ~np.eye(len(W), dtype=bool)
    a, b = W[off], (mix @ mix.T)[off]
    return None if a.std() == 0 or b.std() == 0 else float(np.corrcoef(a, b)[0, 1])


def metrics(res: dict) -> dict:
    ids = res["node_ids"]
    n = len(ids)
    out = {}
    local = res["strategies"].get("local")
    for name, s in res["strategies"].items():
        cl = np.array(clusters_of(res, name))
        noisy = [i for i, nid in enumerate(ids) if s["node_configs"][nid]["learner"].get("label_noise", 0) > 0]
        clean = [i for i in range(n) if i not in noisy]
        acc = np.array([s["nodes"][nid]["final_test_acc"] or 0.0 for nid in ids])
        acc_clean = acc[clean]
        k = max(1, int(round(0.1 * len(acc_clean))))
        W = late_weights(s, n)
        off = ~np.eye(n, dtype=bool)
        same = (cl[:, None] == cl[None, :]) & off
        peer_mass = (W * off).sum(1)
        in_mass = np.where(peer_mass > 0, (W * same).sum(1) / np.where(peer_mass > 0, peer_mass, 1), np.nan)
        csize = np.array([(cl == c).sum() for c in cl])
        chance = float(np.mean((csize[clean] - 1) / (n - 1)))
        rounds = max(len(s["weights"]["rounds"]), 1)
        row = {
            "mean_acc": float(acc_clean.mean()),
            "worst10_acc": float(np.sort(acc_clean)[:k].mean()),
            "in_cluster_mass": float(np.nanmean(in_mass[clean])) if not np.all(np.isnan(in_mass[clean])) else None,
            "in_cluster_chance": chance,
            "auroc": auroc(W[off], same[off]),
            "bytes_per_node_round": s["summary"]["bytes_sent_total"] / n / rounds,
            "wall_time_s": s["wall_time_s"],
        }
        if local is not None:
            lacc = np.array([local["nodes"][nid]["final_test_acc"] or 0.0 for nid in ids])
            row["beats_local_share"] = float(np.mean(acc_clean > lacc[clean]))
        if noisy:
            row["max_weight_on_noisy"] = float(W[np.ix_(clean, noisy)].max())
        if res.get("true_mixture"):
            row["mixture_corr"] = mixture_corr(W, np.asarray(res["true_mixture"]))
        out[name] = row
    return out


def heatmaps(res: dict, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["strategies"])
    n = len(res["node_ids"])
    snaps = 4
    fig, axes = plt.subplots(len(names), snaps, figsize=(2.2 * snaps, 2.2 * len(names)), squeeze=False)
    for r, name in enumerate(names):
        mats = res["strategies"][name]["weights"]["matrices"]
        picks = np.linspace(0, len(mats) - 1, snaps).round().astype(int) if mats else []
        for c, idx in enumerate(picks):
            M = np.array([row if row is not None else [np.nan] * n for row in mats[idx]])
            ax = axes[r][c]
            ax.imshow(M, vmin=0, vmax=max(1e-9, np.nanmax(M * ~np.eye(n, dtype=bool))), cmap="viridis")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"round {res['strategies'][name]['weights']['rounds'][idx]}", fontsize=8)
            if c == 0:
                ax.set_ylabel(name, fontsize=8)
    fig.suptitle(f"{title}: collaborator weights over rounds (diagonal saturates)", fontsize=9)
    fig.tight_layout()
    path = out / f"{title}_weights.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def fmt(v, pct=False):
    if v is None:
        return "–"
    return f"{100 * v:.1f}" if pct else (f"{v:.3f}" if isinstance(v, float) else str(v))


def markdown(all_metrics: dict, runs: dict | None = None) -> str:
    """summary.md: one seed per scenario. ``runs``: scenario -> its results.json (when and how it ran)."""
    lines = [
        "# Strategies, one run per scenario (bench/strategy_bench.py)",
        "",
        "One `coterie run` per scenario at the seed given (default: the scenario's own, 0); the "
        "backend and date of each run are under its heading. A single run is not a result: the "
        "headline — three seeds, mean ± 95% CI, paired gains, the oracle's share — is "
        "[seeds.md](seeds.md). Code changed since a run's date is not in its row.",
        "",
    ]
    for sc, rows in all_metrics.items():
        res = (runs or {}).get(sc) or {}
        lines += [f"### {sc}", ""]
        if res:
            lines += [
                f"Run {res.get('created', '?')}, backend `{res.get('backend', 'processes')}`, "
                f"seed {res.get('scenario', {}).get('seed', '?')}.",
                "",
            ]
        lines += [
            "| strategy | mean acc % | worst-10% acc % | beats local % | in-cluster mass (chance) | AUROC | max w on noisy | KB/node/round | wall s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in rows.items():
            lines.append(
                f"| {name} | {fmt(r['mean_acc'], True)} | {fmt(r['worst10_acc'], True)} | "
                f"{fmt(r.get('beats_local_share'), True)} | {fmt(r['in_cluster_mass'])} ({r['in_cluster_chance']:.2f}) | "
                f"{fmt(r['auroc'])} | {fmt(r.get('max_weight_on_noisy'))} | {r['bytes_per_node_round'] / 1024:.0f} | "
                f"{r['wall_time_s']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


CI_METRICS = ("mean_acc", "worst10_acc", "in_cluster_mass", "auroc", "bytes_per_node_round")


def t95(n: int) -> float:
    """Two-sided 95% Student t quantile for n samples (n - 1 degrees of freedom)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1)) if n > 1 else float("nan")


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the 95% confidence half-width of the mean (nan for one value)."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if len(v) == 0:
        return float("nan"), float("nan")
    half = t95(len(v)) * v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("nan")
    return float(v.mean()), float(half)


def across_seeds(per_seed: dict[int, dict]) -> dict:
    """Per strategy: mean ± CI of each metric, the paired gain over local (same seed, same
    partition), the share of the oracle's gain it reaches (mean gain / mean oracle gain) and
    the seeds in which it does not beat local."""
    seeds = sorted(per_seed)
    names = list(per_seed[seeds[0]])
    out = {}
    for name in names:
        row: dict = {"seeds": seeds}
        for m in CI_METRICS:
            row[m] = mean_ci([per_seed[k][name].get(m) for k in seeds])
        if all("local" in per_seed[k] for k in seeds):
            gains = [per_seed[k][name]["mean_acc"] - per_seed[k]["local"]["mean_acc"] for k in seeds]
            row["gain_over_local"] = mean_ci(gains)
            row["seeds_not_beating_local"] = [k for k, g in zip(seeds, gains, strict=True) if g <= 0]
            if all("oracle" in per_seed[k] for k in seeds):
                og = np.mean([per_seed[k]["oracle"]["mean_acc"] - per_seed[k]["local"]["mean_acc"] for k in seeds])
                row["share_of_oracle_gain"] = float(np.mean(gains) / og) if og > 0 else None
        out[name] = row
    return out


# Why a paper method stays under 0.75 of the oracle's gain (issue 23): what was measured, where.
BELOW_ORACLE: dict[tuple[str, str], str] = {
    ("s1", "cobo"): "its pair weights do not separate the clusters within S1's 600 model steps "
    "(in-cluster mass 0.24, chance 0.18): the sign of the midpoint gradients' inner "
    "product, on which COBO's weight ascent turns, is positive for most cross-cluster pairs "
    "once the clusters' models drift apart (7% at round 5, 87% at round 15, W held at the "
    "true clusters); `docs/strategy-cobo.md`, `fidelity.md`. With the paper's 5,000 steps "
    "see `papers.md` (Fig. 3).",
    ("s1", "scool-sbm"): "the graph is exact (in-cluster mass and AUROC 1.00) and it keeps both cluster "
    "mates after pruning, so the shortfall is in how it mixes, not whom it picks "
    "(update mixing of the peers' Δθ at the SBM weights, where the oracle averages "
    "the models); not measured further.",
    ("s2", "fedfomo"): "S2's oracle gains only 3.9 ± 2.9 points (local is already 72.8% on two-class "
    "tasks), so the ratio of two small, noisy gains is loose: FedFomo's gain is "
    "1.9 ± 3.3 and its interval holds the oracle's. Its weights barely rank the "
    "groups (AUROC 0.58): its weights are loss improvements on a node's validation "
    "split, which S2's 40–80-sample nodes keep small.",
    ("s2", "l2c"): "S2's oracle gains only 3.9 ± 2.9 points, and L2C's 1.6 ± 0.1 lies inside that "
    "interval. At T0 L2C keeps ⌈10% × 19⌉ = 2 neighbours, so at most 2 of the 3 group "
    "mates the oracle averages with.",
    ("s2", "cobo"): "S2's oracle gains only 3.9 ± 2.9 points; COBO's 2.8 ± 3.3 lies inside that interval.",
    ("s3", "cobo"): "its weights hardly favour the clean nodes (in-cluster mass 0.88 against a chance "
    "of 0.82): the noisy nodes keep weight (the sign rule, as on S1).",
    ("s3", "l2c"): "every weight it keeps is on clean peers (in-cluster mass 1.00), but L2C keeps "
    "⌈10% × 11⌉ = 2 of them at T0 where the oracle averages with all 9. Keeping half "
    "(6 of 11) on the same seeds: 0.90 of the oracle's gain, in-cluster mass still 1.00 "
    "(`pruning_s3_keep0.5.md`).",
    ("s3", "meta-l2c"): "as L2C: 2 of the 9 clean peers kept at T0; keeping 6 of 11: 0.92 (`pruning_s3_keep0.5.md`).",
    ("s3", "scool-sbm"): "as L2C: SCool's code keeps int(20% × 11) = 2 of the 9 clean peers; "
    "keeping 5 of 11: 0.78 (`pruning_s3_keep0.5.md`).",
    ("s3", "scool-attention"): "as SCool-SBM: 2 of the 9 clean peers kept; keeping 5 of 11: 0.78 "
    "(`pruning_s3_keep0.5.md`).",
}


def seeds_markdown(agg: dict, config: dict) -> str:
    def ci(pair, pct=True, digits=1):
        mean, half = pair
        if mean != mean:  # nan: no value in any seed
            return "–"
        k = 100 if pct else 1
        return f"{k * mean:.{digits}f} ± {k * half:.{digits}f}" if half == half else f"{k * mean:.{digits}f}"

    lines = [
        "# Strategies across seeds (bench/strategy_bench.py --seeds)",
        "",
        f"Seeds {config['seeds']}, backend `{config['backend']}`, rounds "
        f"{config['rounds'] or 'as in the scenario'}. Each cell: mean over the seeds ± the 95% "
        "confidence half-width of that mean (Student t, n − 1 degrees of freedom; with 3 seeds "
        "the half-width is 2.48 × the sample std). `gain` is paired: the strategy minus local on "
        "the same seed's partition. `oracle share`: mean gain / the oracle's mean gain "
        "(issue 23 asks ≥ 0.75). `fails in`: the seeds where it does not beat local.",
        "",
    ]
    for sc, rows in agg.items():
        lines += [
            f"## {sc}",
            "",
            "| strategy | mean acc % | worst-10% acc % | gain over local (points) | oracle share | "
            "fails in | in-cluster mass | AUROC | KB/node/round |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in rows.items():
            share = r.get("share_of_oracle_gain")
            lines.append(
                f"| {name} | {ci(r['mean_acc'])} | {ci(r['worst10_acc'])} | "
                f"{ci(r['gain_over_local']) if 'gain_over_local' in r else '–'} | "
                f"{'–' if share is None or name in ('local', 'oracle') else f'{share:.2f}'} | "
                f"{'–' if name == 'local' else (', '.join(map(str, r.get('seeds_not_beating_local', []))) or 'none')} | "
                f"{ci(r['in_cluster_mass'], False, 3)} | {ci(r['auroc'], False, 3)} | "
                f"{r['bytes_per_node_round'][0] / 1024:.0f} |"
            )
        lines.append("")
        if config.get(sc, {}).get("reruns"):
            lines += [f"Reruns: {config[sc]['reruns']}.", ""]
        below = [
            (name, r.get("share_of_oracle_gain"))
            for name, r in rows.items()
            if name not in ("local", "oracle", "dpsgd")
            and r.get("share_of_oracle_gain") is not None
            and r["share_of_oracle_gain"] < 0.75
        ]
        if below:
            lines += ["Below 0.75 of the oracle's gain, and why:", ""]
            for name, share in below:
                lines.append(f"- **{name}** ({share:.2f}): {BELOW_ORACLE.get((sc, name), 'not explained yet.')}")
            lines.append("")
    return "\n".join(lines)


def run_seeds(args) -> int:
    """The multi-seed sweep: one `coterie run` per scenario and seed, then the spread."""
    seeds = [int(k) for k in args.seeds.split(",")]
    path = args.out / "seeds.json"
    doc = json.loads(path.read_text()) if path.exists() else {"per_seed": {}, "config": {}}
    for sc in [] if args.report_only else args.scenarios.split(","):
        for k in seeds:
            run_dir = args.out / sc / f"seed{k}"
            cmd = [
                sys.executable,
                "-m",
                "coterie.cli.main",
                "run",
                str(ROOT / "scenarios" / SCENARIOS[sc]),
                "--out",
                str(run_dir),
                "--seed",
                str(k),
                "--backend",
                args.backend,
            ]
            for flag, v in (("--strategy", args.strategies), ("--rounds", args.rounds)):
                if v is not None:
                    cmd += [flag, str(v)]
            if not args.reuse:
                print("$", " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            res = json.loads((run_dir / "results.json").read_text())
            seed_rows = doc["per_seed"].setdefault(sc, {}).setdefault(str(k), {})
            seed_rows.update(metrics(res))  # --strategies reruns replace only their own rows
            doc["config"][sc] = {  # everything needed to rerun it, next to the figures
                "scenario": SCENARIOS[sc],
                "scenario_toml": (ROOT / "scenarios" / SCENARIOS[sc]).read_text(),
                "seeds": seeds,
                "backend": args.backend,
                "rounds": args.rounds,
                "commands": doc["config"].get(sc, {}).get("commands", {}),
            }
            doc["config"][sc]["commands"].setdefault(str(k), []).append(" ".join(cmd[2:]))
            path.write_text(json.dumps(doc, indent=1))
    agg = {sc: across_seeds({int(k): m for k, m in doc["per_seed"][sc].items()}) for sc in args.scenarios.split(",")}
    doc["across_seeds"] = agg
    path.write_text(json.dumps(doc, indent=1))
    md = seeds_markdown(agg, {"seeds": seeds, "backend": args.backend, "rounds": args.rounds, **doc["config"]})
    (args.out / "seeds.md").write_text(md)
    print(md, flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="s1,s2,s3")
    ap.add_argument("--strategies", default=None, help="comma list (default: the scenario's)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--seeds", default=None, help="comma list: the multi-seed sweep (seeds.md)")
    ap.add_argument("--backend", default="processes", help="processes | inproc (with --seeds)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--reuse", action="store_true", help="only recompute metrics from existing results.json")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="with --seeds: re-render seeds.md from seeds.json (no runs, no run directories read)",
    )
    ap.add_argument(
        "--merge", action="store_true", help="rerun only --strategies and replace their entries in the existing results"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if args.seeds:
        return run_seeds(args)
    for sc in args.scenarios.split(","):
        out = args.out / sc
        run_dir = out.with_name(f"{sc}-rerun") if args.merge else out
        if not args.reuse:
            cmd = [
                sys.executable,
                "-m",
                "coterie.cli.main",
                "run",
                str(ROOT / "scenarios" / SCENARIOS[sc]),
                "--out",
                str(run_dir),
            ]
            for flag, v in (("--strategy", args.strategies), ("--rounds", args.rounds), ("--seed", args.seed)):
                if v is not None:
                    cmd += [flag, str(v)]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        if args.merge and not args.reuse:  # same scenario and seed: swap in the rerun strategies
            old = json.loads((out / "results.json").read_text())
            new = json.loads((run_dir / "results.json").read_text())
            old["strategies"].update(new["strategies"])
            old.setdefault("notes", []).append(f"rerun {sorted(new['strategies'])} at {new['created']}")
            (out / "results.json").write_text(json.dumps(old))
        res = json.loads((out / "results.json").read_text())
        # the run dir (node state, logs) stays out of git; its results.json is kept beside the summary
        (args.out / f"{sc}_results.json").write_text(json.dumps(res))
        summary[sc] = metrics(res)
        heatmaps(res, args.out, sc)
        summary_path.write_text(json.dumps(summary, indent=2))
        runs = {k: json.loads(p.read_text()) for k in summary if (p := args.out / f"{k}_results.json").exists()}
        (args.out / "summary.md").write_text(markdown(summary, runs))
        print(markdown({sc: summary[sc]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
