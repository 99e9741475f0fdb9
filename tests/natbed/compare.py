"""The NAT testbed's network with and without NAT, side by side in one run (issue 31 item 5: round
time behind NAT against the flat network's, accuracy alike):

    sudo python -m tests.natbed.compare        # NATBED_PAIRS (1), NATBED_SITE_SIZE (3), NATBED_ROUNDS (6),
        NATBED_LOCAL_STEPS (20: local steps a round), NATBED_DUMP (a folder for every node's /history and /status)

Each pair runs the flat network (the routers only route; every node listens on its own address)
and then the NAT'd one (run.py's: six outbound-only nodes behind MASQUERADE, relayed by p0 and
p1), the same FedFomo/MNIST-1D nodes and seeds. It prints the median round time (rounds 2..N of
every node, from /history) and the final mean test accuracy of each, and their ratio. A
measurement, not a CI check: it asserts nothing about the ratio."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from .daemons import NsNode, wait_for
from .netns import Topology
from .run import finished_rounds, start_nodes


def one_run(nat: bool, root: Path, size: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    topo = Topology(prefix=os.environ.get("NATBED_PREFIX", "cnb"), site_size=size, nat=nat)
    nodes: dict[str, NsNode] = {}
    try:
        topo.up()
        start_nodes(topo, root, rounds, nodes)
        for h, node in nodes.items():
            wait_for(partial(finished_rounds, node, rounds), 240, f"{h} to finish {rounds} rounds")
        history = {h: n.get("/history") for h, n in nodes.items()}
        if dump := os.environ.get("NATBED_DUMP"):  # every node's /history and /status, to see where rounds went
            out = Path(dump) / root.name
            out.mkdir(parents=True, exist_ok=True)
            for h, n in nodes.items():
                (out / f"{h}.json").write_text(json.dumps({"history": history[h], "status": n.get("/status")}))
        return history
    finally:
        for n in nodes.values():
            n.terminate()
        for n in nodes.values():
            n.stop()
        topo.down()


def summary(history: dict[str, list[dict[str, Any]]]) -> tuple[float, float]:
    """(median round time over rounds 2..N of all nodes, mean test accuracy at the last round)"""
    times = [float(e["duration_s"]) for hist in history.values() for e in hist[1:]]
    acc = statistics.mean(float(hist[-1]["eval"]["test_acc"]) for hist in history.values())
    return statistics.median(times), acc


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so one_run's finally cleans up
    pairs = int(os.environ.get("NATBED_PAIRS", "1"))
    size, rounds = int(os.environ.get("NATBED_SITE_SIZE", "3")), int(os.environ.get("NATBED_ROUNDS", "6"))
    root = Path(tempfile.mkdtemp(prefix="natbed-compare-"))
    rows: dict[str, list[tuple[float, float]]] = {"flat": [], "nat": []}
    try:
        for k in range(pairs):
            for kind in ("flat", "nat"):
                rows[kind].append(summary(one_run(kind == "nat", root / f"{kind}{k}", size, rounds)))
                t, a = rows[kind][-1]
                print(f"pair {k + 1} {kind:4}: median round {t:.3f} s, final mean test accuracy {a:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t_flat, t_nat = (statistics.median(t for t, _ in rows[k]) for k in ("flat", "nat"))
    a_flat, a_nat = (statistics.median(a for _, a in rows[k]) for k in ("flat", "nat"))
    print(
        f"round time NAT / flat: {t_nat / t_flat:.2f} (medians {t_nat:.3f} / {t_flat:.3f} s); "
        f"final accuracy NAT {a_nat:.3f}, flat {a_flat:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
