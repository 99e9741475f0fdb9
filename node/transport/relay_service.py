"""The relay a reachable node runs for peers that cannot be dialled (``relay.proto``,
docs/nat.md), in the manner of libp2p's circuit relay: an outbound-only node holds a
``Reserve`` stream; a dialer's ``Connect`` naming it is announced on that stream as a tunnel, the
node answers with ``Accept``, and the relay splices the two streams' bytes. The bytes are the two
ends' own mutual TLS, so the relay reads ciphertext only and cannot answer in either's name.

Every party is the node its mTLS certificate names (no certificate: no relay). Each peer's
demands are bounded (``RelayBudget``): reservations held, tunnels open per dialer and per
reserved node, bytes per second per node through this relay. A refusal names the limit."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from ...proto.v1 import relay_pb2 as pb
from ..peering.errors import short
from .tls import TLS, caller_identity

FRAME_QUEUE = 16  # frames buffered per direction of a tunnel: back-pressure beyond that
KEEPALIVE_S = 10.0  # an empty offer on idle reservations, so dead ones are noticed both ways


@dataclass(frozen=True)
class RelayBudget:
    """What one peer may demand of this relay (config ``relay``)."""

    max_reservations: int = 128  # outbound-only nodes relayed for at once
    max_tunnels_per_peer: int = 16  # tunnels open at once per dialer, and per reserved node
    max_bytes_per_s: float = 64e6  # per node (dialer or reserved), both directions together
    accept_timeout_s: float = 5.0  # a reserved node must accept an offered tunnel within this


class _Bucket:
    """Token bucket: ``take(n)`` waits until n bytes fit the rate (one second's burst)."""

    def __init__(self, rate: float):
        self.rate, self.tokens, self.at = rate, rate, time.monotonic()

    async def take(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= min(n, self.rate):
                self.tokens -= n
                return
            await asyncio.sleep((min(n, self.rate) - self.tokens) / self.rate)  # the rate limit itself


@dataclass
class _Tunnel:
    dialer: str
    target: str
    to_target: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(FRAME_QUEUE))
    to_dialer: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(FRAME_QUEUE))
    accepted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RelayService:
    """The Relay servicer; ``forward`` is where bytes cross (a test double overrides it)."""

    def __init__(self, tls: TLS, budget: RelayBudget = RelayBudget()):
        self.tls, self.budget = tls, budget
        self._offers: dict[str, asyncio.Queue] = {}  # reserved node -> its offer queue
        self._tunnels: dict[str, _Tunnel] = {}  # tunnel id -> tunnel
        self._open: dict[str, int] = {}  # node -> tunnels it is an end of
        self._buckets: dict[str, _Bucket] = {}
        self.relayed_bytes = 0
        self._dialling: set[str] = set()  # nodes with a dial-back in progress

    def retune(self, budget: RelayBudget) -> None:
        """A new budget, live (a config reload): byte buckets take the new rate at once."""
        self.budget = budget
        for b in self._buckets.values():
            b.rate, b.tokens = budget.max_bytes_per_s, min(b.tokens, budget.max_bytes_per_s)

    def reserved(self) -> list[str]:
        return sorted(self._offers)

    async def _who(self, context: grpc.aio.ServicerContext) -> str:
        """The node the caller's certificate names, accepted (allow-list, CRL); else the call ends."""
        ident = caller_identity(context)
        if ident is None or not self.tls.allowed(ident) or self.tls.refusal(context):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "relay: the caller's certificate names no accepted Coterie node"
            )
        assert ident is not None  # (abort raised otherwise)
        return ident

    async def forward(self, data: bytes, tunnel: _Tunnel, to_target: bool) -> bytes | None:
        """The bytes passed on (None: none). An honest relay passes them unchanged, within the
        budget of both ends."""
        await self._bucket(tunnel.dialer).take(len(data))
        await self._bucket(tunnel.target).take(len(data))
        self.relayed_bytes += len(data)
        return data

    def _bucket(self, node: str) -> _Bucket:
        b = self._buckets.get(node)
        if b is None:
            b = self._buckets[node] = _Bucket(self.budget.max_bytes_per_s)
        return b

    # ------------------------------------------------------------------ RPCs
    async def DialBack(self, raw: bytes, context) -> pb.DialBackReply:
        from .dial_back import caller_host, dial

        who = await self._who(context)
        try:
            port = pb.DialBackRequest.FromString(raw).port
        except DecodeError:
            port = 0
        if not 0 < port < 65536:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "relay: dial-back needs a port 1..65535")
        host = caller_host(context.peer())
        if host is None:
            return pb.DialBackReply(reachable=False, detail=f"the caller's address {context.peer()!r} is not IP")
        if who in self._dialling:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "relay: one dial-back at a time per node")
        self._dialling.add(who)
        try:
            ok, detail, open_ = await dial(self.tls, host, port, who)
        finally:
            self._dialling.discard(who)
        return pb.DialBackReply(reachable=ok, detail=detail, port_open=open_)

    async def Reserve(self, request: bytes, context) -> AsyncIterator[pb.TunnelOffer]:
        who = await self._who(context)
        if who not in self._offers and len(self._offers) >= self.budget.max_reservations:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"relay: max_reservations ({self.budget.max_reservations}) reached"
            )
        queue: asyncio.Queue = asyncio.Queue()
        self._offers[who] = queue  # a node's newer reservation replaces its older one
        try:
            yield pb.TunnelOffer()
            while True:
                try:
                    offer = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    offer = pb.TunnelOffer()
                yield offer
        except asyncio.CancelledError:  # the reserved node went away, or this server is stopping
            return
        finally:
            if self._offers.get(who) is queue:
                del self._offers[who]

    def _admit(self, dialer: str, target: str) -> str | None:
        """Why a tunnel from ``dialer`` to ``target`` is refused (None: admitted)."""
        if target not in self._offers:
            return f"relay: node {target!r} holds no reservation here"
        cap = self.budget.max_tunnels_per_peer
        for node in (dialer, target):
            if self._open.get(node, 0) >= cap:
                return f"relay: max_tunnels_per_peer ({cap}) reached for node {node!r}"
        return None

    async def Connect(self, frames, context) -> AsyncIterator[pb.RelayFrame]:
        dialer = await self._who(context)
        it = frames.__aiter__()
        first = await _first(it, context, "target")
        target = first.target
        why = self._admit(dialer, target)
        if why:
            code = grpc.StatusCode.NOT_FOUND if "reservation" in why else grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, why)
        tid = secrets.token_hex(12)
        tunnel = self._tunnels[tid] = _Tunnel(dialer, target)
        for node in (dialer, target):
            self._open[node] = self._open.get(node, 0) + 1
        pump = None
        try:
            self._offers[target].put_nowait(pb.TunnelOffer(tunnel_id=tid, dialer=dialer))
            try:
                await asyncio.wait_for(asyncio.shield(tunnel.accepted), self.budget.accept_timeout_s)
            except asyncio.TimeoutError:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"relay: node {target!r} did not accept within {self.budget.accept_timeout_s} s",
                )
            yield pb.RelayFrame(tunnel_id=tid)
            pump = asyncio.ensure_future(self._pump(it, tunnel, to_target=True))
            async for frame in _drain(tunnel.to_dialer):
                yield frame
        finally:
            if pump is not None:
                pump.cancel()
            _shut(tunnel.to_target)
            self._tunnels.pop(tid, None)
            for node in (dialer, target):
                self._open[node] -= 1

    async def Accept(self, frames, context) -> AsyncIterator[pb.RelayFrame]:
        who = await self._who(context)
        it = frames.__aiter__()
        first = await _first(it, context, "tunnel_id")
        tunnel = self._tunnels.get(first.tunnel_id)
        if tunnel is None or who != tunnel.target or tunnel.accepted.done():
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "relay: no such tunnel offered to this node")
        assert tunnel is not None  # (abort raised otherwise)
        tunnel.accepted.set_result(True)
        pump = asyncio.ensure_future(self._pump(it, tunnel, to_target=False))
        try:
            async for frame in _drain(tunnel.to_target):
                yield frame
        finally:
            pump.cancel()
            _shut(tunnel.to_dialer)

    async def _pump(self, it, tunnel: _Tunnel, *, to_target: bool) -> None:
        """One direction: frames read from one end, forwarded to the other's queue; None at the end."""
        out = tunnel.to_target if to_target else tunnel.to_dialer
        try:
            async for raw in it:
                frame = _parse(raw)
                if frame is None or frame.WhichOneof("body") != "data":
                    break  # malformed or out of place: this tunnel ends
                data = await self.forward(frame.data, tunnel, to_target)
                if data is not None:
                    await out.put(data)
            await out.put(None)
        except grpc.aio.AioRpcError:
            _shut(out)
        except asyncio.CancelledError:
            _shut(out)
            raise


async def _first(it, context, field_name: str) -> pb.RelayFrame:
    try:
        first = _parse(await asyncio.wait_for(it.__anext__(), 10.0))
    except (StopAsyncIteration, asyncio.TimeoutError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"relay: the stream must start with {field_name}")
    if first is None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "relay: the first frame is not a RelayFrame")
    assert first is not None  # (abort raised otherwise)
    if first.WhichOneof("body") != field_name:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"relay: the stream must start with {field_name}, not {short(str(first.WhichOneof('body')), 40)}",
        )
    return first


def _parse(raw: bytes) -> pb.RelayFrame | None:
    """A frame from the wire; None when malformed (requests arrive as bytes: a bad one ends its
    stream with a reason, not a deserialisation traceback)."""
    try:
        return pb.RelayFrame.FromString(raw)
    except DecodeError:
        return None


def handlers(service: RelayService) -> grpc.GenericRpcHandler:
    """The Relay service's method table, requests as raw bytes (parsed by the servicer)."""
    ser = _serialize
    return grpc.method_handlers_generic_handler(
        "coterie.v1.Relay",
        {
            "Reserve": grpc.unary_stream_rpc_method_handler(
                service.Reserve, request_deserializer=None, response_serializer=ser
            ),
            "Connect": grpc.stream_stream_rpc_method_handler(
                service.Connect, request_deserializer=None, response_serializer=ser
            ),
            "Accept": grpc.stream_stream_rpc_method_handler(
                service.Accept, request_deserializer=None, response_serializer=ser
            ),
            "DialBack": grpc.unary_unary_rpc_method_handler(
                service.DialBack, request_deserializer=None, response_serializer=ser
            ),
        },
    )


def _serialize(msg) -> bytes:
    return msg.SerializeToString()


def _shut(queue: asyncio.Queue) -> None:
    """End a tunnel direction now: its reader stops (bytes still queued for a closed end are moot)."""
    while queue.full():
        queue.get_nowait()
    queue.put_nowait(None)


async def _drain(queue: asyncio.Queue) -> AsyncIterator[pb.RelayFrame]:
    while True:
        data = await queue.get()
        if data is None:
            return
        yield pb.RelayFrame(data=data)
