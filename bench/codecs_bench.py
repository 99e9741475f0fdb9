"""Snapshot codecs: bytes per node-round against final accuracy, per codec, on S1 (or S2, S3).

Runs ``coterie run`` on scenarios/s1_label_permuted.toml (``--scenario s2|s3``: S2, S3; real daemons, gRPC over loopback: the
in-process backend shares snapshots without encoding them) once per codec and seed, the
scenario's ``[node]`` section extended with ``snapshots.codecs`` / ``snapshots.delta``, and
reports per codec the mean final test accuracy over seeds (mean ± std of the per-seed means) and
the bytes sent per node and round — all traffic, and snapshots alone — with the ratio to fp32.

    python bench/codecs_bench.py                                    # fedfomo, 4 codecs, seeds 0-2
    python bench/codecs_bench.py --strategy dpsgd --rounds 10 --seeds 0,1
    python bench/codecs_bench.py --scenario s3 --codecs fp32,q8+delta --rounds 10

Writes bench/results/codecs/[<scenario>/]<strategy>/<codec>_s<seed>/ (the run directories with
the scenario file each ran, not committed), bench/results/codecs_[<scenario>_]<strategy>.json (S1
without the prefix) and bench/results/codecs.md (a section per scenario and strategy, with the
command line and the config).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"s1": "s1_label_permuted.toml", "s2": "s2_class_groups.toml", "s3": "s3_noisy_nodes.toml"}
SCENARIO = ROOT / "scenarios" / SCENARIOS["s1"]
CODECS = {  # name -> [node.snapshots] settings
    "fp32": {"codecs": ["fp32"], "delta": False},
    "fp16": {"codecs": ["fp16", "fp32"], "delta": False},
    "q8": {"codecs": ["q8", "fp32"], "delta": False},
    "q8+delta": {"codecs": ["q8", "fp32"], "delta": True},
    # deltas with room for one peer's base (S1-S3's models are 24-100k parameters: 0.1 MiB holds
    # one 96 KB CNN), as a 21 MB model gets by default: the other peers send whole q8 snapshots
    "q8+delta@1base": {"codecs": ["q8", "fp32"], "delta": True, "bases_mb": 0.1},
}


def scenario_for(codec: str, scenario: Path = SCENARIO) -> str:
    s = CODECS[codec]
    codecs = ", ".join(f'"{c}"' for c in s["codecs"])
    return (
        scenario.read_text() + f"\n[node.snapshots]  # added by bench/codecs_bench.py\n"
        f"codecs = [{codecs}]\ndelta = {'true' if s['delta'] else 'false'}\n"
        + (f"bases_mb = {s['bases_mb']}\n" if "bases_mb" in s else "")
    )


def run_one(
    out: Path, strategy: str, codec: str, seed: int, rounds: int, nodes: int | None, scenario: Path = SCENARIO
) -> dict:
    run_dir = out / strategy / f"{codec}_s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    toml = run_dir / "scenario.toml"
    toml.write_text(scenario_for(codec, scenario))
    cmd = [
        sys.executable,
        "-m",
        "coterie.cli.main",
        "run",
        str(toml),
        "--out",
        str(run_dir),
        "--strategy",
        strategy,
        "--seed",
        str(seed),
        "--rounds",
        str(rounds),
    ]
    if nodes:
        cmd += ["--nodes", str(nodes)]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    res = json.loads((run_dir / "results.json").read_text())
    s = res["strategies"][strategy]
    n = len(res["node_ids"])
    snap = sum(s["nodes"][k]["bytes_sent"].get("snapshot", 0) for k in res["node_ids"])
    accs = [s["nodes"][k]["final_test_acc"] for k in res["node_ids"] if s["nodes"][k]["final_test_acc"] is not None]
    row = {
        "codec": codec,
        "seed": seed,
        "rounds": rounds,
        "nodes": n,
        "wall_s": time.time() - t0,
        "mean_acc": sum(accs) / len(accs),
        "bytes_per_node_round": s["summary"]["bytes_sent_total"] / n / rounds,
        "snapshot_bytes_per_node_round": snap / n / rounds,
    }
    row["collab_acc"] = collab_acc(res, strategy)
    print(json.dumps(row), flush=True)
    return row


def collab_acc(res: dict, strategy: str) -> float | None:
    """The mean over nodes of the collaborative model's last test accuracy (issue 33's reference
    evaluates it beside the local twin; ``final_test_acc`` is what the node predicts with, which
    the blend may take from the twin alone — then it does not show what the codec did)."""
    s = res["strategies"][strategy]
    accs = [
        ev[-1]["collab_test_acc"]
        for k in res["node_ids"]
        if (ev := s["nodes"][k].get("eval")) and ev[-1] and ev[-1].get("collab_test_acc") is not None
    ]
    return sum(accs) / len(accs) if accs else None


def backfill(rows: list[dict], runs: Path, strategy: str) -> None:
    """Rows written before ``collab_acc`` existed get it from their run directories, if kept."""
    for r in rows:
        f = runs / strategy / f"{r['codec']}_s{r['seed']}" / "results.json"
        if "collab_acc" not in r and f.exists():
            r["collab_acc"] = collab_acc(json.loads(f.read_text()), strategy)


def _ms(xs: list[float]) -> str:
    return f"{100 * statistics.mean(xs):.1f} ± {100 * (statistics.stdev(xs) if len(xs) > 1 else 0):.1f}"


def table(rows: list[dict], codecs: list[str]) -> list[str]:
    by = {c: [r for r in rows if r["codec"] == c] for c in codecs}
    base = by.get("fp32") or []
    b_all = statistics.mean(r["bytes_per_node_round"] for r in base) if base else None
    b_snap = statistics.mean(r["snapshot_bytes_per_node_round"] for r in base) if base else None
    a0 = statistics.mean(r["mean_acc"] for r in base) if base else None
    collab = all(r.get("collab_acc") is not None for r in rows)
    c0 = statistics.mean(r["collab_acc"] for r in base) if base and collab else None
    out = [
        "| codec | seeds | mean final accuracy % (± std over seeds) | Δ vs fp32 (points) | KB sent / node-round "
        "(all) | × fewer than fp32 | KB of snapshots / node-round | × fewer than fp32 |"
        + (" collaborative model's accuracy % | Δ vs fp32 |" if collab else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if collab else ""),
    ]
    for c, rs in by.items():
        if not rs:
            continue
        acc = [r["mean_acc"] for r in rs]
        b = statistics.mean(r["bytes_per_node_round"] for r in rs)
        sb = statistics.mean(r["snapshot_bytes_per_node_round"] for r in rs)
        d = f"{100 * (statistics.mean(acc) - a0):+.1f}" if a0 is not None else "–"
        out.append(
            f"| {c} | {len(rs)} | {_ms(acc)} | {d} | {b / 1024:.1f} | "
            f"{(b_all / b) if b_all else float('nan'):.2f} | {sb / 1024:.1f} | "
            f"{(b_snap / sb) if b_snap and sb else float('nan'):.2f} |"
            + (
                f" {_ms([r['collab_acc'] for r in rs])} | "
                + (f"{100 * (statistics.mean(r['collab_acc'] for r in rs) - c0):+.1f} |" if c0 is not None else "– |")
                if collab
                else ""
            )
        )
    return out


def section(data: dict) -> list[str]:
    """codecs.md's section for one strategy's results."""
    rows, codecs = data["rows"], list(data["codecs"])
    seeds = sorted({r["seed"] for r in rows})
    per = {c: sorted(r["seed"] for r in rows if r["codec"] == c) for c in codecs}
    sc = data["scenario"]
    what = (
        next(
            (
                line.split("=", 1)[1].strip().strip('"')
                for line in (ROOT / sc).read_text().splitlines()
                if line.startswith("description")
            ),
            "",
        )
        if (ROOT / sc).exists()
        else ""
    )
    lines = [
        f"## {Path(sc).stem.split('_')[0].upper()}: {data['strategy']}",
        "",
        f"`python {data['command']}` — scenario `{sc}` ({what}), strategy `{data['strategy']}`, "
        f"{data['rounds']} rounds, seeds {seeds} (per codec: {per}), real daemons over gRPC on loopback "
        "(mTLS), on a 2-core machine shared with other work (wall times are not comparable).",
        "",
        "Config added to the scenario's `[node]` per codec (`[node.snapshots]`): "
        + "; ".join(
            f"`{c}`: codecs = {v['codecs']}, delta = {str(v['delta']).lower()}"
            + (f", bases_mb = {v['bases_mb']}" if "bases_mb" in v else "")
            for c, v in data["codecs"].items()
        )
        + ".",
        "",
        "Accuracy: the mean over nodes of the final test accuracy, then mean ± std over seeds. Bytes: "
        "everything the nodes sent (snapshots, membership, gossip), per node and round, and the snapshot "
        "part alone; ratio = fp32's bytes / the codec's."
        + (
            " Collaborative model: the mean over nodes of its last test accuracy, evaluated beside the "
            "local twin (issue 33); the final accuracy is what a node predicts with, which the blend may "
            "take from the twin alone."
            if all(r.get("collab_acc") is not None for r in rows)
            else ""
        ),
        "",
    ]
    lines += table(rows, codecs)
    lines += [
        "",
        "Per run:",
        "",
        "| codec | seed | mean final accuracy % | KB sent / node-round | wall s | collaborative model % |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['codec']} | {r['seed']} | {100 * r['mean_acc']:.1f} | {r['bytes_per_node_round'] / 1024:.1f} | "
        f"{r['wall_s']:.0f} | " + (f"{100 * r['collab_acc']:.1f} |" if r.get("collab_acc") is not None else "– |")
        for r in rows
    ]
    return lines + [""]


def report(out: Path) -> None:
    """bench/results/codecs.md: a section per strategy with results (codecs_<strategy>.json)."""
    lines = [
        "# Snapshot codecs on S1–S3: bytes against accuracy",
        "",
        "Written by `bench/codecs_bench.py` (see docs/codecs.md). Goal (issue 24): q8 + delta within "
        "0.5 points of fp32's mean accuracy at >= 3.5x fewer bytes per node-round.",
        "",
    ]

    def scenario_of(f: Path) -> str:  # codecs_<scenario>_<strategy>.json, or codecs_<strategy>.json for S1
        part = f.stem.split("_")[1]
        return part if part in SCENARIOS else "s1"

    for f in sorted(out.glob("codecs_*.json"), key=lambda f: (scenario_of(f), f.stem)):
        lines += section(json.loads(f.read_text()))
    (out / "codecs.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="fedfomo")
    ap.add_argument("--scenario", default="s1", choices=sorted(SCENARIOS))
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--merge", action="store_true", help="add these runs to the existing results json")
    ap.add_argument("--report", action="store_true", help="only write codecs.md from the results json")
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    scenario = ROOT / "scenarios" / SCENARIOS[args.scenario]
    prefix = "" if args.scenario == "s1" else f"{args.scenario}_"
    path = args.out / f"codecs_{prefix}{args.strategy}.json"
    data = {
        "strategy": args.strategy,
        "rounds": args.rounds,
        "codecs": {c: CODECS[c] for c in codecs},
        "scenario": str(scenario.relative_to(ROOT)),
        "command": "bench/codecs_bench.py " + " ".join(sys.argv[1:]),
        "rows": [],
    }
    runs = args.out / "codecs" / args.scenario if prefix else args.out / "codecs"
    if args.merge or args.report:
        data = json.loads(path.read_text())
        data.setdefault("command", "bench/codecs_bench.py")
        backfill(data["rows"], runs, args.strategy)
    if not args.report:
        for seed in seeds:  # seed-major: a cut-short bench still has every codec for the first seeds
            for c in codecs:
                row = run_one(
                    args.out / "codecs" / args.scenario if prefix else args.out / "codecs",
                    args.strategy,
                    c,
                    seed,
                    args.rounds,
                    args.nodes,
                    scenario,
                )
                data["rows"] = [r for r in data["rows"] if (r["codec"], r["seed"]) != (c, seed)] + [row]
                for k in CODECS:
                    if k == c or k in data["codecs"]:
                        data["codecs"][k] = CODECS[k]
                path.write_text(json.dumps(data, indent=1))
    order = [c for c in CODECS if c in data["codecs"]]
    data["codecs"] = {c: CODECS[c] for c in order}
    if args.report:
        path.write_text(json.dumps(data, indent=1))
    report(args.out)
    print("\n".join(table(data["rows"], order)))


if __name__ == "__main__":
    main()
