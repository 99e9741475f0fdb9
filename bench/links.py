"""Time-to-accuracy on constrained links (issue 24.3): real node daemons, each in its own Linux
network namespace, every node's link shaped with ``tc tbf`` (e.g. 10 Mbit/s up and down).

Topology (``ShapedNet``): one namespace per node (``PREFIX-nI``), each joined by a veth pair to a
bridge that lives in a namespace of its own (``PREFIX-hub``) — not in the root namespace, whose
firewall (docker's FORWARD policy DROP, with bridge netfilter on) would drop bridged traffic and
must not be touched. Each node's link carries a ``tbf`` qdisc on both ends: on the node's side
(its upload) and on the hub's side (its download). The root namespace, where this script polls the
nodes' admin APIs, reaches the bridge through one more veth, unshaped. Every name starts with
``PREFIX`` (``ctlk``): ``--cleanup`` (and every exit) removes exactly those, nothing else.

Latency: this kernel has no ``netem``, so the round-trip time is the node's own ``delay_ms``:
the transport sleeps that long once per outgoing call (handshake, heartbeat, snapshot pull,
compute request; deploy/README.md measured ``delay_ms = 200`` as ≈ 210 ms heartbeat RTT), so
``delay_ms`` = the emulated RTT. It is per call, not per packet: TCP's window growth under a
long RTT (bandwidth-delay product) is not modelled; the rate is, in the kernel, per packet.

Per configuration (link × model × strategy × codecs): N daemons (``coterie node start``, fresh
interpreters under ``ip netns exec``, mTLS from a throwaway CA — netlab.Lab), free-running for a
bounded number of rounds and a wall-clock cap. From each node's round history: the time from
"all daemons up" until its test accuracy first reaches 95% of its final one (median over nodes),
bytes sent/received per node-round, rounds completed, wall time.

    sudo nice -n 10 python bench/links.py                      # the default grid, today's fp32
    python bench/links.py --codecs fp32 --codecs q8,fp32+delta  # snapshot codecs side by side
    python bench/links.py --cleanup                            # remove leftover namespaces/links
Results: bench/results/links.json (full config, seeds, per-node series) and links.md."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import Lab, load, mnist1d_mlp  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PREFIX = "ctlk"  # every namespace and link this bench makes starts with it
# the small model is the demo's (mnist1d MLP 40-64-64-10, ~30 KB); the big one round_overhead's 21 MB
MODELS = {"small": {"hidden": [64, 64], "steps": 40}, "20mb": {"hidden": [2280, 2280], "steps": 10}}
LINKS = {"10mbit-40ms": {"rate_mbit": 10, "rtt_ms": 40}, "100mbit-10ms": {"rate_mbit": 100, "rtt_ms": 10}}


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def code_version() -> str:
    """Which checkout's node code the daemons run (this interpreter's ``coterie``), and its commit."""
    import coterie.node

    where = Path(coterie.node.__file__).resolve().parent.parent
    commit = run("git", "-C", str(where), "rev-parse", "--short", "HEAD", check=False).stdout.strip()
    return f"{where}" + (f" @ {commit}" if commit else "")


def shaping_problem() -> str | None:
    """Why this machine cannot build shaped namespaces, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"no `{tool}` command (iproute2)"
    return None


class ShapedNet:
    """``n`` namespaces on one bridge, each node's link limited to ``rate_mbit`` both ways (see the
    module docstring). ``subnet``: the first three octets of the /24 the nodes live in (root side
    .1, node i at .10+i). A context manager that always tears down what it made."""

    def __init__(self, n: int, rate_mbit: float, *, prefix: str = PREFIX, subnet: str = "10.231.0"):
        if not re.fullmatch(r"[a-z]{2,8}", prefix):
            raise ValueError(f"prefix {prefix!r}: 2-8 lowercase letters (interface names are at most 15 characters)")
        self.n, self.rate_mbit, self.prefix, self.subnet = n, rate_mbit, prefix, subnet
        self.hub = f"{prefix}-hub"
        self.bridge = f"{prefix}br"
        self.root_link = f"{prefix}r"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def wrap(self, i: int) -> list[str]:
        """The command prefix that runs a program inside node ``i``'s namespace (in place: same pid)."""
        return ["ip", "netns", "exec", self.ns(i)]

    def _tbf(self, ns: str, dev: str) -> None:
        # burst: at least one timer tick's worth at this rate (HZ ≥ 100), and ≥ 4 KB
        burst = max(4096, int(self.rate_mbit * 1e6 / 8 / 100))
        run(
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{self.rate_mbit}mbit",
            "burst",
            str(burst),
            "latency",
            "400ms",
        )

    def up(self) -> ShapedNet:
        cleanup(self.prefix)  # leftovers of a killed run
        run("ip", "netns", "add", self.hub)
        run("ip", "-n", self.hub, "link", "set", "lo", "up")
        run("ip", "-n", self.hub, "link", "add", self.bridge, "type", "bridge")
        run("ip", "-n", self.hub, "link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, node_end, hub_end = self.ns(i), f"{self.prefix}{i}n", f"{self.prefix}{i}h"
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "link", "add", node_end, "type", "veth", "peer", "name", hub_end)
            run("ip", "link", "set", node_end, "netns", ns)
            run("ip", "link", "set", hub_end, "netns", self.hub)
            run("ip", "-n", self.hub, "link", "set", hub_end, "master", self.bridge, "up")
            run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", node_end)
            run("ip", "-n", ns, "link", "set", node_end, "up")
            self._tbf(ns, node_end)  # the node's upload
            self._tbf(self.hub, hub_end)  # its download
        # the root namespace's way in (admin API polling): unshaped
        run("ip", "link", "add", self.root_link, "type", "veth", "peer", "name", f"{self.root_link}h")
        run("ip", "link", "set", f"{self.root_link}h", "netns", self.hub)
        run("ip", "-n", self.hub, "link", "set", f"{self.root_link}h", "master", self.bridge, "up")
        run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.root_link)
        run("ip", "link", "set", self.root_link, "up")
        return self

    def kernel_bytes(self, i: int) -> dict[str, int]:
        """Bytes the kernel's shapers passed for node ``i`` so far (TLS, gRPC framing, heartbeats and
        admin polling included): ``up`` its upload, ``down`` its download."""

        def sent(ns: str, dev: str) -> int:
            m = re.search(r"Sent (\d+) bytes", run("tc", "-s", "-n", ns, "qdisc", "show", "dev", dev).stdout)
            return int(m.group(1)) if m else 0

        return {"up": sent(self.ns(i), f"{self.prefix}{i}n"), "down": sent(self.hub, f"{self.prefix}{i}h")}

    def down(self) -> list[str]:
        return cleanup(self.prefix)

    def __enter__(self) -> ShapedNet:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.down()


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove this bench's namespaces (their veths and qdiscs go with them) and its root-side link:
    only names ``PREFIX-hub``, ``PREFIX-nI`` and ``PREFIXr``, so nothing else is ever touched."""
    removed = []
    names = run("ip", "netns", "list", check=False).stdout.split("\n")
    for name in (line.split()[0] for line in names if line.strip()):
        if name == f"{prefix}-hub" or re.fullmatch(rf"{re.escape(prefix)}-n\d+", name):
            run("ip", "netns", "del", name, check=False)
            removed.append(f"netns {name}")
    if run("ip", "link", "show", f"{prefix}r", check=False).returncode == 0:
        run("ip", "link", "del", f"{prefix}r", check=False)
        removed.append(f"link {prefix}r")
    return removed


# ------------------------------------------------------------------------------------ one run
def parse_codecs(spec: str) -> dict[str, Any]:
    """``q8,fp32`` -> snapshots.codecs = [q8, fp32]; a ``+delta`` suffix also sets snapshots.delta."""
    delta = spec.endswith("+delta")
    codecs = [c.strip() for c in spec.removesuffix("+delta").split(",") if c.strip()]
    if not codecs:
        raise SystemExit(f"--codecs {spec!r}: name at least one codec, e.g. fp32 or q8,fp32+delta")
    return {"codecs": codecs, **({"delta": True} if delta else {})}


def check_snapshots_config(snapshots: dict[str, Any]) -> None:
    """Refuse ``--codecs`` up front when this checkout's node config has no such keys (its models
    forbid unknown keys: every daemon would exit with a config error)."""
    from coterie.node.config import NodeConfig

    if "snapshots" not in NodeConfig.model_fields:
        raise SystemExit(
            "--codecs: this checkout's node config has no `snapshots` section (snapshot codecs "
            "not merged here): run without --codecs (fp32, today's wire format)"
        )
    try:
        NodeConfig.model_validate({"snapshots": snapshots})
    except ValueError as e:
        raise SystemExit(f"--codecs: the node config refuses snapshots = {snapshots}: {e}") from None


def node_configs(
    args, model: str, strategy: str, link: dict[str, Any], net: ShapedNet, snapshots: dict[str, Any] | None, rounds: int
) -> list[dict[str, Any]]:
    spec = MODELS[model]
    out = []
    for i in range(args.nodes):
        c: dict[str, Any] = {
            "strategy": strategy,
            "round_interval_s": 0.0,
            "rounds": rounds,
            "seed": args.seed,
            "min_peers": args.nodes - 1,
            "start_timeout_s": 300,
            "listen": f"{net.ip(i)}:7000",
            "admin_listen": f"{net.ip(i)}:0",
            "delay_ms": float(link["rtt_ms"]),  # once per call = the emulated RTT (module docstring)
            # a 20 MB pull at 10 Mbit/s shared by several peers takes minutes, and heartbeats queue
            # behind it in tbf: deadlines and suspicion sized for the link, not for loopback
            "request_timeout_s": 900.0,
            "heartbeat_interval_s": 1.0,
            "suspect_after_s": 15.0,
            "dead_after_s": 120.0,
            "log_level": "WARNING",
            "learner": {
                **mnist1d_mlp(
                    args.nodes,
                    i,
                    hidden=spec["hidden"],
                    steps=spec["steps"],
                    samples=args.samples,
                    clusters=args.clusters,
                )
            },
        }
        if strategy == "fedfomo":
            c["strategy_params"] = {"num_models": 3}  # the demo's
        if snapshots is not None:
            c["snapshots"] = snapshots
        out.append(c)
    return out


def tta(series: list[tuple[float, float]], frac: float = 0.95) -> float | None:
    """Seconds until the accuracy first reaches ``frac`` of the final (last round's) accuracy."""
    if not series:
        return None
    final = series[-1][1]
    return next(t for t, a in series if a >= frac * final)


def round_split(h: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median seconds per round in peer calls (the link's share) and in the rest of the strategy's
    work (training, CPU-bound: on a shared machine, contention)."""
    tm = [r["timing"] for r in h if r.get("timing")]
    return {
        "exchange_s": med(t.get("exchange_s", 0.0) for t in tm),
        "train_s": med(t["strategy_s"] - t.get("exchange_s", 0.0) for t in tm),
    }


def med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_config(args, link_name: str, model: str, strategy: str, codecs: str | None) -> dict[str, Any]:
    link = LINKS[link_name]
    rounds = args.rounds if model == "small" else args.rounds_big
    cap = args.timeout if model == "small" else args.timeout_big
    snapshots = parse_codecs(codecs) if codecs else None
    root = Path(tempfile.mkdtemp(prefix=f"coterie-links-{link_name}-{model}-{strategy}-"))
    row: dict[str, Any] = {
        "link": link_name,
        **link,
        "model": model,
        "strategy": strategy,
        "codecs": codecs or "fp32 (default)",
        "snapshots": snapshots,
        "nodes": args.nodes,
        "rounds_asked": rounds,
        "cap_s": cap,
        "seed": args.seed,
        "dir": str(root),
        "code": code_version(),
        "load_before": load(),
        "args": {k: v for k, v in vars(args).items() if k not in ("cleanup", "report")},
    }
    with ShapedNet(args.nodes, link["rate_mbit"], prefix=args.prefix, subnet=args.subnet) as net:
        configs = node_configs(args, model, strategy, link, net, snapshots, rounds)
        row["config"] = configs[0]
        with Lab(root, configs, wraps=[net.wrap(i) for i in range(args.nodes)]) as lab:
            lab.start(timeout=300)
            k0 = [net.kernel_bytes(i) for i in range(args.nodes)]
            t0 = time.time()
            timed_out = False
            while True:
                sts = lab.statuses(timeout=10)
                if all(s and s.get("done") for s in sts):
                    break
                for n in lab.nodes:
                    if n.proc.poll() is not None:
                        raise RuntimeError(f"{n.node_id} died: {n.log_tail()}")
                if time.time() - t0 > cap:
                    timed_out = True
                    break
                time.sleep(1.0)
            wall = time.time() - t0
            histories = {n.node_id: n.history() for n in lab.nodes}
            k1 = [net.kernel_bytes(i) for i in range(args.nodes)]
    per_node = {}
    for nid, h in histories.items():
        series = [(r["t"] - t0, r["eval"]["test_acc"]) for r in h if "test_acc" in (r.get("eval") or {})]
        recv = [sum((r.get("bytes_received") or {}).values()) for r in h]
        sent = [sum((r.get("bytes_sent") or {}).values()) for r in h]
        per_node[nid] = {
            "rounds": len(h),
            "final_acc": series[-1][1] if series else None,
            "tta_s": tta(series),
            "recv_per_round": statistics.mean(recv) if recv else None,
            "sent_per_round": statistics.mean(sent) if sent else None,
            "first_round_s": h[0]["t"] - t0 if h else None,
            "cycle_s": med([b["t"] - a["t"] for a, b in itertools.pairwise(h)]),
            **round_split(h),
            "series": [(round(t, 2), a) for t, a in series],
        }
    vals = list(per_node.values())
    row.update(
        {
            "timed_out": timed_out,
            "wall_s": wall,
            "load_after": load(),
            "rounds_min": min(v["rounds"] for v in vals),
            "rounds_median": med(v["rounds"] for v in vals),
            "tta_median_s": med(v["tta_s"] for v in vals),
            "final_acc_median": med(v["final_acc"] for v in vals),
            "recv_mb_per_node_round": (med(v["recv_per_round"] for v in vals) or 0) / 1e6,
            "sent_mb_per_node_round": (med(v["sent_per_round"] for v in vals) or 0) / 1e6,
            "cycle_median_s": med(v["cycle_s"] for v in vals),
            "per_node": per_node,
            "exchange_median_s": med(v["exchange_s"] for v in vals),
            "train_median_s": med(v["train_s"] for v in vals),
            # what crossed the shaped links from "all up" to the end, per node and round (kernel's count)
            "kernel_down_mb_per_node_round": med(
                (b["down"] - a["down"]) / max(1, v["rounds"]) for a, b, v in zip(k0, k1, vals, strict=True)
            )
            / 1e6,
            "kernel_up_mb_per_node_round": med(
                (b["up"] - a["up"]) / max(1, v["rounds"]) for a, b, v in zip(k0, k1, vals, strict=True)
            )
            / 1e6,
        }
    )
    return row


# ------------------------------------------------------------------------------------ report
def _f(x, fmt: str = ".1f") -> str:
    return "–" if x is None else format(x, fmt)


NOTES = "<!-- findings: written by hand, kept when the table above is regenerated -->"


def write_md(results: dict[str, Any], path: Path) -> None:
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES) :] if NOTES in old else NOTES + "\n"
    a = results["args"]
    lines = [
        f"# Time-to-accuracy on constrained links ({results['when']}, {results['machine']})",
        "",
        f"Real daemons (`coterie node start`, mTLS), {a['nodes']} nodes, each in its own network namespace "
        "behind a veth pair to a bridge; every node's link shaped by `tc tbf` in both directions (upload on "
        "its side, download on the bridge's side). mnist1d, label-permutation clusters "
        f"({a['clusters']}), {a['samples']} samples per node, seed {a['seed']}.",
        "",
        "**Latency is app-level, not per packet.** This kernel has no `netem`; the RTT is the node's own "
        "`delay_ms`, which the transport sleeps once per outgoing call (handshake, heartbeat, snapshot "
        "pull, cross-loss request), so `delay_ms` = the RTT. TCP's window growth under a real RTT "
        "(bandwidth-delay product) is not modelled; the rate is enforced per packet by the kernel.",
        "",
        "**Time to 95%**: from the moment all daemons are up (they then find each other and start round 1) "
        "until a node's test accuracy first reaches 95% of its final (last round's) accuracy; median over "
        "nodes. **Bytes** per node-round: the node's own per-round counters (round history "
        "`bytes_received` / `bytes_sent`, summed over peers), mean over its rounds, median over nodes; the "
        "link columns are what the kernel's shapers passed (TLS, gRPC framing, heartbeats and admin polling "
        "included) from all-up to the end, per round completed. "
        f"**Rounds**: small model {a['rounds']} asked, 20 MB model {a['rounds_big']} asked (reduced to keep "
        f"each run under {a['timeout_big']:.0f} s at 10 Mbit/s); a run that hits its cap "
        "reports what it completed (final = the last completed round).",
        "",
        "**Wall times are under contention**: 2 CPU cores shared with other work (load average in the "
        "table); compare rows side by side, not the absolute numbers.",
        "",
        "| link | model | strategy | codecs | rounds done (min/median) | wall s | time to 95% s (median) | "
        "final acc (median) | MB recv / node-round | MB sent / node-round | link MB down / up per node-round "
        "(kernel) | round cycle s | exchange / train s per round | capped | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    codes = sorted({r.get("code", "?") for r in results["runs"] if "error" not in r})
    for r in results["runs"]:
        if "error" in r:
            lines.append(
                f"| {r['link']} | {r['model']} | {r['strategy']} | {r['codecs']} | failed: {r['error'][:200]} |||||||||"
            )
            continue
        lines.append(
            f"| {r['link']} | {r['model']} | {r['strategy']} | {r['codecs']} | {r['rounds_min']}/"
            f"{_f(r['rounds_median'], '.0f')} of {r['rounds_asked']} | {r['wall_s']:.0f} | "
            f"{_f(r['tta_median_s'])} | {_f(r['final_acc_median'], '.3f')} | "
            f"{r['recv_mb_per_node_round']:.2f} | {r['sent_mb_per_node_round']:.2f} | "
            f"{r.get('kernel_down_mb_per_node_round', 0):.2f} / {r.get('kernel_up_mb_per_node_round', 0):.2f} | "
            f"{_f(r['cycle_median_s'])} | {_f(r.get('exchange_median_s'), '.2f')} / "
            f"{_f(r.get('train_median_s'), '.2f')} | {'yes' if r['timed_out'] else 'no'} | {r['load_before']} |"
        )
    lines += [
        "",
        "Node code: " + "; ".join(f"`{c}`" for c in codes) + " (per row in `links.json`).",
        "Per-node series (time s, test accuracy) and every node's config: `links.json`.",
        "",
        notes,
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # leave through the cleanups
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default=",".join(LINKS), help=f"of {list(LINKS)}")
    ap.add_argument("--models", default="small,20mb", help=f"of {list(MODELS)}")
    ap.add_argument("--strategies", default="dpsgd,fedfomo")
    ap.add_argument(
        "--codecs",
        action="append",
        metavar="LIST[+delta]",
        help="snapshots.codecs for every node, e.g. fp32 or q8,fp32+delta ('+delta': snapshots.delta "
        "= true); repeat to compare; left out: no snapshots key at all (today's fp32)",
    )
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20, help="rounds for the small model")
    ap.add_argument("--rounds-big", type=int, default=4, help="rounds for the 20 MB model")
    ap.add_argument("--timeout", type=float, default=240, help="wall cap per small-model run, s")
    ap.add_argument("--timeout-big", type=float, default=360, help="wall cap per 20 MB run, s")
    ap.add_argument("--samples", type=int, default=400, help="samples per node")
    ap.add_argument("--clusters", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prefix",
        default=PREFIX,
        help="names of the namespaces and links (another one lets two "
        "runs share the machine; --cleanup removes only this prefix's)",
    )
    ap.add_argument("--subnet", default="10.231.0", help="first three octets of the nodes' /24")
    ap.add_argument("--out", default=str(RESULTS / "links.json"))
    ap.add_argument("--cleanup", action="store_true", help="only remove leftover namespaces and links, then exit")
    ap.add_argument("--report", action="store_true", help="only rewrite the .md from the .json")
    args = ap.parse_args()
    out_path = Path(args.out)
    if args.cleanup:
        print("\n".join(cleanup(args.prefix)) or "nothing to clean up")
        return 0
    results: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {"runs": []}
    if args.report:
        write_md(results, out_path.with_suffix(".md"))
        return 0
    problem = shaping_problem()
    if problem:
        raise SystemExit(f"links.py: {problem}")
    for spec in args.codecs or []:
        check_snapshots_config(parse_codecs(spec))
    results.update(
        {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "args": vars(args),
            "bench_commit": run(
                "git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD", check=False
            ).stdout.strip(),
        }
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        for link in args.links.split(","):
            for model in args.models.split(","):
                for strategy in args.strategies.split(","):
                    for codecs in args.codecs or [None]:
                        key = (link, model, strategy, codecs or "fp32 (default)")
                        try:
                            row = run_config(args, link, model, strategy, codecs)
                        except (RuntimeError, TimeoutError, OSError) as e:
                            row = {
                                "link": link,
                                "model": model,
                                "strategy": strategy,
                                "codecs": codecs or "fp32 (default)",
                                "error": str(e),
                            }
                        # a rerun replaces its own row, keeps the others
                        results["runs"] = [
                            r for r in results["runs"] if (r["link"], r["model"], r["strategy"], r["codecs"]) != key
                        ] + [row]
                        print(json.dumps({k: v for k, v in row.items() if k not in ("per_node", "config")}), flush=True)
                        out_path.write_text(json.dumps(results, indent=2))
                        write_md(results, out_path.with_suffix(".md"))
    finally:
        cleanup(args.prefix)
    print(f"wrote {out_path} and {out_path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
