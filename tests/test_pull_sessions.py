"""Pull sessions (``PullSnapshots``): a peer pulled from again gets one bidirectional stream on
which each pull is a request and its answer, instead of a gRPC call per pull.

A scripted peer server (plaintext, in this process) for the client's side: pulls move onto a
session and stay correct (new versions, "unchanged" answers, chunked and inline payloads), a
pull that misses its deadline closes the session and the next one works, a session the server
ended or refused falls back to a plain call. Then a real daemon over mTLS, its bounds attacked by
authenticated peers: a second session of one peer, one over ``max_watches``, a stranger, a
request on someone else's session."""

from __future__ import annotations

import asyncio
import contextlib
import re

import grpc
import pytest
import torch

from coterie.node.peering.errors import PeerCallError, unknown_peer
from coterie.node.peering.messages import LocalSnapshot
from coterie.node.transport import server as server_mod
from coterie.node.transport.client import PeerClient
from coterie.node.transport.server import StreamLimits, serve
from coterie.proto.v1 import peer_pb2 as pb
from tests.nodeproc import NodeProc, tiny_learner, wait_for
from tests.test_security_limits import Mallory


class _NoTraffic:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


class _Received(_NoTraffic):
    def __init__(self):
        self.received = 0

    def record(self, kind, sent=0, received=0):
        self.received += received


class Board:
    """A peer's publishing side: the current snapshot, a round-aligned request waits for its
    round (up to its wait); counts what it served."""

    def __init__(self, floats: int = 4):
        self.floats = floats
        self.served = 0
        self.published = asyncio.Event()
        self.publish(1)

    def publish(self, rnd: int) -> None:
        self.snap = LocalSnapshot("p", rnd, rnd, {"params": {"w": torch.full((self.floats,), float(rnd))}})
        self.snap.prepare()
        self.published.set()
        self.published = asyncio.Event()

    async def snapshot(self, requester, min_round=0, wait_s=0.0):
        self.served += 1
        with contextlib.suppress(asyncio.TimeoutError):
            while self.snap.round < min_round:
                await asyncio.wait_for(self.published.wait(), wait_s)
        return self.snap

    def check_known(self, node_id):
        if node_id == "stranger":
            raise unknown_peer(f"{node_id} is not known here")

    def admit(self, peer, kind):
        return contextlib.nullcontext()


@contextlib.asynccontextmanager
async def _pair(board: Board, *, max_watches: int = 64, chunk_bytes: int = 1 << 20):
    server, port = await serve(
        board,
        _NoTraffic(),
        "127.0.0.1:0",
        tls=None,
        chunk_bytes=chunk_bytes,
        streams=StreamLimits(max_watches=max_watches),
    )
    client = PeerClient(
        "me",
        _Received(),
        chunk_bytes=chunk_bytes,
        max_model_bytes=1 << 26,
        max_gossip_bytes=1 << 20,
        timeout_s=5,
        tls=None,
    )
    try:
        yield client, f"127.0.0.1:{port}", server
    finally:
        await client.close()
        await server.stop(0)


def _session(client: PeerClient):
    return next(iter(client.streams._sessions.values()), None)


async def _pulled_twice(client: PeerClient, addr: str):
    """Pull twice (the second pull opens a session); the session."""
    await client.get_snapshot(addr, "me")
    await client.get_snapshot(addr, "me")
    s = _session(client)
    assert s is not None
    return s


@pytest.mark.parametrize("floats", [20_000, 600_000])  # inline in the header's message; header + chunks
def test_pulls_of_a_peer_pulled_again_move_onto_one_session(floats):
    async def go():
        board = Board(floats)
        async with _pair(board, chunk_bytes=1 << 20) as (client, addr, _):
            h, g = await client.get_snapshot(addr, "me")  # once: a plain call, no session
            assert h.version == 1 and _session(client) is None
            for rnd in range(2, 7):
                board.publish(rnd)
                h, g = await client.get_snapshot(addr, "me", have_version=h.version)
                assert h.version == rnd and torch.equal(g["params"]["w"], torch.full((floats,), float(rnd)))
            s = _session(client)
            assert s is not None and s.served == 5  # every pull after the first went on it
            # bytes received are counted once, inline or chunked (each answer: payload + a header)
            assert 6 * len(board.snap.encoded) <= client.traffic.received < 6 * (len(board.snap.encoded) + 150)
            h2, g2 = await client.get_snapshot(addr, "me", have_version=h.version)  # nothing new
            assert h2.version == h.version and g2 is None and s.served == 6
            later = asyncio.ensure_future(client.get_snapshot(addr, "me", min_round=8, wait_s=5))
            await asyncio.sleep(0)  # (the request goes out; round 8 is not published yet)
            board.publish(7)
            board.publish(8)
            assert (await later)[0].round == 8 and s.served == 7 and _session(client) is s
            assert board.served == 8

    asyncio.run(go())


def test_a_pull_that_misses_its_deadline_closes_the_session_and_the_next_one_works():
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            s = await _pulled_twice(client, addr)
            # a round that never comes, asked with a server-side wait longer than the deadline
            with pytest.raises(PeerCallError, match="deadline"):
                await client.get_snapshot(addr, "me", min_round=99, wait_s=30, timeout=0.5)
            assert _session(client) is None and s.call.done()  # closed: its stream state is unknown
            h, g = await client.get_snapshot(addr, "me")
            h, g = await client.get_snapshot(addr, "me")
            assert h.version == 1 and g is not None and _session(client) not in (None, s)

    asyncio.run(go())


def test_a_session_the_server_ended_or_refused_falls_back_to_a_plain_call(monkeypatch):
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            s = await _pulled_twice(client, addr)
            await asyncio.wait_for(s.call.wait_for_connection(), 5)
            # the server ends idle sessions; the next pull must not fail on the ended stream
            monkeypatch.setattr(server_mod, "SESSION_IDLE_S", 0.05)
            board.publish(2)
            await client.get_snapshot(addr, "me")  # (the server's wait for the next request restarts)
            await asyncio.wait_for(s.call.wait_for_connection(), 5)
            deadline = asyncio.get_running_loop().time() + 5
            while not s.call.done():
                assert asyncio.get_running_loop().time() < deadline, "the server did not end the idle session"
                await asyncio.sleep(0.05)
            h, g = await client.get_snapshot(addr, "me")
            assert h.version == 2 and g is not None
        async with _pair(Board(), max_watches=0) as (client, addr, _):  # sessions refused there
            for _ in range(4):
                h, g = await client.get_snapshot(addr, "me")
                assert h.version == 1 and g is not None
            assert _session(client) is None and addr in client.streams._session_refused  # tried once, not again

    asyncio.run(go())


def test_sessions_are_one_per_peer_and_bounded_in_all_on_the_server():
    """One per peer (a newer session replaces the older: a peer cannot hold two), ``max_watches``
    in all, none for a stranger, none carrying another peer's requests."""

    async def open_session(client: PeerClient, addr: str, requester: str):
        call = client.channel(addr, "bulk")[0].stream_stream(
            "/coterie.v1.Peer/PullSnapshots",
            request_serializer=pb.SnapshotRequest.SerializeToString,
            response_deserializer=pb.SnapshotChunk.FromString,
        )()
        await call.write(pb.SnapshotRequest(requester=requester))
        return call, await call.read()

    async def go():
        board = Board()
        async with _pair(board, max_watches=2) as (client, addr, _):
            old, first = await open_session(client, addr, "mallory")
            assert first.header.version == 1
            a, again = await open_session(client, addr, "mallory")  # a second one replaces the first
            assert again.header.version == 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await old.read()
            assert e.value.code() == grpc.StatusCode.CANCELLED
            b, _ = await open_session(client, addr, "eve")
            with pytest.raises(grpc.aio.AioRpcError, match="the limit is 2"):
                await open_session(client, addr, "trent")
            with pytest.raises(grpc.aio.AioRpcError, match="not known"):
                await open_session(client, addr, "stranger")
            await a.write(pb.SnapshotRequest(requester="eve"))  # someone else's request on mallory's session
            with pytest.raises(grpc.aio.AioRpcError, match="snapshot session of mallory: a request from eve"):
                await a.read()
            b.cancel()
            assert board.served == 3  # the refused ones never reached the snapshot

    asyncio.run(go())


# ------------------------------------------------------------------------------ a real daemon
@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    root = tmp_path_factory.mktemp("sessions")
    node = NodeProc(
        root,
        "victim",
        {"strategy": "local", "round_interval_s": 0.2, "learner": tiny_learner(1, 0), "limits": {"max_watches": 1}},
    ).start()
    yield root, node
    node.stop()


def test_a_daemon_serves_pulls_on_sessions_within_its_bounds_over_mtls(victim):
    """Authenticated peers: pulls on a session, answered as calls are; the limit on sessions
    holds (a second peer pulls with plain calls instead); a request on a session claiming another
    node than the certificate's is refused."""
    root, node = victim

    async def go():
        a, b = Mallory(root, node, "mallory"), Mallory(root, node, "eve")
        for m in (a, b):
            await m.join()
        versions = []
        for _ in range(5):
            v, params = await a.params()
            versions.append(v)
            assert all(torch.isfinite(t).all() for t in params.values())
        s = _session(a.client)
        assert s is not None and s.served == 4 and versions == sorted(versions)
        for _ in range(3):  # max_watches = 1: eve's session is refused, its pulls still answered
            await b.params()
        assert _session(b.client) is None and node.address in b.client.streams._session_refused
        await s.call.write(pb.SnapshotRequest(requester="eve"))  # mallory's certificate, eve's name
        with pytest.raises(grpc.aio.AioRpcError) as e:
            while True:
                await s.call.read()
        assert re.search(r"certificate is for 'mallory'", e.value.details())
        for m in (a, b):
            await m.close()

    asyncio.run(go())
    wait_for(lambda: node.status()["round"] > 0, 60, "the node to go on with its rounds")  # it kept running
