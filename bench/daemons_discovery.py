"""Issue 32 on real daemons: 100 daemons (``coterie run``, processes backend, mTLS, one machine)
in 10 label-permutation clusters of 10, past the partial-view threshold (membership on HyParView
views, candidates from discovery). Reports, from the run's own files:

- false deaths: no node is killed in this run, so every member a node's table moved to dead
  (``membership.declared_dead`` in its final status, kept in results.json) is a false death;
  suspicions too;
- view sizes (active ids, passive count) and whether membership ran on the views;
- per node, how many of its 9 cluster mates are among: the peers it evaluated that round (its
  candidates), all it evaluated so far, its 9 top-scored peers and its clear collaborators — at
  rounds 10/20/30. Scores are replayed from history.jsonl (the strategy's weights and the peers
  it contacted each round) with the daemon's own ``Discovery.observe``, so they are the node's;
- the comparison: a uniform draw of 5 of the 99 others each round (the strategies' draw without
  discovery), simulated over the same rounds (the mates it would have evaluated).

    python bench/daemons_discovery.py --run --out /tmp/d100        # run, then report
    python bench/daemons_discovery.py --out /tmp/d100              # report an earlier run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from coterie.node.peering.discovery import Discovery, DiscoverySettings

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "discovery_daemons100.toml"
AT = (10, 20, 30)


def run(scenario: Path, out: Path) -> dict[str, Any]:
    """``coterie run`` on the processes backend, with the machine's load and memory sampled."""
    samples: list[tuple[float, float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(10.0):
            mem = {
                k: int(v.split()[0])
                for k, v in (ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
            }
            samples.append((time.time(), os.getloadavg()[0], (mem["MemTotal"] - mem["MemAvailable"]) // 1024))

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.time()
    cmd = ["coterie", "run", str(scenario), "--out", str(out), "--backend", "processes"]
    rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
    stop.set()
    loads = [s[1] for s in samples]
    return {
        "command": " ".join(cmd),
        "rc": rc,
        "wall_s": round(time.time() - t0, 1),
        "load_1min": {"median": statistics.median(loads), "max": max(loads)} if loads else None,
        "memory_used_mb_max": max((s[2] for s in samples), default=None),
    }


def read_history(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def node_figures(
    node: str, history: list[dict[str, Any]], mates: set[str], settings: DiscoverySettings
) -> dict[str, Any]:
    """Per round of ``AT``: mates among that round's candidates, among all evaluated so far, among
    the 9 top-scored and among the clear collaborators (scores replayed as the node kept them)."""
    d = Discovery(node, lambda: [], settings=settings)
    evaluated: set[str] = set()
    out: dict[str, Any] = {}
    for rec in sorted(history, key=lambda r: r["round"]):
        contacted = [p for p in rec.get("contacted") or () if isinstance(p, str)]
        weights = {p: float(w) for p, w in (rec.get("weights") or {}).items() if p != node}
        d.observe(weights, contacted)
        evaluated.update(contacted)
        if rec["round"] in AT:
            out[str(rec["round"])] = {
                "candidates": len(contacted),
                "mates_in_candidates": len(mates & set(contacted)),
                "mates_evaluated": len(mates & evaluated),
                "mates_in_top9": len(mates & set(d.best(9))),
                "mates_in_collaborators": len(mates & set(d.collaborators(9))),
                "collaborators": len(d.collaborators(9)),
            }
    return out


def strategy_signal(history: list[dict[str, Any]], node: str, mates: set[str]) -> dict[str, list[float]]:
    """The strategy's weight for each peer it evaluated, by round, split into cluster mates and
    strangers: how clearly the strategy tells them apart (what discovery has to work with)."""
    out: dict[str, list[float]] = {"mates": [], "strangers": []}
    for rec in history:
        weights = rec.get("weights") or {}
        for p in rec.get("contacted") or ():
            if isinstance(p, str) and p != node:
                out["mates" if p in mates else "strangers"].append(float(weights.get(p, 0.0)))
    return out


def signal_summary(weights: list[float], clear: float = 0.05) -> dict[str, Any]:
    return {
        "evaluations": len(weights),
        "mean_weight": round(statistics.mean(weights), 3) if weights else None,
        f"share_weighted_over_{clear}": round(sum(w > clear for w in weights) / len(weights), 3) if weights else None,
    }


def uniform_draw(nodes: list[str], cluster: dict[str, int], k: int, seed: int = 0) -> dict[str, float]:
    """Mates met (ever evaluated) by round r when each node draws ``k`` of the others uniformly."""
    rng = random.Random(seed)
    met = {r: [] for r in AT}
    for n in nodes:
        others = [p for p in nodes if p != n]
        mates = {p for p in others if cluster[p] == cluster[n]}
        seen: set[str] = set()
        for r in range(1, max(AT) + 1):
            seen.update(rng.sample(others, k))
            if r in AT:
                met[r].append(len(mates & seen))
    return {str(r): statistics.mean(v) for r, v in met.items()}


def analyse(out: Path, strategy: str = "fedfomo") -> dict[str, Any]:
    res = json.loads((out / "results.json").read_text())
    nodes: list[str] = res["node_ids"]
    cluster = dict(zip(nodes, res["true_clusters"], strict=True))
    scen = res["scenario"]
    dcfg = (scen.get("node") or {}).get("discovery") or {}
    settings = DiscoverySettings(candidates=dcfg.get("candidates", 8), explore=dcfg.get("explore", 3))
    per_node = res["strategies"][strategy]["nodes"]
    figures: dict[str, Any] = {}
    deaths, victims, suspected, short, membership_kinds = 0, set(), 0, [], {}
    active, passive = [], []
    reintroductions: dict[str, int] = {}  # calls refused as from a stranger, and what came of them
    signal: dict[str, list[float]] = {"mates": [], "strangers": []}
    declarers: dict[str, list[int]] = {}  # final membership kind -> deaths each node declared
    first, last, durations, stalls = [], [], [], []
    for n in nodes:
        hist = read_history(out / strategy / "nodes" / n / "history.jsonl")
        if hist:
            first.append(hist[0]["t"])
            last.append(hist[-1]["t"])
        durations += [float(h["duration_s"]) for h in hist]
        stalls += [float((h.get("timing") or {}).get("loop_stall_s", 0.0)) for h in hist]
        if len(hist) < scen["rounds"]:
            short.append(f"{n}: {len(hist)} rounds")
        mates = {p for p in nodes if p != n and cluster[p] == cluster[n]}
        figures[n] = node_figures(n, hist, mates, settings)
        for kind, ws in strategy_signal(hist, n, mates).items():
            signal[kind] += ws
        m = per_node[n].get("membership") or {}
        deaths += int(m.get("declared_dead", 0))
        victims.update(m.get("deaths_recent") or ())
        suspected += int(m.get("suspected", 0))
        disc = per_node[n].get("discovery") or {}
        kind = disc.get("membership", "?")
        for outcome, count in (disc.get("reintroductions") or {}).items():
            reintroductions[outcome] = reintroductions.get(outcome, 0) + int(count)
        membership_kinds[kind] = membership_kinds.get(kind, 0) + 1
        declarers.setdefault(kind, []).append(int(m.get("declared_dead", 0)))
        views = disc.get("views") or {}
        if "active" in views:
            active.append(len(views["active"]))
            passive.append(int(views.get("passive", 0)))

    def stat(r: int, key: str) -> dict[str, Any]:
        vals = [f[str(r)][key] for f in figures.values() if str(r) in f]
        return {
            "mean": round(statistics.mean(vals), 2) if vals else None,
            "min": min(vals, default=None),
            "nodes_with_none": sum(v == 0 for v in vals),
            "nodes": len(vals),
        }

    def spread(vals: list[float]) -> dict[str, float] | None:
        if not vals:
            return None
        vals = sorted(vals)
        return {
            "median": round(statistics.median(vals), 2),
            "p90": round(vals[int(0.9 * (len(vals) - 1))], 2),
            "max": vals[-1],
        }

    keys = ("mates_in_candidates", "mates_evaluated", "mates_in_top9", "mates_in_collaborators")
    return {
        "nodes": len(nodes),
        "clusters": len(set(cluster.values())),
        "rounds": scen["rounds"],
        "discovery": dcfg,
        # the strategy's weight for an evaluated mate against a stranger (every node, every round)
        "strategy_signal": {kind: signal_summary(ws) for kind, ws in signal.items()},
        "false_deaths": {"declared_dead": deaths, "distinct_victims": sorted(victims), "suspected": suspected},
        "membership_on": membership_kinds,
        "reintroductions": reintroductions,
        # by the membership each node ended on: how many declared any death, and how many in all
        "deaths_by_declarer": {k: {"nodes": sum(v > 0 for v in vs), "deaths": sum(vs)} for k, vs in declarers.items()},
        # the daemons' pace: a round's wall time and how long its event loop was blocked in it
        "round_s": spread(durations),
        "loop_stall_s_per_round": spread(stalls),
        # from the first node's round 1: the last node's round 1, the first and last node done
        "start_spread_s": round(max(first) - min(first), 1) if first else None,
        "done_s": [round(min(last) - min(first), 1), round(max(last) - min(first), 1)] if first else None,
        "views": {
            "active": {"median": statistics.median(active), "min": min(active), "max": max(active)} if active else None,
            "passive": {"median": statistics.median(passive), "min": min(passive), "max": max(passive)}
            if passive
            else None,
        },
        "short_histories": short,
        "by_round": {str(r): {k: stat(r, k) for k in keys} for r in AT},
        "uniform_mates_evaluated": uniform_draw(nodes, cluster, settings.candidates),
        "per_node": figures,
    }


def report(fig: dict[str, Any]) -> str:
    lines = [
        f"{fig['nodes']} daemons, {fig['clusters']} clusters, {fig['rounds']} rounds, discovery {fig['discovery']}",
        f"false deaths: {fig['false_deaths']['declared_dead']} declared (victims {fig['false_deaths']['distinct_victims']}), "
        f"{fig['false_deaths']['suspected']} suspicions; membership on {fig['membership_on']}",
        f"deaths by the declarer's final membership: {fig['deaths_by_declarer']}",
        f"calls refused as from a stranger, all nodes: {fig.get('reintroductions')}",
        f"views: active {fig['views']['active']}, passive {fig['views']['passive']}",
        f"strategy's weight for an evaluated peer: {fig['strategy_signal']}",
        f"round s {fig['round_s']}, loop stall s per round {fig['loop_stall_s_per_round']}",
        f"last node's round 1 at {fig['start_spread_s']} s; first and last node done at {fig['done_s']} s",
        "mates of 9 (mean over nodes; nodes with none):",
        "| round | in that round's candidates (of 5) | evaluated so far | uniform draw: evaluated so far | in top-9 scored | clear collaborators |",
        "|---|---|---|---|---|---|",
    ]
    for r, row in fig["by_round"].items():

        def cell(k: str, row: dict[str, Any] = row) -> str:
            return f"{row[k]['mean']} ({row[k]['nodes_with_none']})"

        lines.append(
            f"| {r} | {cell('mates_in_candidates')} | {cell('mates_evaluated')} | "
            f"{fig['uniform_mates_evaluated'][r]:.2f} | {cell('mates_in_top9')} | {cell('mates_in_collaborators')} |"
        )
    if fig["short_histories"]:
        lines.append(f"short histories: {fig['short_histories']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the run's output directory")
    ap.add_argument("--run", action="store_true", help="run the scenario first (coterie run, processes)")
    ap.add_argument("--scenario", type=Path, default=SCENARIO)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "daemons_discovery.json")
    args = ap.parse_args()
    meta = run(args.scenario, args.out) if args.run else {}
    if meta.get("rc"):
        sys.exit(f"coterie run failed (rc {meta['rc']}); logs under {args.out}")
    fig = {"created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "run": meta, **analyse(args.out)}
    print(report(fig))
    args.json.write_text(json.dumps(fig, indent=1) + "\n")


if __name__ == "__main__":
    main()
