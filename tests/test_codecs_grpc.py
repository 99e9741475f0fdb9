"""Snapshot codecs over real gRPC (a peer server in this process, plaintext, real sockets):
negotiation per request, fallback to fp32 for peers that name no codec, deltas against the
version the requester holds (and a whole snapshot when the server forgot it), fewer bytes
counted; then a hostile server's payloads — bad scales, truncated blocks, an unknown codec, a
delta against a version the requester never had — refused by the client naming the problem,
and a hostile client's compute payloads refused by the server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import weakref

import grpc
import pytest
import torch

from coterie.node.peering.messages import CROSS_LOSS, ComputeReply, ComputeRequest, LocalSnapshot, NodeInfo
from coterie.node.transport import served_versions
from coterie.node.transport import server as server_module
from coterie.node.transport.chunks import sha256
from coterie.node.transport.client import PeerClient
from coterie.node.transport.served_versions import CodecPolicy, Payload, ServedVersions
from coterie.node.transport.server import serve
from coterie.node.wire import codec as raw_codec
from coterie.node.wire import codecs as C
from coterie.node.wire.codec import WireError
from coterie.proto.v1 import peer_pb2 as pb

N = 50_000


class _Traffic:
    def __init__(self):
        self.received = self.sent = 0

    def record(self, kind, sent=0, received=0):
        self.sent += sent
        self.received += received

    def latency(self, *a, **k):
        pass


class Board:
    """A peer's publishing side (one model that moves a little each version) and a compute
    handler that records the models it was sent."""

    node_id = "p"

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(N, generator=g)
        self.steps = 0
        self.computed: list[dict] = []
        self.published = asyncio.Event()
        self.publish(1)

    def publish(self, v: int) -> None:
        if v > 1:
            self.w = self.w + 0.01 * torch.randn(N)
        self.snap = LocalSnapshot("p", v, v, {"params": {"w": self.w.clone(), "n": torch.tensor([v])}})
        self.snap.prepare()
        if hasattr(self, "published"):
            self.published.set()
            self.published = asyncio.Event()

    async def snapshot(self, requester, min_round=0, wait_s=0.0):
        with contextlib.suppress(asyncio.TimeoutError):
            while self.snap.round < min_round:
                await asyncio.wait_for(self.published.wait(), wait_s)
        return self.snap

    def check_known(self, node_id):
        pass

    def admit(self, peer, kind):
        return contextlib.nullcontext()

    def info(self):
        return NodeInfo("p", 1, "", codecs=("q8", "fp16", "fp32"))

    def on_handshake(self, remote):
        return []

    async def compute(self, req):
        self.computed.append(req.groups)
        return ComputeReply(loss=1.0, samples=1)


def _client(name: str, codecs=("q8", "fp32"), delta=True, sessions=False, bases_bytes: int | None = None) -> PeerClient:
    policy = (
        CodecPolicy(tuple(codecs), delta) if bases_bytes is None else CodecPolicy(tuple(codecs), delta, 3, bases_bytes)
    )
    return PeerClient(
        name,
        _Traffic(),
        chunk_bytes=1 << 16,
        max_model_bytes=1 << 26,
        max_gossip_bytes=1 << 20,
        timeout_s=10,
        tls=None,
        sessions=sessions,
        codecs=policy,
    )


@contextlib.asynccontextmanager
async def _pair(
    board: Board,
    server_codecs=("q8", "fp16", "fp32"),
    client_codecs=("q8", "fp32"),
    delta=True,
    history=3,
    sessions=False,
):
    server, port = await serve(
        board, _Traffic(), "127.0.0.1:0", tls=None, codecs=CodecPolicy(tuple(server_codecs), delta, history)
    )
    client = _client("me", client_codecs, delta, sessions)
    try:
        yield client, f"127.0.0.1:{port}", server
    finally:
        await client.close()
        await server.stop(0)


def _err(groups, board):
    return float((groups["params"]["w"] - board.snap.params["w"]).abs().max())


async def _raw_pull(addr: str, request: pb.SnapshotRequest) -> tuple[pb.SnapshotHeader, bytes]:
    async with grpc.aio.insecure_channel(addr) as ch:
        frames = [
            pb.SnapshotChunk.FromString(m)
            async for m in ch.unary_stream(
                "/coterie.v1.Peer/GetSnapshot",
                request_serializer=pb.SnapshotRequest.SerializeToString,
                response_deserializer=None,
            )(request, timeout=10)
        ]
    return frames[0].header, b"".join(f.data for f in frames[1:])


def test_the_first_shared_codec_is_used_and_deltas_follow_the_version_held():
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            h, g = await client.get_snapshot(addr, "me", peer="p")
            whole_bytes = client.traffic.received
            assert h.version == 1 and 0 < _err(g, board) <= float(board.w.abs().max()) / 254 * 1.01
            assert g["params"]["n"].tolist() == [1] and g["params"]["w"].dtype == torch.float32
            assert whole_bytes < len(board.snap.encoded) / 3.5  # q8: < 1/3.5 of the fp32 bytes
            errors = []
            for v in range(2, 8):
                board.publish(v)
                before = client.traffic.received
                h, g = await client.get_snapshot(addr, "me", have_version=h.version, peer="p")
                assert h.version == v and g["params"]["n"].tolist() == [v]
                assert client.traffic.received - before < len(board.snap.encoded) / 3.5
                errors.append(_err(g, board))
            # each delta quantises the move (~0.04 at most), not the model (~4): far smaller errors
            assert max(errors) < _err(C.decode(C.encode(board.snap.groups, "q8"))[0], board) / 10
            held = client.held.get("p")
            assert held is not None and held.version == 7
            # the identity digest (what references name) is the snapshot's own, whatever the codec
            assert h.digest == board.snap.digest

    asyncio.run(go())


def test_a_subscription_pushes_deltas_against_the_snapshot_it_pushed_before():
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, server):
            stream = client.watch_snapshots(addr, "me", peer="p")
            errors = []
            async with contextlib.aclosing(stream):
                async for h, g in stream:
                    errors.append(_err(g, board))
                    assert g["params"]["n"].tolist() == [h.version]
                    if h.version == 6:
                        break
                    board.publish(h.version + 1)
            whole = errors[0]
            assert max(errors[1:]) < whole / 10  # deltas: the move quantised, not the model

    asyncio.run(go())


def test_a_subscriptions_base_is_kept_while_pulls_bring_newer_versions():
    """A watch's next delta is against the last snapshot it pushed, even when a pull of the same
    peer brought a newer one meanwhile, or the same version in other bytes: that copy stays held
    while the watch is open. Copies were kept by version only, so a pull's whole v4 replaced the
    watch's v4 and the watch's next delta was refused ("a delta against v4 (…), but this node
    holds v4 (…)"): the watch closed, and a D-PSGD pair fell back to a pull a round (a flake of
    test_snapshot_watch.py::test_a_dpsgd_pair_runs_its_rounds_on_subscriptions)."""

    async def go():
        board = Board()
        async with _pair(board) as (client, addr, server):
            stream = client.watch_snapshots(addr, "me", peer="p")
            async with contextlib.aclosing(stream):
                h1, _ = await stream.__anext__()
                board.publish(2)
                h2, _ = await stream.__anext__()  # the watch's last: v2
                board.publish(3)
                h3, _ = await client.get_snapshot(addr, "me", have_version=h2.version, peer="p")  # a pull: v3
                assert h3.version == 3 and client.held.get("p").version == 3
                # the watch pushes v3 too, as a delta against v2 (its last), though v3 is held now
                h3w, g3w = await asyncio.wait_for(stream.__anext__(), 10)
                assert h3w.version == 3 and _err(g3w, board) < float(board.w.abs().max()) / 254
                board.publish(4)
                h4, g4 = await asyncio.wait_for(stream.__anext__(), 10)
                assert h4.version == 4 and _err(g4, board) < float(board.w.abs().max()) / 254
                # a pull of the same version in other bytes (whole: it named no base) keeps the
                # watch's copy, which its next delta is against
                h4p, _ = await client.get_snapshot(addr, "me", peer="p")
                assert h4p.version == 4 and client.held.copies("p") == 2  # the pull's v4 and the watch's
                board.publish(5)
                h5, g5 = await asyncio.wait_for(stream.__anext__(), 10)
                assert h5.version == 5 and _err(g5, board) < float(board.w.abs().max()) / 254
            assert client.held.get("p").version == 5
            assert client.held.copies("p") == 1  # the watch closed: nothing pinned, the newest held

    asyncio.run(go())


def test_a_request_naming_no_codec_gets_todays_bytes_and_header():
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            header, data = await _raw_pull(addr, pb.SnapshotRequest(requester="me"))  # an older peer
            assert header.codec == "" and header.payload_sha256 == "" and not header.base_version
            assert data == bytes(board.snap.encoded) and sha256(data) == header.sha256
            # a client preferring codecs the server lacks: fp32, decoded exactly

    asyncio.run(go())

    async def go2():
        board = Board()
        async with _pair(board, server_codecs=("fp32",), client_codecs=("q8", "fp16", "fp32")) as (client, addr, _):
            _, g = await client.get_snapshot(addr, "me", peer="p")
            assert torch.equal(g["params"]["w"], board.snap.params["w"])
        async with _pair(board, server_codecs=("q8", "fp16"), client_codecs=("fp16", "q8")) as (client, addr, _):
            header, data = await _raw_pull(addr, pb.SnapshotRequest(requester="me", codecs=["fp16", "q8"]))
            assert header.codec == "fp16" and header.payload_sha256 == sha256(data) != header.sha256

    asyncio.run(go2())


def test_a_forgotten_base_gets_a_whole_snapshot():
    async def go():
        board = Board()
        async with _pair(board, history=1) as (client, addr, _):
            h1, _ = await client.get_snapshot(addr, "me", peer="p")
            held1 = client.held.get("p")
            board.publish(2)
            # someone else, who takes deltas (a reader that takes none costs no reconstruction): whole v2
            await _raw_pull(addr, pb.SnapshotRequest(requester="x", codecs=["q8"], delta=True))
            board.publish(3)
            await _raw_pull(addr, pb.SnapshotRequest(requester="x", codecs=["q8"], delta=True))  # v3: v1 forgotten
            header, _ = await _raw_pull(
                addr,
                pb.SnapshotRequest(requester="me", codecs=["q8"], delta=True, have_version=1, have_sha256=held1.digest),
            )
            assert header.codec == "q8" and not header.base_version  # whole, not a delta
            h, g = await client.get_snapshot(addr, "me", have_version=h1.version, peer="p")
            assert h.version == 3 and _err(g, board) <= float(board.w.abs().max()) / 254 * 1.01

    asyncio.run(go())


def test_a_delta_against_the_version_held_before_the_newest_still_decodes():
    """A pull and a subscription to one peer run side by side: the pull asked with v1 held, the
    subscription brought v2 meanwhile, then the pull's answer — a delta against v1 — arrives. With
    only the newest version kept, that delta was refused ("holds v2"), and the subscription was
    dropped along with the held copies (a D-PSGD pair fell back to a pull a round)."""

    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            h1, _ = await client.get_snapshot(addr, "me", peer="p")
            held1 = client.held.get("p")
            board.publish(2)
            with client.held.keeping("p", held1):  # what a pull naming v1 as its base holds while in flight
                late_header, late = await _raw_pull(
                    addr,
                    pb.SnapshotRequest(  # the pull asked with v1
                        requester="me", codecs=["q8"], delta=True, have_version=1, have_sha256=held1.digest
                    ),
                )
                assert late_header.base_version == 1  # a delta against v1
                h2, _ = await client.get_snapshot(addr, "me", have_version=h1.version, peer="p")  # v2 came first
                assert client.held.get("p").version == 2
                g = client.streams._decode_snapshot(late_header, memoryview(late), "p")
                assert _err(g, board) < float(board.w.abs().max()) / 254  # v2 rebuilt from the held v1
                assert client.held.get("p").version == 2  # and v2 is still the newest held
            assert client.held.find("p", 1, held1.digest) is None  # v1 goes once nothing in flight needs it

    asyncio.run(go())


def test_between_pulls_one_version_of_a_peer_is_held():
    """The bases kept for deltas cost a model each: between pulls a node keeps only the newest
    version of a peer (two were kept always: with a 21 MB model and three D-PSGD peers, 62 MB at
    rest for nothing), and the next delta still decodes against it."""

    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            h1, _ = await client.get_snapshot(addr, "me", peer="p")
            held1 = client.held.get("p")
            board.publish(2)
            h2, g2 = await client.get_snapshot(addr, "me", have_version=h1.version, peer="p")
            assert h2.version == 2 and g2 is not None
            assert client.held.find("p", 1, held1.digest) is None  # v1 is no longer a base anyone asked for
            held2 = client.held.get("p")
            board.publish(3)
            h3, g3 = await client.get_snapshot(addr, "me", have_version=h2.version, peer="p")
            assert h3.version == 3 and _err(g3, board) < float(board.w.abs().max()) / 254  # a delta on v2
            assert client.held.find("p", 2, held2.digest) is None and client.held.get("p").version == 3

    asyncio.run(go())


def _forge(monkeypatch, make):
    """The server sends ``make(real_payload, snap)`` instead of its real payload (a hostile peer
    with a patched server: real bytes over a real stream, its digest matching them)."""
    real = served_versions.ServedVersions.payload

    async def hostile(self, snap, wanted, **kw):
        p = await real(self, snap, wanted, **kw)
        data, fields = make(p, snap)
        return dataclasses.replace(p, data=data, digest=sha256(data), **fields)

    monkeypatch.setattr(served_versions.ServedVersions, "payload", hostile)


def _edit_q8(edit):
    def make(p, snap):
        groups, meta = raw_codec.decode(p.data, copy=True)
        edit(groups, meta)
        return raw_codec.encode(groups, meta), {}

    return make


@pytest.mark.parametrize(
    "make,problem",
    [
        (_edit_q8(lambda g, m: g["params#scales"]["w"].__setitem__(0, float("nan"))), "block scale is NaN"),
        (_edit_q8(lambda g, m: g["params#scales"]["w"].__setitem__(0, -2.0)), "block scale is negative"),
        (_edit_q8(lambda g, m: g["params"].__setitem__("w", g["params"]["w"][: N - 100])), "truncated blocks"),
        (lambda p, s: (bytes(p.data)[:-7], {}), "truncated"),
        (_edit_q8(lambda g, m: m["codec"].__setitem__("name", "q3")), "unknown codec 'q3'"),
        (lambda p, s: (p.data, {"codec": "q3"}), "unknown codec 'q3'"),
        (lambda p, s: (p.data, {"codec": "fp16"}), "payload in codec 'fp16', which this node did not ask for"),
        (lambda p, s: (bytes(s.encoded), {}), "header says codec 'q8', payload is 'fp32'"),
        (_edit_q8(lambda g, m: m.__setitem__("version", 99)), "header says v1, payload is v99"),
        # a delta against a version the requester never had, or against one it has with another digest
        (
            lambda p, s: (
                C.encode(s.groups, "q8", base=s.groups, base_ref={"version": 7, "sha256": "f" * 64}),
                {"base": (7, "f" * 64)},
            ),
            "a delta against v7 \\(ffffffffffff\\), but this node holds no version",
        ),
    ],
)
def test_a_hostile_servers_payloads_are_refused_naming_the_problem(monkeypatch, make, problem):
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            _forge(monkeypatch, make)
            with pytest.raises(WireError, match=problem):
                await client.get_snapshot(addr, "me", peer="p")
            assert client.held.get("p") is None  # nothing held from a refused payload

    asyncio.run(go())


def test_a_delta_against_the_wrong_base_digest_is_refused(monkeypatch):
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            await client.get_snapshot(addr, "me", peer="p")
            held = client.held.get("p")
            board.publish(2)

            def wrong_base(p, snap):
                assert p.base == (1, held.digest)  # an honest server would send a delta against it
                return p.data, {"base": (1, "0" * 64)}

            _forge(monkeypatch, wrong_base)
            with pytest.raises(
                WireError,
                match=f"a delta against v1 \\(000000000000\\), but this node holds v1 \\({held.digest[:12]}\\)",
            ):
                await client.get_snapshot(addr, "me", have_version=1, peer="p")

    asyncio.run(go())


def test_models_sent_for_compute_use_the_codec_the_peer_advertised_and_bad_ones_are_refused():
    async def go():
        board = Board()
        model = {"params": {"w": torch.randn(N)}}
        req = ComputeRequest(CROSS_LOSS, "me", groups=model, purpose="fedfomo-loss")
        async with _pair(board, server_codecs=("q8", "fp32")) as (client, addr, _):
            await client.compute(addr, req)  # no handshake yet: the peer's codecs unknown -> fp32
            assert torch.equal(board.computed[-1]["params"]["w"], model["params"]["w"])
            sent0 = client.traffic.sent
            await client.handshake(addr, NodeInfo("me", 1, ""), timeout=5)  # advertises q8
            await client.compute(addr, dataclasses.replace(req))
            assert client.traffic.sent - sent0 < 4 * N / 3.5
            got = board.computed[-1]["params"]["w"]
            assert 0 < float((got - model["params"]["w"]).abs().max()) <= float(model["params"]["w"].abs().max()) / 127

            async def raw_compute(codec: str, data: bytes):
                header = pb.ComputeHeader(
                    requester="me", total_bytes=len(data), sha256=sha256(data), purpose="fedfomo-loss", codec=codec
                )
                frames = [pb.ComputeFrame(header=header), pb.ComputeFrame(data=data)]
                async with grpc.aio.insecure_channel(addr) as ch:
                    return await pb_stub(ch).CrossLoss(iter(frames), timeout=10)

            q8 = C.encode(model, "q8")
            bad_scale = _edit_q8(lambda g, m: g["params#scales"]["w"].__setitem__(3, float("inf")))(
                Payload(q8, "", "q8"), None
            )[0]
            for codec, data, problem in [
                ("q8", bad_scale, "block scale is NaN or infinite"),
                ("fp16", C.encode(model, "fp16"), "codec 'fp16' is not one this node advertised"),
                ("q5", q8, "unknown codec 'q5'"),
                ("", q8, "header says codec 'fp32', the payload another"),
                (
                    "q8",
                    C.encode(model, "q8", base=model, base_ref={"version": 1, "sha256": "a"}),
                    "a delta, but no base",
                ),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await raw_compute(codec, data)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in err.value.details()
            n = len(board.computed)
            await client.compute(addr, dataclasses.replace(req))  # the server kept serving
            assert len(board.computed) == n + 1

    asyncio.run(go())


def pb_stub(ch):
    from coterie.proto.v1 import peer_pb2_grpc as rpc

    return rpc.PeerStub(ch)


def test_unknown_codecs_in_config_are_refused():
    from pydantic import ValidationError

    from coterie.node.config import NodeConfig

    with pytest.raises(Exception, match="unknown codec"):
        NodeConfig(snapshots={"codecs": ["q8", "zstd"]})
    assert NodeConfig(snapshots={"codecs": ["q8", "fp32"], "delta": True}).snapshots.delta
    with pytest.raises(ValidationError):
        NodeConfig(snapshots={"codecs": []})


def test_a_real_daemon_advertises_its_codecs_and_serves_q8_deltas_over_mtls(tmp_path):
    """A daemon started with ``snapshots.codecs = [q8, fp32]`` and deltas, over mTLS: its handshake
    advertises them; a peer asking for q8 gets ~1/4 of the bytes an fp32 peer gets, then deltas;
    a peer naming no codec (fp32) gets the exact model."""
    from tests.nodeproc import CertifiedPeer, NodeProc, tiny_learner, wait_for

    node = NodeProc(
        tmp_path,
        "n0",
        {
            "strategy": "local",
            "round_interval_s": 0.2,
            "learner": tiny_learner(1, 0),
            "snapshots": {"codecs": ["q8", "fp32"], "delta": True},
        },
    ).start()
    try:

        async def go():
            q8, plain = CertifiedPeer(tmp_path, node, "q8peer"), CertifiedPeer(tmp_path, node, "plain")
            q8.client.codecs = q8.client.streams.codecs = CodecPolicy(("q8", "fp32"), delta=True)
            for p in (q8, plain):  # (the client's snapshot streams hold the same collaborators)
                p.client.traffic = p.client.streams.traffic = _Traffic()
            try:
                await q8.join()
                await plain.join()
                assert q8.client._peer_codecs[node.address] == ("q8", "fp32")
                h, exact = await plain.client.get_snapshot(node.address, "plain", peer="n0")
                hq, g = await q8.client.get_snapshot(node.address, "q8peer", peer="n0")
                assert q8.client.traffic.received < plain.client.traffic.received / 3.5
                if hq.version == h.version:
                    for k, t in exact["params"].items():
                        assert float((g["params"][k] - t).abs().max()) <= float(t.abs().max()) / 254 * 1.01 + 1e-12
                v = hq.version
                wait_for(lambda: node.status()["model_version"] > v, 60, "a newer version")
                before = q8.client.traffic.received
                h2, g2 = await q8.client.get_snapshot(node.address, "q8peer", have_version=v, peer="n0")
                assert h2.version > v and q8.client.held.get("n0").version == h2.version
                assert q8.client.traffic.received - before < plain.client.traffic.received / 3.5
            finally:
                await q8.close()
                await plain.close()

        asyncio.run(go())
    finally:
        node.stop()


# --- what a node keeps between rounds (issue 34 item 2; D-PSGD's extra memory,
# bench/results/memory.md): one decoded copy per peer (an older one only while a read in flight
# may need it as a delta's base), no payloads of superseded versions, no snapshot held by an idle
# pull session


def test_one_decoded_copy_per_peer_and_an_older_one_only_while_a_pull_needs_it():
    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            h, _ = await client.get_snapshot(addr, "me", peer="p")
            for v in range(2, 6):  # pulls in turn, each a delta against the one before
                board.publish(v)
                h, g = await client.get_snapshot(addr, "me", have_version=h.version, peer="p")
                assert h.version == v
                assert client.held.copies("p") == 1  # (two on the old code: a spare kept always)
            # a pull that asked with v5 held waits for round 7; meanwhile another brings v6: the
            # waiting pull's answer is a delta against v5, which must still be there
            waiting = asyncio.ensure_future(
                client.get_snapshot(addr, "me", have_version=5, min_round=7, wait_s=5.0, peer="p")
            )
            while not board.published._waiters:  # the server holds the pull open
                await asyncio.sleep(0.01)
            board.publish(6)
            h6, _ = await client.get_snapshot(addr, "me", have_version=5, peer="p")
            assert h6.version == 6 and client.held.copies("p") == 2  # v5 kept: the waiting pull named it
            board.publish(7)
            h7, g7 = await asyncio.wait_for(waiting, 10)
            assert h7.version == 7 and _err(g7, board) < float(board.w.abs().max()) / 254  # rebuilt from v5
            assert client.held.copies("p") == 1 and client.held.get("p").version == 7

    asyncio.run(go())


def test_a_server_keeps_no_payloads_of_superseded_versions(monkeypatch):
    made: list[ServedVersions] = []

    class Recorded(ServedVersions):  # the server's own, to look into
        def __init__(self, policy):
            super().__init__(policy)
            made.append(self)

    monkeypatch.setattr(server_module, "ServedVersions", Recorded)

    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            h, _ = await client.get_snapshot(addr, "me", peer="p")
            for v in range(2, 8):
                board.publish(v)
                h, _ = await client.get_snapshot(addr, "me", have_version=h.version, peer="p")
            (served,) = made
            versions = {key[0] for key in served._payloads}
            assert versions == {7}, versions  # (the old code kept up to 4 x history: v2..v7)

    asyncio.run(go())


def _recorded_server(monkeypatch) -> list[ServedVersions]:
    """The ServedVersions the next server makes, to look into."""
    made: list[ServedVersions] = []

    class Recorded(ServedVersions):
        def __init__(self, policy):
            super().__init__(policy)
            made.append(self)

    monkeypatch.setattr(server_module, "ServedVersions", Recorded)
    return made


def test_peers_in_step_cost_the_server_one_reconstruction(monkeypatch):
    """Three peers pulling every version as q8 deltas share one payload a version, so the server
    needs one reconstruction to diff the next against — it kept ``history`` (3: with a 21 MB
    model 62 MB a node, 42 of them for nothing)."""
    made = _recorded_server(monkeypatch)

    async def go():
        board = Board()
        async with _pair(board) as (_, addr, _):
            (served,) = made
            peers = [_client(name) for name in ("a", "b", "c")]
            try:
                have = dict.fromkeys(range(3), 0)
                for v in range(1, 7):
                    if v > 1:
                        board.publish(v)
                    for i, c in enumerate(peers):
                        h, g = await c.get_snapshot(addr, c.node_id, have_version=have[i], peer="p")
                        assert h.version == v and _err(g, board) <= float(board.w.abs().max()) / 254 * 1.01
                        have[i] = h.version
                    assert served.deltas == v - 1  # one delta a version, shared by all three
                    assert len(served._recon) == 1, (v, [ver for ver, _ in served._recon.values()])
            finally:
                for c in peers:
                    await c.close()

    asyncio.run(go())


def test_a_lagging_peer_gets_a_delta_against_what_it_was_sent_last_or_a_whole_snapshot(monkeypatch):
    """The server keeps, for each reader, the reconstruction of what it sent it last: a peer
    that skipped versions still gets a delta against it (main kept the 3 newest, so a peer 4
    versions behind got a whole snapshot); a peer whose last answer was lost names a base the
    server no longer keeps and gets a whole snapshot — never a delta against a wrong base."""
    made = _recorded_server(monkeypatch)

    async def go():
        board = Board()
        async with _pair(board) as (fast, addr, _):
            (served,) = made
            slow = _client("slow")
            try:
                hs, _ = await slow.get_snapshot(addr, "slow", peer="p")
                hf, _ = await fast.get_snapshot(addr, "me", peer="p")
                for v in range(2, 7):  # the slow peer sits out five versions
                    board.publish(v)
                    hf, _ = await fast.get_snapshot(addr, "me", have_version=hf.version, peer="p")
                assert len(served._recon) == 2  # the fast peer's v6 and the slow peer's v1
                deltas = served.deltas
                hs, g = await slow.get_snapshot(addr, "slow", have_version=hs.version, peer="p")
                assert hs.version == 6 and served.deltas == deltas + 1  # a delta against its v1
                assert _err(g, board) < float(board.w.abs().max()) / 254
                # each holds v6 in its own payload (a delta against v1, one against v5); v1 is gone
                assert sorted(ver for ver, _ in served._recon.values()) == [6, 6]
                held = slow.held.get("p")
                board.publish(7)
                # an answer the slow peer never got: the server believes it now holds v7
                lost, _ = await _raw_pull(
                    addr,
                    pb.SnapshotRequest(
                        requester="slow", codecs=["q8"], delta=True, have_version=6, have_sha256=held.digest
                    ),
                )
                assert lost.base_version == 6
                board.publish(8)
                hf, _ = await fast.get_snapshot(addr, "me", have_version=hf.version, peer="p")  # v6 now unneeded
                wholes = served.wholes
                hs, g = await slow.get_snapshot(addr, "slow", have_version=6, peer="p")
                assert hs.version == 8 and served.wholes == wholes + 1  # whole: v6 is no longer kept
                assert _err(g, board) <= float(board.w.abs().max()) / 254 * 1.01
            finally:
                await slow.close()

    asyncio.run(go())


def test_readers_out_of_step_are_bounded_by_the_history(monkeypatch):
    """However many readers each hold a different version, at most ``history`` reconstructions
    are kept (the least recently used go: its reader gets a whole snapshot)."""
    made = _recorded_server(monkeypatch)

    async def go():
        board = Board()
        async with _pair(board, history=2) as (_, addr, _):
            (served,) = made
            peers = [_client(f"r{i}") for i in range(4)]
            try:
                held = []
                for v, c in enumerate(peers, start=1):  # each peer holds another version
                    if v > 1:
                        board.publish(v)
                    h, _ = await c.get_snapshot(addr, c.node_id, peer="p")
                    held.append(h)
                    assert len(served._recon) <= 2
                board.publish(5)
                wholes = served.wholes
                h, g = await peers[0].get_snapshot(addr, "r0", have_version=held[0].version, peer="p")
                assert served.wholes == wholes + 1 and _err(g, board) <= float(board.w.abs().max()) / 254 * 1.01
                deltas = served.deltas
                h, g = await peers[3].get_snapshot(addr, "r3", have_version=held[3].version, peer="p")
                assert served.deltas == deltas + 1 and _err(g, board) < float(board.w.abs().max()) / 254
            finally:
                for c in peers:
                    await c.close()

    asyncio.run(go())


def test_an_idle_pull_session_holds_no_snapshot():
    async def go():
        board = Board()
        async with _pair(board, server_codecs=("q8", "fp32"), sessions=True) as (client, addr, _):
            h, _ = await client.get_snapshot(addr, "me", peer="p")
            board.publish(2)
            h, _ = await client.get_snapshot(addr, "me", have_version=1, peer="p")  # opens the session
            board.publish(3)
            h, _ = await client.get_snapshot(addr, "me", have_version=2, peer="p")  # served on it
            assert h.version == 3 and client.streams._sessions, "the pull did not go over a session"
            old = weakref.ref(board.snap)
            board.publish(4)  # v3 superseded; the session now waits for its next request
            deadline = asyncio.get_running_loop().time() + 5
            while old() is not None and asyncio.get_running_loop().time() < deadline:
                gc.collect()
                await asyncio.sleep(0.05)
            assert old() is None, [type(r).__name__ for r in gc.get_referrers(old())]

    asyncio.run(go())


class _Peer(Board):
    """A publishing peer with a model of its own (seeded), so a base used for the wrong peer shows."""

    def __init__(self, seed: int):
        super().__init__()
        self.w = torch.randn(N, generator=torch.Generator().manual_seed(seed))
        self.publish(1)


def test_decoded_bases_stay_within_the_budget_with_more_peers_than_it_holds(monkeypatch):
    """Five peers, a budget of two models' bases: after every pull the newest copies held weigh at
    most the budget; the two peers that took the slots get deltas that decode bit for bit to what
    their server reconstructed; the three others name no base, get whole snapshots, and what they
    receive is their own model within q8's bound. A delta against a base not kept is refused."""
    made = _recorded_server(monkeypatch)
    model = N * 4 + 8  # the weights and the int64 version tensor
    budget = 2 * model

    async def go():
        boards = [_Peer(seed) for seed in range(5)]
        servers = [
            await serve(b, _Traffic(), "127.0.0.1:0", tls=None, codecs=CodecPolicy(("q8", "fp32"), True))
            for b in boards
        ]
        addrs = [f"127.0.0.1:{port}" for _, port in servers]
        client = _client("me", bases_bytes=budget)
        try:
            have = [0] * 5
            for v in range(1, 6):
                for i, (board, addr, served) in enumerate(zip(boards, addrs, made, strict=True)):
                    if v > 1 and board.snap.version < v:
                        board.publish(v)
                    h, g = await client.get_snapshot(addr, "me", have_version=have[i], peer=f"p{i}")
                    have[i] = h.version
                    assert h.version == v and client.held.counted() <= budget
                    if i < 2:  # a base kept: what the server reconstructed from the payload it sent
                        (digest,) = served._sent.values()
                        want = served._recon[digest][1]
                    else:  # none kept, none named: the whole q8 snapshot
                        want = C.decode(C.encode(board.snap.groups, "q8"))[0]
                    assert torch.equal(g["params"]["w"], want["params"]["w"])  # bit for bit
                    assert _err(g, board) <= float(board.w.abs().max()) / 254 * 1.01  # its own model
            assert [client.held.get(f"p{i}") is not None for i in range(5)] == [True, True, False, False, False]
            assert [s.deltas for s in made] == [4, 4, 0, 0, 0]  # every pull after the first a delta
            assert [s.wholes for s in made] == [1, 1, 5, 5, 5]  # never a base named: whole snapshots
            assert client.held.not_kept == 3 * 5  # every copy of p2-p4 decoded, none kept
            # a reader that keeps no base costs its server no reconstruction (two, a whole payload's
            # and a delta's, when every request asked for deltas)
            assert [len(s._recon) for s in made] == [1, 1, 0, 0, 0]
            # a delta against a version of p3 this node once decoded but did not keep is refused
            first, _ = await _raw_pull(addrs[3], pb.SnapshotRequest(requester="me", codecs=["q8"], delta=True))
            digest = first.payload_sha256  # v5, whole, and p3 keeps its reconstruction for "me"
            boards[3].publish(6)
            header, payload = await _raw_pull(
                addrs[3],
                pb.SnapshotRequest(requester="me", codecs=["q8"], delta=True, have_version=5, have_sha256=digest),
            )
            assert header.base_version == 5
            with pytest.raises(WireError, match="a delta against v5 .* but this node holds no version"):
                client.streams._decode_snapshot(header, memoryview(payload), "p3")
        finally:
            await client.close()
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(go())


@pytest.mark.parametrize("off_loop", [False, True])
def test_a_payload_first_sent_without_deltas_is_reconstructed_for_a_reader_that_takes_them(monkeypatch, off_loop):
    """A reader that takes no deltas costs the server no reconstruction; the same whole payload
    sent next to one that does is reconstructed then (off the loop for a large model), and that
    reader's next pull is a delta."""
    made = _recorded_server(monkeypatch)
    if off_loop:
        monkeypatch.setattr(served_versions, "OFF_LOOP_BYTES", 0)

    async def go():
        board = Board()
        async with _pair(board) as (client, addr, _):
            (served,) = made
            header, _ = await _raw_pull(addr, pb.SnapshotRequest(requester="x", codecs=["q8"], delta=False))
            assert served.wholes == 1 and len(served._recon) == 0 and not served._sent
            h1, _ = await client.get_snapshot(addr, "me", peer="p")  # the same payload, shared
            assert served.wholes == 1 and client.held.get("p").digest == header.payload_sha256
            assert len(served._recon) == 1
            board.publish(2)
            h2, g2 = await client.get_snapshot(addr, "me", have_version=h1.version, peer="p")
            assert h2.version == 2 and served.deltas == 1
            (digest,) = served._sent.values()
            assert torch.equal(g2["params"]["w"], served._recon[digest][1]["params"]["w"])

    asyncio.run(go())


def test_a_reconstruction_goes_once_its_reader_takes_no_more_deltas(monkeypatch):
    """A reader that asked for deltas once (a node's first pull of a peer, before it knows the
    model will not fit its bases' budget) and then no more: the reconstruction made for it goes
    once a newer version is encoded — it stayed for the server's life when no later payload made
    one (21 MB per node at rest with the 21 MB MLP: bench/results/memory.md)."""
    made = _recorded_server(monkeypatch)

    async def go():
        board = Board()
        async with _pair(board) as (_, addr, _):
            (served,) = made
            await _raw_pull(addr, pb.SnapshotRequest(requester="me", codecs=["q8"], delta=True))
            assert len(served._recon) == 1
            for v in (2, 3):
                board.publish(v)
                header, _ = await _raw_pull(addr, pb.SnapshotRequest(requester="me", codecs=["q8"], delta=False))
                assert header.version == v and not header.base_version
                assert len(served._recon) == 0, v

    asyncio.run(go())
