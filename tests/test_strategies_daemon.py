"""Every strategy over the real peer plane: node daemons in one event loop, run against both
transports — gRPC over loopback sockets and the in-process switchboard (cheaper than processes;
the process path is covered by the integration tests). Two label-permuted clusters; the
in-cluster share of each node's weight must end above chance."""

from __future__ import annotations

import asyncio
import time

import pytest

from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.strategies.registry import available
from tests.nodeproc import node_certs
from tests.transports import TRANSPORTS, NodeMaker

N, CLUSTERS = 4, 2
CHANCE = (N // CLUSTERS - 1) / (N - 1)  # in-cluster share of uniform weights: 1/3

# A handful of rounds of a tiny model: make each strategy decide early where the paper defaults
# assume hundreds of rounds (the benchmark runs the defaults).
FAST = {
    "federico": {"local_steps": 20, "temperature": 0.3},  # Alg. 1's single M-step learns too slowly for 6 rounds
    "l2c": {"prune_round": 4},  # T0 = 10 in the paper
    "meta-l2c": {"alpha_steps": 5, "prune_round": 5},
    # told: its block-count estimate (the default) cannot see blocks of 2 nodes (docs/strategies.md);
    # the estimate is tested on synthetic matrices and in-process in test_strategies_scool.py
    "scool-sbm": {"num_blocks": CLUSTERS},
}
# round-aligned strategies aggregate from round 2 on; FedeRiCo weights a peer only once it has
# measured its loss (untried = "skip"), so its rows settle a few rounds later
ROUNDS = {
    "cobo": 8,
    "meta-l2c": 10,
    "scool-sbm": 7,
    "federico": 10,
}  # round-aligned strategies aggregate from round 2 on


def _config(tmp, i, strategy, peers, partition="label_permutation", rounds=None, samples=300, clusters=CLUSTERS):
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": strategy,
            "strategy_params": FAST.get(strategy, {}),
            "rounds": rounds or ROUNDS.get(strategy, 6),
            "peers": peers,
            "heartbeat_interval_s": 0.2,
            "min_peers": N - 1,
            "start_timeout_s": 20,
            "seed": 1,
            "security": {"cert_dir": str(node_certs(tmp, f"n{i}"))},
            "round_interval_s": 0.0,
            "learner": {
                "dataset": "mnist1d",
                "partition": partition,
                "num_nodes": N,
                "node_index": i,
                "dataset_params": {"num_samples": 4000},
                "model": "mlp",
                "optimizer": "adam",
                "lr": 0.003,
                "local_steps": 20,
                "partition_params": {
                    "samples_per_node": samples,
                    **({"num_clusters": clusters} if partition == "label_permutation" else {}),
                },
            },
        }
    )


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


async def _network(
    tmp, strategy, partition="label_permutation", rounds=None, samples=300, clusters=CLUSTERS, transport="grpc"
):
    nodes: list[Node] = []
    make = NodeMaker(transport)
    try:
        for i in range(N):
            node = make(
                _config(tmp, i, strategy, [nodes[0].address] if nodes else [], partition, rounds, samples, clusters)
            )
            await node.start()
            nodes.append(node)
        deadline = time.monotonic() + 240
        while not all(n.done for n in nodes):
            assert time.monotonic() < deadline, f"{strategy}: rounds {[n.round for n in nodes]}"
            assert all(n.healthy() for n in nodes), f"{strategy}: a round loop died"
            await asyncio.sleep(0.1)
        return [
            (n.node_id, n.network.true_cluster(n.node_id), n.strategy.weights(), n.history, n.strategy.public_state())
            for n in nodes
        ]
    finally:
        for n in nodes:
            await n.stop()


def collaborating_row(nid: str, w: dict[str, float], hist: list[dict]) -> dict[str, float]:
    """The node's final row, or, when its last round used no peer (FedFomo logs the weights its
    update used: {self: 1} in a round that kept its base model), the mean of the rows of the
    rounds that did use one."""
    if any(v > 0 for p, v in w.items() if p != nid):
        return w
    rows = [
        h["weights"]
        for h in hist
        if isinstance(h.get("weights"), dict) and any(v > 0 for p, v in h["weights"].items() if p != nid)
    ]
    keys = {k for r in rows for k in r}
    return {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys} if rows else w


def in_cluster_mass(results) -> list[float]:
    cluster = {nid: c for nid, c, *_ in results}
    out = []
    for nid, c, w, hist, _ in results:
        w = collaborating_row(nid, w, hist)
        peers = {p: v for p, v in w.items() if p != nid}
        total = sum(peers.values())
        out.append(sum(v for p, v in peers.items() if cluster[p] == c) / total if total > 0 else float("nan"))
    return out


# COBO's weights separate only once the models have moved apart (the paper's "point A": early
# gradients agree across clusters); its cluster finding is measured by the benchmark, and its
# wire mechanics below.
# meta-L2C and SCool-attention learn a shared encoder by gossip; over a handful of asynchronous
# rounds their rows depend on message timing (cluster finding is tested in-process, where it is
# deterministic, and measured by the benchmark). Over gRPC they are checked for the encoder gossip.
ENCODER = ["meta-l2c", "scool-attention"]
PERSONALISED = [s for s in available() if s not in ("local", "dpsgd", "oracle", "cobo", *ENCODER)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", PERSONALISED + ["oracle"])
def test_strategy_finds_its_cluster(tmp_path, strategy, transport):
    results = asyncio.run(_network(tmp_path, strategy, transport=transport))
    for nid, _, w, hist, _ in results:
        assert len(hist) == ROUNDS.get(strategy, 6) and abs(sum(w.values()) - 1) < 1e-4, (nid, w)
        assert sum(sum(h["bytes_received"].values()) for h in hist) > 0, f"{nid} received nothing"
    mass = in_cluster_mass(results)
    defined = [m for m in mass if m == m]  # a node that weights no peer at all has no share (nan)
    assert len(defined) >= N // 2, f"{strategy}: too few nodes weight any peer: {mass}"
    mean = sum(defined) / len(defined)
    assert mean > CHANCE + 0.25, f"{strategy}: in-cluster mass {mass} (chance {CHANCE:.2f})"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ENCODER)
def test_encoder_strategies_gossip_their_encoder(tmp_path, strategy, transport):
    results = asyncio.run(_network(tmp_path, strategy, transport=transport))
    for nid, _, w, hist, _ in results:
        assert len(hist) == ROUNDS.get(strategy, 6) and abs(sum(w.values()) - 1) < 1e-4, (nid, w)
        gossip = sum(h["bytes_sent"].get("gossip", 0) + h["bytes_received"].get("gossip", 0) for h in hist)
        assert gossip > 0, f"{nid}: no encoder gossip crossed the wire"
        assert sum(h["bytes_received"].get("snapshot", 0) for h in hist) > 0, f"{nid} pulled nothing"


@pytest.mark.slow
def test_cobo_pair_updates_cross_the_wire_and_stay_symmetric(tmp_path, transport):
    results = asyncio.run(_network(tmp_path, "cobo", transport=transport))
    W = {nid: st["W"] for nid, _, _, _, st in results}
    ips = {nid: st["last_inner_product"] for nid, _, _, _, st in results}
    assert sum(len(v) for v in ips.values()) > 0, "no alignment call happened"
    # the initiator (the pair's smaller id) sets w_ij from the reply, the peer sets w_ji in
    # on_alignment: both ends apply the same updates in the same order. (When both ends started
    # updates, crossing requests were applied in opposite orders, and the clip to [0,1] made the
    # ends differ by γ|⟨·,·⟩|.) Every round awaits its replies, so all updates are in by now.
    for i, row in W.items():
        for j, w in row.items():
            if j in W and i in W[j]:
                assert abs(w - W[j][i]) < 1e-9, (i, j, w, W[j][i])
    assert any(w != 1.0 for row in W.values() for w in row.values()), "no weight ever moved"
    for nid, _, _, hist, _ in results:
        assert hist[-1]["bytes_sent"].get("cross_gradient", 0) > 0 or ips[nid], nid


@pytest.mark.slow
def test_dpsgd_uses_every_peer_and_local_none(tmp_path, transport):
    results = asyncio.run(_network(tmp_path / "d", "dpsgd", transport=transport))
    for _, _, w, _, _ in results:
        assert len(w) == N and all(abs(v - 1 / N) < 1e-9 for v in w.values())
    results = asyncio.run(_network(tmp_path / "l", "local", transport=transport))
    for nid, _, w, hist, _ in results:
        assert w == {nid: 1.0}
        assert not hist[-1]["bytes_sent"].get("snapshot")


@pytest.mark.slow
def test_dpsgd_on_iid_data_learns_faster_than_alone(tmp_path, transport):
    """Averaging must carry each round's training: on one distribution the network beats a node alone."""

    def mean_acc(results):
        return sum(h[-1]["eval"]["test_acc"] for *_, h, _ in results) / len(results)

    local = mean_acc(asyncio.run(_network(tmp_path / "l", "local", "iid", rounds=15, samples=800, transport=transport)))
    dpsgd = mean_acc(asyncio.run(_network(tmp_path / "d", "dpsgd", "iid", rounds=15, samples=800, transport=transport)))
    # Publishing the average instead of the trained model gave 0.356 vs local 0.361. Working
    # (gRPC, 6 runs each of 78ad308 and of this code): local 0.361, D-PSGD 0.400-0.422, so the old
    # bar of local + 0.04 failed 1 run in 6 (and once in CI) on the correct code.
    assert dpsgd > local + 0.02, (local, dpsgd)


@pytest.mark.slow
def test_dpsgd_consensus_fails_on_permuted_labels(tmp_path, transport):
    """The reason personalisation exists: one consensus model cannot serve four label
    permutations, so D-PSGD, evaluated on the model it keeps, ends below learning alone (a node
    backed off to its local-only reference reports the kept model as ``collab_test_acc``)."""

    def mean_acc(results):
        return sum(h[-1]["eval"].get("collab_test_acc", h[-1]["eval"]["test_acc"]) for *_, h, _ in results) / len(
            results
        )

    local = mean_acc(asyncio.run(_network(tmp_path / "l", "local", rounds=10, clusters=N, transport=transport)))
    dpsgd = mean_acc(asyncio.run(_network(tmp_path / "d", "dpsgd", rounds=10, clusters=N, transport=transport)))
    assert dpsgd < local - 0.05, (local, dpsgd)
