"""The gRPC side a node serves to its peers: decode → gate → encode. It moves bytes: protobuf
frames in and out (through ``serde``), chunking, hash checks, tensor decoding; every request then
goes through the ``gate`` (``gate.py``: claimed id, known peer, references and sizes, admission)
to the ``PeerHandler``, whose business is what a request *means*.

What it adds for gRPC:
- who calls: with mTLS (``tls.py``) the node id a request claims must be the one in the caller's
  certificate, and on the allow-list if there is one (``_GrpcCaller``, which the gate asks);
  otherwise PERMISSION_DENIED;
- how long: uploads must finish within ``upload_timeout_s`` with no gap over ``upload_idle_s``;
  reply streams to a slow reader are cut after ``send_timeout_s``; subscriptions and pull
  sessions are bounded (``max_watches``);
- what: requests arrive as raw bytes and are parsed here, so a malformed message is an
  INVALID_ARGUMENT with a one-line reason, never gRPC's UNKNOWN or INTERNAL with a traceback.
Every refusal's detail is at most ``errors.MAX_MESSAGE`` characters. The unary calls are derived
from their table (``peering/api.py``, ``unary``); the snapshot streams are written here, the
compute streams in ``compute_rpcs.py``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from ...proto.v1 import peer_pb2 as pb
from ..peering import api
from ..peering.api import Unary
from ..peering.errors import exhausted, invalid
from ..peering.interfaces import PeerHandler, SizeLimits, Traffic
from . import serde
from .chunks import data_frames
from .client import KEEPALIVE_MS
from .compute_rpcs import ComputeRpcs
from .gate import Gate
from .health_service import add_health_service
from .replies import Replies
from .serde import parse as _parse
from .served_versions import CodecPolicy, Payload, ServedVersions
from .stream_limits import StreamLimits
from .tls import TLS

MAX_WATCH_WAIT_S = 30.0  # a subscription with no new round for this long ends
SESSION_IDLE_S = 120.0  # a pull session with no request for this long ends (readers close theirs at 60 s)
# HTTP/2 streams one connection may hold open (gRPC's default: no limit). A last resort far above
# the bounds that answer with a reason — the global cap on calls in flight (limits.max_rpcs) and
# admission's per-peer ones — because gRPC refuses a stream past this cap with a bare RST_STREAM
# (REFUSED_STREAM: the caller reads UNAVAILABLE), and its client does not wait for the setting: at
# 64, a burst of 100 calls on one connection lost the refusal reason for 14 of them (issue 22).
MAX_STREAMS_PER_CONNECTION = 4096


class PeerService:
    """The Peer service: the unary calls derived from their table, the snapshot streams here,
    the compute streams in its ``compute`` part; both answer through ``replies`` (guard, caller,
    bounded sends)."""

    def __init__(
        self,
        gate: Gate,
        traffic: Traffic,
        *,
        chunk_bytes: int,
        tls: TLS | None,
        streams: StreamLimits = StreamLimits(),
        codecs: CodecPolicy = CodecPolicy(),
    ):
        self.gate = gate
        self.replies = Replies(traffic, tls, streams)
        self.compute = ComputeRpcs(gate, traffic, self.replies, streams=streams, codecs=codecs, chunk_bytes=chunk_bytes)
        self.codecs = codecs
        self.served = ServedVersions(codecs)  # payloads per codec, and the versions deltas start from
        self.traffic = traffic
        self.chunk_bytes = chunk_bytes
        self.tls = tls
        self.streams = streams
        self._watchers: set[str] = set()  # peers with a snapshot subscription open
        self._sessions: dict[str, _Session] = {}  # peer -> its open pull session

    def method(self, name: str) -> Callable[..., Any]:
        """The servicer method of a stream RPC (the unary ones: ``unary``)."""
        return getattr(self.compute, name, None) or getattr(self, name)

    # --- the unary calls (peering/api.py): parse → gate → encode, one method for all ---
    def unary(self, rpc: Unary) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
        """The servicer method of ``rpc``: its request parsed from raw bytes (malformed: a refusal
        naming it), the gate's one path, the reply encoded; both counted in traffic."""
        wire = serde.WIRE[rpc.name]

        async def method(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            async def go():
                request = wire.request_from_pb(_parse(wire.request, raw, rpc.said))
                reply = wire.reply_to_pb(await self.gate.unary(rpc, self.replies.caller(context), request))
                self.traffic.record(rpc.kind, received=len(raw), sent=reply.ByteSize())
                return reply

            return await self.replies.guard(context, rpc.kind, go())

        method.__name__ = rpc.name
        return method

    # --- snapshots ---
    async def _pull(
        self,
        context,
        raw: bytes,
        slot: contextlib.ExitStack,
        what: str = "snapshot request",
        admit_first: Callable[[str], None] | None = None,
    ):
        """Parse, authenticate and admit one snapshot request (its admission slot held by
        ``slot``), then the snapshot to answer it with (waiting for ``min_round`` if asked)."""
        request = _parse(pb.SnapshotRequest, raw, what)
        who = self.gate.requester(self.replies.caller(context), request.requester, what)
        if admit_first is not None:  # this server's own bound (a pull session's), before admission
            admit_first(who)
        return request, who, await self.gate.snapshot(who, request.min_round, request.wait_ms / 1000.0, slot)

    async def _snapshot_frames(
        self, request, snap, *, inline: bool, reader: tuple[str, str], have: tuple[int, str] | None = None
    ) -> tuple[Iterable[Any], int, str]:
        """A snapshot's reply messages, their size and the payload's digest: its header alone
        when the reader has this version, else the header and the payload in the codec agreed
        with the reader (a delta against what it holds if it asks: ``ServedVersions``) — in the
        header's message when it fits one chunk and ``inline`` (watch, session), else in chunks
        framed by hand from the payload's one buffer as they go out. ``have``: (version, payload
        digest) the reader holds when the stream knows better than the request (a watch's last).
        ``reader``: (peer, "pull" or "watch"): the server keeps what it last sent each reader, the
        base its next delta may be against."""
        have_version, have_sha256 = have if have is not None else (request.have_version, request.have_sha256)
        unchanged = have_version == snap.version and have_version > 0
        if unchanged:
            header = serde.snapshot_header_to_pb(snap.header(True), 0)
            return (pb.SnapshotChunk(header=header),), header.ByteSize(), ""
        payload = await self.served.payload(
            snap,
            list(request.codecs),
            delta=request.delta,
            have_version=have_version,
            have_sha256=have_sha256,
            reader=reader,
        )
        header = serde.snapshot_header_to_pb(snap.header(False), len(payload.data), _payload_fields(request, payload))
        size = header.ByteSize() + len(payload.data)
        if inline and len(payload.data) <= self.chunk_bytes:
            return (pb.SnapshotChunk(header=header, inline=bytes(payload.data)),), size, payload.digest
        frames = itertools.chain((pb.SnapshotChunk(header=header),), data_frames(payload.data, self.chunk_bytes))
        return frames, size, payload.digest

    async def GetSnapshot(self, raw: bytes, context):
        t0 = time.perf_counter()
        with contextlib.ExitStack() as slot:
            request, who, snap = await self.replies.guard(context, "snapshot", self._pull(context, raw, slot))
            frames, size, _ = await self._snapshot_frames(request, snap, inline=False, reader=(who, "pull"))
            sent = await self.replies.send(context, frames, f"snapshot for {who}", size=size)
        self.traffic.record("snapshot", sent=sent)
        self.traffic.latency("snapshot", time.perf_counter() - t0, "server")

    async def PullSnapshots(self, requests, context):
        """A pull session: one peer's snapshot requests on one stream, each answered as
        ``GetSnapshot`` answers one — authenticated, the peer still known, admitted and rate
        limited like a pull — so a peer pulled from again and again costs a message, not a call.
        The reader sets the pace (one answer per request, the next request read when the answer
        is out): nothing is pushed that was not asked for. Bounded like subscriptions: one
        session per peer — a newer one replaces it (the old one of a peer that restarted or
        reconnected lingers until its connection is found dead; refusing the new one would keep
        the peer on plain calls meanwhile) — and ``max_watches`` sessions in all; every request
        must come from the peer that opened it; a session idle for ``SESSION_IDLE_S`` ends; a
        refusal ends it with its status (the reader pulls, or opens another)."""
        it = requests.__aiter__()
        me = _Session()

        def admit_session(who: str) -> None:
            if me.peer is not None:
                if who != me.peer:  # (with mTLS _who already ties every request to the certificate)
                    raise invalid(f"snapshot session of {me.peer}: a request from {who}")
                return
            older = self._sessions.get(who)
            if older is None and len(self._sessions) >= self.streams.max_watches:
                raise exhausted(
                    f"snapshot session from {who}: {len(self._sessions)} open, the limit is {self.streams.max_watches}"
                )
            if older is not None:
                older.replace()
            self._sessions[who] = me
            me.peer = who

        try:
            while True:
                if me.replaced:
                    await context.abort(
                        grpc.StatusCode.CANCELLED, f"snapshot session of {me.peer}: replaced by a newer one"
                    )
                me.next = asyncio.ensure_future(it.__anext__())
                try:
                    raw = await asyncio.wait_for(me.next, SESSION_IDLE_S)
                except (StopAsyncIteration, asyncio.TimeoutError):
                    return  # the reader closed it, or has not asked for a while
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if me.replaced and task is not None and not task.cancelling():
                        continue  # (only the wait was cancelled: end it with its reason, above)
                    raise
                t0 = time.perf_counter()
                with contextlib.ExitStack() as slot:
                    request, who, snap = await self.replies.guard(
                        context, "snapshot", self._pull(context, raw, slot, "snapshot session", admit_session)
                    )
                    frames, size, _ = await self._snapshot_frames(request, snap, inline=True, reader=(who, "pull"))
                    try:
                        sent = await self.replies.send(context, frames, f"snapshot for {who}", size=size)
                    except Exception as e:
                        if _reader_gone(context, e):
                            return
                        raise
                # the snapshot and its frames are not held while the next request is awaited (up to
                # SESSION_IDLE_S): else a superseded 21 MB snapshot stays alive per idle session
                del request, snap, frames
                self.traffic.record("snapshot", sent=sent)
                self.traffic.latency("snapshot", time.perf_counter() - t0, "server")
        finally:
            if me.peer is not None and self._sessions.get(me.peer) is me:
                del self._sessions[me.peer]

    async def WatchSnapshots(self, raw: bytes, context):
        """A subscription: each snapshot this node publishes from ``min_round`` on, pushed when
        it is published (the newest one if the reader fell behind: flow control holds the writes
        meanwhile). Bounded: one subscription per peer, ``max_watches`` in all, each opening
        admitted like a pull; a peer that stops being known ends it (``h.snapshot`` checks that
        for every snapshot), so does a round not published within ``MAX_WATCH_WAIT_S``; a reader
        that stops taking one is cut off like a slow pull."""

        def bound(who: str) -> None:
            if who in self._watchers:
                raise exhausted(f"snapshot watch from {who}: it already has one open")
            if len(self._watchers) >= self.streams.max_watches:
                raise exhausted(
                    f"snapshot watch from {who}: {len(self._watchers)} open, the limit is {self.streams.max_watches}"
                )

        async def go():
            request = _parse(pb.SnapshotRequest, raw, "snapshot watch")
            who = self.gate.requester(self.replies.caller(context), request.requester, "snapshot watch")
            bound(who)  # this server's count of open subscriptions, before admission
            self.gate.open_watch(who)
            return request, who

        request, who = await self.replies.guard(context, "watch", go())
        self._watchers.add(who)

        async def push():
            next_round, last = request.min_round, 0
            have: tuple[int, str] | None = None  # what the reader holds: the last snapshot sent here
            while True:
                snap = await self.gate.watched(who, next_round, MAX_WATCH_WAIT_S)
                if snap.version == last or snap.round < next_round:
                    return  # nothing new within the wait: end it (the reader pulls, or subscribes again)
                t0 = time.perf_counter()
                frames, size, digest = await self._snapshot_frames(
                    request, snap, inline=True, reader=(who, "watch"), have=have
                )
                try:
                    sent = await self.replies.send(context, frames, f"snapshot watch of {who}", size=size)
                except Exception as e:
                    if _reader_gone(context, e):
                        return  # the reader closed it (the write in flight fails): nothing to report
                    raise
                self.traffic.record("snapshot", sent=sent)
                self.traffic.latency("snapshot-push", time.perf_counter() - t0, "server")
                last, next_round = snap.version, snap.round + 1
                have = (snap.version, digest)
                del snap, frames  # (not held while the next one is awaited)

        try:  # a refusal on the way (the peer no longer known, ...) ends it with its status
            await self.replies.guard(context, "watch", push())
        finally:
            self._watchers.discard(who)


def _payload_fields(request, p: Payload) -> dict[str, Any]:
    """The header fields that say how the payload is encoded. A request that named no codec
    (an older peer) gets a whole fp32 payload and a header exactly as before."""
    if not request.codecs or (p.codec == "fp32" and p.base is None):
        return {}  # (a whole fp32 payload's digest is the snapshot's own: nothing to add)
    out: dict[str, Any] = {"codec": p.codec, "payload_sha256": p.digest}
    if p.base is not None:
        out["base_version"], out["base_sha256"] = p.base
    return out


class _Session:
    """A pull session being served: whose it is, and the wait for its next request (cancelled
    when a newer session of the same peer replaces it)."""

    __slots__ = ("peer", "next", "replaced")

    def __init__(self) -> None:
        self.peer: str | None = None
        self.next: asyncio.Future | None = None
        self.replaced = False

    def replace(self) -> None:
        """End it at its next wait for a request (at once if it is waiting; an answer being
        prepared or sent is finished first)."""
        self.replaced = True
        if self.next is not None:
            self.next.cancel()


def _reader_gone(context, err: Exception) -> bool:
    """Whether a failed write means only that the reader went away (cancelled or closed the
    call while a reply was going out), which is not worth a report."""
    me = asyncio.current_task()
    return (
        context.cancelled()
        or context.done()
        or (me is not None and me.cancelling() > 0)
        or type(err).__name__ == "ExecuteBatchError"
    )  # (cygrpc's "the call is gone")


def _serialize(msg: Any) -> bytes:
    """Messages pass through protobuf, except frames already serialised (snapshot chunks)."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _handlers(servicer: PeerService) -> grpc.GenericRpcHandler:
    """The Peer service's method table, derived from the proto descriptor (as the generated
    ``add_PeerServicer_to_server`` does), but requests arrive as raw bytes (parsed by the
    servicer: a malformed one is refused with a reason, not a deserialisation traceback) and
    replies may be pre-serialised frames. The unary calls are the table's (``api.UNARY``), the
    streams the servicer's own methods."""
    service = pb.DESCRIPTOR.services_by_name["Peer"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    table = {}
    for m in service.methods:
        make = kinds[(m.client_streaming, m.server_streaming)]
        rpc = api.BY_NAME.get(m.name)
        method = servicer.unary(rpc) if rpc is not None else servicer.method(m.name)
        table[m.name] = make(method, request_deserializer=None, response_serializer=_serialize)
    return grpc.method_handlers_generic_handler(service.full_name, table)


class HealthStatus:
    """The standard gRPC health service of a peer server; the node sets it NOT_SERVING while
    something keeps it from progressing (see node/failures.py)."""

    SERVICES = ("", "coterie.v1.Peer")

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.serving = True

    async def set(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self.SERVICES:
            await self.servicer.set(service, status)


async def serve(
    handler: PeerHandler,
    traffic: Traffic,
    address: str,
    *,
    tls: TLS | None,
    chunk_bytes: int = 1 << 20,
    max_model_bytes: int = 1 << 31,
    max_gossip_bytes: int = 1 << 20,
    streams: StreamLimits = StreamLimits(),
    codecs: CodecPolicy = CodecPolicy(),
    max_rpcs: int | None = None,
    health_status: HealthStatus | None = None,
    limits: SizeLimits | None = None,
    reflection_on: bool = False,
    relay: Any = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the peer server (and the standard gRPC health service) on ``address``: mTLS with
    ``tls``, plaintext only when the caller passes ``tls=None`` on purpose. ``limits``: the
    node's ``SizeLimits`` (shared with its clients); else one of ``max_model_bytes`` and
    ``max_gossip_bytes``. ``relay``: a ``RelayService`` served beside Peer."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # our clients' keepalive pings (client.KEEPALIVE_MS, also on idle
            # connections) are welcome; by default the server allows one per
            # 5 min and sent GOAWAY too_many_pings during minute-long transfers
            # on a 10 Mbit/s link. A client pinging faster still gets GOAWAY.
            # (The arg is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, whose
            # string has no "recv" in it: spelt after the macro, gRPC ignored it.)
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ],
        maximum_concurrent_rpcs=max_rpcs,
    )
    if limits is None:
        limits = SizeLimits(max_model_bytes, max_gossip_bytes)
    service = PeerService(
        Gate(handler, limits), traffic, chunk_bytes=chunk_bytes, tls=tls, streams=streams, codecs=codecs
    )
    server.add_generic_rpc_handlers((_handlers(service),))
    health_status = health_status or HealthStatus()
    add_health_service(health_status.servicer, server)  # malformed requests: INVALID_ARGUMENT, no traceback
    if relay is not None:  # the Relay service (relay_service.py) for outbound-only peers
        from .relay_service import handlers as relay_handlers

        server.add_generic_rpc_handlers((relay_handlers(relay),))
    if reflection_on:  # security.reflection: lets grpcurl/grpcui list and call the peer service
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Peer"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )  # (over mTLS too: grpcurl -cacert ca.pem -cert node.pem -key node.key -authority coterie-peer)
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError:  # grpc raises "Failed to bind to address" for a taken port
        port = 0
    if port == 0:
        raise OSError(f"cannot bind the peer address {address}: the port is in use or not available here")
    await server.start()
    await health_status.set(health_status.serving)
    return server, port
