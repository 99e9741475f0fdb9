"""Byte counts add up: every byte a node received was sent by some node, so a run's totals of
sent and received agree. A node keeps serving after its last round (peers that started later
still pull its model); those bytes are in no round record and reach the run's totals through the
node's final status (``traffic_since_last_round``). Without them, a 1,000-node in-process run,
whose nodes start over minutes, reported 1,443 MB received against 663 MB sent."""

from __future__ import annotations

import asyncio
import time

import pytest

from coterie.lab.results import node_results
from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.metrics import Metrics
from coterie.node.peering.traffic import TrafficStats
from coterie.node.transport.inproc import InProcNetwork
from tests.nodeproc import tiny_learner

pytestmark = pytest.mark.slow
EARLY, LATE = 3, 2  # nodes that finish first; nodes that start after them and pull their models


def _config(tmp, i, peers, min_peers):
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": "dpsgd",
            "peers": peers,
            "heartbeat_interval_s": 0.2,
            "request_timeout_s": 10,
            "rounds": 2,
            "min_peers": min_peers,
            "strategy_params": {"sync_wait_s": 2.0},
            "learner": tiny_learner(EARLY + LATE, i),
        }
    )


async def _wait(cond, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_pending_tallies_are_the_bytes_no_round_took():
    t = TrafficStats(Metrics())
    t.record("snapshot", sent=100, received=7)
    assert t.take_round() == ({"snapshot": 100}, {"snapshot": 7})
    t.record("snapshot", sent=40)
    t.record("gossip", received=3)
    assert t.pending() == {"sent": {"snapshot": 40}, "received": {"gossip": 3}}


def test_run_totals_add_up_when_nodes_pull_from_finished_ones(tmp_path):
    """Three nodes run their rounds and finish; two more start only then and pull the finished
    nodes' models in their rounds. Totals as results.json computes them must agree exactly (in
    memory both sides of a call are counted at the same moment)."""

    async def go():
        hub = InProcNetwork()
        nodes = []
        try:
            for i in range(EARLY):
                c = _config(tmp_path, i, [nodes[0].address] if nodes else [], EARLY - 1)
                nodes.append(Node(c, transport=hub.transport_for(c), admin=False))
                await nodes[-1].start()
            await _wait(lambda: all(n.done and n.saved["round"] == 2 for n in nodes), "the early nodes never finished")
            for i in range(EARLY, EARLY + LATE):
                c = _config(tmp_path, i, [nodes[0].address], EARLY + LATE - 1)
                nodes.append(Node(c, transport=hub.transport_for(c), admin=False))
                await nodes[-1].start()
            await _wait(lambda: all(n.done and n.saved["round"] == 2 for n in nodes), "the late nodes never finished")
            statuses = [n.status() for n in nodes]  # what the launcher keeps: no await in between
            histories = [list(n.history) for n in nodes]
        finally:
            for n in nodes:
                await n.stop()
        return statuses, histories

    statuses, histories = asyncio.run(go())
    results = [node_results(h, s) for h, s in zip(histories, statuses, strict=True)]
    assert all(len(h) == 2 for h in histories)
    # the scenario happened: the late nodes pulled models the early ones served after their last round
    late_pulled = sum(r["bytes_received"].get("snapshot", 0) for r in results[EARLY:])
    assert late_pulled > 0
    assert all(r["bytes_sent_after_rounds"].get("snapshot", 0) > 0 for r in results[:EARLY])
    sent = sum(sum(r["bytes_sent"].values()) for r in results)
    received = sum(sum(r["bytes_received"].values()) for r in results)
    assert sent == received, f"sent {sent} B, received {received} B"
    # the round records alone miss the early nodes' serving after their rounds
    rounds_only = [node_results(h) for h in histories]
    assert sum(sum(r["bytes_sent"].values()) for r in rounds_only) < received


def test_a_nodes_final_membership_counters_and_discovery_view_reach_results_json():
    """bench/daemons_discovery.py counts false deaths from results.json, after the daemons are gone."""
    status = {
        "membership": {"suspected": 3, "declared_dead": 2, "deaths_recent": ["n4", "n7"], "channels": 9},
        "discovery": {"active": True, "candidates": ["n1"], "views": {"active": ["n2"], "passive": 5}},
    }
    r = node_results([], status)
    assert r["membership"] == {"suspected": 3, "declared_dead": 2, "deaths_recent": ["n4", "n7"]}
    assert r["discovery"]["views"] == {"active": ["n2"], "passive": 5}
    assert "membership" not in node_results([]) and "discovery" not in node_results([])
