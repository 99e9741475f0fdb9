"""The calling side of the gRPC peer plane (``peering.interfaces.PeerTransport``): cached
channels per peer address, chunked streams, size and hash checks on everything that comes back,
tensors decoded into domain objects. Every call is bounded by a deadline; every failure leaves
as a ``PeerCallError`` (a malformed reply as a ``WireError``).

Two channels per peer: membership messages (handshake, ping, indirect probe, peer lists) never
queue behind a model-sized transfer on the same TCP connection. Channels nobody used for
``idle_channel_s`` (and with no call in flight) are closed. Received payloads land in one
buffer and decode as zero-copy views of it.

With mTLS (``tls.py``) a channel is opened for an (address, plane, expected node id) triple and
TLS checks the server's certificate names that node. A handshake to an address whose owner is not
known yet goes over a channel that accepts any CA-issued node; the id the reply claims is then
proven by a second connection that asks for that id's certificate, and from then on every call to
that address is held to it. So a node's address book only ever binds an address to a node id that
node's certificate proved."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Any, AsyncIterator, Iterator

import grpc
import msgpack
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ...proto.v1 import peer_pb2 as pb
from ...proto.v1 import peer_pb2_grpc as rpc
from ..peering.errors import REFUSED, UNAVAILABLE, PeerCallError, Refusal, short
from ..peering.interfaces import UNSET_MODEL_BYTES, SizeLimits, Traffic
from ..peering.messages import (CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, Beat, ComputeReply, ComputeRequest,
                                IndirectProbe, MemberUpdate, NodeInfo, PeerEntry, SnapshotHeader)
from ..security.ids import node_id_problem
from ..offload import OFF_LOOP_BYTES
from ..wire.codec import Groups, WireError, decode, encode, encoded_size
from . import serde
from .chunks import Assembler, collect, data_field, sha256, split
from .errors import call_error
from .tls import TLS

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # a dead peer must fail fast instead of sitting in exponential reconnect backoff
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # each channel its own connection: the membership channel must not share the bulk one's
    ("grpc.use_local_subchannel_pool", 1),
]
CONTROL, BULK = "control", "bulk"  # the two channels to each peer
# Pull sessions (PullSnapshots): a peer pulled from again gets one long-lived stream on which each
# pull is a request and its answer. A gRPC call costs ~0.5 ms of CPU on each end on this kind of
# machine, a request and answer on an open stream ~0.2 ms: most of a small model's pull.
SESSION_AFTER_S = 60.0  # open one for an address pulled again within this (once is not a habit)
SESSION_IDLE_S = 60.0  # close one unused this long (the server ends its side at 120 s)
SESSION_RETRY_S = 30.0  # after a server refused one (its limit): plain calls there for this long
_ANY = ""  # expected node id "any node of the CA": a first contact, before a handshake proves who


@contextlib.contextmanager
def _in_flight(client: "PeerClient", address: str) -> Iterator[None]:
    """gRPC failures become PeerCallError; a malformed stream (bad chunk, size, hash) a WireError.
    The call counts as in flight on its address meanwhile (idle channel eviction spares it)."""
    client._busy[address] = client._busy.get(address, 0) + 1
    try:
        yield
    except grpc.aio.AioRpcError as e:
        raise call_error(e) from None
    except Refusal as e:
        raise WireError(e.message) from None
    except (StopAsyncIteration, ValueError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"malformed reply: {e}") from None
    except OSError as e:
        raise PeerCallError("unavailable", str(e)) from None
    finally:
        client._busy[address] -= 1
        if not client._busy[address]:
            del client._busy[address]


class _Session:
    """One pull session: its bidirectional call, read one reply message at a time."""
    __slots__ = ("call", "busy", "used", "served")

    def __init__(self, call):
        self.call, self.busy, self.used, self.served = call, False, time.monotonic(), 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        msg = await self.call.read()
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        return msg


class _SessionGone(Exception):
    """The session ended under a request (the server closed it, or refused opening it): the
    request was not answered and goes out as a plain call instead."""


def _domain_errors(fn):
    """A call under ``_in_flight``."""
    @functools.wraps(fn)
    async def wrapper(self, address, *args, **kwargs):
        with _in_flight(self, address):
            return await fn(self, address, *args, **kwargs)
    return wrapper


class PeerClient:
    def __init__(self, node_id: str, traffic: Traffic, *, chunk_bytes: int, max_model_bytes: int = UNSET_MODEL_BYTES,
                 max_gossip_bytes: int = 1 << 20, timeout_s: float, tls: TLS | None, delay_ms: float = 0.0,
                 idle_channel_s: float = 120.0, sessions: bool = True, limits: SizeLimits | None = None):
        """``limits``: the node's ``SizeLimits`` (shared with its served side); else one of
        ``max_model_bytes`` and ``max_gossip_bytes``."""
        self.node_id = node_id
        self.traffic = traffic
        self.chunk_bytes = chunk_bytes
        self.limits = limits if limits is not None else SizeLimits(max_model_bytes, max_gossip_bytes)
        self.timeout_s = timeout_s
        self.delay_s = delay_ms / 1000.0  # emulated one-way link latency (testbed)
        self.idle_channel_s = idle_channel_s
        self.tls = tls
        self._creds = tls.channel_credentials() if tls is not None else None
        # (address, plane, expected node id or None) -> channel, stub
        self._stubs: dict[tuple[str, str, str | None], tuple[grpc.aio.Channel, rpc.PeerStub]] = {}
        self._proven: dict[str, str] = {}  # address -> node id its certificate proved (mTLS)
        self._used: dict[str, float] = {}  # address -> last time a call started
        self._busy: dict[str, int] = {}  # address -> calls in flight
        self._next_sweep = time.monotonic() + idle_channel_s
        self.evicted = 0
        self.sessions = sessions
        self._sessions: dict[tuple[str, str | None], _Session] = {}  # (address, peer) -> open session
        self._pulled: dict[tuple[str, str | None], float] = {}  # -> last pull made with a plain call
        self._session_refused: dict[str, float] = {}  # address -> when its server refused one

    def _channel(self, address: str, plane: str, peer: str | None = None) -> tuple[grpc.aio.Channel, rpc.PeerStub]:
        """The ``plane`` channel to ``address`` that only reaches ``peer`` (default: the node
        proven to be there; none yet: any node of the CA, for a handshake)."""
        now = time.monotonic()
        self._used[address] = now
        if now >= self._next_sweep:
            self._next_sweep = now + self.idle_channel_s / 4
            self._evict_idle(now)
        expected = None if self.tls is None else (peer if peer is not None else self._proven.get(address, _ANY))
        key = (address, plane, expected)
        entry = self._stubs.get(key)
        if entry is None:
            options = _CHANNEL_OPTIONS + [("coterie.plane", plane)]
            if self.tls is None:
                ch = grpc.aio.insecure_channel(address, options=options)
            else:
                name = ("grpc.ssl_target_name_override", self.tls.target_name(expected))
                ch = grpc.aio.secure_channel(address, self._creds, options=[*options, name])
            entry = self._stubs[key] = (ch, rpc.PeerStub(ch))
        return entry

    def stub(self, address: str, plane: str = BULK, peer: str | None = None) -> rpc.PeerStub:
        return self._channel(address, plane, peer)[1]

    def channels(self) -> int:
        return len(self._stubs)

    def _evict_idle(self, now: float) -> None:
        """Close the channels of addresses unused for ``idle_channel_s`` with nothing in flight."""
        stale = {a for a, t in self._used.items() if now - t > self.idle_channel_s and a not in self._busy}
        for address in stale:
            del self._used[address]
            self._drop_sessions(address)
            for key in [k for k in self._stubs if k[0] == address]:
                self.evicted += 1
                asyncio.get_running_loop().create_task(self._stubs.pop(key)[0].close())

    def _raw_snapshot_call(self, address: str, peer: str | None = None):
        """GetSnapshot with chunk messages left as raw bytes: the payload is sliced out of each
        message without protobuf building (and copying) a message object per MiB."""
        return self._channel(address, BULK, peer)[0].unary_stream(
            "/coterie.v1.Peer/GetSnapshot", request_serializer=pb.SnapshotRequest.SerializeToString,
            response_deserializer=None)

    async def forget(self, address: str) -> None:
        self._used.pop(address, None)
        self._proven.pop(address, None)
        for call in self._drop_sessions(address):
            with contextlib.suppress(Exception):  # let each cancelled session finish before its channel closes
                await asyncio.wait_for(call.code(), 1.0)
        for key in [k for k in self._stubs if k[0] == address]:
            await self._stubs.pop(key)[0].close()

    async def close(self) -> None:
        for address in {k[0] for k in self._stubs}:
            await self.forget(address)

    async def _prove(self, address: str, node_id: str, timeout: float) -> None:
        """Check that the node at ``address`` holds a certificate for ``node_id``: a call on a
        channel that asks TLS for exactly that name (the gRPC health check: cheap, always served)."""
        if self.tls is None or self._proven.get(address) == node_id:
            return
        problem = node_id_problem(node_id)
        if problem:
            raise PeerCallError(REFUSED, f"peer at {address}: {problem}")
        if not self.tls.allowed(node_id):
            raise PeerCallError(REFUSED, f"peer at {address} is node {node_id!r}, not on the allow-list")
        ch, _ = self._channel(address, CONTROL, node_id)
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            await self._stubs.pop((address, CONTROL, node_id))[0].close()
            raise PeerCallError(REFUSED, f"peer at {address} claims to be node {node_id!r} but could not "
                                         f"prove it with that node's certificate ({short(e.details() or '', 300)})") from None
        old = self._proven.get(address)
        self._proven[address] = node_id
        if old is not None:
            for key in [k for k in self._stubs if k[0] == address and k[2] == old]:
                await self._stubs.pop(key)[0].close()

    async def _link(self) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # the emulated wire delay itself, not a wait for state

    def _timed(self, kind: str, t0: float) -> None:
        self.traffic.latency(kind, time.perf_counter() - t0, "client")

    # --- membership ---
    @_domain_errors
    async def handshake(self, address: str, info: NodeInfo, timeout: float) -> tuple[NodeInfo, list[PeerEntry]]:
        t0 = time.perf_counter()
        await self._link()
        req = pb.HandshakeRequest(node=serde.node_info_to_pb(info))
        # a fresh look at whoever is at the address now (a restarted node may have another id)
        reply = await self.stub(address, CONTROL, _ANY if self.tls else None).Handshake(req, timeout=timeout)
        self.traffic.record("handshake", sent=req.ByteSize(), received=reply.ByteSize())
        remote = serde.node_info_from_pb(reply.node)
        await self._prove(address, remote.node_id, timeout)
        self._timed("handshake", t0)
        return remote, serde.entries_from_pb(reply.peers)

    @_domain_errors
    async def heartbeat(self, address: str, beat: Beat, timeout: float, *,
                        peer: str | None = None) -> tuple[Beat, float]:
        t0 = time.perf_counter()
        await self._link()
        req = serde.beat_to_request(beat)
        reply = await self.stub(address, CONTROL, peer).Heartbeat(req, timeout=timeout)
        rtt = time.perf_counter() - t0
        self.traffic.record("heartbeat", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("heartbeat", t0)
        return serde.beat_from_reply(reply), rtt

    @_domain_errors
    async def indirect_probe(self, address: str, probe: IndirectProbe, timeout: float, *,
                             peer: str | None = None) -> tuple[bool, tuple[MemberUpdate, ...]]:
        await self._link()
        req = serde.probe_to_pb(probe)
        reply = await self.stub(address, CONTROL, peer).IndirectProbe(req, timeout=timeout)
        self.traffic.record("probe", sent=req.ByteSize(), received=reply.ByteSize())
        return reply.ack, serde.updates_from_pb(reply.updates)

    @_domain_errors
    async def exchange_peers(self, address: str, sender: str, entries: list[PeerEntry], timeout: float, *,
                             members: list[MemberUpdate] = (), incarnation: int = 0, peer: str | None = None
                             ) -> tuple[list[PeerEntry], tuple[MemberUpdate, ...], int]:
        await self._link()
        req = serde.peer_list_to_pb(sender, entries, members, incarnation)
        reply = await self.stub(address, CONTROL, peer).ExchangePeers(req, timeout=timeout)
        self.traffic.record("peers", sent=req.ByteSize(), received=reply.ByteSize())
        return serde.entries_from_pb(reply.peers), serde.updates_from_pb(reply.members), reply.incarnation

    # --- snapshots ---
    @_domain_errors
    async def get_snapshot(self, address: str, requester: str, have_version: int = 0, *,
                           min_round: int = 0, wait_s: float = 0.0, timeout: float | None = None,
                           peer: str | None = None) -> tuple[SnapshotHeader, Groups | None]:
        """The peer's current snapshot; groups is None when it is still ``have_version``. On the
        peer's pull session when it has one (see ``_session``), else a call of its own."""
        t0 = time.perf_counter()
        await self._link()
        request = pb.SnapshotRequest(requester=requester, have_version=have_version, chunk_bytes=self.chunk_bytes,
                                     min_round=min_round, wait_ms=int(wait_s * 1000))
        deadline = time.monotonic() + (timeout or self.timeout_s)
        h = None
        session = self._session(address, peer)
        if session is not None:
            try:
                h, groups = await self._session_pull(session, address, peer, request, deadline)
            except _SessionGone:
                h = None  # not answered: a plain call asks again
        if h is None:
            call = self._raw_snapshot_call(address, peer)(request, timeout=max(deadline - time.monotonic(), 0.001))
            h, groups, _ = await self._read_snapshot(address, call.__aiter__(), whole_stream=True)
        self._timed("snapshot", t0)
        return serde.snapshot_header_from_pb(h), groups

    # --- pull sessions ---
    def _session(self, address: str, peer: str | None) -> _Session | None:
        """The open pull session to ``peer`` at ``address`` for a pull to use, opening one for a
        peer pulled again within ``SESSION_AFTER_S``; None: make a call (no session yet, one
        already carrying a pull, sessions off or refused there lately)."""
        if not self.sessions:
            return None
        key, now = (address, peer), time.monotonic()
        s = self._sessions.get(key)
        if s is not None:
            if s.busy:
                return None
            if not s.call.done() and now - s.used <= SESSION_IDLE_S:
                return s
            self._drop_session(key)
        last, self._pulled[key] = self._pulled.get(key), now
        if (last is None or now - last > SESSION_AFTER_S
                or now - self._session_refused.get(address, float("-inf")) < SESSION_RETRY_S):
            return None
        call = self._channel(address, BULK, peer)[0].stream_stream(
            "/coterie.v1.Peer/PullSnapshots", request_serializer=pb.SnapshotRequest.SerializeToString,
            response_deserializer=None)()
        s = self._sessions[key] = _Session(call)
        return s

    async def _session_pull(self, s: _Session, address: str, peer: str | None, request,
                            deadline: float) -> tuple[Any, Groups | None]:
        """One request and its answer on ``s``. A session whose answer did not come in full
        (deadline, refusal, broken stream, the caller gave up) is closed: what is still in
        flight on it is unknown. ``_SessionGone``: it ended before answering, or its server
        refused to open it (a plain call takes the request)."""
        s.busy = True
        try:
            try:
                await s.call.write(request)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                raise _SessionGone(str(e)) from None
            try:
                h, groups, _ = await asyncio.wait_for(self._read_snapshot(address, s, whole_stream=False),
                                                      max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise PeerCallError(UNAVAILABLE, f"snapshot of {peer or address}: deadline exceeded") from None
            except StopAsyncIteration:
                raise _SessionGone("ended by the server") from None
            except grpc.aio.AioRpcError as e:
                if not s.served and (e.code() == grpc.StatusCode.UNIMPLEMENTED or (
                        e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "snapshot session" in (e.details() or ""))):
                    self._session_refused[address] = time.monotonic()
                    raise _SessionGone(e.details() or e.code().name) from None
                raise
        except BaseException:
            self._drop_session((address, peer))
            raise
        finally:
            s.busy, s.used = False, time.monotonic()
        s.served += 1
        return h, groups

    def _drop_session(self, key: tuple[str, str | None]) -> Any:
        """Close the session (its call is cancelled); the call, or None if there was none."""
        s = self._sessions.pop(key, None)
        if s is not None:
            s.call.cancel()
            return s.call
        return None

    def _drop_sessions(self, address: str) -> list[Any]:
        calls = [self._drop_session(key) for key in [k for k in self._sessions if k[0] == address]]
        for key in [k for k in self._pulled if k[0] == address]:
            del self._pulled[key]
        return calls

    async def _read_snapshot(self, address: str, it, *, whole_stream: bool) -> tuple[Any, Groups | None, int]:
        """One snapshot off a stream: its header, then chunks up to the announced size (size and
        sha256 checked while reassembling), decoded as zero-copy views of the one buffer.
        ``whole_stream``: the stream ends after it (a pull), else more snapshots follow (a watch)."""
        first = pb.SnapshotChunk.FromString(await it.__anext__())
        if first.WhichOneof("body") != "header":
            raise WireError(f"snapshot stream from {address} did not start with a header")
        h = first.header
        groups, size = None, 0
        if not h.unchanged:
            asm = Assembler(f"snapshot of {h.node_id or address}", h.total_bytes, h.sha256,
                            self.limits.max_model_bytes)
            if first.inline:  # a small snapshot comes in its header's message (a watch, a session)
                asm.add(first.inline)
            if whole_stream:
                async for raw in it:
                    asm.add(data_field(raw))  # copied once, into the snapshot's own buffer
            else:
                try:
                    while asm.size < asm.total:
                        asm.add(data_field(await it.__anext__()))
                except StopAsyncIteration:
                    raise WireError(f"snapshot v{h.version} of {h.node_id or address}: stream ended "
                                    f"after {asm.size} of {asm.total} bytes") from None
            data = asm.finish()
            size = len(data)
            try:  # zero-copy: the tensors are views of that one buffer
                groups, _ = decode(data, max_bytes=self.limits.max_model_bytes)
            except WireError as e:
                raise WireError(f"snapshot v{h.version} of {h.node_id or address} is malformed: {e}") from None
        # (an inline payload is already part of the header's message)
        self.traffic.record("snapshot", received=first.ByteSize() + (0 if first.inline else size))
        return h, groups, size

    async def watch_snapshots(self, address: str, requester: str, *, min_round: int = 0,
                              peer: str | None = None) -> AsyncIterator[tuple[SnapshotHeader, Groups]]:
        """Every snapshot the peer publishes from ``min_round`` on, as it publishes it: one
        long-lived stream instead of a call a round. Checked like a pull; ends by raising
        ``PeerCallError`` / ``WireError`` (or when the caller stops iterating: the call is
        cancelled). The channel counts as busy meanwhile, so idle eviction spares it."""
        call = None
        try:
            with _in_flight(self, address):
                await self._link()
                call = self._channel(address, BULK, peer)[0].unary_stream(
                    "/coterie.v1.Peer/WatchSnapshots", request_serializer=pb.SnapshotRequest.SerializeToString,
                    response_deserializer=None)(
                    pb.SnapshotRequest(requester=requester, chunk_bytes=self.chunk_bytes, min_round=min_round))
                it = call.__aiter__()
                while True:
                    try:
                        h, groups, _ = await self._read_snapshot(address, it, whole_stream=False)
                    except StopAsyncIteration:  # the server ended it between two snapshots
                        return
                    if groups is None:
                        raise WireError(f"snapshot watch on {address}: an empty snapshot (only a header)")
                    self._used[address] = time.monotonic()
                    await self._link()  # the emulated link delays every snapshot, as it does a pull
                    yield serde.snapshot_header_from_pb(h), groups
        finally:
            if call is not None:
                call.cancel()

    # --- compute requests ---
    def _frames(self, header: pb.ComputeHeader, payload: bytes | None) -> AsyncIterator[pb.ComputeFrame]:
        async def gen():
            yield pb.ComputeFrame(header=header)
            if payload:
                for part in split(payload, self.chunk_bytes):
                    yield pb.ComputeFrame(data=part)
        return gen()

    @_domain_errors
    async def compute(self, address: str, request: ComputeRequest, timeout: float | None = None, *,
                      peer: str | None = None) -> ComputeReply:
        t0 = time.perf_counter()
        kind = request.kind
        await self._link()
        payload, digest = None, ""
        if request.groups is not None and request.ref is None:
            def pack(groups=request.groups):
                data = encode(groups)
                return data, sha256(data)
            big = encoded_size(request.groups) > OFF_LOOP_BYTES
            payload, digest = await asyncio.to_thread(pack) if big else pack()
        header = serde.compute_header_to_pb(request, len(payload) if payload else 0, digest)
        frames = self._frames(header, payload)
        stub = self.stub(address, BULK, peer)
        sent = header.ByteSize() + (len(payload) if payload else 0)
        timeout = timeout or self.timeout_s
        if kind == CROSS_LOSS:
            reply = await stub.CrossLoss(frames, timeout=timeout)
            out, received = ComputeReply(loss=reply.loss, samples=reply.samples), reply.ByteSize()
        elif kind == PUSH_GRADIENT:
            ack = await stub.PushGradient(frames, timeout=timeout)
            out, received = ComputeReply(accepted=ack.accepted, message=ack.message), ack.ByteSize()
        elif kind == CROSS_GRADIENT:
            it = stub.CrossGradient(frames, timeout=timeout).__aiter__()
            first = await it.__anext__()
            if first.WhichOneof("body") != "header":
                raise WireError(f"gradient stream from {address} did not start with a header")
            gh = first.header
            grad = None
            data = b""
            if gh.total_bytes:
                data = await collect(it, Assembler(f"gradient from {address}", gh.total_bytes, gh.sha256,
                                                   self.limits.max_model_bytes))
                grad, _ = decode(data, max_bytes=self.limits.max_model_bytes)
            out = ComputeReply(loss=gh.loss, samples=gh.samples, grad=grad, inner_product=gh.inner_product)
            received = first.ByteSize() + len(data)
        else:
            raise ValueError(f"unknown compute request kind {kind!r}")
        self.traffic.record(kind, sent=sent, received=received)
        self._timed(kind, t0)
        return out

    @_domain_errors
    async def gossip(self, address: str, sender: str, key: str, payload: dict[str, Any],
                     timeout: float | None = None, *, peer: str | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        await self._link()
        raw = msgpack.packb(payload, use_bin_type=True)
        if len(raw) > self.limits.max_gossip_bytes:
            raise PeerCallError("invalid", f"gossip payload for {key!r} is {len(raw)} bytes, "
                                           f"over the limit of {self.limits.max_gossip_bytes}")
        req = pb.GossipMessage(node_id=sender, key=key, payload=raw)
        reply = await self.stub(address, BULK, peer).GossipState(req, timeout=timeout or self.timeout_s)
        if len(reply.payload) > self.limits.max_gossip_bytes:
            raise WireError(f"gossip reply from {address} exceeds {self.limits.max_gossip_bytes} bytes")
        self.traffic.record("gossip", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("gossip", t0)
        try:
            out = msgpack.unpackb(reply.payload, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises a zoo of types on garbage
            raise WireError(f"gossip reply from {address} is not msgpack ({e})") from None
        if not isinstance(out, dict):
            raise WireError(f"gossip reply from {address} is not a map")
        return out
