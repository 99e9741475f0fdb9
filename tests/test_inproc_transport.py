"""The in-process transport keeps the gRPC transport's contract: the handler's checks run,
refusals and failures arrive as PeerCallError of the same kinds, deadlines and stopped peers are
honoured, size limits apply; shared snapshots cannot be corrupted by a receiver. (Mixed mode,
memory inside a process and gRPC between: test_routing_transport.py. The strategy and peering
suites run against both transports: test_strategies_daemon.py, test_peering.py.)"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.metrics import Metrics
from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.messages import CROSS_LOSS, Beat, ComputeRequest, IndirectProbe, NodeInfo
from coterie.node.peering.traffic import TrafficStats
from coterie.node.transport.inproc import InProcNetwork
from coterie.node.wire.codec import WireError
from tests.nodeproc import tiny_learner

pytestmark = pytest.mark.slow


def _config(tmp, i, peers, **extra):
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": "local",
            "peers": peers,
            "heartbeat_interval_s": 0.2,
            "request_timeout_s": 10,
            "rounds": 0,
            "learner": tiny_learner(2, i % 2),
            # "local" serves no compute on its data; these tests need one purpose open (exact answers)
            "privacy": {"serve_purposes": ["scool-evidence"], "enabled": False},
            **extra,
        }
    )


async def _wait(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _pair(tmp, hub, extra_a=None, extra_b=None):
    ca = _config(tmp, 0, [], **(extra_a or {}))
    a = Node(ca, transport=hub.transport_for(ca), admin=False)
    await a.start()
    cb = _config(tmp, 1, [a.address], **(extra_b or {}))
    b = Node(cb, transport=hub.transport_for(cb), admin=False)
    await b.start()
    await _wait(lambda: a.peers.alive() == ["n1"] and b.peers.alive() == ["n0"], "the two nodes never met")
    return a, b


def _stranger(hub):
    return hub.transport(timeout_s=5).connect("stranger", TrafficStats(Metrics()))


def test_refusals_and_failures_arrive_as_on_grpc(tmp_path):
    async def go():
        hub = InProcNetwork()
        a, b = await _pair(tmp_path, hub)
        try:
            assert a.address.startswith("inproc:") and b.address != a.address
            out = _stranger(hub)
            req = ComputeRequest(
                CROSS_LOSS, "stranger", groups={"params": b.learner.get_params()}, purpose="scool-evidence"
            )
            with pytest.raises(PeerCallError) as e:
                await out.compute(a.address, req)
            assert e.value.kind == "unknown_peer" and "stranger" in e.value.message
            with pytest.raises(PeerCallError) as e:  # another architecture: refused by the handler
                await out.handshake(a.address, NodeInfo("stranger", 1, "f" * 64, address="inproc:99"), 5)
            assert e.value.kind == "refused" and "architecture" in e.value.message
            with pytest.raises(PeerCallError) as e:
                await out.heartbeat("inproc:4242", Beat("stranger", 0, 0), 5)
            assert e.value.kind == "unavailable" and "inproc:4242" in e.value.message
            # a known peer sending NaN weights: the served side's validation refuses it
            bad = {k: torch.full_like(v, float("nan")) for k, v in b.learner.get_params().items()}
            with pytest.raises(PeerCallError) as e:
                await b.client.compute(
                    a.address, ComputeRequest(CROSS_LOSS, "n1", groups={"params": bad}, purpose="scool-evidence")
                )
            assert e.value.kind == "invalid" and "n1" in e.value.message
            assert any("n1" in p["peer"] and p["rejected"] for p in a.problems.recent())
            # a gossip key the strategy does not understand
            with pytest.raises(PeerCallError) as e:
                await b.client.gossip(a.address, "n1", "nonsense", {"x": 1})
            assert e.value.kind == "invalid"
            assert await b.network.cross_loss("n0", purpose="scool-evidence") is not None  # a sound one works
            assert a.admission.budget("n1").compute_s > 0  # billed to n1, run on a's served-compute threads
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())


def test_a_node_speaks_only_for_itself(tmp_path):
    """No TLS in one process, but the same rule mTLS enforces on gRPC: a node's client may claim
    only its own node id, in every kind of request (else ``forbidden``, before the handler sees
    it); and a call that expects a node at an address reaches only that node."""

    async def go():
        hub = InProcNetwork()
        a, b = await _pair(tmp_path, hub)
        try:
            params = b.learner.get_params()
            spoofs = [  # b pretending to be a (the one peer a surely knows)
                b.client.heartbeat(a.address, Beat("n0", 0, 0), 5),
                b.client.handshake(a.address, replace(b.info(), node_id="n0"), 5),
                b.client.exchange_peers(a.address, "n0", [], 5),
                b.client.indirect_probe(a.address, IndirectProbe("n0", "n1", 1.0), 5),
                b.client.get_snapshot(a.address, "n0"),
                b.client.compute(
                    a.address, ComputeRequest(CROSS_LOSS, "n0", groups={"params": params}, purpose="scool-evidence")
                ),
                b.client.gossip(a.address, "n0", "x", {}),
            ]
            for call in spoofs:
                with pytest.raises(PeerCallError) as e:
                    await call
                assert e.value.kind == "forbidden" and "'n0'" in e.value.message and "'n1'" in e.value.message
            with pytest.raises(PeerCallError) as e:  # b expected someone else at a's address
                await b.client.heartbeat(a.address, Beat("n1", 0, 0), 5, peer="n7")
            assert e.value.kind == "unavailable" and "n7" in e.value.message
            reply, _ = await b.client.heartbeat(a.address, Beat("n1", 0, 0), 5, peer="n0")
            assert reply.node_id == "n0"
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())


def test_admission_and_privacy_budgets_hold_in_memory(tmp_path):
    """The per-peer budgets apply to in-process callers as to gRPC ones: a peer over its
    concurrency limit is refused (``exhausted``) and gets its slots back when its calls end
    (deadline: the peer side is cancelled); a spent privacy budget is ``privacy_budget``."""

    async def go():
        hub = InProcNetwork()
        a, b = await _pair(
            tmp_path,
            hub,
            extra_a={
                "limits": {"max_concurrent": 2},
                "privacy": {"serve_purposes": ["scool-evidence"], "budget_epsilon": 1e-3},
            },
        )
        try:
            # two round-aligned pulls waiting for a round a never reaches hold both of n1's slots
            held = [
                asyncio.ensure_future(b.client.get_snapshot(a.address, "n1", min_round=10**6, wait_s=30, timeout=2))
                for _ in range(2)
            ]
            await _wait(lambda: a.admission.budget("n1").in_flight == 2, "two slots taken")
            with pytest.raises(PeerCallError) as e:
                await b.client.gossip(a.address, "n1", "x", {})
            assert e.value.kind == "exhausted" and "in flight" in e.value.message
            for call in held:
                with pytest.raises(PeerCallError) as e:
                    await call
                assert e.value.kind == "unavailable" and "deadline" in e.value.message
            await _wait(lambda: a.admission.budget("n1").in_flight == 0, "slots released")
            header, _ = await b.client.get_snapshot(a.address, "n1")
            assert header.node_id == "n0"
            # any DP release passes an ε budget of 0.001. The deadline is not under test: the refusal
            # waits for a's background privacy warm-up (importing opacus), which took over the
            # default 10 s on a loaded 2-core box
            with pytest.raises(PeerCallError) as e:
                await b.client.compute(
                    a.address,
                    ComputeRequest(
                        CROSS_LOSS, "n1", purpose="scool-evidence", groups={"params": b.learner.get_params()}
                    ),
                    timeout=120,
                )
            assert e.value.kind == "privacy_budget" and "budget" in e.value.message, (e.value.kind, e.value.message)
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())


def test_deadlines_and_stopped_peers(tmp_path):
    async def go():
        hub = InProcNetwork()
        a, b = await _pair(tmp_path, hub)
        stopped = False
        try:
            # a round b never reaches, a generous wait, a short deadline: the deadline wins
            t0 = time.monotonic()
            with pytest.raises(PeerCallError) as e:
                await a.client.get_snapshot(b.address, "n0", min_round=10**6, wait_s=30, timeout=0.5)
            assert e.value.kind == "unavailable" and "deadline" in e.value.message
            assert time.monotonic() - t0 < 5
            # the same call with a long deadline fails as soon as b stops, not after the wait
            call = asyncio.ensure_future(a.client.get_snapshot(b.address, "n0", min_round=10**6, wait_s=30, timeout=40))

            # waiting at b for the round: it holds one of n0's admission slots there
            async def waiting_at_b():
                while b.admission.view().get("n0", {}).get("in_flight") != 1:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(waiting_at_b(), 10)
            assert not call.done()
            t0 = time.monotonic()
            await b.stop()
            stopped = True
            with pytest.raises(PeerCallError) as e:
                await call
            assert e.value.kind == "unavailable" and "stopped" in e.value.message
            assert time.monotonic() - t0 < 5
            with pytest.raises(PeerCallError) as e:  # and every later call
                await a.client.get_snapshot(b.address, "n0")
            assert e.value.kind == "unavailable"
            assert hub.lookup(b.address) is None and await a.network.pull("n1") is None
        finally:
            await a.stop()
            if not stopped:
                await b.stop()

    asyncio.run(go())


def test_a_receiver_cannot_corrupt_a_shared_snapshot(tmp_path):
    """Pullers share the publisher's tensors. One that modifies them in place (an attack, or a
    strategy bug) must not reach the others: the next hand-out is refused, naming the snapshot."""

    async def go():
        hub = InProcNetwork()
        a, b = await _pair(tmp_path, hub)
        try:
            snap = await a.network.pull("n1")
            truth = {k: v.clone() for k, v in b.learner.get_params().items()}
            assert snap is not None and all(torch.equal(snap.params[k], truth[k]) for k in truth)
            next(iter(snap.params.values())).mul_(25.0)  # the attack: in place, on the shared tensor
            with pytest.raises(WireError, match="v1 of n1 was modified in place"):
                await a.client.get_snapshot(b.address, "n0")
        finally:
            await a.stop()
            await b.stop()

        hub = InProcNetwork(share_snapshots=False)  # every puller gets its own copy instead
        a, b = await _pair(tmp_path / "copies", hub)
        try:
            snap = await a.network.pull("n1")
            next(iter(snap.params.values())).mul_(25.0)
            _, again = await a.client.get_snapshot(b.address, "n0")
            for k, v in b.board.current.params.items():
                assert torch.equal(again["params"][k], v) and torch.equal(v, b.learner.get_params()[k])
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())


def test_size_limits_apply_in_memory(tmp_path):
    async def go():
        hub = InProcNetwork()
        small = {"max_model_bytes": 4096, "max_gossip_bytes": 64}  # the MLP is ~30 KB
        a, b = await _pair(tmp_path, hub, extra_a=small)
        try:
            assert await a.network.pull("n1") is None  # a refuses b's oversized snapshot
            assert any("exceeds the limit of 4096" in p["message"] for p in a.problems.recent())
            with pytest.raises(PeerCallError) as e:  # and b's oversized model in a request
                await b.client.compute(
                    a.address,
                    ComputeRequest(
                        CROSS_LOSS, "n1", purpose="scool-evidence", groups={"params": b.learner.get_params()}
                    ),
                )
            assert e.value.kind == "invalid" and "exceeds the limit of 4096" in e.value.message
            with pytest.raises(PeerCallError) as e:  # a's own gossip limit, before anything is sent
                await a.client.gossip(b.address, "n0", "x", {"blob": b"x" * 100})
            assert e.value.kind == "invalid"
            with pytest.raises(PeerCallError) as e:  # b's payload over a's limit: a refuses it
                await b.client.gossip(a.address, "n1", "x", {"blob": b"x" * 100})
            assert e.value.kind == "invalid" and "exceeds the limit of 64" in e.value.message
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())
