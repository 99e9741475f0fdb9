"""The calling side of the peer plane: one cached channel per peer address, chunked streams,
size and hash checks on everything that comes back. Every call is bounded by a deadline."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import grpc
import msgpack

from ...proto.v1 import peer_pb2 as pb
from ...proto.v1 import peer_pb2_grpc as rpc
from .chunks import Assembler, collect, data_field, sha256, split
from .server import Stats

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # a dead peer must fail fast instead of sitting in exponential reconnect backoff
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class PeerClient:
    def __init__(self, node_id: str, stats: Stats, *, chunk_bytes: int, max_model_bytes: int,
                 max_gossip_bytes: int, timeout_s: float, delay_ms: float = 0.0):
        self.node_id = node_id
        self.stats = stats
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
        self.stats.latency(kind, time.perf_counter() - t0, "client")

    # --- membership ---
    async def handshake(self, address: str, info: pb.NodeInfo, timeout: float | None = None) -> pb.HandshakeReply:
        t0 = time.perf_counter()
        await self._link()
        req = pb.HandshakeRequest(node=info)
        reply = await self.stub(address).Handshake(req, timeout=timeout or self.timeout_s)
        self.stats.record("handshake", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("handshake", t0)
        return reply

    async def heartbeat(self, address: str, round: int, version: int, timeout: float) -> tuple[pb.HeartbeatReply, float]:
        t0 = time.perf_counter()
        await self._link()
        req = pb.HeartbeatRequest(node_id=self.node_id, round=round, snapshot_version=version,
                                  sent_at=time.time())
        reply = await self.stub(address).Heartbeat(req, timeout=timeout)
        rtt = time.perf_counter() - t0
        self.stats.record("heartbeat", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("heartbeat", t0)
        return reply, rtt

    async def exchange_peers(self, address: str, entries: list[pb.PeerEntry], timeout: float) -> list[pb.PeerEntry]:
        await self._link()
        req = pb.PeerList(node_id=self.node_id, peers=entries)
        reply = await self.stub(address).ExchangePeers(req, timeout=timeout)
        self.stats.record("peers", sent=req.ByteSize(), received=reply.ByteSize())
        return list(reply.peers)

    # --- snapshots ---
    async def get_snapshot(self, address: str, have_version: int = 0) -> tuple[pb.SnapshotHeader, bytes | None]:
        """The peer's current snapshot; data is None when it is still ``have_version``."""
        t0 = time.perf_counter()
        await self._link()
        call = self._raw_snapshot_call(address)(
            pb.SnapshotRequest(requester=self.node_id, have_version=have_version,
                               chunk_bytes=self.chunk_bytes), timeout=self.timeout_s)
        it = call.__aiter__()
        first = pb.SnapshotChunk.FromString(await it.__anext__())
        if first.WhichOneof("body") != "header":
            raise ValueError(f"snapshot stream from {address} did not start with a header")
        h = first.header
        data = None
        if not h.unchanged:
            asm = Assembler(f"snapshot of {h.node_id or address}", h.total_bytes, h.sha256,
                            self.max_model_bytes)
            async for raw in it:
                asm.add(data_field(raw))
            data = asm.finish()
        self.stats.record("snapshot", received=first.ByteSize() + (len(data) if data else 0))
        self._timed("snapshot", t0)
        return h, data

    # --- compute requests ---
    def _frames(self, header: pb.ComputeHeader, payload: bytes | None) -> AsyncIterator[pb.ComputeFrame]:
        async def gen():
            yield pb.ComputeFrame(header=header)
            if payload:
                for part in split(payload, self.chunk_bytes):
                    yield pb.ComputeFrame(data=part)
        return gen()

    @staticmethod
    def header_for(payload: bytes | None, **fields: Any) -> pb.ComputeHeader:
        h = pb.ComputeHeader(**fields)
        if payload:
            h.total_bytes = len(payload)
            h.sha256 = sha256(payload)
        return h

    def _sent(self, kind: str, header: pb.ComputeHeader, payload: bytes | None) -> None:
        self.stats.record(kind, sent=header.ByteSize() + (len(payload) if payload else 0))

    async def cross_loss(self, address: str, header: pb.ComputeHeader, payload: bytes | None) -> pb.LossReply:
        t0 = time.perf_counter()
        await self._link()
        reply = await self.stub(address).CrossLoss(self._frames(header, payload), timeout=self.timeout_s)
        self._sent("cross_loss", header, payload)
        self.stats.record("cross_loss", received=reply.ByteSize())
        self._timed("cross_loss", t0)
        return reply

    async def cross_gradient(self, address: str, header: pb.ComputeHeader,
                             payload: bytes | None) -> tuple[pb.GradientHeader, bytes]:
        t0 = time.perf_counter()
        await self._link()
        call = self.stub(address).CrossGradient(self._frames(header, payload), timeout=self.timeout_s)
        it = call.__aiter__()
        first = await it.__anext__()
        if first.WhichOneof("body") != "header":
            raise ValueError(f"gradient stream from {address} did not start with a header")
        gh = first.header
        data = b""
        if gh.total_bytes:
            data = await collect(it, Assembler(f"gradient from {address}", gh.total_bytes, gh.sha256,
                                               self.max_model_bytes))
        self._sent("cross_gradient", header, payload)
        self.stats.record("cross_gradient", received=first.ByteSize() + len(data))
        self._timed("cross_gradient", t0)
        return gh, data

    async def push_gradient(self, address: str, header: pb.ComputeHeader, payload: bytes) -> pb.Ack:
        t0 = time.perf_counter()
        await self._link()
        ack = await self.stub(address).PushGradient(self._frames(header, payload), timeout=self.timeout_s)
        self._sent("push_gradient", header, payload)
        self.stats.record("push_gradient", received=ack.ByteSize())
        self._timed("push_gradient", t0)
        return ack

    async def gossip(self, address: str, key: str, payload: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        await self._link()
        raw = msgpack.packb(payload, use_bin_type=True)
        if len(raw) > self.max_gossip_bytes:
            raise ValueError(f"gossip payload for {key!r} is {len(raw)} bytes, over {self.max_gossip_bytes}")
        req = pb.GossipMessage(node_id=self.node_id, key=key, payload=raw)
        reply = await self.stub(address).GossipState(req, timeout=self.timeout_s)
        if len(reply.payload) > self.max_gossip_bytes:
            raise ValueError(f"gossip reply from {address} exceeds {self.max_gossip_bytes} bytes")
        self.stats.record("gossip", sent=req.ByteSize(), received=reply.ByteSize())
        self._timed("gossip", t0)
        out = msgpack.unpackb(reply.payload, raw=False, strict_map_key=False)
        if not isinstance(out, dict):
            raise ValueError(f"gossip reply from {address} is not a map")
        return out
