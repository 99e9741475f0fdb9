"""Memory per node, this checkout against another side by side (issue 34 item 2): N real daemons
(fresh interpreters, as ``coterie node start`` runs on a device) with the ~21 MB MLP
(mnist1d 40-2280-2280-10, Adam), strategies local and D-PSGD, a fixed number of rounds at full
rate. Every daemon's PSS and RSS are sampled every ``--sample-s`` from /proc/PID/smaps_rollup:
the peak of the whole tree (sum over daemons at one sample), each node's peak, and each node's
PSS at rest (after its last round, the checkpoint written). Networks alternate between the
interpreters, so both see the same load.

    python bench/memory.py --python base=/path/to/old/.venv/bin/python [--nodes 4 --rounds 6]
    python bench/memory.py --fork --nodes 8 --python base=/path/to/old/.venv/bin/python

With ``--fork`` the daemons are forked from a preloaded fork server (as ``coterie run`` starts
them); compared, each network is forked from a fresh run of this script under its checkout's
interpreter, the same for every checkout. The order of the checkouts flips with the seed's parity.

Writes ``bench/results/memory.json`` (figures and the full config) and prints a table with the
issue's budget per node: 150 MB + 3x the model at rest, 150 MB + 5x while exchanging.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import Lab, load, mnist1d_mlp, wait_for  # noqa: E402


def smaps(pid: int) -> tuple[float, float]:
    """(PSS, RSS) of a process in MB; (0, 0) once it is gone."""
    pss = rss = 0.0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) / 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) / 1024
    except OSError:
        pass
    return pss, rss


# what a node's PSS is made of: its own pages (private), its share of the pages it holds in common
# with the fork server and the other daemons (shared), anonymous memory against file maps
ANATOMY = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


def smaps_fields(pid: int) -> dict[str, float]:
    """The fields of ``ANATOMY`` from /proc/PID/smaps_rollup, in MB; {} once the process is gone."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ANATOMY:
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:
        return {}
    return out


class Sampler(threading.Thread):
    def __init__(self, pids: list[int], every: float):
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.samples: list[list[tuple[float, float]]] = []
        self.at_peak: list[dict[str, float]] = [{} for _ in pids]  # each node's anatomy at its peak PSS
        self.times: list[float] = []  # wall clock of each sample (to place a peak in its round)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.times.append(time.time())
            row = [smaps_fields(p) for p in self.pids]
            self.samples.append([(r.get("Pss", 0.0), r.get("Rss", 0.0)) for r in row])
            for i, r in enumerate(row):
                if r and r["Pss"] > self.at_peak[i].get("Pss", -1.0):
                    self.at_peak[i] = r
            self.halt.wait(self.every)


def median_anatomy(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each field's median over nodes."""
    rows = [r for r in rows if r]
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows), 1) for k in ANATOMY} if rows else {}


def exchanged(history: Path, log: Path, peers: int) -> dict[str, Any]:
    """A node's rounds (its history), the rounds in which it mixed every peer, the snapshot bytes it
    received, and the lines of its log about a refused or malformed snapshot or delta."""
    rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()] if history.exists() else []
    text = log.read_text(errors="replace") if log.exists() else ""
    problems = [line for line in text.splitlines() if re.search(r"delta against|malformed|refus", line)]
    ends = [r["t"] for r in rows if "t" in r]  # when each round's work ended: the gaps include any wait
    # between one round's work and the next's: publishing, handing the checkpoint over (and, for a
    # model written from its own tensors, the write itself)
    between = [b["t"] - a["t"] - b["duration_s"] for a, b in zip(rows, rows[1:], strict=False) if "t" in a and "t" in b]
    return {
        "between_rounds_s": round(statistics.median(between), 3) if between else None,
        "rounds": len(rows),
        "round_period_s": round(statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False)), 3)
        if len(ends) > 2
        else None,
        "full_rounds": sum(1 for r in rows if len(r.get("contacted") or ()) == peers),
        "snapshot_mb": round(sum((r.get("bytes_received") or {}).get("snapshot", 0) for r in rows) / 1e6, 1),
        "delta_problems": len(problems),
        # what the node published last: the same on two checkouts = the same computation (local)
        "last_snapshot_sha256": rows[-1].get("snapshot_sha256") if rows else None,
        "delta_problem_lines": [line[-300:] for line in problems[:3]],  # (the logs go with the state dirs)
    }


def moment(history: Path, t: float) -> str:
    """Where a node was at wall time ``t``: "r3 0.40" (40 % into round 3's own work: training,
    exchange, evaluation), "r3+" (after it: publishing, the checkpoint), or "start"."""
    rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()] if history.exists() else []
    for r in rows:
        if "t" not in r or r.get("round", 0) < 1:
            continue
        start = r["t"] - r.get("duration_s", 0.0)
        if t < start:
            return f"r{r['round'] - 1}+" if r["round"] > 1 else "start"
        if t <= r["t"]:
            return f"r{r['round']} {(t - start) / max(r['t'] - start, 1e-9):.2f}"
    return f"r{rows[-1].get('round', 0)}+" if rows else "start"


def peaks_by_round(history: Path, times: list[float], pss: list[float]) -> dict[str, float]:
    """The highest PSS sampled in each round of a node ("start", "r1", ...: a round's own work and
    what follows it until the next begins)."""
    out: dict[str, float] = {}
    for t, p in zip(times, pss, strict=True):
        key = moment(history, t).split()[0].rstrip("+")
        key = key if key == "start" or key[1:] != "0" else "start"
        out[key] = round(max(out.get(key, 0.0), p), 1)
    return out


def one_network(python: str, strategy: str, args: argparse.Namespace, model_mb: float) -> dict[str, Any]:
    # --fork: daemons forked from this interpreter's preloaded fork server (what `coterie run`
    # does): torch's pages are shared, so PSS counts a node's own memory
    n = args.nodes
    configs = [
        {
            "strategy": strategy,
            "rounds": args.rounds,
            "round_interval_s": 0.0,
            "min_peers": n - 1,
            "seed": args.seed,
            "log_level": "WARNING",
            "learner": mnist1d_mlp(n, i, hidden=args.hidden, steps=args.steps),
            # --no-delta: every pull a whole q8 snapshot, no decoded copy of a peer kept as a base
            **({"snapshots": {"delta": False}} if args.no_delta else {}),
            # --bases-mb: the decoded peer bases kept for deltas (unset: the checkout's default)
            **({"snapshots": {"bases_mb": args.bases_mb}} if args.bases_mb is not None else {}),
        }
        for i in range(n)
    ]
    root = Path(tempfile.mkdtemp(prefix=f"coterie-mem-{strategy}-"))
    with Lab(root, configs, python=python, fork=args.fork) as lab:
        lab.start(seeds=1)
        pids = [d.proc.pid for d in lab.nodes if d.proc is not None]
        sampler = Sampler(pids, args.sample_s)
        sampler.start()
        t0 = time.monotonic()
        wait_for(
            lambda: all(s and s.get("done") for s in lab.statuses()),
            args.timeout,
            f"{n} nodes to finish {args.rounds} rounds",
            interval=1.0,
        )
        wall = time.monotonic() - t0
        time.sleep(2 * args.sample_s)
        sampler.halt.set()
        sampler.join()
        rest = []  # at rest: four samples once every node is done and has written its checkpoint
        for _ in range(4):
            time.sleep(args.sample_s)
            rest.append([smaps(p) for p in pids])
        rest_anatomy = [smaps_fields(p) for p in pids]
        exchange = [exchanged(d.state_dir / "history.jsonl", d.log_path, n - 1) for d in lab.nodes]
        by_round = [  # each node's peak PSS in each round (its own work and what follows it, to the next)
            peaks_by_round(d.state_dir / "history.jsonl", sampler.times, [s[i][0] for s in sampler.samples])
            for i, d in enumerate(lab.nodes)
        ]
        peak_at = [  # the moment of each node's peak sample (dissection: which phase of which round)
            moment(
                d.state_dir / "history.jsonl",
                sampler.times[max(range(len(sampler.samples)), key=lambda k: sampler.samples[k][i][0])],
            )
            for i, d in enumerate(lab.nodes)
        ]
    # the daemons' state dirs (checkpoints: 650-975 MB a network) are not results: 114 of them
    # left behind once filled this machine's disk
    shutil.rmtree(root, ignore_errors=True)
    per_node_peak = [max(s[i][0] for s in sampler.samples) for i in range(len(pids))]
    return {
        "wall_s": round(wall, 1),
        "samples": len(sampler.samples),
        "tree_peak_pss_mb": round(max(sum(p for p, _ in s) for s in sampler.samples), 1),
        "node_peak_pss_mb": [round(x, 1) for x in per_node_peak],
        "node_peak_pss_mb_median": round(statistics.median(per_node_peak), 1),
        "node_peak_at": peak_at,
        "node_peak_by_round": by_round,
        # every sample: seconds since the first, then each node's PSS (MB)
        "timeline": [
            [round(t - sampler.times[0], 2), *(round(p, 1) for p, _ in s)]
            for t, s in zip(sampler.times, sampler.samples, strict=True)
        ],
        "node_peak_rss_mb_median": round(
            statistics.median(max(s[i][1] for s in sampler.samples) for i in range(len(pids))), 1
        ),
        "node_rest_pss_mb_median": round(
            statistics.median(statistics.median(r[i][0] for r in rest) for i in range(len(pids))), 1
        ),
        # what the network did: the same work on both checkouts, or the memory figures mean little
        "rounds_done": [e["rounds"] for e in exchange],
        "last_snapshot_sha256": [e["last_snapshot_sha256"] for e in exchange],
        "rounds_mixing_every_peer": [e["full_rounds"] for e in exchange],
        "snapshot_mb_received_per_node": [e["snapshot_mb"] for e in exchange],
        "between_rounds_s_median": round(
            statistics.median(e["between_rounds_s"] for e in exchange if e["between_rounds_s"] is not None), 3
        )
        if any(e["between_rounds_s"] is not None for e in exchange)
        else None,
        # median over nodes of each node's median gap between round ends (checkpoint waits included)
        "round_period_s_median": round(
            statistics.median(e["round_period_s"] for e in exchange if e["round_period_s"]), 3
        )
        if any(e["round_period_s"] for e in exchange)
        else None,
        # median node's smaps_rollup fields at its peak PSS and at rest (what turned private, what is shared)
        "node_peak_anatomy_mb_median": median_anatomy(sampler.at_peak),
        "node_rest_anatomy_mb_median": median_anatomy(rest_anatomy),
        "node_peak_minus_rest_anatomy_mb": [
            {k: round(a.get(k, 0.0) - b.get(k, 0.0), 1) for k in ANATOMY}
            for a, b in zip(sampler.at_peak, rest_anatomy, strict=True)
        ],
        "delta_problems_logged": sum(e["delta_problems"] for e in exchange),
        "delta_problem_lines": [line for e in exchange for line in e["delta_problem_lines"]][:5],
        "budget_rest_mb": round(150 + 3 * model_mb, 1),
        "budget_exchange_mb": round(150 + 5 * model_mb, 1),
    }


def forked_from(python: str, strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    """One network of daemons forked from ``python``'s own fork server (forking runs the forking
    interpreter's code): this script under that interpreter, for that one network."""
    with tempfile.TemporaryDirectory(prefix="coterie-mem-fork-") as d:
        out = Path(d) / "network.json"
        flags = ["--nodes", str(args.nodes), "--rounds", str(args.rounds), "--steps", str(args.steps)]
        flags += ["--hidden", ",".join(map(str, args.hidden)), "--sample-s", str(args.sample_s)]
        flags += ["--timeout", str(args.timeout), "--seed", str(args.seed), "--strategies", strategy]
        flags += ["--no-delta"] if args.no_delta else []
        flags += ["--bases-mb", str(args.bases_mb)] if args.bases_mb is not None else []
        subprocess.run([python, __file__, "--fork", *flags, "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["results"][strategy]["this"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", action="append", default=[], help="LABEL=INTERPRETER (another checkout's)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", default="2280,2280")
    ap.add_argument("--strategies", default="local,dpsgd")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fork",
        action="store_true",
        help="fork the daemons from a preloaded interpreter (each --python's network from its own)",
    )
    ap.add_argument("--no-delta", action="store_true", help="snapshots.delta = false on every node")
    ap.add_argument("--bases-mb", type=float, default=None, help="snapshots.bases_mb on every node")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory.json")
    args = ap.parse_args()
    args.hidden = [int(h) for h in args.hidden.split(",")]
    pythons = dict(p.split("=", 1) for p in args.python)
    if sys.executable not in pythons.values():
        pythons["this"] = sys.executable
    order = list(pythons.items())[:: -1 if args.seed % 2 else 1]  # who runs first flips with the seed
    sizes = [40, *args.hidden, 10]
    params = sum(a * b + b for a, b in zip(sizes, sizes[1:], strict=False))
    model_mb = params * 4 / 1e6
    print(f"model: {params:,} parameters ({model_mb:.1f} MB fp32); {args.nodes} nodes; load {load()}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for strategy in args.strategies.split(","):
        for label, py in order:  # alternating: each strategy runs every interpreter in turn
            # compared, every network forks from a fresh run of this script under its interpreter:
            # a fork server that already ran networks would share other pages with its daemons
            forked_elsewhere = args.fork and len(order) > 1
            r = forked_from(py, strategy, args) if forked_elsewhere else one_network(py, strategy, args, model_mb)
            results.setdefault(strategy, {})[label] = r
            print(
                f"{strategy:>6} {label:>6}: tree peak PSS {r['tree_peak_pss_mb']:7.1f} MB; per node: peak PSS "
                f"{r['node_peak_pss_mb_median']:6.1f} (budget {r['budget_exchange_mb']}), at rest "
                f"{r['node_rest_pss_mb_median']:6.1f} (budget {r['budget_rest_mb']}), peak RSS "
                f"{r['node_peak_rss_mb_median']:6.1f}; {r['wall_s']} s; rounds {r['rounds_done']} "
                f"(every peer mixed: {r['rounds_mixing_every_peer']}), snapshots received "
                f"{r['snapshot_mb_received_per_node']} MB, round period {r['round_period_s_median']} s (between rounds {r['between_rounds_s_median']} s), delta problems {r['delta_problems_logged']}; load {load()}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(
        json.dumps({"config": {**cfg, "pythons": pythons}, "model_mb": model_mb, "results": results}, indent=1)
    )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
