"""The routing transport (what a Ray actor's nodes run on): two switchboards stand for two
processes; every node serves real gRPC and is reached through memory from its own process and
over gRPC from the other, and its route counters say which is which."""

from __future__ import annotations

import asyncio
import time

import pytest

from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.messages import Beat
from coterie.node.transport.inproc import InProcNetwork
from coterie.node.transport.routing import GRPC, MEMORY, RoutingTransport
from tests.nodeproc import node_certs, tiny_learner

pytestmark = pytest.mark.slow


def _config(tmp, i, peers):
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": "local",
            "peers": peers,
            "listen": "127.0.0.1:0",
            "heartbeat_interval_s": 0.2,
            "request_timeout_s": 10,
            "rounds": 0,
            "learner": tiny_learner(2, i % 2),
            "security": {"cert_dir": str(node_certs(tmp, f"n{i}"))},
        }
    )  # gRPC between processes: mTLS


async def _wait(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_memory_inside_a_process_grpc_between_and_counted(tmp_path):
    async def go():
        hubs = [InProcNetwork(), InProcNetwork()]
        nodes: list[Node] = []
        transports: list[RoutingTransport] = []
        try:
            for i in range(4):
                cfg = _config(tmp_path, i, [nodes[0].address] if nodes else [])
                t = RoutingTransport.from_config(hubs[i // 2], cfg)
                node = Node(cfg, transport=t, admin=False)
                await node.start()
                nodes.append(node)
                transports.append(t)
            a0, a1, b0, b1 = nodes
            assert all(n.address.startswith("127.0.0.1:") and n.transport.mtls for n in nodes)  # gRPC addresses,
            assert hubs[0].addresses() == sorted([a0.address, a1.address])  # also in memory
            assert hubs[1].addresses() == sorted([b0.address, b1.address])
            await _wait(lambda: all(len(n.peers.alive()) == 3 for n in nodes), "full membership across hubs")

            assert a0.client.route(a1.address) == MEMORY and a0.client.route(b0.address) == GRPC
            before = {r: transports[0].stats.received[r] for r in (MEMORY, GRPC)}
            assert await a0.network.pull("n1") is not None  # same process: memory
            mem = transports[0].stats.received[MEMORY] - before[MEMORY]
            assert mem > 0 and transports[0].stats.received[GRPC] == before[GRPC]
            assert hubs[0].lookup(b1.address) is None  # the other process: nowhere in this one's memory
            assert await a0.network.pull("n3") is not None  # so over gRPC
            assert transports[0].stats.received[GRPC] - before[GRPC] > 0
            # a0's own traffic accounting saw both (the route tally forwards, it does not divert)
            assert a0.traffic.round_received["snapshot"] >= mem + transports[0].stats.received[GRPC] - before[GRPC]

            # memory really is memory: with a1's gRPC server gone, a0 still reaches it, b0 cannot
            await a1._server.also.stop()
            assert await a0.network.pull("n1") is not None
            with pytest.raises(PeerCallError):
                await b0.client.heartbeat(a1.address, Beat("n2", 0, 0), timeout=2.0)

            # heartbeats to every peer: each node soon calls its own process's peers through
            # memory and the other process's over gRPC
            await _wait(
                lambda: all(t.stats.calls[MEMORY] > 0 and t.stats.calls[GRPC] > 0 for t in transports),
                "every node calls both ways",
            )
            for t in transports[2:]:
                assert t.stats.as_dict()["bytes_received"][GRPC] > 0  # b0, b1 handshook a0 over gRPC
        finally:
            for n in nodes:
                await n.stop()

    asyncio.run(go())
