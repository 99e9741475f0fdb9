"""The calling side of the gRPC peer plane (``peering.interfaces.PeerTransport``): one cached
channel per peer address, chunked streams, size and hash checks on everything that comes back,
tensors decoded into domain objects. Every call is bounded by a deadline; every failure leaves
as a ``PeerCallError`` (a malformed reply as a ``WireError``)."""
from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, AsyncIterator

import grpc
import msgpack

from ...proto.v1 import peer_pb2 as pb
from ...proto.v1 import peer_pb2_grpc as rpc
from ..peering import serde
from ..peering.errors import PeerCallError, Refusal
from ..peering.interfaces import Traffic
from ..peering.messages import (CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, Beat, ComputeReply, ComputeRequest,
                                NodeInfo, PeerEntry, SnapshotHeader)
from ..wire.codec import Groups, WireError, decode, encode
from .chunks import Assembler, collect, data_field, sha256, split
from .errors import call_error

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # a dead peer must fail fast instead of sitting in exponential reconnect backoff
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def _domain_errors(fn):
    """gRPC failures become PeerCallError; a malformed stream (bad chunk, size, hash) a WireError."""
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
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
    return wrapper


class PeerClient:
    def __init__(self, node_id: str, traffic: Traffic, *, chunk_bytes: int, max_model_bytes: int,
                 max_gossip_bytes: int, timeout_s: float, delay_ms: float = 0.0):
        self.node_id = node_id
        self.traffic = traffic
        self.chunk_bytes = chunk_bytes
        self.max_model_bytes = max_model_bytes
        self.max_gossip_bytes = max_gossip_bytes
        self.timeout_s = timeout_s
        self.delay_s = delay_ms / 1000.0  # emulated one-way link latency (testbed)
        self._stubs: dict[str, tuple[grpc.aio.Channel, rpc.PeerStub]] = {}

    def stub(self, address: str) -> rpc.PeerStub:
        if address not in self._stubs:
            ch = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._stubs[address] = (ch, rpc.PeerStub(ch))
        return self._stubs[address][1]

    def _raw_snapshot_call(self, address: str):
        """GetSnapshot with chunk messages left as raw bytes: the payload is sliced out of each
        message without protobuf building (and copying) a message object per MiB."""
        self.stub(address)
        return self._stubs[address][0].unary_stream(
            "/coterie.v1.Peer/GetSnapshot", request_serializer=pb.SnapshotRequest.SerializeToString,
            response_deserializer=None)

    async def forget(self, address: str) -> None:
        entry = self._stubs.pop(address, None)
        if entry:
            await entry[0].close()

    async def close(self) -> None:
        for address in list(self._stubs):
            await self.forget(address)

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
        reply = await self.stub(address).Handshake(req, timeout=timeout)
        self.traffic.record("handshake", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("handshake", t0)
        return serde.node_info_from_pb(reply.node), serde.entries_from_pb(reply.peers)

    @_domain_errors
    async def heartbeat(self, address: str, beat: Beat, timeout: float) -> tuple[Beat, float]:
        t0 = time.perf_counter()
        await self._link()
        req = serde.beat_to_request(beat)
        reply = await self.stub(address).Heartbeat(req, timeout=timeout)
        rtt = time.perf_counter() - t0
        self.traffic.record("heartbeat", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("heartbeat", t0)
        return serde.beat_from_reply(reply), rtt

    @_domain_errors
    async def exchange_peers(self, address: str, sender: str, entries: list[PeerEntry],
                             timeout: float) -> list[PeerEntry]:
        await self._link()
        req = pb.PeerList(node_id=sender, peers=serde.entries_to_pb(entries))
        reply = await self.stub(address).ExchangePeers(req, timeout=timeout)
        self.traffic.record("peers", sent=req.ByteSize(), received=reply.ByteSize())
        return serde.entries_from_pb(reply.peers)

    # --- snapshots ---
    @_domain_errors
    async def get_snapshot(self, address: str, requester: str, have_version: int = 0, *,
                           min_round: int = 0, wait_s: float = 0.0,
                           timeout: float | None = None) -> tuple[SnapshotHeader, Groups | None]:
        """The peer's current snapshot; groups is None when it is still ``have_version``."""
        t0 = time.perf_counter()
        await self._link()
        call = self._raw_snapshot_call(address)(
            pb.SnapshotRequest(requester=requester, have_version=have_version, chunk_bytes=self.chunk_bytes,
                               min_round=min_round, wait_ms=int(wait_s * 1000)),
            timeout=timeout or self.timeout_s)
        it = call.__aiter__()
        first = pb.SnapshotChunk.FromString(await it.__anext__())
        if first.WhichOneof("body") != "header":
            raise WireError(f"snapshot stream from {address} did not start with a header")
        h = first.header
        groups, size = None, 0
        if not h.unchanged:
            asm = Assembler(f"snapshot of {h.node_id or address}", h.total_bytes, h.sha256,
                            self.max_model_bytes)
            async for raw in it:
                asm.add(data_field(raw))
            data = asm.finish()
            size = len(data)
            try:
                groups, _ = decode(data, max_bytes=self.max_model_bytes)
            except WireError as e:
                raise WireError(f"snapshot v{h.version} of {h.node_id or address} is malformed: {e}") from None
        self.traffic.record("snapshot", received=first.ByteSize() + size)
        self._timed("snapshot", t0)
        return serde.snapshot_header_from_pb(h), groups

    # --- compute requests ---
    def _frames(self, header: pb.ComputeHeader, payload: bytes | None) -> AsyncIterator[pb.ComputeFrame]:
        async def gen():
            yield pb.ComputeFrame(header=header)
            if payload:
                for part in split(payload, self.chunk_bytes):
                    yield pb.ComputeFrame(data=part)
        return gen()

    @_domain_errors
    async def compute(self, address: str, request: ComputeRequest, timeout: float | None = None) -> ComputeReply:
        t0 = time.perf_counter()
        kind = request.kind
        await self._link()
        payload = encode(request.groups) if request.groups is not None and request.ref is None else None
        header = serde.compute_header_to_pb(request, len(payload) if payload else 0,
                                            sha256(payload) if payload else "")
        frames = self._frames(header, payload)
        stub = self.stub(address)
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
                                                   self.max_model_bytes))
                grad, _ = decode(data, max_bytes=self.max_model_bytes)
            out = ComputeReply(loss=gh.loss, samples=gh.samples, grad=grad, inner_product=gh.inner_product)
            received = first.ByteSize() + len(data)
        else:
            raise ValueError(f"unknown compute request kind {kind!r}")
        self.traffic.record(kind, sent=sent, received=received)
        self._timed(kind, t0)
        return out

    @_domain_errors
    async def gossip(self, address: str, sender: str, key: str, payload: dict[str, Any],
                     timeout: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        await self._link()
        raw = msgpack.packb(payload, use_bin_type=True)
        if len(raw) > self.max_gossip_bytes:
            raise PeerCallError("invalid", f"gossip payload for {key!r} is {len(raw)} bytes, "
                                           f"over the limit of {self.max_gossip_bytes}")
        req = pb.GossipMessage(node_id=sender, key=key, payload=raw)
        reply = await self.stub(address).GossipState(req, timeout=timeout or self.timeout_s)
        if len(reply.payload) > self.max_gossip_bytes:
            raise WireError(f"gossip reply from {address} exceeds {self.max_gossip_bytes} bytes")
        self.traffic.record("gossip", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("gossip", t0)
        try:
            out = msgpack.unpackb(reply.payload, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises a zoo of types on garbage
            raise WireError(f"gossip reply from {address} is not msgpack ({e})") from None
        if not isinstance(out, dict):
            raise WireError(f"gossip reply from {address} is not a map")
        return out
