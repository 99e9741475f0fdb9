"""How far one machine goes: the in-process backend against daemon processes, and the lean daemon.

Three sections, each run side by side in one invocation (the machine is shared and noisy: compare
figures within a table, not across runs):

``scale``   ``coterie run scenarios/scale_fedfomo.toml`` (fedfomo, MNIST-1D MLP, 10 rounds) at
            N nodes on each backend: wall time, peak memory of the whole run (sum over its
            processes of RSS and of PSS, sampled), memory per node, final accuracy, peers known.
``daemon``  one daemon process (processes backend), started as ``coterie node start`` (a fresh
            interpreter) and forked from the launcher's preloaded fork server: seconds from launch
            to the first handshake answered, and RSS/PSS/USS idle and during rounds (a 8-node
            network of each kind), against the issue's budget of 150 MB + 3 x model size.
            Also the largest imports of ``coterie node start`` (``python -X importtime``).
``ray``     the same scale scenario at N nodes on processes, inproc and ray (a local Ray instance
            the run starts itself, so its GCS, raylet and worker processes are in the sampled
            tree; ``--groups 2``: two actors, memory inside each and gRPC between them).
``floor``   the scale scenario in one process (inproc) against its compute floor (every node's
            training CPU spread over the cores), this checkout beside ``--baseline-python``'s.
``overlay``  membership's cost per node and protocol period (CPU, bytes, entries held), full
            membership (SWIM + push-pull) against membership on partial views (HyParView), the
            daemon's membership over the in-process transport, side by side at N nodes, and
            partial views alone for 5 periods at ``--overlay-big`` nodes (``bench/overlay_cost.py``).
``discovery`` cluster mates among each node's top-weighted peers after K rounds, candidates from
            discovery against a uniform draw (``bench/overlay_cost.py``).
``s1``      scenarios/s1_label_permuted.toml on both backends (same partitions and seeds) for a
            few strategies, plus a second processes run as the run-to-run noise reference.

    python bench/scale.py                                  # everything (an hour or more)
    python bench/scale.py --sections scale --inproc 8,32,100,1000 --processes 8,32
    python bench/scale.py --sections daemon
    python bench/scale.py --sections ray --ray-nodes 16,64       # needs pip install -e '.[ray]'
    python bench/scale.py --sections s1 --s1-strategies local,fedfomo
    python bench/scale.py --sections overlay,discovery --merge
    python bench/scale.py --sections floor --floor-nodes 200 --baseline-python ../main-venv/bin/python

Writes bench/results/scale.json and bench/results/scale.md (run directories under
bench/results/scale/, not committed).

RSS counts every page a process maps, shared ones included (torch's libraries, and — for forked
daemons — the fork server's imported modules), so a sum of RSS over processes counts shared pages
once per process; PSS divides each shared page among the processes that map it, so a sum of PSS
is what the run really occupies. USS is what a process alone holds (freed if it exits).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overlay_cost  # noqa: E402 (bench/ beside this file)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUNS = RESULTS / "scale"
SCALE_SCENARIO = ROOT / "scenarios" / "scale_fedfomo.toml"
S1_SCENARIO = ROOT / "scenarios" / "s1_label_permuted.toml"
MB = 1024 * 1024


# ------------------------------------------------------------------------------------ memory
def smaps(pid: int) -> dict[str, int] | None:
    """RSS, PSS and USS of one process in bytes (None if it is gone)."""
    out = {"rss": 0, "pss": 0, "uss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                kb = int(rest.split()[0]) * 1024 if rest.strip() else 0
                if key == "Rss":
                    out["rss"] = kb
                elif key == "Pss":
                    out["pss"] = kb
                elif key in ("Private_Clean", "Private_Dirty"):
                    out["uss"] += kb
    except (OSError, ValueError, IndexError):
        return None
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


class Sampler(threading.Thread):
    """Samples a process tree's memory every ``interval`` s: peaks of the sums, and per process."""

    def __init__(self, root_pid: int, interval: float = 0.5, phases: dict[int, str] | None = None):
        super().__init__(daemon=True)
        self.root, self.interval = root_pid, interval
        self.phases = phases if phases is not None else {}  # pid -> what it is doing (set by the caller)
        self.peak = {"rss": 0, "pss": 0, "uss": 0, "processes": 0}
        self.per_pid: dict[int, list[tuple[str, dict[str, int]]]] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            pids = [self.root] + descendants(self.root)
            total = {"rss": 0, "pss": 0, "uss": 0}
            for p in pids:
                m = smaps(p)
                if m is None:
                    continue
                self.per_pid.setdefault(p, []).append((self.phases.get(p, ""), m))
                for k in total:
                    total[k] += m[k]
            for k in total:
                self.peak[k] = max(self.peak[k], total[k])
            self.peak["processes"] = max(self.peak["processes"], len(pids))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


# -------------------------------------------------------------------------------------- scale
def run_coterie(
    args: list[str],
    out: Path,
    sample_interval: float = 0.5,
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """``coterie run`` as a subprocess, its process tree sampled; returns figures and results."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [python or sys.executable, "-m", "coterie.cli.main", "run", *args, "--out", str(out)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    sampler = Sampler(proc.pid, sample_interval)
    sampler.start()
    rc = proc.wait()
    wall = time.monotonic() - t0
    sampler.stop()
    log.close()
    if rc != 0:
        tail = (out.parent / f"{out.name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"coterie run {' '.join(args)} failed ({rc}):\n{tail}")
    return {
        "wall_s": wall,
        "peak": sampler.peak,
        "per_pid": sampler.per_pid,
        "results": json.loads((out / "results.json").read_text()),
    }


def node_files(out: Path, strategy: str) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    rows = []
    for d in sorted((out / strategy / "nodes").iterdir()):
        try:
            info = json.loads((d / "node.json").read_text())
        except (OSError, ValueError):
            info = {}
        hist = (
            [json.loads(x) for x in (d / "history.jsonl").read_text().splitlines() if x.strip()]
            if (d / "history.jsonl").exists()
            else []
        )
        rows.append((info, hist))
    return rows


def scale_point(backend: str, nodes: int, rounds: int) -> dict[str, Any]:
    out = RUNS / f"{backend}-{nodes}"
    extra, env = [], None
    if backend == "ray":
        import tempfile

        # a local Ray instance started by the run (its processes are the run's descendants), in a
        # directory of its own rather than the machine-wide /tmp/ray
        extra, env = ["--groups", "2"], {"RAY_TMPDIR": tempfile.mkdtemp(prefix="cray")}
    try:
        r = run_coterie(
            [str(SCALE_SCENARIO), "--backend", backend, "--nodes", str(nodes), "--rounds", str(rounds), *extra],
            out,
            env=env,
        )
    finally:
        if env:
            import shutil

            shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    s = r["results"]["strategies"]["fedfomo"]
    files = node_files(out, "fedfomo")
    peers = [h[-1].get("peers_alive", 0) for _, h in files if h]
    ckpt = [(h[-1]["duration_s"]) for _, h in files if h]
    return {
        "backend": backend,
        "nodes": nodes,
        "rounds": rounds,
        "wall_s": round(r["wall_s"], 1),
        "network_wall_s": s["wall_time_s"],
        "peak_rss_mb": round(r["peak"]["rss"] / MB, 1),
        "peak_pss_mb": round(r["peak"]["pss"] / MB, 1),
        "processes": r["peak"]["processes"],
        "pss_per_node_mb": round(r["peak"]["pss"] / MB / nodes, 2),
        "mean_test_acc": s["summary"]["mean_test_acc"],
        "rounds_done": min(len(h) for _, h in files),
        "median_peers_alive": statistics.median(peers) if peers else 0,
        "median_last_round_s": round(statistics.median(ckpt), 3) if ckpt else None,
    }


# -------------------------------------------------------------------------------------- floor
def node_compute_s(reps: int = 20) -> dict[str, float]:
    """One scale-scenario node's ``train()`` and ``evaluate()`` in this process, one torch thread
    (medians of CPU seconds: on a shared machine the CPU time is the figure to trust)."""
    import tempfile

    import tomllib
    import torch

    from coterie.lab.scenario import node_config, parse_scenario
    from coterie.node.learning.torch_learner import build_learner

    torch.set_num_threads(1)
    sc = parse_scenario(tomllib.loads(SCALE_SCENARIO.read_text()))
    learner = build_learner(node_config(sc, "fedfomo", 0, Path(tempfile.mkdtemp(prefix="coterie-floor-"))).learner)
    learner.train()
    train, ev = [], []
    for _ in range(reps):
        c0 = time.process_time()
        learner.train()
        c1 = time.process_time()
        learner.evaluate("val")
        learner.evaluate("test")
        train.append(c1 - c0)
        ev.append(time.process_time() - c1)
    return {"train_s": statistics.median(train), "eval_s": statistics.median(ev)}


def floor_point(impl: str, python: str, nodes: int, rounds: int, compute: dict[str, float]) -> dict[str, Any]:
    """The scale scenario on the inproc backend with ``python``'s coterie, against its compute
    floor: every node's training (and evaluation) CPU, spread over this machine's cores."""
    out = RUNS / f"floor-{impl}-{nodes}"
    load0 = os.getloadavg()
    r = run_coterie(
        [str(SCALE_SCENARIO), "--backend", "inproc", "--nodes", str(nodes), "--rounds", str(rounds)], out, python=python
    )
    s = r["results"]["strategies"]["fedfomo"]
    cores = os.cpu_count() or 1
    floor = nodes * rounds * compute["train_s"] / cores
    floor_eval = nodes * rounds * (compute["train_s"] + compute["eval_s"]) / cores
    sent, recv = s["summary"]["bytes_sent_total"], s["summary"]["bytes_received_total"]
    return {
        "impl": impl,
        "nodes": nodes,
        "rounds": rounds,
        "wall_s": round(r["wall_s"], 1),
        "network_wall_s": s["wall_time_s"],
        "floor_train_s": round(floor, 1),
        "floor_train_eval_s": round(floor_eval, 1),
        "x_floor": round(s["wall_time_s"] / floor, 2),
        "x_floor_eval": round(s["wall_time_s"] / floor_eval, 2),
        "peak_pss_mb": round(r["peak"]["pss"] / MB, 1),
        "mean_test_acc": s["summary"]["mean_test_acc"],
        "bytes_sent_mb": round(sent / 1e6, 2),
        "bytes_received_mb": round(recv / 1e6, 2),
        "load_before": [round(x, 1) for x in load0],
        "load_after": [round(x, 1) for x in os.getloadavg()],
    }


# ------------------------------------------------------------------------------------- daemon
def first_handshake_s(how: str, tmp: Path) -> float:
    """Seconds from launching one node to its first handshake answered (``how``: "fresh" =
    ``python -m coterie.cli.main node start``; "forked" = from the warm preloaded fork server)."""
    import asyncio

    import tomli_w

    from coterie.lab.launch import processes
    from coterie.node.config import PROTOCOL_VERSION, validate_config
    from coterie.node.learning.torch_learner import build_learner
    from coterie.node.metrics import Metrics
    from coterie.node.peering.errors import PeerCallError
    from coterie.node.peering.messages import NodeInfo
    from coterie.node.peering.traffic import TrafficStats
    from coterie.node.security.pki import CA_KEY, init_ca, issue_cert, load_credentials
    from coterie.node.transport.client import PeerClient
    from coterie.node.transport.tls import TLS

    with socket.socket() as sock:  # a port free a moment ago: the probe must know it before node.json
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pki = tmp / f"{how}-pki"  # mTLS as every daemon runs it: the certificate is loaded at start
    if not (pki / "ca" / CA_KEY).exists():  # one CA for this start method's repeats
        init_ca(pki / "ca", name="bench CA")
    data = {
        "node_id": "solo",
        "state_dir": str(tmp / f"{how}-state"),
        "listen": f"127.0.0.1:{port}",
        "security": {"cert_dir": str(issue_cert(pki / "ca", "solo", pki / "solo"))},
        "admin_listen": "127.0.0.1:0",
        "strategy": "fedfomo",
        "rounds": 0,
        "log_level": "WARNING",
        "learner": {
            "dataset": "mnist1d",
            "dataset_params": {"num_samples": 100000},
            "num_nodes": 1000,
            "node_index": 3,
            "partition_params": {"num_clusters": 4, "samples_per_node": 100},
            "model": "mlp",
            "optimizer": "adam",
        },
    }
    cfg = validate_config(data)
    fingerprint = build_learner(cfg.learner).fingerprint()
    path = tmp / f"{how}.toml"
    path.write_text(tomli_w.dumps(data))
    log = tmp / f"{how}.log"
    me = NodeInfo("probe", PROTOCOL_VERSION, fingerprint, address="127.0.0.1:1")

    async def probe() -> float:
        client = PeerClient(
            "probe",
            TrafficStats(Metrics()),
            chunk_bytes=1 << 20,
            max_model_bytes=1 << 30,
            max_gossip_bytes=1 << 20,
            timeout_s=2,
            tls=TLS(load_credentials(issue_cert(pki / "ca", "probe", pki / "probe"))),
        )
        try:
            while True:
                try:
                    await client.handshake(f"127.0.0.1:{port}", me, timeout=1.0)
                    return time.monotonic()
                except PeerCallError:
                    await client.forget(f"127.0.0.1:{port}")
                    await asyncio.sleep(0.02)
        finally:
            await client.close()

    if how == "forked":
        ctx = processes.fork_context(["fedfomo"])  # the launcher starts it once per run: measured warm
        warm = ctx.Process(target=os.getpid)
        warm.start()
        warm.join()
        t0 = time.monotonic()
        p = ctx.Process(target=processes._run_forked_node, args=(["node", "start", "--config", str(path)], str(log)))
        p.start()
        try:
            t1 = asyncio.run(asyncio.wait_for(probe(), 120))
        finally:
            os.kill(p.pid, 15)
            p.join(30)
    else:
        t0 = time.monotonic()
        p = subprocess.Popen(
            [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config", str(path)],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=processes._child_env(),
        )
        try:
            t1 = asyncio.run(asyncio.wait_for(probe(), 120))
        finally:
            p.terminate()
            p.wait(30)
    return t1 - t0


def run_daemons(out: Path, nodes: int, rounds: int, fresh: bool) -> dict[str, Any]:
    """Per-daemon RSS/PSS/USS of an N-node scale network: idle (up, serving, before its first
    round: every node waits for all others first) and during rounds (maximum), medians over the
    daemons; the fork server's own USS; the network's peak PSS (this process included)."""
    from concurrent.futures import ThreadPoolExecutor

    from coterie.lab.launch import processes
    from coterie.lab.launch.common import NodeProgress
    from coterie.lab.scenario import load_scenario

    sc = load_scenario(SCALE_SCENARIO, nodes=nodes, rounds=rounds)
    sc = sc.model_copy(update={"node": {**sc.node, "min_peers": nodes - 1}})  # an idle phase: all meet first
    specs = processes.prepare(sc, "fedfomo", out)
    me = os.getpid()
    phases: dict[int, str] = {}
    sampler = Sampler(me, 0.25, phases)
    sampler.start()
    t0 = time.monotonic()
    progress = [NodeProgress() for _ in specs]
    with (
        processes.Network(specs, processes.node_command if fresh else None, 15.0) as net,
        ThreadPoolExecutor(8) as pool,
    ):
        deadline = time.monotonic() + 900
        while not all(p.done for p in progress) and time.monotonic() < deadline:
            net.poll(pool, rounds, progress)
            for proc, pr in zip(net.procs, progress, strict=True):
                phases[proc.pid] = (
                    "idle" if pr.state == "running" and pr.round == 0 else "rounds" if pr.state == "running" else ""
                )
            time.sleep(0.2)
        pids = [p.pid for p in net.procs]
    sampler.stop()
    wall = time.monotonic() - t0

    def stat(phase: str, key: str) -> float | None:
        per = [max((m[key] for ph, m in sampler.per_pid.get(p, []) if ph == phase), default=None) for p in pids]
        per = [v for v in per if v is not None]
        return round(statistics.median(per) / MB, 1) if per else None

    others = [p for p in sampler.per_pid if p not in pids and p != me]
    server = max((max(m["uss"] for _, m in sampler.per_pid[p]) for p in others), default=0)
    return {
        "nodes": nodes,
        "wall_s": round(wall, 1),
        **{f"{ph}_{k}_mb": stat(ph, k) for ph in ("idle", "rounds") for k in ("rss", "pss", "uss")},
        "fork_server_uss_mb": round(server / MB, 1),
        "peak_total_pss_mb": round(sampler.peak["pss"] / MB, 1),
    }


def import_times() -> list[tuple[str, float]]:
    """The largest cumulative imports of ``coterie node start`` (python -X importtime)."""
    code = (
        "import coterie.cli.main, coterie.node.daemon, coterie.node.learning.torch_learner, "
        "coterie.node.transport.grpc_transport, coterie.node.strategies.fedfomo"
    )
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True).stderr
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            depth = len(name) - len(name.lstrip())
            if depth <= 3:
                rows.append((name.strip(), int(parts[1]) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:12]


# ----------------------------------------------------------------------------------------- s1
def s1_point(backend: str, strategies: str, tag: str) -> dict[str, Any]:
    out = RUNS / f"s1-{tag}"
    r = run_coterie([str(S1_SCENARIO), "--backend", backend, "--strategy", strategies], out)
    res = r["results"]
    return {
        "backend": backend,
        "tag": tag,
        "wall_s": round(r["wall_s"], 1),
        "peak_pss_mb": round(r["peak"]["pss"] / MB, 1),
        "strategies": {
            s: {
                "mean_test_acc": v["summary"]["mean_test_acc"],
                "final_test_acc": {n: v["nodes"][n]["final_test_acc"] for n in res["node_ids"]},
                "wall_time_s": v["wall_time_s"],
            }
            for s, v in res["strategies"].items()
        },
    }


# ------------------------------------------------------------------------------------- report
def pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def report(data: dict[str, Any]) -> str:
    lines = [
        "# Scale: in-process nodes against daemon processes",
        "",
        f"Machine: {os.cpu_count()} cores, {round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 1e9)} GB, "
        "shared with other jobs (load varies: compare within a table). "
        f"Generated by `python bench/scale.py` on {data['when']}.",
        "",
    ]
    if data.get("scale"):
        lines += [
            "## Nodes × wall time × memory (scenarios/scale_fedfomo.toml: fedfomo, MNIST-1D MLP "
            "40-64-64-10 = 30 KB, 100 samples/node, 10 rounds)",
            "",
            "Wall: `coterie run` from start to exit (interpreter start, data check, figures included); "
            "network: first node started to last node done. Peak memory of the whole run, sampled "
            "every 0.5 s: RSS summed over its processes counts shared pages once per process; PSS is "
            "what the run occupies. Per node: peak PSS / nodes; marginal: the PSS one more node adds "
            "(slope from the previous row of the same backend).",
            "",
            "| backend | nodes | wall s | network s | peak RSS MB | peak PSS MB | PSS/node MB | marginal MB/node "
            "| processes | rounds | mean acc % | peers alive (median) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        last: dict[str, dict[str, Any]] = {}
        for p in sorted(data["scale"], key=lambda p: (p["backend"] != "inproc", p["nodes"])):
            prev = last.get(p["backend"])
            marginal = f"{(p['peak_pss_mb'] - prev['peak_pss_mb']) / (p['nodes'] - prev['nodes']):.2f}" if prev else "–"
            last[p["backend"]] = p
            lines.append(
                f"| {p['backend']} | {p['nodes']} | {p['wall_s']} | {p['network_wall_s']:.1f} | "
                f"{p['peak_rss_mb']} | {p['peak_pss_mb']} | {p['pss_per_node_mb']} | {marginal} | "
                f"{p['processes']} | {p['rounds_done']} | {pct(p['mean_test_acc'])} | {p['median_peers_alive']} |"
            )
        lines.append("")
    if data.get("floor"):
        f = data["floor"]
        lines += [
            "## In-process nodes against their compute floor (scenarios/scale_fedfomo.toml, inproc)",
            "",
            f"Compute floor: nodes × rounds × one node's `train()` CPU ({f['compute']['train_s'] * 1000:.1f} ms; "
            f"with its two evaluations {(f['compute']['train_s'] + f['compute']['eval_s']) * 1000:.1f} ms, "
            f"one torch thread, median) / {os.cpu_count()} cores. Network: first node started to last node "
            "done. Side by side in one invocation: "
            + "; ".join(f"{k} = {v}" for k, v in f["versions"].items())
            + ". Bytes: results.json's totals (sent and received must agree).",
            "",
            "| code | nodes | rounds | network s | floor s (train) | × floor | floor s (train+eval) | × floor | "
            "wall s | peak PSS MB | sent MB | received MB | mean acc % | load before |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in f["points"]:
            lines.append(
                f"| {p['impl']} | {p['nodes']} | {p['rounds']} | {p['network_wall_s']:.1f} | {p['floor_train_s']} | "
                f"{p['x_floor']} | {p['floor_train_eval_s']} | {p['x_floor_eval']} | {p['wall_s']} | "
                f"{p['peak_pss_mb']} | {p['bytes_sent_mb']} | {p['bytes_received_mb']} | "
                f"{pct(p['mean_test_acc'])} | {p['load_before']} |"
            )
        lines.append("")
    if data.get("ray"):
        lines += [
            "## The ray backend beside the others (scenarios/scale_fedfomo.toml, same nodes, seed, rounds)",
            "",
            "ray: a local Ray instance started by the run (GCS, raylet, dashboard and worker processes "
            "all in the sampled tree), `--groups 2`: two actors of in-process nodes, memory inside a "
            "group and gRPC between them. Run one after another in one invocation.",
            "",
            "| backend | nodes | wall s | peak RSS MB | peak PSS MB | PSS/node MB | processes | rounds | "
            "mean acc % | peers alive (median) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in data["ray"]:
            lines.append(
                f"| {p['backend']} | {p['nodes']} | {p['wall_s']} | {p['peak_rss_mb']} | {p['peak_pss_mb']} | "
                f"{p['pss_per_node_mb']} | {p['processes']} | {p['rounds_done']} | {pct(p['mean_test_acc'])} | "
                f"{p['median_peers_alive']} |"
            )
        lines.append("")
        for n in sorted({p["nodes"] for p in data["ray"]}):
            med = {
                b: {
                    k: statistics.median(p[k] for p in data["ray"] if p["backend"] == b and p["nodes"] == n)
                    for k in ("wall_s", "network_wall_s", "peak_pss_mb")
                }
                for b in ("processes", "inproc", "ray")
            }
            runs = sum(1 for p in data["ray"] if p["backend"] == "ray" and p["nodes"] == n)
            lines.append(
                f"Medians at {n} nodes ({runs} run(s) each, interleaved): wall s (of which the network's own) "
                + ", ".join(f"{b} {m['wall_s']:.1f} ({m['network_wall_s']:.1f})" for b, m in med.items())
                + "; peak PSS MB "
                + ", ".join(f"{b} {m['peak_pss_mb']:.0f}" for b, m in med.items())
                + f". ray / processes: wall {med['ray']['wall_s'] / med['processes']['wall_s']:.2f}x, "
                f"PSS {med['ray']['peak_pss_mb'] / med['processes']['peak_pss_mb']:.2f}x; "
                f"ray / inproc: wall {med['ray']['wall_s'] / med['inproc']['wall_s']:.2f}x, "
                f"PSS {med['ray']['peak_pss_mb'] / med['inproc']['peak_pss_mb']:.2f}x."
            )
        lines.append("")
    if data.get("daemon"):
        d = data["daemon"]
        lines += [
            "## The lean daemon (processes backend)",
            "",
            f"Budget (issue 12.3): 150 MB + 3 × model size = {150 + 3 * 30 / 1024:.1f} MB for the 30 KB MLP. "
            "Medians over the daemons of an 8-node scale network (fedfomo, 10 rounds); idle = up and "
            "serving before its first round, rounds = maximum while running rounds.",
            "",
            "| daemon started as | idle RSS | idle PSS | idle USS | rounds RSS | rounds PSS | rounds USS | "
            "first handshake s (median) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for how, label in (
            ("fresh", "`coterie node start` (fresh interpreter)"),
            ("forked", "forked from the preloaded fork server (launcher default)"),
        ):
            m, hs = d["memory"][how], d["handshake_s"][how]
            lines.append(
                f"| {label} | {m['idle_rss_mb']} | {m['idle_pss_mb']} | {m['idle_uss_mb']} | "
                f"{m['rounds_rss_mb']} | {m['rounds_pss_mb']} | {m['rounds_uss_mb']} | "
                f"{statistics.median(hs):.2f} ({', '.join(f'{x:.2f}' for x in hs)}) |"
            )
        lines += [
            "",
            f"The fork server itself (one per `coterie run`): USS {d['memory']['forked']['fork_server_uss_mb']} MB. "
            "Peak PSS of the whole 8-daemon network (bench process included): fresh "
            f"{d['memory']['fresh']['peak_total_pss_mb']} MB, forked {d['memory']['forked']['peak_total_pss_mb']} MB.",
            "",
            "Largest imports of a fresh `coterie node start` (cumulative seconds, `python -X importtime`):",
            "",
        ]
        lines += [f"- `{name}` {s:.2f} s" for name, s in d["imports"]]
        lines.append("")
    if data.get("s1"):
        runs = data["s1"]
        strategies = list(runs[0]["strategies"])
        lines += [
            "## S1 on both backends (scenarios/s1_label_permuted.toml, same partitions and seeds)",
            "",
            "Mean final test accuracy %; the second processes run measures the run-to-run noise of "
            "asynchronous rounds. Δ = mean over nodes of |inproc − processes| per node.",
            "",
            "| strategy | " + " | ".join(f"{r['tag']}" for r in runs) + " | |inproc−processes| per node | "
            "|processes−processes₂| per node |",
            "|---" * (len(runs) + 3) + "|",
        ]
        by = {r["tag"]: r for r in runs}
        for s in strategies:

            def dev(a: str, b: str, s: str = s) -> str:
                if a not in by or b not in by:
                    return "–"
                fa, fb = by[a]["strategies"][s]["final_test_acc"], by[b]["strategies"][s]["final_test_acc"]
                return f"{100 * statistics.mean(abs(fa[n] - fb[n]) for n in fa):.1f}"

            lines.append(
                f"| {s} | "
                + " | ".join(pct(r["strategies"][s]["mean_test_acc"]) for r in runs)
                + f" | {dev('inproc', 'processes')} | {dev('processes', 'processes-2')} |"
            )
        lines += ["", "Wall time s: " + ", ".join(f"{r['tag']} {r['wall_s']}" for r in runs), ""]
    lines += overlay_cost.report(data)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="scale,daemon,s1")
    ap.add_argument("--inproc", default="8,32,100,1000", help="node counts for the inproc backend")
    ap.add_argument("--processes", default="8,32", help="node counts for the processes backend")
    ap.add_argument("--ray-nodes", default="16", help="node counts of the ray section (each on all three backends)")
    ap.add_argument("--ray-repeats", type=int, default=3, help="runs of each ray-section point (medians reported)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--handshakes", type=int, default=5, help="launches per start method")
    ap.add_argument("--s1-strategies", default="local,dpsgd,fedfomo")
    ap.add_argument("--floor-nodes", default="200", help="node counts of the floor section (inproc)")
    ap.add_argument(
        "--baseline-python",
        help="floor: an interpreter whose coterie is the baseline checkout, "
        "run side by side (alternating) with this one",
    )
    ap.add_argument(
        "--overlay-nodes",
        default="100,1000,3000",
        help="overlay: node counts (full membership up to 1,000; partial views at all)",
    )
    ap.add_argument(
        "--overlay-big", default="10000", help="overlay: node counts of partial views alone, 5 periods (wall, memory)"
    )
    ap.add_argument("--discovery-nodes", default="300,1000", help="discovery: node counts")
    ap.add_argument("--discovery-rounds", type=int, default=30)
    ap.add_argument(
        "--merge",
        action="store_true",
        help="scale: keep the points already in scale.json, replacing those measured again "
        "(one more size without rerunning the rest)",
    )
    a = ap.parse_args()
    sections = a.sections.split(",")
    path = RESULTS / "scale.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["when"] = time.strftime("%Y-%m-%d %H:%M")
    RUNS.mkdir(parents=True, exist_ok=True)
    if "scale" in sections:
        points = []
        counts = [("processes", int(n)) for n in a.processes.split(",") if n] + [
            ("inproc", int(n)) for n in a.inproc.split(",") if n
        ]
        for backend, n in sorted(counts, key=lambda c: (c[1], c[0])):
            print(f"scale: {backend} {n} nodes ...", flush=True)
            points.append(scale_point(backend, n, a.rounds))
            print("  ", points[-1], flush=True)
        if a.merge:
            new = {(p["backend"], p["nodes"]) for p in points}
            points = [p for p in data.get("scale", []) if (p["backend"], p["nodes"]) not in new] + points
            points.sort(key=lambda p: (p["backend"], p["nodes"]))
        data["scale"] = points
    if "floor" in sections:
        compute = node_compute_s()
        print(
            f"floor: one node's train() {compute['train_s'] * 1000:.1f} ms CPU, evaluations "
            f"{compute['eval_s'] * 1000:.1f} ms",
            flush=True,
        )
        impls = [("this", sys.executable)] + ([("baseline", a.baseline_python)] if a.baseline_python else [])
        points = []
        for n in [int(n) for n in a.floor_nodes.split(",") if n]:
            for impl, python in impls[::-1]:
                print(f"floor: {impl} {n} nodes ...", flush=True)
                points.append(floor_point(impl, python, n, a.rounds, compute))
                print("  ", points[-1], flush=True)
        data["floor"] = {"compute": compute, "points": points, "versions": {k: v for k, v in impls}}
    if "ray" in sections:
        points = []
        for n in [int(n) for n in a.ray_nodes.split(",") if n] * a.ray_repeats:
            for backend in ("processes", "inproc", "ray"):
                print(f"ray section: {backend} {n} nodes ...", flush=True)
                points.append(scale_point(backend, n, a.rounds))
                print("  ", points[-1], flush=True)
        data["ray"] = points
    if "overlay" in sections:
        print("overlay: membership cost per node-period ...", flush=True)
        rows = overlay_cost.overlay_section(
            [int(n) for n in a.overlay_nodes.split(",") if n], [int(n) for n in a.overlay_big.split(",") if n]
        )
        data["overlay"] = overlay_cost.merged(
            data.get("overlay", []) if a.merge else [], rows, ("kind", "nodes", "periods")
        )
    if "discovery" in sections:
        print("discovery: cluster mates found ...", flush=True)
        rows = overlay_cost.discovery_section([int(n) for n in a.discovery_nodes.split(",") if n], a.discovery_rounds)
        data["discovery"] = overlay_cost.merged(data.get("discovery", []) if a.merge else [], rows, ("mode", "nodes"))
    if "daemon" in sections:
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="coterie-scale-"))
        hs: dict[str, list[float]] = {"fresh": [], "forked": []}
        for _ in range(a.handshakes):  # alternate, so both see the same machine load
            for how in ("fresh", "forked"):
                hs[how].append(round(first_handshake_s(how, tmp), 3))
                print(f"first handshake {how}: {hs[how][-1]} s", flush=True)
        mem = {}
        for how in ("fresh", "forked"):
            print(f"daemon memory {how} ...", flush=True)
            mem[how] = run_daemons(RUNS / f"daemon-{how}", 8, a.rounds, fresh=how == "fresh")
            print("  ", mem[how], flush=True)
        data["daemon"] = {"handshake_s": hs, "memory": mem, "imports": import_times()}
    if "s1" in sections:
        runs = []
        for backend, tag in (("processes", "processes"), ("inproc", "inproc"), ("processes", "processes-2")):
            print(f"s1: {tag} ...", flush=True)
            runs.append(s1_point(backend, a.s1_strategies, tag))
            print("  ", {s: v["mean_test_acc"] for s, v in runs[-1]["strategies"].items()}, flush=True)
        data["s1"] = runs
    path.write_text(json.dumps(data, indent=1))
    (RESULTS / "scale.md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
