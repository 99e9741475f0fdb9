"""The gRPC side a node serves to its peers. It moves bytes and checks sizes and hashes; what a
request *means* (whose model, which data, which strategy) is the ``PeerHandler``'s business."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import msgpack
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ...proto.v1 import peer_pb2 as pb
from ...proto.v1 import peer_pb2_grpc as rpc
from ..wire.codec import Groups, WireError, decode, encode
from .chunks import Assembler, collect, sha256, split
from .errors import PeerError, invalid

log = logging.getLogger(__name__)

# After refusing a streamed request, keep reading (and discarding) what the sender still has in
# flight before sending the status: if the server closes first, the sender's next write fails and
# grpc reports a bare INTERNAL "execute_batch" error instead of our reason (HTTP servers do the
# same "lingering close"). Bounded so a hostile sender cannot keep the call open.
LINGER_BYTES = 64 << 20
LINGER_S = 2.0


async def _linger(frames) -> None:
    async def drain() -> None:
        drained = 0
        async for msg in frames:
            drained += msg.ByteSize()
            if drained > LINGER_BYTES:
                return

    try:
        await asyncio.wait_for(drain(), LINGER_S)
    except (asyncio.TimeoutError, grpc.RpcError):
        pass


@dataclass(frozen=True)
class Published:
    """A snapshot as this node serves it: encoded and cut into chunks once per publish, then
    streamed to every puller without further copies."""
    node_id: str
    version: int
    round: int
    data: bytes
    sha256: str
    chunk_bytes: int = 1 << 20
    frames: tuple[bytes, ...] = field(default=(), compare=False)  # serialised SnapshotChunk messages

    def __post_init__(self) -> None:
        if not self.frames and self.data:
            object.__setattr__(self, "frames", tuple(pb.SnapshotChunk(data=part).SerializeToString()
                                                     for part in split(self.data, self.chunk_bytes)))


class Stats(Protocol):
    def record(self, kind: str, *, sent: int = 0, received: int = 0) -> None: ...
    def latency(self, kind: str, seconds: float, side: str) -> None: ...


class PeerHandler(Protocol):
    chunk_bytes: int
    max_model_bytes: int
    max_gossip_bytes: int
    stats: Stats

    def info(self) -> pb.NodeInfo: ...
    def on_handshake(self, remote: pb.NodeInfo, peer_addr: str) -> list[pb.PeerEntry]: ...
    def on_heartbeat(self, node_id: str, round: int, version: int) -> tuple[int, int]: ...
    def on_peer_list(self, sender: str, entries: list[pb.PeerEntry]) -> list[pb.PeerEntry]: ...
    def published(self) -> Published | None: ...
    def check_known(self, node_id: str) -> None: ...
    def resolve_ref(self, ref: pb.SnapshotRef) -> Groups: ...
    async def cross_loss(self, requester: str, groups: Groups, h: pb.ComputeHeader) -> tuple[float, int]: ...
    async def cross_gradient(self, requester: str, groups: Groups, h: pb.ComputeHeader
                             ) -> tuple[Groups | None, float, int, float]: ...
    async def push_gradient(self, requester: str, groups: Groups, h: pb.ComputeHeader) -> tuple[bool, str]: ...
    async def gossip(self, requester: str, key: str, payload: dict[str, Any]) -> dict[str, Any]: ...


class PeerService(rpc.PeerServicer):
    def __init__(self, handler: PeerHandler):
        self.h = handler

    async def _guard(self, context: grpc.aio.ServicerContext, kind: str, coro, stream=None):
        """Run a handler call; turn PeerError/WireError into a status the caller can read.
        ``stream``: the request stream, drained before refusing (see ``LINGER_BYTES``)."""
        t0 = time.perf_counter()
        try:
            return await coro
        except (PeerError, WireError) as e:
            code, message = ((e.code, e.message) if isinstance(e, PeerError)
                             else (grpc.StatusCode.INVALID_ARGUMENT, str(e)))
            log.warning("refused %s from %s: %s", kind, context.peer(), message)
            if stream is not None:
                await _linger(stream)
            await context.abort(code, message)
        finally:
            self.h.stats.latency(kind, time.perf_counter() - t0, "server")

    # --- membership ---
    async def Handshake(self, request, context):
        async def go():
            self.h.stats.record("handshake", received=request.ByteSize())
            peers = self.h.on_handshake(request.node, context.peer())
            reply = pb.HandshakeReply(node=self.h.info(), peers=peers)
            self.h.stats.record("handshake", sent=reply.ByteSize())
            return reply
        return await self._guard(context, "handshake", go())

    async def Heartbeat(self, request, context):
        async def go():
            rnd, ver = self.h.on_heartbeat(request.node_id, request.round, request.snapshot_version)
            reply = pb.HeartbeatReply(node_id=self.h.info().node_id, round=rnd, snapshot_version=ver,
                                      echo_sent_at=request.sent_at)
            self.h.stats.record("heartbeat", received=request.ByteSize(), sent=reply.ByteSize())
            return reply
        return await self._guard(context, "heartbeat", go())

    async def ExchangePeers(self, request, context):
        async def go():
            self.h.check_known(request.node_id)
            entries = self.h.on_peer_list(request.node_id, list(request.peers))
            reply = pb.PeerList(node_id=self.h.info().node_id, peers=entries)
            self.h.stats.record("peers", received=request.ByteSize(), sent=reply.ByteSize())
            return reply
        return await self._guard(context, "peers", go())

    # --- snapshots ---
    async def GetSnapshot(self, request, context):
        t0 = time.perf_counter()
        try:
            self.h.check_known(request.requester)
        except PeerError as e:
            await context.abort(e.code, e.message)
        snap = self.h.published()
        if snap is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no snapshot published yet")
        unchanged = request.have_version == snap.version and request.have_version > 0
        header = pb.SnapshotHeader(node_id=snap.node_id, version=snap.version, round=snap.round,
                                   sha256=snap.sha256, total_bytes=len(snap.data), unchanged=unchanged)
        yield pb.SnapshotChunk(header=header)
        sent = header.ByteSize()
        if not unchanged:
            for frame in snap.frames:  # pre-serialised at publish time: no per-puller copies
                yield frame
                sent += len(frame)
        self.h.stats.record("snapshot", sent=sent)
        self.h.stats.latency("snapshot", time.perf_counter() - t0, "server")

    # --- compute on my data ---
    async def _read_compute(self, frames, kind: str) -> tuple[pb.ComputeHeader, Groups]:
        it = frames.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        if first is None or first.WhichOneof("body") != "header":
            raise invalid(f"{kind}: stream must start with a header frame")
        h = first.header
        self.h.check_known(h.requester)
        who = f"{kind} from {h.requester}"
        if h.HasField("ref"):
            self.h.stats.record(kind, received=first.ByteSize())
            return h, self.h.resolve_ref(h.ref)
        limit = self.h.max_gossip_bytes if kind == "gossip" else self.h.max_model_bytes
        asm = Assembler(who, h.total_bytes, h.sha256, limit)
        data = await collect(it, asm)
        self.h.stats.record(kind, received=first.ByteSize() + len(data))
        try:
            groups, _ = decode(data, max_bytes=limit)
        except WireError as e:
            raise invalid(f"{who}: {e}") from None
        return h, groups

    async def CrossLoss(self, request_iterator, context):
        async def go():
            h, groups = await self._read_compute(request_iterator, "cross_loss")
            loss, n = await self.h.cross_loss(h.requester, groups, h)
            reply = pb.LossReply(loss=loss, samples=n)
            self.h.stats.record("cross_loss", sent=reply.ByteSize())
            return reply
        return await self._guard(context, "cross_loss", go(), request_iterator)

    async def CrossGradient(self, request_iterator, context):
        async def go():
            h, groups = await self._read_compute(request_iterator, "cross_gradient")
            return await self.h.cross_gradient(h.requester, groups, h)
        result = await self._guard(context, "cross_gradient", go(), request_iterator)
        grad, loss, n, ip = result
        data = encode(grad) if grad is not None else b""
        header = pb.GradientHeader(loss=loss, samples=n, total_bytes=len(data),
                                   sha256=sha256(data) if data else "", inner_product=ip)
        yield pb.GradientChunk(header=header)
        for part in split(data, self.h.chunk_bytes):
            yield pb.GradientChunk(data=part)
        self.h.stats.record("cross_gradient", sent=header.ByteSize() + len(data))

    async def PushGradient(self, request_iterator, context):
        async def go():
            h, groups = await self._read_compute(request_iterator, "push_gradient")
            ok, msg = await self.h.push_gradient(h.requester, groups, h)
            return pb.Ack(accepted=ok, message=msg)
        return await self._guard(context, "push_gradient", go(), request_iterator)

    async def GossipState(self, request, context):
        async def go():
            self.h.check_known(request.node_id)
            if len(request.payload) > self.h.max_gossip_bytes:
                raise invalid(f"gossip from {request.node_id}: {len(request.payload)} bytes exceeds "
                              f"the limit of {self.h.max_gossip_bytes}")
            try:
                payload = msgpack.unpackb(request.payload, raw=False, strict_map_key=False)
            except Exception as e:
                raise invalid(f"gossip from {request.node_id}: payload is not msgpack ({e})") from None
            if not isinstance(payload, dict):
                raise invalid(f"gossip from {request.node_id}: payload is not a map")
            reply = await self.h.gossip(request.node_id, request.key, payload)
            out = pb.GossipMessage(node_id=self.h.info().node_id, key=request.key,
                                   payload=msgpack.packb(reply, use_bin_type=True))
            self.h.stats.record("gossip", received=request.ByteSize(), sent=out.ByteSize())
            return out
        return await self._guard(context, "gossip", go())


def _serialize(msg: Any) -> bytes:
    """Messages pass through protobuf, except frames already serialised (snapshot chunks)."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _handlers(servicer: PeerService) -> grpc.GenericRpcHandler:
    """The Peer service's method table, derived from the proto descriptor (as the generated
    ``add_PeerServicer_to_server`` does) but with a serializer that passes pre-serialised frames."""
    service = pb.DESCRIPTOR.services_by_name["Peer"]
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    table = {}
    for m in service.methods:
        request_cls = getattr(pb, m.input_type.name)
        make = kinds[(m.client_streaming, m.server_streaming)]
        table[m.name] = make(getattr(servicer, m.name), request_deserializer=request_cls.FromString,
                             response_serializer=_serialize)
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
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in self.SERVICES:
            await self.servicer.set(service, status)


async def serve(handler: PeerHandler, address: str,
                health_status: HealthStatus | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the peer server (and the standard gRPC health service) on ``address``."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_handlers(PeerService(handler)),))
    health_status = health_status or HealthStatus()
    health_pb2_grpc.add_HealthServicer_to_server(health_status.servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind peer address {address}")
    await server.start()
    await health_status.set(health_status.serving)
    return server, port
