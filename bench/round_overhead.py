"""Round time ≈ compute time? What a round costs beyond training, and how membership scales
(issue 14.5), on real daemons on this machine.

``overhead``: N nodes (default 8) of local, dpsgd and fedfomo, free-running, with the small
mnist1d MLP (40-64-64-10, 40 steps of batch 32) and a ~21 MB one (40-2280-2280-10, 10 steps).
Per run: the median round cycle (time between two round completions, checkpoint included), the
compute baseline (``train()`` alone in this process, quiet: the issue's definition) and their
ratio; the contention floor (N daemons training on this machine's cores cannot cycle faster than
N × compute / cores); and from the round records the in-round split: training, exchange (peer
calls), evaluation, checkpoint, event-loop stall; peak RSS per node. ``--baseline-python`` runs
the same networks with another interpreter (one whose ``coterie`` is another checkout, e.g. the
system python3 = /work/main) side by side, alternating, so ratios compare like with like; both
run under ``lagprobe.py`` so the loop stall is measured the same way for both.

``scale``: 16, 32, 64, 100 real daemons (tiny model, D-PSGD with 3 sampled neighbours, paced
rounds): time until every node knows >= 95% of the others (from the moment the last one is up),
whether that holds to the end, suspicion flaps (alive → suspect of healthy peers) and false
deaths, CPU cores used by the network while idle (membership alone), and whether every node
finished its rounds (and how far apart).

    python bench/round_overhead.py overhead --baseline-python python3
    python bench/round_overhead.py scale --sizes 16,32,64,100
Results: bench/results/round_overhead.json (+ .md); the run's config and load are recorded."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import Lab, cpu_s, load, mem_available_mib, mnist1d_mlp, peak_rss_mib, rss_mib  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"small": {"hidden": [64, 64], "steps": 40}, "21mb": {"hidden": [2280, 2280], "steps": 10}}
CORES = os.cpu_count() or 1


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def code_version(python: str) -> dict[str, str]:
    """Which checkout an interpreter's ``coterie`` is, and its git commit."""
    where = subprocess.run(
        [python, "-c", "import coterie.node, os; print(os.path.dirname(coterie.node.__file__))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    root = str(Path(where).parent) if where else ""
    commit = (
        subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        if root
        else ""
    )
    return {"python": python, "checkout": root, "commit": commit}


# ------------------------------------------------------------------------------------ compute
def train_alone(model: str, nodes: int, reps: int = 15) -> tuple[float, float]:
    """Median ``train()`` wall time and CPU time of one node's learner in this process, one torch
    thread (on a busy machine the CPU time is the figure to trust)."""
    import torch

    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.torch_learner import build_learner

    torch.set_num_threads(1)
    spec = MODELS[model]
    learner = build_learner(LearnerConfig(**mnist1d_mlp(nodes, 0, hidden=spec["hidden"], steps=spec["steps"])))
    learner.train()
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        learner.train()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def _train_worker(model: str, nodes: int, index: int, reps: int, start, out) -> None:
    import torch

    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.torch_learner import build_learner

    torch.set_num_threads(1)
    spec = MODELS[model]
    learner = build_learner(LearnerConfig(**mnist1d_mlp(nodes, index, hidden=spec["hidden"], steps=spec["steps"])))
    learner.train()
    start.wait()
    cpu = []
    for _ in range(reps):
        c0 = time.process_time()
        learner.train()
        cpu.append(time.process_time() - c0)
    out.put(statistics.median(cpu))


def train_contended(model: str, nodes: int, reps: int) -> float:
    """Median ``train()`` CPU time with ``nodes`` processes training at once, each one node's
    learner (no daemon, no network): what the same training costs under the contention the
    daemons run in (caches and cores shared by ``nodes`` processes on this machine's cores)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(nodes), ctx.Queue()
    procs = [ctx.Process(target=_train_worker, args=(model, nodes, i, reps, start, out)) for i in range(nodes)]
    for p in procs:
        p.start()
    got = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(got)


# ------------------------------------------------------------------------------------ overhead
def run_network(python: str, model: str, strategy: str, nodes: int, rounds: int, skip: int) -> dict[str, Any]:
    spec = MODELS[model]
    configs = [
        {
            "strategy": strategy,
            "round_interval_s": 0.0,
            "rounds": rounds,
            "min_peers": nodes - 1,
            "start_timeout_s": 600,
            "seed": 0,
            "learner": mnist1d_mlp(nodes, i, hidden=spec["hidden"], steps=spec["steps"]),
        }
        for i in range(nodes)
    ]
    root = Path(tempfile.mkdtemp(prefix=f"coterie-overhead-{model}-{strategy}-"))
    base: dict[str, float] = {}
    with Lab(root, configs, python=python, lag_probe=True) as lab:
        lab.start(on_ready=lambda n: base.__setitem__(n.node_id, rss_mib(n.proc.pid)))
        t0 = time.monotonic()
        lag0: dict[str, dict] = {}
        while True:
            sts = lab.statuses()
            if not lag0 and all(s and s["round"] >= skip for s in sts):
                lag0 = {n.node_id: n.lag() for n in lab.nodes}
                cpu0 = {n.node_id: (cpu_s(n.proc.pid), s["round"]) for n, s in zip(lab.nodes, sts, strict=True)}
                t_lag0 = time.monotonic()
            if all(s and s.get("done") for s in sts):
                break
            for n in lab.nodes:
                if n.proc.poll() is not None:
                    raise RuntimeError(f"{n.node_id} died: {n.log_tail()}")
            if time.monotonic() - t0 > 3600:
                raise TimeoutError(f"{strategy}/{model}: rounds {[s and s['round'] for s in sts]}")
            time.sleep(0.5)
        t_lag1 = time.monotonic()
        lag1 = {n.node_id: n.lag() for n in lab.nodes}
        # CPU a node spent per round (training, serving peers, membership, checkpoint: all of it)
        cpu_per_round = (
            [(cpu_s(n.proc.pid) - cpu0[n.node_id][0]) / max(1, rounds - cpu0[n.node_id][1]) for n in lab.nodes]
            if lag0
            else []
        )
        peaks = {n.node_id: peak_rss_mib(n.proc.pid) for n in lab.nodes}
        histories = {n.node_id: n.history() for n in lab.nodes}
    cycles, durations, train, exchange, evals, stalls, ckpt = [], [], [], [], [], [], []
    for h in histories.values():
        h = [r for r in h if r["round"] > skip]
        for a, b in itertools.pairwise(h):
            cycles.append(b["t"] - a["t"])
            ckpt.append(b["t"] - a["t"] - b["duration_s"])  # the time between two rounds' loops
        for r in h:
            durations.append(r["duration_s"])
            tm = r.get("timing")
            if tm:
                train.append(tm["strategy_s"] - tm.get("exchange_s", 0.0))
                exchange.append(tm.get("exchange_s", 0.0))
                evals.append(tm.get("eval_s"))
                stalls.append(tm.get("loop_stall_s"))
    rounds_measured = sum(max(0, len(h) - skip) for h in histories.values())
    lag_during = sum((lag1[k].get("lag_total_s", 0) - lag0.get(k, {}).get("lag_total_s", 0)) for k in lag1)
    busy_during = sum((lag1[k].get("busy_total_s", 0) - lag0.get(k, {}).get("busy_total_s", 0)) for k in lag1)
    cycle = median(cycles)
    out = {
        "cycle_s": cycle,
        "cpu_per_round_s": median(cpu_per_round),
        "duration_s": median(durations),
        "between_rounds_s": median(ckpt),
        "in_round": {
            "train_s": median(train),
            "exchange_s": median(exchange),
            "eval_s": median(evals),
            "loop_stall_s": median(stalls),
        }
        if train
        else None,
        "loop_stall_per_round_s": lag_during / rounds_measured if rounds_measured else None,
        "loop_busy_per_round_s": busy_during / rounds_measured if rounds_measured else None,
        "loop_busy_max_s": max(v.get("busy_max_s", 0) for v in lag1.values()),
        "loop_stall_share": lag_during / (nodes * (t_lag1 - t_lag0)) if lag0 else None,
        "loop_lag_max_s": max(v.get("lag_max_s", 0) for v in lag1.values()),
        "peak_rss_mib": {"median": median(peaks.values()), "max": max(peaks.values())},
        "base_rss_mib": median(base.values()),
        "rounds_measured": rounds_measured,
        "dir": str(root),
    }
    if cycle:
        out["shares"] = {
            "between_rounds (checkpoint, history)": median(ckpt) / cycle,
            "loop_stall": out["loop_stall_per_round_s"] / cycle if out["loop_stall_per_round_s"] else None,
        }
        if train:
            out["shares"].update(
                {"train": median(train) / cycle, "exchange": median(exchange) / cycle, "eval": median(evals) / cycle}
            )
    return out


def overhead(args) -> dict[str, Any]:
    impls = {"this": sys.executable}
    if args.baseline_python:
        impls["baseline"] = args.baseline_python
    out: dict[str, Any] = {"versions": {k: code_version(v) for k, v in impls.items()}, "runs": []}
    for model in args.models.split(","):
        compute, compute_cpu = train_alone(model, args.nodes)
        floor = args.nodes * compute / CORES
        contended_cpu = train_contended(model, args.nodes, 20 if model == "small" else 5)
        print(
            f"[{model}] train() CPU with {args.nodes} processes training at once: {contended_cpu * 1000:.1f} ms",
            flush=True,
        )
        print(
            f"[{model}] train() alone: {compute * 1000:.1f} ms wall, {compute_cpu * 1000:.1f} ms CPU; contention "
            f"floor with {args.nodes} daemons on {CORES} cores: {floor * 1000:.0f} ms per cycle; load {load()}",
            flush=True,
        )
        rounds = args.rounds if model == "small" else args.rounds_big
        for strategy in args.strategies.split(","):
            order = list(impls.items())[::-1] if args.baseline_first else impls.items()
            for impl, python in order:  # side by side: same model/strategy, one after the other
                load0 = load()
                r = run_network(python, model, strategy, args.nodes, rounds, args.skip)
                r.update(
                    {
                        "impl": impl,
                        "model": model,
                        "strategy": strategy,
                        "compute_alone_s": compute,
                        "compute_alone_cpu_s": compute_cpu,
                        "contention_floor_s": floor,
                        "load_before": load0,
                        "load_after": load(),
                    }
                )
                r["cpu_ratio"] = r["cpu_per_round_s"] / compute_cpu if r["cpu_per_round_s"] else None
                r["compute_contended_cpu_s"] = contended_cpu
                r["cpu_ratio_contended"] = r["cpu_per_round_s"] / contended_cpu if r["cpu_per_round_s"] else None
                r["ratio_vs_compute"] = r["cycle_s"] / compute if r["cycle_s"] else None
                r["ratio_vs_floor"] = r["cycle_s"] / max(floor, compute) if r["cycle_s"] else None
                if r["in_round"]:
                    r["ratio_vs_in_round_train"] = r["cycle_s"] / r["in_round"]["train_s"]
                out["runs"].append(r)
                ir = r["in_round"] or {}
                print(
                    f"  {impl:8s} {strategy:8s} cycle {r['cycle_s'] * 1000:7.1f} ms = "
                    f"{r['ratio_vs_compute']:.2f}x compute, {r['ratio_vs_floor']:.2f}x floor; CPU/round "
                    f"{_ms(r['cpu_per_round_s'])} ms = {r['cpu_ratio'] or float('nan'):.2f}x train CPU "
                    f"({r['cpu_ratio_contended'] or float('nan'):.2f}x contended); "
                    f"train {_ms(ir.get('train_s'))} exch {_ms(ir.get('exchange_s'))} eval {_ms(ir.get('eval_s'))} "
                    f"between {_ms(r['between_rounds_s'])} stall/round {_ms(r['loop_stall_per_round_s'])} "
                    f"(max {r['loop_lag_max_s'] * 1000:.0f} ms), loop busy/round {_ms(r['loop_busy_per_round_s'])} "
                    f"(max {r['loop_busy_max_s'] * 1000:.0f} ms); peak RSS {r['peak_rss_mib']['median']:.0f} MiB "
                    f"(base {r['base_rss_mib']:.0f}); load {load0}",
                    flush=True,
                )
    return out


def _ms(x) -> str:
    return "   -  " if x is None else f"{x * 1000:6.1f}"


# ------------------------------------------------------------------------------------ scale
def scale_one(python: str, n: int, rounds: int, interval: float) -> dict[str, Any]:
    # daemons forked from the preloaded fork server (netlab's default): ~50 MB PSS each, 200 MB
    # RSS of which most is shared; a fresh interpreter per daemon would need ~200 MB each
    need = n * 60 + 2000
    if mem_available_mib() < need:
        return {"nodes": n, "skipped": f"needs ~{need} MiB, {mem_available_mib():.0f} available"}
    configs = [
        {
            "strategy": "dpsgd",
            "strategy_params": {"max_neighbours": 3},
            "round_interval_s": interval,
            "rounds": rounds,
            "min_peers": math.ceil(0.95 * (n - 1)),
            "start_timeout_s": 600,
            "seed": 0,
            "learner": {
                **mnist1d_mlp(n, i, hidden=[32], steps=5, samples=60, clusters=2),
                "dataset_params": {"num_samples": max(2000, 80 * n)},
            },
        }
        for i in range(n)
    ]
    root = Path(tempfile.mkdtemp(prefix=f"coterie-scale-{n}-"))
    want = math.ceil(0.95 * (n - 1))  # "knows >= 95% of the others"
    timeline: list[tuple[float, int, int]] = []  # (t since all up, min alive, min known)
    with Lab(root, configs, python=python) as lab, ThreadPoolExecutor(max_workers=32) as pool:
        t_launch = time.monotonic()
        lab.start(seeds=3, batch=10, timeout=900)
        t_up = time.monotonic()
        reached = None
        done_at = None
        while True:
            sts = lab.statuses(timeout=10)
            now = time.monotonic() - t_up
            alive = [s["peers_alive"] if s else 0 for s in sts]
            timeline.append((now, min(alive), min(s["peers_known"] if s else 0 for s in sts)))
            if reached is None and min(alive) >= want:
                reached = now
            if all(s and s.get("done") for s in sts):
                done_at = now
                break
            if now > 900:
                break
            time.sleep(2.0)
        # idle: rounds done, only membership runs — what does it cost?
        c0 = sum(cpu_s(d.proc.pid) for d in lab.nodes)
        time.sleep(20.0)
        c1 = sum(cpu_s(d.proc.pid) for d in lab.nodes)
        final = lab.statuses(timeout=10)
        hist = list(pool.map(lambda d: d.history(), lab.nodes))
        transitions = [t for d in lab.nodes for t in d.transitions()]
        mstats = [st.get("membership", {}) for st in final if st]
    ends = [h[-1]["t"] for h in hist if h]
    after = [a for t, a, _ in timeline if reached is not None and t >= reached]
    return {
        "nodes": n,
        "launch_to_all_up_s": t_up - t_launch,
        "full_membership_after_up_s": reached,
        "full_membership_after_launch_s": (reached + (t_up - t_launch)) if reached is not None else None,
        "kept_full_membership": bool(after) and min(after) >= want,
        "min_alive_after_full": min(after) if after else None,
        "final_min_alive": min(s["peers_alive"] for s in final if s) if all(final) else None,
        "suspicion_flaps": sum(1 for _, old, new in transitions if old == "alive" and new == "suspect"),
        "false_dead": sum(1 for _, _, new in transitions if new == "dead"),
        "refutations": sum(m.get("refuted", 0) for m in mstats),
        "all_finished": done_at is not None and all(len(h) >= rounds for h in hist),
        "finish_spread_s": (max(ends) - min(ends)) if ends else None,
        "round_cycle_s": median([b["t"] - a["t"] for h in hist for a, b in itertools.pairwise(h)]),
        "idle_cores": (c1 - c0) / 20.0,
        "idle_cores_per_node": (c1 - c0) / 20.0 / n,
        "timeline": timeline[:: max(1, len(timeline) // 60)],
        "dir": str(root),
    }


def scale(args) -> dict[str, Any]:
    out = {"versions": {"this": code_version(sys.executable)}, "runs": []}
    impls = [("this", sys.executable)] + ([("baseline", args.baseline_python)] if args.baseline_python else [])
    for n in map(int, args.sizes.split(",")):
        for impl, python in impls:
            if impl == "baseline" and n > args.baseline_max_nodes:
                continue
            load0 = load()
            r = scale_one(python, n, args.scale_rounds, args.scale_interval)
            r.update({"impl": impl, "load_before": load0, "load_after": load()})
            out["runs"].append(r)
            print(
                f"  {impl:8s} {n:4d} nodes: "
                + ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("timeline", "dir", "nodes", "impl")),
                flush=True,
            )
    return out


# ------------------------------------------------------------------------------------ main
def write_md(results: dict[str, Any], path: Path) -> None:
    lines = [f"# Round overhead and scale ({results['when']}, {results['machine']})", ""]
    ov = results.get("overhead")
    if ov:
        lines += [
            "## Round time vs compute (8 nodes, free-running; medians)",
            "",
            "versions: " + "; ".join(f"{k} = {v['checkout']} @ {v['commit']}" for k, v in ov["versions"].items()),
            "",
            "× contended train() CPU: against the CPU of the same `train()` with as many processes "
            "training at once as there are daemons (no daemon, no network; the contention alone).",
            "",
            "| model | strategy | code | CPU/round ms | × train() CPU | × contended train() CPU | cycle ms | × train() alone | × contention floor |"
            " train | exchange | eval | between rounds | loop lag/round (wall) | loop busy/round (CPU) | peak RSS MiB | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in ov["runs"]:
            ir = r["in_round"] or {}
            contended = f"{r['cpu_ratio_contended']:.2f}" if r.get("cpu_ratio_contended") else "–"
            lines.append(
                f"| {r['model']} | {r['strategy']} | {r['impl']} | {_ms(r['cpu_per_round_s'])} | "
                f"{(r['cpu_ratio'] or float('nan')):.2f} | {contended} | {r['cycle_s'] * 1000:.1f} | "
                f"{r['ratio_vs_compute']:.2f} | {r['ratio_vs_floor']:.2f} | {_ms(ir.get('train_s'))} | "
                f"{_ms(ir.get('exchange_s'))} | {_ms(ir.get('eval_s'))} | {_ms(r['between_rounds_s'])} | "
                f"{_ms(r['loop_stall_per_round_s'])} | {_ms(r.get('loop_busy_per_round_s'))} | "
                f"{r['peak_rss_mib']['median']:.0f} | {r['load_before']} |"
            )
    sc = results.get("scale")
    if sc:
        lines += [
            "",
            "## Scale sweep (real daemons on this machine)",
            "",
            "Each size: N daemons forked from the preloaded fork server (as `coterie run` starts them), mTLS, "
            "started in batches of 10 bootstrapped to 3 seeds; D-PSGD with 3 sampled neighbours on a tiny "
            "MLP, rounds paced every 3 s. Full membership: every node has >= 95% of the others alive in its "
            "table (`/status` peers_alive, polled every 2 s); kept: it never fell below that until the end; "
            "flaps: alive -> suspect transitions logged by any node; false dead: -> dead transitions (no "
            "node failed); idle cores: CPU of all daemons over 20 s after the rounds (membership alone).",
            "",
            "| code | nodes | all up after launch s | full membership after up s | after launch s | kept | min alive after | flaps | false dead |"
            " all finished | finish spread s | idle cores | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sc["runs"]:
            if "skipped" in r:
                lines.append(f"| {r['impl']} | {r['nodes']} | skipped: {r['skipped']} |||||||||||")
                continue
            fm, fl = r["full_membership_after_up_s"], r["full_membership_after_launch_s"]
            lines.append(
                f"| {r['impl']} | {r['nodes']} | {r['launch_to_all_up_s']:.1f} | "
                f"{'never' if fm is None else f'{fm:.1f}'} | {'never' if fl is None else f'{fl:.1f}'} | "
                f"{r['kept_full_membership']} | {r['min_alive_after_full']} of {r['nodes'] - 1} | "
                f"{r['suspicion_flaps']} | {r['false_dead']} | {r['all_finished']} | "
                f"{r['finish_spread_s'] and round(r['finish_spread_s'], 1)} | {r['idle_cores']:.2f} | {r['load_before']} |"
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # leave through the labs' cleanup
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "what", choices=["overhead", "scale", "all", "report"], help="report: rewrite the .md from the .json"
    )
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--models", default="small,21mb")
    ap.add_argument("--strategies", default="local,dpsgd,fedfomo")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--rounds-big", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3, help="warm-up rounds left out")
    ap.add_argument("--baseline-python", help="interpreter whose coterie is the baseline checkout (e.g. python3)")
    ap.add_argument(
        "--baseline-first",
        action="store_true",
        help="run the baseline before this checkout in each pair (alternate it across repetitions)",
    )
    ap.add_argument("--sizes", default="16,32,64,100")
    ap.add_argument("--scale-rounds", type=int, default=15)
    ap.add_argument("--scale-interval", type=float, default=3.0)
    ap.add_argument("--baseline-max-nodes", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "round_overhead.json"))
    args = ap.parse_args()
    out_path = Path(args.out)
    results: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.what == "report":
        write_md(results, out_path.with_suffix(".md"))
        return 0
    results.update(
        {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {CORES} cores", "args": vars(args)}
    )
    if args.what in ("overhead", "all"):
        results["overhead"] = overhead(args)
    if args.what in ("scale", "all"):
        results["scale"] = scale(args)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2))
    write_md(results, out_path.with_suffix(".md"))
    print(f"wrote {out_path} and {out_path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
