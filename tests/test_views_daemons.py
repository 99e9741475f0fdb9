"""Partial views on real daemons (gRPC, mTLS, processes): past the discovery threshold each node
runs a HyParView overlay over the ``Shuffle`` and ``Link`` RPCs, with an active view of 4 of its 11
peers, and membership on it (probes to active neighbours, no push-pull, the table pruned to the
views: ``view_scope.py``); every node is in it, the active views form one component, and discovery's candidates,
drawn from the views and from recommendations, let FedFomo weight its cluster mates."""

from __future__ import annotations

import signal

import pytest

from coterie.node.peering.partial_view import view_components
from tests.nodeproc import NodeProc, tiny_learner, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # 12 daemons: ~3.5 min alone on this box

N, CLUSTERS = 12, 3  # label-permutation clusters: contiguous blocks of 4 nodes
CHANCE = (N // CLUSTERS - 1) / (N - 1)  # a uniform pick is a cluster mate 3 times in 11


def test_daemons_past_the_threshold_run_connected_partial_views_and_find_cluster_mates(tmp_path):
    nodes: list[NodeProc] = []
    try:
        for i in range(N):
            cfg = {
                "strategy": "fedfomo",
                "round_interval_s": 0.5,
                "learner": tiny_learner(N, i, clusters=CLUSTERS),
                "strategy_params": {"num_models": 3},
                # past 4 alive peers: views of 4 active (+ passive), 3 candidates a round
                "discovery": {"above": 4, "candidates": 3, "explore": 2},
                "peers": [nodes[0].address] if nodes else [],
                "round_stall_s": 60,  # a stuck round logs its stacks well before the wait below gives up
            }
            node = NodeProc(tmp_path, f"n{i:02d}", cfg)
            nodes.append(node.start() if i == 0 else node.launch())
        # launched together, then waited on: started one by one, the 12th loaded torch behind 11
        # training daemons and missed a 60 s start on CI
        for n in nodes[1:]:
            n.wait_ready(240)
        cluster = {n.node_id: i // (N // CLUSTERS) for i, n in enumerate(nodes)}
        for n in nodes:
            try:
                wait_for(lambda n=n: n.status()["round"] >= 15, 400, f"{n.node_id} to run 15 rounds")
            except AssertionError:
                st = n.status()
                where = f"round {st['round']}, now {st['in_round']}, failures {st['failures']}"
                raise AssertionError(f"{n.node_id} stuck at {where}:\n{_stacks(n)}") from None
        views = {n.node_id: n.status()["discovery"] for n in nodes}
        active = {p: v["views"]["active"] for p, v in views.items()}
        for p, v in views.items():
            assert v["active"], p  # past the threshold: discovery (and the overlay) run
            assert v["membership"] == "views", p  # ... and membership runs on the views
            assert 1 <= len(active[p]) <= 4 and p not in active[p], (p, active[p])
        assert len(view_components(active)) == 1, active
        assert sum(v["views"]["shuffles_received"] for v in views.values()) > N  # shuffles went over the RPC
        # FedFomo, seeing 3 candidates a round, weights its cluster mates well above chance
        mates = [
            sum(cluster[q] == cluster[p] for q in v["collaborators"]) / len(v["collaborators"])
            for p, v in views.items()
            if v["collaborators"]
        ]
        # (measured under load: 8 of 12 had collaborators after 15 rounds, every one a cluster mate)
        assert len(mates) >= N // 2, views
        share = sum(mates) / len(mates)
        print(f"\nin-cluster share of collaborators {share:.2f} (chance {CHANCE:.2f}); active views {active}")
        assert share > CHANCE + 0.25, (share, mates)
        for n in nodes:  # no refused overlay or discovery call
            assert not [p for p in n.status()["problems"] if "link" in str(p) or "shuffle" in str(p)], n.node_id
    finally:
        for n in nodes:
            n.stop()


def _stacks(node: NodeProc) -> str:
    """A stuck node's thread and asyncio task stacks (SIGUSR1, SIGUSR2: node/service.py) and its
    log's tail (with round_stall_s, the node has logged them itself by then: node/stall_watch.py).
    CI once saw one of the 12 stop at round 9 for 7 minutes without a word."""
    node.proc.send_signal(signal.SIGUSR1)
    node.proc.send_signal(signal.SIGUSR2)
    try:
        wait_for(lambda: "on SIGUSR2" in node.log_tail(2000), 30, "the stack dumps")
    except AssertionError:
        pass  # the log as it is
    return node.log_tail(600)
