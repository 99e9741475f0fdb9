"""What a D-PSGD exchange holds and where its heavy work runs (issue 24.4): each pulled model is
added into the live model (the running sum) and released at once (the node keeps no copy of its neighbours'
models between rounds), a large model is pulled at most ``big_pulls`` at a time, and the
model-sized work — validating a received model, adding it, averaging, checking the model a
round publishes — runs in worker threads,
not on the event loop that carries heartbeats and peer requests."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest

from coterie.node import publishing
from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.learning.guard import RoundGuard
from coterie.node.learning.torch_learner import TorchLearner
from coterie.node.peering import network as network_mod
from coterie.node.strategies import baselines
from coterie.node.transport.inproc import InProcNetwork
from tests.nodeproc import tiny_learner

pytestmark = pytest.mark.slow
N = 4


def _config(tmp, i, peers):
    learner = {**tiny_learner(N, i), "model_params": {"hidden": [600, 600]}, "local_steps": 2}  # 1.6 MB: "big"
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": "dpsgd",
            "peers": peers,
            "heartbeat_interval_s": 0.2,
            "request_timeout_s": 20,
            "rounds": 2,
            "min_peers": N - 1,
            "strategy_params": {"sync_wait_s": 5.0},
            "learner": learner,
        }
    )


async def start_chain(tmp, hub, nodes: list, configure=lambda c: c, first_made=lambda node: None) -> None:
    """N nodes, each given the first's address, made and started one by one into ``nodes`` (the
    caller's list: its ``finally`` stops those that started); ``configure`` adjusts each config,
    ``first_made`` instruments the first node before it starts (it waits for N - 1 peers anyway)."""
    for i in range(N):
        c = configure(_config(tmp, i, [nodes[0].address] if nodes else []))
        nodes.append(Node(c, transport=hub.transport_for(c), admin=False))
        if i == 0:
            first_made(nodes[0])
        await nodes[-1].start()


async def _wait(cond, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_pulled_models_are_released_bounded_and_handled_off_the_loop(tmp_path, monkeypatch):
    pulled: list[weakref.ref] = []
    in_flight, most = [0], [0]
    threads: dict[str, set[str]] = {"validate": set(), "add": set()}
    publishes: list[str] = []  # the thread of every finiteness check before a publish

    real_validate, real_add = network_mod.snapshot_groups, TorchLearner.add_to_params

    def validate(*a, **kw):
        threads["validate"].add(threading.current_thread().name)
        return real_validate(*a, **kw)

    def add(*a, **kw):
        threads["add"].add(threading.current_thread().name)
        return real_add(*a, **kw)

    real_publishable = RoundGuard.publishable

    def publishable(self, groups):
        publishes.append(threading.current_thread().name)
        return real_publishable(self, groups)

    real_finite = publishing.all_finite

    def finite(tensors):  # a round's trained model, checked as D-PSGD publishes it mid-round (publish_now)
        publishes.append(threading.current_thread().name)
        return real_finite(tensors)

    monkeypatch.setattr(RoundGuard, "publishable", publishable)
    monkeypatch.setattr(publishing, "all_finite", finite)
    monkeypatch.setattr(network_mod, "snapshot_groups", validate)
    monkeypatch.setattr(TorchLearner, "add_to_params", add)

    async def go():
        hub = InProcNetwork(share_snapshots=False)  # every pull gets its own copy, as over gRPC
        nodes = []
        try:
            await start_chain(tmp_path, hub, nodes, first_made=lambda node: watch_pulls(node.network))
            await _wait(lambda: all(n.done and n.saved["round"] == 2 for n in nodes), "the rounds never finished")
            me = nodes[0]
            # the model it shares is held once: the strategy keeps the published snapshot's views
            shared, served = me.strategy.shared_params(), me.board.current.groups["params"]
            assert all(shared[k].data_ptr() == served[k].data_ptr() for k in served)
            return list(me.cache._by_peer), me.history[-1]["contacted"], threading.main_thread().name
        finally:
            for n in nodes:
                await n.stop()

    def watch_pulls(net):
        real_pull = net.pull

        async def pull(peer, **kw):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                snap = await real_pull(peer, **kw)
            finally:
                in_flight[0] -= 1
            if snap is not None:
                pulled.extend(weakref.ref(t) for t in snap.params.values())
            return snap

        net.pull = pull  # the strategy's view of the network is this object

    held, contacted, loop_thread = asyncio.run(go())
    assert len(contacted) == N - 1 and pulled  # it did average with every neighbour
    assert held == []  # nothing kept for the next round
    gc.collect()
    alive = [r for r in pulled if r() is not None]
    assert not alive, f"{len(alive)} of {len(pulled)} pulled tensors are still referenced after their round"
    assert most[0] <= baselines.DPSGD.defaults["big_pulls"] < N - 1, most[0]
    assert threads["validate"] and loop_thread not in threads["validate"]
    assert threads["add"] and loop_thread not in threads["add"]
    # each node publishes once on the loop as it starts, then every round's model from a thread
    assert publishes.count(loop_thread) == N and len(publishes) - N >= 2 * N, publishes
