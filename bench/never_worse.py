"""Never worse than alone (issue 33 items 3-4): for every strategy on S1, S2, S3, the sine
regression networks and a label-permutation network of each built-in dataset, each node's
reported (= exported) model against its own local-only reference, the twin
(``node/local_reference.py``: same data, θ⁰ and batches as the ``local`` strategy).

Per node, at the last round: the gain of what it predicts with over its twin — accuracy points
(goal: worst node >= -1), or for regression the relative MSE, (twin - node) / twin (goal: worst
node >= -5 %) — and the same for its collaborative model (the gain it would report without the
back-off). Per strategy: worst node, mean, nodes backed off, in-cluster weight, and on
label-permutation networks each method's share of the oracle's gain.

Every run is one network of real nodes (lab inproc backend: ``Node``s in one event loop, the
in-process transport) in its own child process; its figures are appended as one JSON line to
``bench/results/never_worse_runs.jsonl`` as soon as it ends, so an interrupted sweep keeps what
finished and a rerun skips it. Seed-major: every (network, strategy) gets seed 0 before any gets
seed 1. ``local`` is not run: it has no twin (its model *is* the reference, gain 0 by definition).

    python bench/never_worse.py sweep --seeds 0,1,2 --jobs 2      # appends runs
    python bench/never_worse.py report                            # never_worse.md / .json

Sizes are shrunk for a shared 2-core machine (``NETWORKS``; ROUNDS): said in the report.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUNS = RESULTS / "never_worse_runs.jsonl"
ALL = ["dpsgd", "oracle", "fedfomo", "federico", "cobo", "l2c", "meta-l2c", "scool-sbm", "scool-attention"]
ROUNDS = 15
NODE = {"heartbeat_interval_s": 0.5, "suspect_after_s": 3.0, "dead_after_s": 10.0, "log_level": "WARNING"}
NO_DP = {"enabled": False}  # the papers' setting, as S1-S3 ship


def _shipped(name: str, nodes: int) -> dict[str, Any]:
    """A shipped scenario with fewer nodes (its rounds are set by ``scenario``)."""
    from coterie.node.config import read_toml

    data = read_toml(ROOT / "scenarios" / name, "scenario")
    data["nodes"] = nodes
    return data


def _s3(nodes: int) -> dict[str, Any]:
    data = _shipped("s3_noisy_nodes.toml", nodes)
    for o in data.get("overrides", []):  # the noisy pair: the last two nodes, as shipped
        o["nodes"] = [nodes - 2, nodes - 1]
    return data


def _made(learner: dict[str, Any], nodes: int, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": "never-worse",
        "nodes": nodes,
        "rounds": ROUNDS,
        "bootstrap": "chain",
        "timeout_s": 1200,
        "strategy_params": {"federico": {"local_steps": 20}, **(params or {})},
        "learner": {"device": "cpu", **learner},
        "node": {**NODE, "privacy": NO_DP},
    }


def _sine(optimizer: str, lr: float) -> dict[str, Any]:
    # the held-out regression network of issue 33: successive intervals of a curve, a tiny MLP,
    # 24-40 training samples per node (60 % of 40-67)
    return _made(
        {
            "dataset": "sine",
            "dataset_params": {"num_samples": 2000, "noise": 0.1},
            "partition": "sine_intervals",
            "partition_params": {"num_intervals": 4, "samples_per_node": [40, 67]},
            "model": "mlp",
            "model_params": {"hidden": [32, 32]},
            "optimizer": optimizer,
            "lr": lr,
            "batch_size": 16,
            "local_steps": 10,
        },
        8,
    )


def _perm(dataset: str, params: dict[str, Any], spn: int, clusters: int, nodes: int) -> dict[str, Any]:
    return _made(
        {
            "dataset": dataset,
            "dataset_params": params,
            "partition": "label_permutation",
            "partition_params": {"num_clusters": clusters, "samples_per_node": spn},
            "model": "mlp",
            "model_params": {"hidden": [64, 64]},
            "optimizer": "adam",
            "lr": 0.003,
            "batch_size": 32,
            "local_steps": 20,
        },
        nodes,
        {"scool-sbm": {"num_blocks": clusters}},
    )


# name -> (scenario dict, what it is). Shrunk from the shipped sizes: 15 rounds (not 30), S1/S3 8
# nodes (not 12: S1 4 clusters x 2), S2 10 nodes (5 groups x 2, not x 4).
NETWORKS: dict[str, tuple[Any, str]] = {
    "s1": (lambda: _shipped("s1_label_permuted.toml", 8), "S1 mnist1d label permutation, 4 clusters x 2, CNN"),
    "s2": (lambda: _shipped("s2_class_groups.toml", 10), "S2 mnist1d class pairs, 5 groups x 2, 40-80 train each, MLP"),
    "s3": (lambda: _s3(8), "S3 mnist1d iid, the last 2 of 8 with random labels, CNN"),
    "sine-sgd": (lambda: _sine("sgd", 0.1), "sine intervals (4 x 2 nodes), 24-40 train each, MLP [32,32], SGD 0.1"),
    "sine-adam": (lambda: _sine("adam", 0.003), "sine intervals (4 x 2 nodes), 24-40 train each, MLP [32,32], Adam"),
    "digits-perm": (
        lambda: _perm("digits", {}, 150, 2, 8),
        "digits label permutation, 2 clusters x 4, 90 train each, MLP",
    ),
    "gaussian-perm": (
        # separation 0.6 (default 3.0: every node alone at 100 %, nothing to gain): alone ~60 %
        lambda: _perm("gaussian", {"num_samples": 4000, "num_classes": 4, "separation": 0.6}, 100, 2, 8),
        "gaussian (synthetic, 4 classes, separation 0.6) label permutation, 2 clusters x 4, 60 train each, MLP",
    ),
}
PERM = ("s1", "digits-perm", "gaussian-perm")  # label-permutation networks: the oracle's gain share


def scenario(network: str, strategy: str, seed: int, reference: dict[str, Any] | None = None) -> Any:
    """The network's scenario for one strategy and seed; ``reference``: node.reference settings
    beside ``enabled`` (diagnostics: never_worse_sine_diag.py)."""
    from coterie.lab.scenario import parse_scenario

    data = NETWORKS[network][0]()
    ref = {"enabled": True, **(reference or {})}  # enabled: the default, said explicitly
    data["node"] = {**data.get("node", {}), "reference": ref}
    return parse_scenario(data, strategies=[strategy], seed=seed, rounds=ROUNDS)


def node_figures(n: dict[str, Any]) -> dict[str, Any]:
    """One node's last round: what it reports (= predicts with, = exports), its twin's figure and
    its collaborative model's, and the gains (accuracy points, or relative MSE in %)."""
    ev = n["eval"][-1]
    regression = ev.get("test_acc") is None
    key = "test_loss" if regression else "test_acc"
    reported, twin = ev.get(key), ev.get(f"local_{key}")
    collab = ev.get(f"collab_{key}", reported)

    def gain(x: float | None) -> float | None:
        if x is None or twin is None or not math.isfinite(x):
            return None
        return 100 * (twin - x) / twin if regression else 100 * (x - twin)

    c = n.get("collaboration") or {}
    ref = c.get("reference") or {}
    last = ref.get("last") or []  # the last check on the validation split: [collab, twin]
    vkey = "loss" if regression else "accuracy"
    return {
        "metric": "mse" if regression else "acc",
        "reported": reported,
        "twin": twin,
        "collab": collab,
        "gain": gain(reported),
        "collab_gain": gain(collab),
        "helping": c.get("helping"),
        "switches": ref.get("switches"),
        "settled_at": ref.get("settled_at_round"),
        "worse_run": ref.get("worse_run"),
        "val_collab": last[0][vkey] if len(last) == 2 else None,
        "val_twin": last[1][vkey] if len(last) == 2 else None,
        "val_n": last[1]["n"] if len(last) == 2 else None,
        "helping_rounds": [e.get("helping") for e in n["eval"]],
    }


def in_cluster(res: dict[str, Any], strategy: str) -> float | None:
    """Mean over nodes of the share of their peer weight on true-cluster peers: each node's last
    weight row, or its row averaged over rounds where the last gave no peer any weight (FedFomo
    resamples its peers every round)."""
    clusters = res.get("true_clusters")
    st = res["strategies"][strategy]
    last, mean = st.get("final_weights") or [], st.get("mean_weights") or []
    if not clusters or not (last or mean):
        return None
    shares = []
    for i in range(len(clusters)):
        for W in (last, mean):
            row = W[i] if i < len(W) and W[i] else []
            peers = [(j, w) for j, w in enumerate(row) if j != i and w]
            tot = sum(w for _, w in peers)
            if tot > 0:
                shares.append(sum(w for j, w in peers if clusters[j] == clusters[i]) / tot)
                break
    return statistics.mean(shares) if shares else None


def cluster_found(res: dict[str, Any], strategy: str, level: float = 0.9) -> int | None:
    """The first round from which the nodes' mean in-cluster share of peer weight stays >= level
    (rounds where no node gave a peer weight do not count either way); None if never."""
    clusters = res.get("true_clusters")
    wm = res["strategies"][strategy].get("weights") or {}
    if not clusters:
        return None
    found = None
    for rnd, M in zip(wm.get("rounds", []), wm.get("matrices", []), strict=False):
        shares = []
        for i, row in enumerate(M or []):
            peers = [(j, w) for j, w in enumerate(row or []) if j != i and w]
            tot = sum(w for _, w in peers)
            if tot > 0:
                shares.append(sum(w for j, w in peers if clusters[j] == clusters[i]) / tot)
        if shares:
            found = (found or rnd) if statistics.mean(shares) >= level else None
    return found


def figures(res: dict[str, Any], network: str, strategy: str, seed: int, wall_s: float) -> dict[str, Any]:
    nodes = res["strategies"][strategy]["nodes"]
    return {
        "network": network,
        "strategy": strategy,
        "seed": seed,
        "rounds": ROUNDS,
        "wall_s": wall_s,
        "in_cluster_weight": in_cluster(res, strategy),
        "cluster_found_round": cluster_found(res, strategy),
        "nodes": {nid: node_figures(n) for nid, n in nodes.items()},
        "notes": res["strategies"][strategy].get("notes", []),
    }


AUDIT_SIZE = 2000  # audit samples per node where the dataset is generated (digits: what the shards leave)


def network_learner(sc: Any) -> Any:
    """Node 0's learner config: the network's dataset, partition, size and data seed."""
    from coterie.node.learning.config import LearnerConfig

    return LearnerConfig(**{**sc.learner, "num_nodes": sc.nodes, "node_index": 0, "data_seed": sc.seed})


def audit_figures(nodes: list[Any], sets: list[Any]) -> dict[str, dict[str, Any]]:
    """Every live node's reported, collaborative and twin models on its own audit set
    (lab/audit.py): figures, gains over the twin and the gains' paired standard errors."""
    from coterie.lab.audit import paired_gain, score_node

    out = {}
    for i, node in enumerate(nodes):
        sc = score_node(node, sets[i])
        task = node.model_card.get("task", "classification")
        fig: dict[str, Any] = {"audit_n": len(sets[i])}
        for k, v in sc.items():
            fig[f"audit_{k}"] = float(v.mean())  # accuracy, or MSE
        if "twin" in sc:
            for k in ("reported", "collab"):
                g, se = paired_gain(sc[k], sc["twin"], task)
                fig[f"audit_{k}_gain"], fig[f"audit_{k}_se"] = g, se
        out[node.node_id] = fig
    return out


def child(network: str, strategy: str, seed: int, out: Path) -> dict[str, Any]:
    from coterie.lab.audit import audit_sets
    from coterie.lab.launch import run_scenario

    sc = scenario(network, strategy, seed)
    sets = audit_sets(network_learner(sc), AUDIT_SIZE)  # before the run: a bad set fails in seconds
    audit: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    res = run_scenario(
        sc, out, backend="inproc", check=False, on_done=lambda nodes: audit.update(audit_figures(nodes, sets))
    )
    fig = figures(res, network, strategy, seed, round(time.time() - t0, 1))
    for nid, n in fig["nodes"].items():
        n.update(audit.get(nid, {}))
    return fig


def rescan(out: Path) -> None:
    """Recompute every finished run's line from its results.json under ``out`` (after a change
    to what a line holds), keeping its wall time."""
    lines = [json.loads(x) for x in RUNS.read_text().splitlines() if x.strip()]
    for i, r in enumerate(lines):
        path = out / f"{r['network']}-{r['strategy']}-{r['seed']}" / "results.json"
        if "failed" not in r and path.exists():
            lines[i] = figures(json.loads(path.read_text()), r["network"], r["strategy"], r["seed"], r["wall_s"])
    RUNS.write_text("".join(json.dumps(x) + "\n" for x in lines))


def open_runs(runs: Path, mode: str):
    """``runs`` as text, by its suffix: ``.xz`` (as large ones are kept), ``.gz``, or plain. Appending
    to a compressed one adds a stream (a gzip member, an xz stream); reading takes them all."""
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(runs.suffix, open)
    return opener(runs, mode)


def run_lines(runs: Path) -> list[dict[str, Any]]:
    """The runs recorded in ``runs``, one JSON line each."""
    with open_runs(runs, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def done(runs: Path = RUNS) -> set[tuple[str, str, int]]:
    if not runs.exists():
        return set()
    return {(r["network"], r["strategy"], r["seed"]) for r in run_lines(runs)}


def sweep(
    networks: list[str],
    strategies: list[str],
    seeds: list[int],
    jobs: int,
    out: Path,
    *,
    script: str = __file__,
    runs: Path = RUNS,
) -> None:
    """Each (network, strategy, seed) not yet in ``runs``: ``script one ...`` in its own process,
    its last stdout line appended to ``runs`` (never_worse_rules.py sweeps through here too)."""
    have = done(runs)
    todo = [(w, s, seed) for seed in seeds for w in networks for s in strategies if (w, s, seed) not in have]
    print(f"{len(todo)} runs to do ({len(have)} already in {runs.name})", flush=True)

    def one(job: tuple[str, str, int]) -> None:
        w, s, seed = job
        cmd = [sys.executable, script, "one", w, s, str(seed), "--out", str(out / f"{w}-{s}-{seed}")]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            line = {"network": w, "strategy": s, "seed": seed, "failed": p.stderr.strip().splitlines()[-3:]}
        else:
            line = json.loads(p.stdout.strip().splitlines()[-1])
        with open_runs(runs, "at") as f:  # one line per run, written whole: partial sweeps survive
            f.write(json.dumps(line) + "\n")
        worst = min((n["gain"] for n in line.get("nodes", {}).values() if n["gain"] is not None), default=None)
        print(w, s, seed, line.get("wall_s"), "worst gain", worst, "FAILED" if "failed" in line else "", flush=True)

    with ThreadPoolExecutor(jobs) as ex:
        list(ex.map(one, todo))


def command_line(doc: str, *, seeds: str, networks: str, jobs: int, out: str) -> tuple[Any, Any]:
    """``sweep``, ``one`` (a run, in its own process) and ``report``, with the bench's defaults:
    the parser and its subcommands (a bench adds its own)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep")
    sw.add_argument("--seeds", default=seeds)
    sw.add_argument("--networks", default=networks)
    sw.add_argument("--strategies", default=",".join(ALL))
    sw.add_argument("--jobs", type=int, default=jobs)
    sw.add_argument("--out", default=out)
    sw.add_argument("--runs", default=None, help="append to this runs file instead of the bench's (a rerun)")
    one = sub.add_parser("one")
    one.add_argument("network", choices=sorted(NETWORKS))
    one.add_argument("strategy")
    one.add_argument("seed", type=int)
    one.add_argument("--out", required=True)
    sub.add_parser("report")
    return ap, sub


def hooked_main(
    doc: str,
    script: str,
    hook: Callable[[], None],
    runs: Path,
    report: Callable[[], None],
    *,
    seeds: str,
    networks: str,
    jobs: int,
    out: str,
) -> None:
    """The command line of a bench that runs these networks with ``hook`` installed in each run's
    process (never_worse_rules.py, never_worse_blend.py): ``sweep``, ``one`` (a run, in its own
    process) and ``report``; the defaults are the bench's."""
    a = command_line(doc, seeds=seeds, networks=networks, jobs=jobs, out=out)[0].parse_args()
    if a.cmd == "one":
        hook()
        print(json.dumps(child(a.network, a.strategy, a.seed, Path(a.out))))
    elif a.cmd == "sweep":
        seed_list = [int(x) for x in a.seeds.split(",")]
        target = Path(a.runs) if a.runs else runs
        sweep(
            a.networks.split(","), a.strategies.split(","), seed_list, a.jobs, Path(a.out), script=script, runs=target
        )
    else:
        report()


def _spread(xs: list[float]) -> str:
    if not xs:
        return "—"
    m = statistics.median(xs)
    return f"{m:+.1f}" if len(xs) == 1 else f"{m:+.1f} [{min(xs):+.1f}, {max(xs):+.1f}]"


GOAL = {"acc": -1.0, "mse": -5.0}


def why(n: dict[str, Any], patience: int = 3) -> str:
    """Why a node missed the goal, from its last check on the validation split."""
    c, t, vn = n.get("val_collab"), n.get("val_twin"), n.get("val_n")
    if c is None or t is None:
        return "no check recorded"
    regression = n["metric"] == "mse"
    better_or_equal = c <= t if regression else c >= t
    fig = f"val {c:.3g} vs twin {t:.3g} (n={vn})"
    if better_or_equal:
        return f"split noise: validation said collaboration was at least as good ({fig})"
    if n.get("worse_run"):
        return f"run ended first: worse beyond noise on its last {n['worse_run']} of {patience} checks ({fig})"
    return f"within the validation split's noise ({fig})"


def test_noise(n: dict[str, Any]) -> float | None:
    """One standard error of the test difference (points), as the check computes it, n = the
    validation split's size (the test split is as large: 20 % each)."""
    from coterie.node.collaboration_check import accuracy_margin

    if n["metric"] != "acc" or not n.get("val_n"):
        return None
    return 100 * accuracy_margin(n["collab"], n["twin"], int(n["val_n"]), 1.0)


def twin_vs_local(rows: list[dict[str, Any]]) -> list[str]:
    """The twin against a `local` run on the same network and seed (same data, θ⁰, batches): equal
    while the twin trains; once it settled, what stopping early cost or saved (points / % MSE)."""
    local = {(r["network"], r["seed"]): r["nodes"] for r in rows if r["strategy"] == "local"}
    out = []
    for (w, seed), alone in sorted(local.items()):
        same, diffs = 0, []
        for r in rows:
            if (r["network"], r["seed"]) != (w, seed) or r["strategy"] == "local":
                continue
            for nid, n in r["nodes"].items():
                lo, tw = alone.get(nid, {}).get("reported"), n.get("twin")
                if lo is None or tw is None:
                    continue
                if n.get("settled_at") is None:
                    same += abs(tw - lo) < 1e-9
                    continue
                diffs.append(100 * (tw - lo) if n["metric"] == "acc" else 100 * (lo - tw) / lo)
        d = (
            f"settled twins vs local: median {statistics.median(diffs):+.1f}, min {min(diffs):+.1f}, max {max(diffs):+.1f} ({len(diffs)} node runs)"
            if diffs
            else "no twin settled"
        )
        out.append(f"- `{w}` seed {seed}: {same} twins that never settled equal local exactly; {d}")
    return out


def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    agg: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        g = {nid: n["gain"] for nid, n in r["nodes"].items() if n["gain"] is not None}
        if not g:
            continue
        cg = [n["collab_gain"] for nid, n in r["nodes"].items() if n["collab_gain"] is not None]
        a = agg.setdefault((r["network"], r["strategy"]), {k: [] for k in AGG_KEYS})
        a["seeds"].append(r["seed"])
        a["worst"].append(min(g.values()))
        a["mean"].append(statistics.mean(g.values()))
        a["cworst"].append(min(cg) if cg else float("nan"))
        a["cmean"].append(statistics.mean(cg) if cg else float("nan"))
        a["off"].append(sum(1 for n in r["nodes"].values() if n["helping"] is False))
        a["inc"] += [100 * r["in_cluster_weight"]] if r.get("in_cluster_weight") is not None else []
        a["found"].append(r.get("cluster_found_round"))
        goal = GOAL[next(iter(r["nodes"].values()))["metric"]]
        for nid, n in r["nodes"].items():
            if n["gain"] is not None and n["gain"] < goal:
                noise = test_noise(n)
                a["misses"].append(
                    f"seed {r['seed']} {nid} {n['gain']:+.1f}"
                    + (f" (test SE {noise:.1f})" if noise is not None else "")
                    + f": {why(n)}"
                )
                a["within_test_noise"].append(noise is not None and -n["gain"] <= noise)
        audit_row(a, r, goal)
    return agg


def audit_row(a: dict[str, Any], r: dict[str, Any], goal: float) -> None:
    """One run's audit-set figures into its (network, strategy) aggregate: worst node (and that
    node's paired SE), mean, the same for the collaborative model, and every miss on the audit set."""
    au = {nid: n for nid, n in r["nodes"].items() if n.get("audit_reported_gain") is not None}
    if not au:
        return
    worst = min(au, key=lambda nid: au[nid]["audit_reported_gain"])
    a["aworst"].append(au[worst]["audit_reported_gain"])
    a["aworst_se"].append(au[worst]["audit_reported_se"])
    a["amean"].append(statistics.mean(n["audit_reported_gain"] for n in au.values()))
    a["acworst"].append(min(n["audit_collab_gain"] for n in au.values()))
    a["acmean"].append(statistics.mean(n["audit_collab_gain"] for n in au.values()))
    for nid, n in r["nodes"].items():
        if n["gain"] is not None and n["gain"] < goal:
            a["test_misses"].append(nid in au and au[nid]["audit_reported_gain"] < goal)
    for nid, n in au.items():
        g, se = n["audit_reported_gain"], n["audit_reported_se"]
        if g < goal:
            a["amisses"].append((f"seed {r['seed']} {nid} {g:+.1f} ± {se:.1f}: {audit_why(n)}", g + 2 * se < goal))
        if n.get("helping") is False and n["audit_collab_gain"] - 2 * n["audit_collab_se"] > 0:
            a["wrong_off"].append(f"seed {r['seed']} {nid} collab {n['audit_collab_gain']:+.1f}")


def audit_why(n: dict[str, Any]) -> str:
    """Why a node's reported model is worse than its twin on the audit set, from what its last
    validation check saw."""
    c, t, vn = n.get("val_collab"), n.get("val_twin"), n.get("val_n")
    if n.get("helping") is False:
        return "backed off, yet worse than its twin (the twin it reports is not the twin it compares?)"
    if c is None or t is None:
        return "twin never chosen: no validation check recorded"
    regression = n["metric"] == "mse"
    fig = f"val {c:.3g} vs twin {t:.3g}, n={vn}"
    if (c <= t) if regression else (c >= t):
        return f"validation said collaboration was at least as good ({fig}): its split is too small to decide"
    if n.get("worse_run"):
        return f"validation saw it worse beyond noise but the run ended before the back-off ({fig})"
    return f"validation saw it worse, within its split's noise ({fig}): too small to decide"


AGG_KEYS = (
    "seeds",
    "worst",
    "mean",
    "cworst",
    "cmean",
    "off",
    "inc",
    "misses",
    "within_test_noise",
    "found",
    "aworst",
    "aworst_se",
    "amean",
    "acworst",
    "acmean",
    "amisses",
    "test_misses",
    "wrong_off",
)


def _row(w: str, s: str, a: dict[str, Any] | None) -> str:
    if not a or not a["seeds"]:
        return f"| {w} | {s} | not run |" + " |" * 12
    goal = GOAL["mse" if w.startswith("sine") else "acc"]
    met = min(a["worst"]) >= goal
    inc = f"{statistics.median(a['inc']):.0f}" if a["inc"] else "—"
    verdict = "met" if met else f"missed ({len(a['misses'])})"
    if not a["aworst"]:
        averdict, aworst = "—", "—"
    else:
        real = sum(beyond for _, beyond in a["amisses"])
        averdict = "met" if min(a["aworst"]) >= goal else f"missed ({len(a['amisses'])}, {real} beyond 2 SE)"
        aworst = _spread(a["aworst"]) + " (SE " + "/".join(f"{x:.1f}" for x in a["aworst_se"]) + ")"
    return (
        f"| {w} | {s} | {','.join(map(str, sorted(a['seeds'])))} | {_spread(a['worst'])} | {_spread(a['mean'])} "
        f"| {_spread(a['cworst'])} | {_spread(a['cmean'])} | {'/'.join(map(str, a['off']))} | {inc} "
        f"| {verdict} | {aworst} | {_spread(a['amean'])} | {_spread(a['acworst'])} | {_spread(a['acmean'])} "
        f"| {averdict} |"
    )


def _oracle_share(agg: dict[tuple[str, str], dict[str, Any]], w: str, s: str) -> str:
    o, a = agg.get((w, "oracle")), agg.get((w, s))
    if not o or not a:
        return "—"
    om = dict(zip(o["seeds"], o["mean"], strict=True))
    shares = [100 * m / om[sd] for sd, m in zip(a["seeds"], a["mean"], strict=True) if sd in om and om[sd] > 0]
    inc = f", w {statistics.median(a['inc']):.0f}%" if a["inc"] else ""
    inc += ", from r" + "/".join("–" if f is None else str(f) for f in a["found"])
    return (_spread(shares).replace("+", "") + "%" + inc) if shares else "—"


HEAD = """# Never worse than alone: every strategy's worst node against its local-only reference

`python bench/never_worse.py sweep --seeds 0,1,2 --jobs 2` then `python bench/never_worse.py report`
(issue 33 items 3-4). Every run: one network of real nodes (lab inproc backend), {rounds} rounds,
the local-only reference on (the default). Per node at its last round, the gain of the model it
reports and exports over its own twin (same data, θ⁰ and batches as `local`): accuracy points, or
for the sine networks relative MSE in % ((twin − node) / twin, + is better). Goal: worst node ≥ −1
point / ≥ −5 %. `collab`: the same for the node's collaborative model (what it would report without
the back-off). Cells: median over seeds [min, max]; `seeds`: those that finished; `backed off`:
nodes predicting with their twin at the end, per seed. `local` is not run: it is its own reference
(gain 0). Raw lines: `never_worse_runs.jsonl`; each network's full config: `never_worse.json`.

The test split holds 8-30 samples a node (one sample: 3-7 points), too few to tell a real loss
from noise, so every node also has an **audit set** (`lab/audit.py`): {audit} fresh samples of its
own distribution (its cluster's label permutation, class pair or sine interval; generated again
with another seed, gaussian around the same class means) or, for `digits`, the 597 of the bundled
1,797 no node holds — never given to any node. At the end of each run the model each node
reports and exports, its collaborative model and its twin are scored on it (`audit_*` columns:
worst node with its paired-difference SE per seed, mean). Only runs with the audit set are in
this table; the runs before it (all seven networks, seeds 0-2): `never_worse_runs_pre_audit.jsonl`.

Networks (shrunk for a 2-core machine shared with five other sessions: {rounds} rounds instead of
30, fewer nodes; validation and test splits 20 % of a node's samples each):
"""


NOTES = RESULTS / "never_worse_notes.md"  # the hand-written reading of the figures, kept across reruns


def audit_section(agg: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Every node below the goal on its audit set, with why; what became of the test-split misses;
    and nodes that backed off although collaboration was better on the audit set."""
    out = ["", "## Every node that missed the goal on its audit set, and why", ""]
    out.append(
        "`gain ± SE`: the reported model's gain over the twin on the node's audit set and the standard "
        "error of that paired difference; `beyond 2 SE`: gain + 2 SE still below the goal (a real loss)."
    )
    out.append("")
    for (w, s), a in agg.items():
        if a["amisses"]:
            real = sum(b for _, b in a["amisses"])
            out.append(
                f"- `{w}` {s} ({real} of {len(a['amisses'])} beyond 2 SE): " + "; ".join(m for m, _ in a["amisses"])
            )
    tm = [x for a in agg.values() for x in a["test_misses"]]
    per = {}
    for (w, _), a in agg.items():
        per.setdefault(w, []).extend(a["test_misses"])
    out += [
        "",
        f"Test-split misses that are misses on the audit set too: {sum(tm)} of {len(tm)} node runs ("
        + ", ".join(f"`{w}` {sum(x)} of {len(x)}" for w, x in per.items() if x)
        + ").",
        "",
        "Backed off although its collaborative model was better on the audit set (by more than 2 SE):",
        "",
    ]
    out += [f"- `{w}` {s}: " + "; ".join(a["wrong_off"]) for (w, s), a in agg.items() if a["wrong_off"]] or ["- none"]
    return out


def report() -> None:
    rows = [json.loads(line) for line in RUNS.read_text().splitlines() if line.strip()]
    agg = aggregate([r for r in rows if "failed" not in r])
    lines = HEAD.format(rounds=ROUNDS, audit=AUDIT_SIZE).splitlines() + [""]
    if NOTES.exists():
        lines += NOTES.read_text().splitlines() + [""]
    lines += [f"- `{w}`: {d}" for w, (_, d) in NETWORKS.items()]
    lines += [
        "",
        "| network | strategy | seeds | worst node | mean | collab worst | collab mean | backed off | in-cluster w % "
        "| goal | audit worst node (its SE) | audit mean | audit collab worst | audit collab mean | audit goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(w, s, agg.get((w, s))) for w in NETWORKS for s in ALL]
    lines += [
        "",
        "## Share of the oracle's gain on label-permutation networks (item 3)",
        "",
        "Per seed, the mean gain over the twin as a share of the oracle's on the same seed (median [min, max]), "
        "the in-cluster weight w (share of a node's last peer weights on its true cluster) and the round "
        "from which the nodes' mean in-cluster share stayed >= 0.9, per seed (–: never).",
        "",
        "| network | " + " | ".join(s for s in ALL if s != "oracle") + " |",
        "|---|" + "---|" * (len(ALL) - 1),
    ]
    lines += [f"| {w} | " + " | ".join(_oracle_share(agg, w, s) for s in ALL if s != "oracle") + " |" for w in PERM]
    lines += audit_section(agg)
    lines += ["", "## Every node that missed the goal on its test split, and why (the validation check's view)", ""]
    for (w, s), a in agg.items():
        if a["misses"]:
            inside = (
                f"{sum(a['within_test_noise'])} of {len(a['misses'])} within 1 SE of the test split"
                if not w.startswith("sine")
                else "MSE on 8-13 test points: no SE computed"
            )
            lines.append(f"- `{w}` {s} ({inside}): " + "; ".join(a["misses"]))
    lines += ["", "## The twin against the `local` strategy", ""]
    lines += twin_vs_local([r for r in rows if "failed" not in r]) or ["- no `local` run finished"]
    failed = [r for r in rows if "failed" in r]
    if failed:
        lines += ["", "## Runs that failed", ""]
        lines += [f"- {r['network']} {r['strategy']} seed {r['seed']}: {r['failed']}" for r in failed]
    (RESULTS / "never_worse.md").write_text("\n".join(lines) + "\n")
    cfg = {w: NETWORKS[w][0]() for w in NETWORKS}
    aggregate_json = {f"{w}/{s}": a for (w, s), a in agg.items()}
    (RESULTS / "never_worse.json").write_text(
        json.dumps({"rounds": ROUNDS, "networks": cfg, "aggregate": aggregate_json}, indent=1, default=str)
    )
    print("\n".join(lines))


def main() -> None:
    ap, sub = command_line(__doc__, seeds="0,1,2", networks=",".join(NETWORKS), jobs=2, out="/tmp/never_worse")
    sub.add_parser("rescan").add_argument("--out", default="/tmp/never_worse")
    a = ap.parse_args()
    if a.cmd == "one":
        print(json.dumps(child(a.network, a.strategy, a.seed, Path(a.out))))
    elif a.cmd == "sweep":
        seed_list = [int(s) for s in a.seeds.split(",")]
        sweep(a.networks.split(","), a.strategies.split(","), seed_list, a.jobs, Path(a.out), runs=Path(a.runs or RUNS))
    elif a.cmd == "rescan":
        rescan(Path(a.out))
    else:
        report()


if __name__ == "__main__":
    main()
