"""Proving a peer's identity (``PeerClient._prove``: a health check on a channel that asks TLS for
exactly that node's certificate) on real sockets: a peer that does not finish the TLS handshake
in time is reported as not answering (``unavailable``, "did not answer in time"), not as a peer
that could not prove who it is (``refused``, a security failure); a peer presenting another
node's certificate is still refused."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from coterie.node.peering.errors import REFUSED, UNAVAILABLE, PeerCallError
from coterie.node.security.pki import load_credentials
from coterie.node.transport.client import PeerClient
from coterie.node.transport.tls import TLS
from tests.nodeproc import node_certs


class _NoTraffic:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


def _client(root, node_id: str) -> PeerClient:
    return PeerClient(
        node_id, _NoTraffic(), chunk_bytes=1 << 20, timeout_s=5, tls=TLS(load_credentials(node_certs(root, node_id)))
    )


@contextlib.asynccontextmanager
async def _silent_listener(root):
    """A listener that takes connections and never answers the TLS hello, and a client (n1):
    (client, the listener's address, the connections it took)."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader, writer):
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    client = _client(root, "n1")
    try:
        yield client, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        await client.close()
        for w in accepted:
            w.close()
        server.close()


async def _prove(client: PeerClient, address: str, node_id: str, timeout: float) -> PeerCallError:
    with pytest.raises(PeerCallError) as e:
        await client._prove(address, node_id, timeout)
    return e.value


def test_a_tls_handshake_that_times_out_is_no_answer_not_an_identity_failure(tmp_path):
    async def go():
        async with _silent_listener(tmp_path) as (client, address, accepted):
            err = await _prove(client, address, "n0", timeout=0.5)
            assert accepted, "the probe never reached the listener"
            assert err.kind == UNAVAILABLE, err
            assert "did not answer in time" in err.message and "could not prove" not in err.message

    asyncio.run(go())


def test_a_peer_with_another_nodes_certificate_is_still_refused(tmp_path):
    async def go():
        mallory = TLS(load_credentials(node_certs(tmp_path, "mallory")))
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", mallory.server_credentials())
        await server.start()
        client = _client(tmp_path, "n1")
        try:
            err = await _prove(client, f"127.0.0.1:{port}", "n0", timeout=5.0)
            assert err.kind == REFUSED and "could not prove" in err.message, err
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(go())


def test_proofs_of_one_address_that_fail_together_each_report_it(tmp_path):
    # they share the cached channel: the first to fail drops it; the others used to raise KeyError
    # (seen on 100 daemons: it escaped the handshake and ended an overlay delivery)
    async def go():
        async with _silent_listener(tmp_path) as (client, address, _):
            outs = await asyncio.gather(
                *(client._prove(address, "n0", timeout=0.5 + 0.1 * i) for i in range(4)), return_exceptions=True
            )
            assert all(isinstance(o, PeerCallError) and o.kind == UNAVAILABLE for o in outs), outs
            assert client.channels() == 0  # the failed channel is gone, and nothing else was dropped

    asyncio.run(go())
