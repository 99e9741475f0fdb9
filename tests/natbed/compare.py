"""The NAT testbed's network with and without NAT, side by side in one run (issue 31 item 5: round
time behind NAT against the flat network's, accuracy alike):

    sudo python -m tests.natbed.compare        # NATBED_PAIRS (1), NATBED_SITE_SIZE (3), NATBED_ROUNDS (6),
        NATBED_LOCAL_STEPS (20: local steps a round), NATBED_DUMP (a folder for every node's /history and /status),
        NATBED_RATE_MBIT (0: every host's link shaped by tc tbf to this rate, up and down, as bench/links.py),
        NATBED_RTT_MS (0: each node's delay_ms, bench/links.py's emulated round-trip time),
        NATBED_SAMPLES (120: training samples a node)

Each pair runs the flat network (the routers only route; every node listens on its own address)
and then the NAT'd one (run.py's: six outbound-only nodes behind MASQUERADE, relayed by p0 and
p1), the same FedFomo/MNIST-1D nodes and seeds. It prints the median round time (rounds 2..N of
every node, from /history), the final mean test accuracy of each, the time to accuracy (from all
daemons up until a node's test accuracy first reaches 95% of its final one, median over nodes: as
bench/links.py) and the ratios. A measurement, not a CI check: it asserts nothing about the ratio."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench.links import tta

from .daemons import NsNode, wait_for
from .netns import Topology
from .run import finished_rounds, start_nodes


def rate_mbit() -> float:
    return float(os.environ.get("NATBED_RATE_MBIT", "0"))


def link_config() -> dict[str, Any]:
    """Node config for shaped links (NATBED_RATE_MBIT / NATBED_RTT_MS): as bench/links.py, the
    emulated RTT as ``delay_ms`` and deadlines sized for the link, not for loopback."""
    rtt = float(os.environ.get("NATBED_RTT_MS", "0"))
    if rate_mbit() <= 0 and rtt <= 0:
        return {}
    return {"delay_ms": rtt, "request_timeout_s": 300.0, "suspect_after_s": 15.0, "dead_after_s": 120.0}


def one_run(nat: bool, root: Path, size: int, rounds: int) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """Every node's /history, and the wall time (time.time) when all daemons were up."""
    topo = Topology(prefix=os.environ.get("NATBED_PREFIX", "cnb"), site_size=size, nat=nat, rate_mbit=rate_mbit())
    nodes: dict[str, NsNode] = {}
    try:
        topo.up()
        start_nodes(topo, root, rounds, nodes, link_config())
        up_at = time.time()
        for h, node in nodes.items():
            wait_for(partial(finished_rounds, node, rounds), 240, f"{h} to finish {rounds} rounds")
        history = {h: n.get("/history") for h, n in nodes.items()}
        if dump := os.environ.get("NATBED_DUMP"):  # every node's /history and /status, to see where rounds went
            out = Path(dump) / root.name
            out.mkdir(parents=True, exist_ok=True)
            for h, n in nodes.items():
                (out / f"{h}.json").write_text(json.dumps({"history": history[h], "status": n.get("/status")}))
        return history, up_at
    finally:
        for n in nodes.values():
            n.terminate()
        for n in nodes.values():
            n.stop()
        topo.down()


def summary(history: dict[str, list[dict[str, Any]]], up_at: float) -> tuple[float, float, float]:
    """(median round time over rounds 2..N of all nodes, mean test accuracy at the last round,
    median over nodes of the seconds from ``up_at`` until a node first reached 95% of its final
    test accuracy)"""
    times = [float(e["duration_s"]) for hist in history.values() for e in hist[1:]]
    acc = statistics.mean(float(hist[-1]["eval"]["test_acc"]) for hist in history.values())
    to_95 = [
        tta(
            [(float(e["t"]) - up_at, float(e["eval"]["test_acc"])) for e in hist if "test_acc" in (e.get("eval") or {})]
        )
        for hist in history.values()
    ]
    return statistics.median(times), acc, statistics.median(t for t in to_95 if t is not None)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so one_run's finally cleans up
    pairs = int(os.environ.get("NATBED_PAIRS", "1"))
    size, rounds = int(os.environ.get("NATBED_SITE_SIZE", "3")), int(os.environ.get("NATBED_ROUNDS", "6"))
    root = Path(tempfile.mkdtemp(prefix="natbed-compare-"))
    rows: dict[str, list[tuple[float, float, float]]] = {"flat": [], "nat": []}
    print(f"links: {link_config() or 'unshaped'}, rate {rate_mbit()} Mbit/s")
    try:
        for k in range(pairs):
            for kind in ("flat", "nat"):
                rows[kind].append(summary(*one_run(kind == "nat", root / f"{kind}{k}", size, rounds)))
                t, a, tta = rows[kind][-1]
                print(
                    f"pair {k + 1} {kind:4}: median round {t:.3f} s, final mean test accuracy {a:.3f}, "
                    f"time to 95% of final {tta:.1f} s (median node)"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t_flat, t_nat = (statistics.median(r[0] for r in rows[k]) for k in ("flat", "nat"))
    a_flat, a_nat = (statistics.median(r[1] for r in rows[k]) for k in ("flat", "nat"))
    tta_flat, tta_nat = (statistics.median(r[2] for r in rows[k]) for k in ("flat", "nat"))
    print(
        f"round time NAT / flat: {t_nat / t_flat:.2f} (medians {t_nat:.3f} / {t_flat:.3f} s); "
        f"time to accuracy NAT / flat: {tta_nat / tta_flat:.2f} ({tta_nat:.1f} / {tta_flat:.1f} s); "
        f"final accuracy NAT {a_nat:.3f}, flat {a_flat:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
