"""Every strategy over the real peer plane: node daemons in one event loop talking gRPC over
loopback sockets (cheaper than processes; the process path is covered by the integration tests).
Two label-permuted clusters; the in-cluster share of each node's weight must end above chance."""
from __future__ import annotations

import asyncio
import time

import pytest

from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.strategies.registry import available

N, CLUSTERS, ROUNDS = 4, 2, 6
CHANCE = (N // CLUSTERS - 1) / (N - 1)  # in-cluster share of uniform weights: 1/3

# a few rounds of tiny models: make each strategy decide early (pruning, sampling) where the
# paper defaults assume hundreds of rounds
FAST = {"fedfomo": {}, "federico": {}, "cobo": {}, "l2c": {}, "meta-l2c": {},
        "scool-sbm": {}, "scool-attention": {}, "dpsgd": {}, "oracle": {}, "local": {}}


def _config(tmp, i, strategy, peers):
    return validate_config({
        "node_id": f"n{i}", "state_dir": str(tmp / f"n{i}"), "strategy": strategy,
        "strategy_params": FAST.get(strategy, {}), "rounds": ROUNDS, "peers": peers,
        "heartbeat_interval_s": 0.2, "min_peers": N - 1, "start_timeout_s": 20, "seed": 1,
        "learner": {"dataset": "mnist1d", "partition": "label_permutation", "num_nodes": N, "node_index": i,
                    "dataset_params": {"num_samples": 4000}, "model": "mlp", "optimizer": "adam",
                    "lr": 0.003, "local_steps": 20,
                    "partition_params": {"num_clusters": CLUSTERS, "samples_per_node": 300}}})


async def _network(tmp, strategy):
    nodes: list[Node] = []
    try:
        for i in range(N):
            node = Node(_config(tmp, i, strategy, [nodes[0].address] if nodes else []))
            await node.start()
            nodes.append(node)
        deadline = time.monotonic() + 240
        while not all(n.done for n in nodes):
            assert time.monotonic() < deadline, f"{strategy}: rounds {[n.round for n in nodes]}"
            assert all(n.healthy() for n in nodes), f"{strategy}: a round loop died"
            await asyncio.sleep(0.1)
        return [(n.node_id, n.network.true_cluster(n.node_id), n.strategy.weights(), n.history) for n in nodes]
    finally:
        for n in nodes:
            await n.stop()


def in_cluster_mass(results) -> list[float]:
    cluster = {nid: c for nid, c, _, _ in results}
    out = []
    for nid, c, w, _ in results:
        peers = {p: v for p, v in w.items() if p != nid}
        total = sum(peers.values())
        out.append(sum(v for p, v in peers.items() if cluster[p] == c) / total if total > 0 else float("nan"))
    return out


PERSONALISED = [s for s in available() if s not in ("local", "dpsgd", "oracle")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", PERSONALISED + ["oracle"])
def test_strategy_finds_its_cluster_over_grpc(tmp_path, strategy):
    results = asyncio.run(_network(tmp_path, strategy))
    for nid, _, w, hist in results:
        assert len(hist) == ROUNDS and abs(sum(w.values()) - 1) < 1e-4, (nid, w)
        assert any(hist[-1]["bytes_sent"].values()), f"{nid} sent nothing"
    mass = in_cluster_mass(results)
    mean = sum(mass) / len(mass)
    assert mean > CHANCE + 0.25, f"{strategy}: in-cluster mass {mass} (chance {CHANCE:.2f})"


@pytest.mark.slow
def test_dpsgd_uses_every_peer_and_local_none(tmp_path):
    results = asyncio.run(_network(tmp_path / "d", "dpsgd"))
    for nid, _, w, _ in results:
        assert len(w) == N and all(abs(v - 1 / N) < 1e-9 for v in w.values())
    results = asyncio.run(_network(tmp_path / "l", "local"))
    for nid, _, w, hist in results:
        assert w == {nid: 1.0}
        assert not hist[-1]["bytes_sent"].get("snapshot")
