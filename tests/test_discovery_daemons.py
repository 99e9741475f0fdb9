"""Discovery on real daemons (gRPC, mTLS, processes): past the threshold a strategy's candidates
come from discovery, and "whom do you weight?" is asked and answered over its own peer RPC
(``Recommend``)."""

from __future__ import annotations

import pytest

from tests.nodeproc import NodeProc, tiny_learner, wait_for

pytestmark = pytest.mark.slow


def test_candidates_come_from_discovery_and_peers_answer_whom_they_weight(tmp_path):
    nodes: list[NodeProc] = []
    try:
        for i in range(4):
            cfg = {
                "strategy": "fedfomo",
                "round_interval_s": 0.3,
                "learner": tiny_learner(4, i),
                "strategy_params": {"num_models": 2},
                "discovery": {"above": 0, "candidates": 2, "explore": 1},  # always on, 2 of 3 peers a round
                "peers": [nodes[0].address] if nodes else [],
            }
            nodes.append(NodeProc(tmp_path, f"n{i}", cfg).start())
        for n in nodes:
            wait_for(lambda n=n: n.status()["round"] >= 5, 90, f"{n.node_id} to run 5 rounds")
        views = [n.status()["discovery"] for n in nodes]
        for n, v in zip(nodes, views, strict=True):
            assert v["active"] and v["above"] == 0
            assert len(v["candidates"]) <= 2 and n.node_id not in v["candidates"]
            assert v["rounds"] >= 3 and v["scored"] >= 2  # (not before it had a peer) it evaluated peers itself
            # no refused asks (a call abandoned because the peer turned suspect on a loaded box is no refusal)
            load = ("call abandoned", "timed out", "deadline")
            asks = [p["message"] for p in n.status()["problems"] if "recommend" in p["message"]]
            assert not [m for m in asks if not any(w in m for w in load)], asks
        assert sum(v["asks"] for v in views) > 0  # collaborators were asked ...
        assert sum(v["hints_received"] for v in views) > 0  # ... and answered over the wire
        metrics = nodes[0].get_text("/metrics")
        assert 'coterie_discovery{what="candidates"}' in metrics
        # the views and the candidates a node explores, for its owner: /peers, `coterie peers`, metrics
        assert 'coterie_view_size{view="active"}' in metrics and "coterie_overlay_events" in metrics
        for n in nodes:  # (views shuffle and rounds pass between two reads: compared with both sides)
            before = n.status()["discovery"]
            rows = n.get("/peers")
            after = n.status()["discovery"]
            active = {r["node_id"] for r in rows if r.get("view") == "active"}
            assert active and active <= set(before["views"]["active"]) | set(after["views"]["active"])
            marked = {r["node_id"] for r in rows if r.get("candidate")}
            assert marked <= set(before["candidates"]) | set(after["candidates"])
        from rich.console import Console

        from coterie.cli.render import peers_table

        console = Console(record=True, width=200)
        console.print(peers_table(nodes[0].get("/peers")))
        text = console.export_text()
        assert "view" in text and "discovery" in text and "partial views:" in text
        # the question took its own RPC (traffic and latency under its own kind), not strategy gossip
        assert any('kind="recommend"' in n.get_text("/metrics") for n in nodes), "no Recommend call measured"
    finally:
        for n in nodes:
            n.stop()
