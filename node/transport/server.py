"""The gRPC side a node serves to its peers. It moves bytes: protobuf frames in and out (through
``peering/serde``), chunking, size and hash checks, tensor decoding. What a request *means*
(whose model, which data, which strategy) is the ``PeerHandler``'s business."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import msgpack
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...proto.v1 import peer_pb2 as pb
from ..peering import serde
from ..peering.errors import Refusal, invalid
from ..peering.interfaces import PeerHandler, Traffic
from ..peering.messages import CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, LocalSnapshot
from ..wire.codec import WireError, decode, encode
from .chunks import Assembler, collect, sha256, split
from .errors import status_of

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


class _Frames:
    """A snapshot cut into serialised ``SnapshotChunk`` messages once, then streamed to every
    puller without further copies (one snapshot at a time: the current one)."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self._snap: LocalSnapshot | None = None
        self._frames: tuple[bytes, ...] = ()

    def of(self, snap: LocalSnapshot) -> tuple[bytes, ...]:
        if self._snap is not snap:
            self._frames = tuple(pb.SnapshotChunk(data=part).SerializeToString()
                                 for part in split(snap.encoded, self.chunk_bytes))
            self._snap = snap
        return self._frames


class PeerService:
    def __init__(self, handler: PeerHandler, traffic: Traffic, *, chunk_bytes: int,
                 max_model_bytes: int, max_gossip_bytes: int):
        self.h = handler
        self.traffic = traffic
        self.chunk_bytes = chunk_bytes
        self.max_model_bytes = max_model_bytes
        self.max_gossip_bytes = max_gossip_bytes
        self._frames = _Frames(chunk_bytes)

    async def _guard(self, context: grpc.aio.ServicerContext, kind: str, coro, stream=None):
        """Run a handler call; turn a Refusal/WireError into a status the caller can read.
        ``stream``: the request stream, drained before refusing (see ``LINGER_BYTES``)."""
        t0 = time.perf_counter()
        try:
            return await coro
        except (Refusal, WireError) as e:
            code, message = ((status_of(e), e.message) if isinstance(e, Refusal)
                             else (grpc.StatusCode.INVALID_ARGUMENT, str(e)))
            log.warning("refused %s from %s: %s", kind, context.peer(), message)
            if stream is not None:
                await _linger(stream)
            await context.abort(code, message)
        finally:
            self.traffic.latency(kind, time.perf_counter() - t0, "server")

    # --- membership ---
    async def Handshake(self, request, context):
        async def go():
            self.traffic.record("handshake", received=request.ByteSize())
            entries = self.h.on_handshake(serde.node_info_from_pb(request.node))
            reply = pb.HandshakeReply(node=serde.node_info_to_pb(self.h.info()),
                                      peers=serde.entries_to_pb(entries))
            self.traffic.record("handshake", sent=reply.ByteSize())
            return reply
        return await self._guard(context, "handshake", go())

    async def Heartbeat(self, request, context):
        async def go():
            reply = serde.beat_to_reply(self.h.on_heartbeat(serde.beat_from_request(request)))
            self.traffic.record("heartbeat", received=request.ByteSize(), sent=reply.ByteSize())
            return reply
        return await self._guard(context, "heartbeat", go())

    async def ExchangePeers(self, request, context):
        async def go():
            entries = self.h.on_peer_list(request.node_id, serde.entries_from_pb(request.peers))
            reply = pb.PeerList(node_id=self.h.node_id, peers=serde.entries_to_pb(entries))
            self.traffic.record("peers", received=request.ByteSize(), sent=reply.ByteSize())
            return reply
        return await self._guard(context, "peers", go())

    # --- snapshots ---
    async def GetSnapshot(self, request, context):
        t0 = time.perf_counter()
        snap = await self._guard(context, "snapshot", self.h.snapshot(
            request.requester, request.min_round, request.wait_ms / 1000.0))
        unchanged = request.have_version == snap.version and request.have_version > 0
        frames = () if unchanged else self._frames.of(snap)
        header = serde.snapshot_header_to_pb(snap.header(unchanged), 0 if unchanged else len(snap.encoded))
        yield pb.SnapshotChunk(header=header)
        sent = header.ByteSize()
        for frame in frames:  # pre-serialised: no per-puller copies
            yield frame
            sent += len(frame)
        self.traffic.record("snapshot", sent=sent)
        self.traffic.latency("snapshot", time.perf_counter() - t0, "server")

    # --- compute on my data ---
    async def _read_compute(self, frames, kind: str):
        it = frames.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        if first is None or first.WhichOneof("body") != "header":
            raise invalid(f"{kind}: stream must start with a header frame")
        h = first.header
        req = serde.compute_request_from_pb(kind, h)
        self.h.check_known(req.requester)  # before reading a payload from a stranger
        if req.ref is not None:
            self.traffic.record(kind, received=first.ByteSize())
            return req
        who = f"{kind} from {req.requester}"
        asm = Assembler(who, h.total_bytes, h.sha256, self.max_model_bytes)
        data = await collect(it, asm)
        self.traffic.record(kind, received=first.ByteSize() + len(data))
        try:
            req.groups, _ = decode(data, max_bytes=self.max_model_bytes)
        except WireError as e:
            raise invalid(f"{who}: {e}") from None
        return req

    async def CrossLoss(self, request_iterator, context):
        async def go():
            reply = await self.h.compute(await self._read_compute(request_iterator, CROSS_LOSS))
            out = serde.loss_reply_to_pb(reply)
            self.traffic.record(CROSS_LOSS, sent=out.ByteSize())
            return out
        return await self._guard(context, CROSS_LOSS, go(), request_iterator)

    async def CrossGradient(self, request_iterator, context):
        async def go():
            return await self.h.compute(await self._read_compute(request_iterator, CROSS_GRADIENT))
        reply = await self._guard(context, CROSS_GRADIENT, go(), request_iterator)
        data = encode(reply.grad) if reply.grad is not None else b""
        header = serde.gradient_header_to_pb(reply, len(data), sha256(data) if data else "")
        yield pb.GradientChunk(header=header)
        for part in split(data, self.chunk_bytes):
            yield pb.GradientChunk(data=part)
        self.traffic.record(CROSS_GRADIENT, sent=header.ByteSize() + len(data))

    async def PushGradient(self, request_iterator, context):
        async def go():
            reply = await self.h.compute(await self._read_compute(request_iterator, PUSH_GRADIENT))
            return serde.ack_to_pb(reply)
        return await self._guard(context, PUSH_GRADIENT, go(), request_iterator)

    async def GossipState(self, request, context):
        async def go():
            sender = request.node_id
            self.h.check_known(sender)
            if len(request.payload) > self.max_gossip_bytes:
                raise invalid(f"gossip from {sender}: {len(request.payload)} bytes exceeds "
                              f"the limit of {self.max_gossip_bytes}")
            try:
                payload = msgpack.unpackb(request.payload, raw=False, strict_map_key=False)
            except Exception as e:  # msgpack raises a zoo of types on garbage
                raise invalid(f"gossip from {sender}: payload is not msgpack ({e})") from None
            if not isinstance(payload, dict):
                raise invalid(f"gossip from {sender}: payload is not a map")
            reply = await self.h.gossip(sender, request.key, payload)
            out = pb.GossipMessage(node_id=self.h.node_id, key=request.key,
                                   payload=msgpack.packb(reply, use_bin_type=True))
            self.traffic.record("gossip", received=request.ByteSize(), sent=out.ByteSize())
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


async def serve(handler: PeerHandler, traffic: Traffic, address: str, *, chunk_bytes: int = 1 << 20,
                max_model_bytes: int = 1 << 31, max_gossip_bytes: int = 1 << 20
                ) -> tuple[grpc.aio.Server, int]:
    """Start the peer server (and the standard gRPC health service) on ``address``."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service = PeerService(handler, traffic, chunk_bytes=chunk_bytes, max_model_bytes=max_model_bytes,
                          max_gossip_bytes=max_gossip_bytes)
    server.add_generic_rpc_handlers((_handlers(service),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(  # lets grpcurl/grpcui list and call the peer service
        (pb.DESCRIPTOR.services_by_name["Peer"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc raises "Failed to bind to address" for a taken port
        port = 0
    if port == 0:
        raise OSError(f"cannot bind the peer address {address}: the port is in use or not available here")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("coterie.v1.Peer", health_pb2.HealthCheckResponse.SERVING)
    return server, port
