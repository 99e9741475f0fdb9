"""A frozen peer (SIGSTOP: a laptop lid, a GC pause, a stopped container) must not stall its
neighbours, and must not make them bury healthy peers (issue 10.1). Six real daemons; one is
stopped for 20 s and resumed. The strict figure (round rate within 10%) is measured by
``bench/frozen_peer.py``; here the tolerance is wide enough for a loaded 2-core CI machine, while
a stall of the old kind (every round waiting out the 10 s request timeout) still fails it."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.nodeproc import NodeProc, tiny_learner, wait_for

pytestmark = pytest.mark.slow

N = 6
PAUSE_S = 20.0
BEFORE_S = 10.0


def _rate(history, t0, t1):
    return sum(1 for h in history if t0 < h["t"] <= t1) / (t1 - t0)


def _deaths(node: NodeProc) -> list[str]:
    text = (node.dir / "node.log").read_text(errors="replace")
    return re.findall(r"peer (\S+): \w+ -> dead", text)


def test_a_frozen_peer_costs_its_neighbours_little_and_rejoins(tmp_path):
    nodes: list[NodeProc] = []
    try:
        for i in range(N):
            cfg = {
                "strategy": "dpsgd",
                "round_interval_s": 0.5,
                "learner": tiny_learner(N, i),
                "peers": [nodes[0].address] if nodes else [],
            }
            nodes.append(NodeProc(tmp_path, f"n{i}", cfg).start())
        for n in nodes:
            wait_for(
                lambda n=n: n.status()["peers_alive"] == N - 1 and n.status()["round"] >= 3,
                90,
                f"{n.node_id} to know everyone and run rounds",
            )
        time.sleep(BEFORE_S)  # the "before" window
        victim = nodes[3]
        others = [n for n in nodes if n is not victim]
        t_stop = time.time()
        victim.proc.send_signal(signal.SIGSTOP)
        noticed: set[str] = set()
        try:
            # while it is stopped, nobody healthy is ever shown dead; the victim is noticed
            while time.time() < t_stop + PAUSE_S:
                for n in others:
                    rows = n.get("/peers")
                    bad = [p["node_id"] for p in rows if p["state"] == "dead" and p["node_id"] != victim.node_id]
                    assert not bad, f"{n.node_id} shows healthy peers dead: {bad}"
                    if any(p["node_id"] == victim.node_id and p["state"] != "alive" for p in rows):
                        noticed.add(n.node_id)
                time.sleep(1.0)
        finally:
            t_cont = time.time()
            victim.proc.send_signal(signal.SIGCONT)

        for n in others:
            h = n.get("/history")
            before, during = _rate(h, t_stop - BEFORE_S, t_stop), _rate(h, t_stop, t_cont)
            assert before > 0, f"{n.node_id} ran no rounds before the pause"
            # the old behaviour: 10 s per round while the victim is sampled, i.e. ~0.1 rounds/s
            assert during >= 0.5 * before, f"{n.node_id}: {before:.2f} rounds/s before, {during:.2f} during"
        assert noticed == {n.node_id for n in others}  # every node stopped sampling it

        # the victim rejoins: alive everywhere, and sampled again (dpsgd pulls every alive peer)
        for n in others:
            wait_for(
                lambda n=n: any(p["node_id"] == victim.node_id and p["state"] == "alive" for p in n.get("/peers")),
                30,
                f"{n.node_id} to see the victim alive",
            )
            wait_for(
                lambda n=n: any(victim.node_id in r["contacted"] for r in n.get("/history") if r["t"] > t_cont),
                30,
                f"{n.node_id} to pull from the victim again",
            )
        wait_for(lambda: victim.status()["peers_alive"] == N - 1, 30, "the victim to see everyone alive")
        r = victim.status()["round"]
        wait_for(lambda: victim.status()["round"] > r, 30, "the victim to run rounds again")
        # nobody — the victim included, whose own probes failed while it was stopped — buried a
        # healthy peer
        for n in nodes:
            wrong = [p for p in _deaths(n) if p != victim.node_id]
            assert not wrong, f"{n.node_id} marked healthy peers dead: {wrong}\n{n.log_tail()}"
    finally:
        for n in nodes:
            if n.proc and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)
            n.stop()
