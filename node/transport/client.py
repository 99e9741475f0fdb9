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
node's certificate proved.

Snapshots travel by stream (``streams``, ``pulls.py``: plain pulls, pull sessions, subscriptions); the
errors every call maps to the domain's are in ``errors.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ...proto.v1 import peer_pb2 as pb
from ...proto.v1 import peer_pb2_grpc as rpc
from ..offload import OFF_LOOP_BYTES
from ..peering.api import HANDSHAKE, Unary, UnaryCalls, check_compute_kind
from ..peering.errors import REFUSED, UNAVAILABLE, PeerCallError, short
from ..peering.interfaces import UNSET_MODEL_BYTES, SizeLimits, Traffic
from ..peering.messages import CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, ComputeReply, ComputeRequest, NodeInfo
from ..security.ids import node_id_problem
from ..wire import codecs as wire_codecs
from ..wire.codec import WireError, decode, encoded_size
from . import serde
from .chunks import Assembler, collect, sha256, split
from .errors import domain_errors as _domain_errors
from .errors import in_flight
from .pulls import BULK, CONTROL, SnapshotStreams
from .relay_address import is_relayed
from .served_versions import CodecPolicy, HeldVersions
from .tls import TLS

Req = TypeVar("Req")
Rep = TypeVar("Rep")

KEEPALIVE_MS = 20_000  # the server accepts pings this often (server.py); keep the two in step
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    # a dead peer must fail fast instead of sitting in exponential reconnect backoff
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # each channel its own connection: the membership channel must not share the bulk one's
    ("grpc.use_local_subchannel_pool", 1),
]
_ANY = ""  # expected node id "any node of the CA": a first contact, before a handshake proves who


class PeerClient(UnaryCalls):
    def __init__(
        self,
        node_id: str,
        traffic: Traffic,
        *,
        chunk_bytes: int,
        max_model_bytes: int = UNSET_MODEL_BYTES,
        max_gossip_bytes: int = 1 << 20,
        timeout_s: float,
        tls: TLS | None,
        delay_ms: float = 0.0,
        idle_channel_s: float = 120.0,
        sessions: bool = True,
        limits: SizeLimits | None = None,
        codecs: CodecPolicy = CodecPolicy(),
        relay_dialer: Any = None,
    ):
        """``limits``: the node's ``SizeLimits`` (shared with its served side); else one of
        ``max_model_bytes`` and ``max_gossip_bytes``. ``relay_dialer``: reaches peers whose
        address is a relay address (``relay_dialer.py``)."""
        self.node_id = node_id
        self.traffic = traffic
        self.chunk_bytes = chunk_bytes
        self.limits = limits if limits is not None else SizeLimits(max_model_bytes, max_gossip_bytes)
        self.timeout_s = timeout_s
        self.delay_s = delay_ms / 1000.0  # emulated one-way link latency (testbed)
        self.idle_channel_s = idle_channel_s
        self.tls = tls
        self.relay_dialer = relay_dialer
        self._creds = tls.channel_credentials() if tls is not None else None
        # (address, plane, expected node id or None) -> channel, stub
        self._stubs: dict[tuple[str, str, str | None], tuple[grpc.aio.Channel, rpc.PeerStub]] = {}
        self._dialled: dict[tuple[str, str, str | None], str] = {}  # the host:port each channel dials
        self._proven: dict[str, str] = {}  # address -> node id its certificate proved (mTLS)
        self._used: dict[str, float] = {}  # address -> last time a call started
        self._busy: dict[str, int] = {}  # address -> calls in flight
        self._next_sweep = time.monotonic() + idle_channel_s
        self.evicted = 0
        self.codecs = codecs  # snapshot codecs this node asks for, preferred first; deltas or not
        self.held = HeldVersions(codecs.bases_bytes)  # per peer: the snapshot version it holds (a delta's base)
        self._peer_codecs: dict[str, tuple[str, ...]] = {}  # address -> codecs its handshake advertised
        # snapshots by stream: pulls, pull sessions, subscriptions (over this client's channels)
        self.streams = SnapshotStreams(
            self,
            traffic,
            self.limits,
            codecs,
            self.held,
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
            sessions=sessions,
        )
        self.get_snapshot = self.streams.get_snapshot
        self.watch_snapshots = self.streams.watch_snapshots

    def channel(self, address: str, plane: str, peer: str | None = None) -> tuple[grpc.aio.Channel, rpc.PeerStub]:
        """The ``plane`` channel to ``address`` that only reaches ``peer`` (default: the node
        proven to be there; none yet: any node of the CA, for a handshake)."""
        now = time.monotonic()
        self._used[address] = now
        if now >= self._next_sweep:
            self._next_sweep = now + self.idle_channel_s / 4
            self._evict_idle(now)
        expected = None if self.tls is None else (peer if peer is not None else self._proven.get(address, _ANY))
        dial = address
        if self.relay_dialer is not None and is_relayed(address):
            # through a relay: TLS is held to the node the address names, whatever else is asked
            dial, expected = self.relay_dialer.local(address)
        key = (address, plane, expected)
        entry = self._stubs.get(key)
        if entry is not None and self._dialled.get(key, dial) != dial:
            # the relay dialer's listener for this address was retired and made anew (the node
            # moved away and back): the cached channel dials a closed port, refused for good
            asyncio.get_running_loop().create_task(self._drop(key).close())
            entry = None
        if entry is None:
            options = _CHANNEL_OPTIONS + [("coterie.plane", plane)]
            if self.tls is None:
                ch = grpc.aio.insecure_channel(dial, options=options)
            else:
                name = ("grpc.ssl_target_name_override", self.tls.target_name(expected))
                ch = grpc.aio.secure_channel(dial, self._creds, options=[*options, name])
            entry = self._stubs[key] = (ch, rpc.PeerStub(ch))
            self._dialled[key] = dial
        return entry

    def _drop(self, key: tuple[str, str, str | None]) -> grpc.aio.Channel:
        """Forget a cached channel (the caller closes it)."""
        self._dialled.pop(key, None)
        return self._stubs.pop(key)[0]

    def touch(self, address: str) -> None:
        self._used[address] = time.monotonic()

    def stub(self, address: str, plane: str = BULK, peer: str | None = None) -> rpc.PeerStub:
        return self.channel(address, plane, peer)[1]

    def channels(self) -> int:
        return len(self._stubs)

    def _evict_idle(self, now: float) -> None:
        """Close the channels of addresses unused for ``idle_channel_s`` with nothing in flight."""
        stale = {a for a, t in self._used.items() if now - t > self.idle_channel_s and a not in self._busy}
        for address in stale:
            del self._used[address]
            self.streams.drop_sessions(address)
            for key in [k for k in self._stubs if k[0] == address]:
                self.evicted += 1
                asyncio.get_running_loop().create_task(self._drop(key).close())

    def raw_snapshot_call(self, address: str, peer: str | None = None):
        """GetSnapshot with chunk messages left as raw bytes: the payload is sliced out of each
        message without protobuf building (and copying) a message object per MiB."""
        return self.channel(address, BULK, peer)[0].unary_stream(
            "/coterie.v1.Peer/GetSnapshot",
            request_serializer=pb.SnapshotRequest.SerializeToString,
            response_deserializer=None,
        )

    async def forget(self, address: str) -> None:
        self._used.pop(address, None)
        self._proven.pop(address, None)
        self._peer_codecs.pop(address, None)
        self.held.drop(address)
        for call in self.streams.drop_sessions(address):
            with contextlib.suppress(Exception):  # let each cancelled session finish before its channel closes
                await asyncio.wait_for(call.code(), 1.0)
        for key in [k for k in self._stubs if k[0] == address]:
            await self._drop(key).close()

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
        proof: tuple[str, str, str | None] = (address, CONTROL, node_id)
        ch, _ = self.channel(*proof)
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise  # this caller is being cancelled: so be it
            # the shared channel was closed under this proof by another one that failed first:
            # no answer from that peer, not a cancellation of whoever asked for the handshake
            raise PeerCallError(
                UNAVAILABLE, f"peer at {address}: its channel closed while proving it is {node_id!r}"
            ) from None
        except grpc.aio.AioRpcError as e:
            # two proofs of one address share the channel: the first to fail drops it, and a
            # later one must neither fail on the missing key (a KeyError once escaped the
            # handshake and ended an overlay delivery) nor drop a fresh channel made since
            if self._stubs.get(proof, (None,))[0] is ch:
                await self._drop(proof).close()
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # a TLS handshake still under way when the deadline fired (a loaded peer, or this
                # node's own stalled loop): no certificate was refused, nothing is known of it yet
                raise PeerCallError(
                    UNAVAILABLE,
                    f"peer at {address} did not answer in time to prove it is node {node_id!r} "
                    f"({timeout:.1f} s; not a certificate refusal)",
                ) from None
            raise PeerCallError(
                REFUSED,
                f"peer at {address} claims to be node {node_id!r} but could not "
                f"prove it with that node's certificate ({short(e.details() or '', 300)})",
            ) from None
        old = self._proven.get(address)
        self._proven[address] = node_id
        if old is not None:
            for key in [k for k in self._stubs if k[0] == address and k[2] == old]:
                await self._drop(key).close()

    async def link(self) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # the emulated wire delay itself, not a wait for state

    def timed(self, kind: str, t0: float) -> None:
        self.traffic.latency(kind, time.perf_counter() - t0, "client")

    # --- the unary calls (peering/api.py): one path for all; call/the named ones are UnaryCalls' ---
    @_domain_errors
    async def send(
        self, rpc: Unary[Req, Rep], address: str, request: Req, timeout: float | None = None, *, peer: str | None = None
    ) -> Rep:
        t0 = time.perf_counter()
        await self.link()
        wire = serde.WIRE[rpc.name]
        req = wire.request_to_pb(request)
        if rpc is HANDSHAKE:  # a fresh look at whoever is at the address now (a restarted node may have another id)
            peer = _ANY if self.tls else None
        stub = self.stub(address, CONTROL if rpc.control else BULK, peer)
        reply = await getattr(stub, rpc.name)(req, timeout=timeout or self.timeout_s)
        self.traffic.record(rpc.kind, sent=req.ByteSize(), received=reply.ByteSize())
        self.timed(rpc.kind, t0)
        return wire.reply_from_pb(reply)

    async def welcomed(self, address: str, remote: NodeInfo, timeout: float) -> None:
        with in_flight(self, address):
            await self._prove(address, remote.node_id, timeout)
        self._peer_codecs[address] = remote.codecs  # what models sent there may be encoded in

    # --- compute requests ---
    def _frames(self, header: pb.ComputeHeader, payload: bytes | None) -> AsyncIterator[pb.ComputeFrame]:
        async def gen():
            yield pb.ComputeFrame(header=header)
            if payload:
                for part in split(payload, self.chunk_bytes):
                    yield pb.ComputeFrame(data=part)

        return gen()

    @_domain_errors
    async def compute(
        self, address: str, request: ComputeRequest, timeout: float | None = None, *, peer: str | None = None
    ) -> ComputeReply:
        t0 = time.perf_counter()
        kind = request.kind
        check_compute_kind(kind)
        await self.link()
        payload, digest = None, ""
        # a model sent along travels in the first of this node's codecs the peer advertised
        codec = wire_codecs.negotiate(self.codecs.codecs, self._peer_codecs.get(address, ()))
        if request.groups is not None and request.ref is None:

            def pack(groups=request.groups):
                data = wire_codecs.encode(groups, codec)
                return data, sha256(data)

            big = encoded_size(request.groups) > OFF_LOOP_BYTES
            payload, digest = await asyncio.to_thread(pack) if big else pack()
        header = serde.compute_header_to_pb(
            request, len(payload) if payload else 0, digest, "" if codec == wire_codecs.FP32 else codec
        )
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
            data: bytes | memoryview = b""
            if gh.total_bytes:
                data = await collect(
                    it, Assembler(f"gradient from {address}", gh.total_bytes, gh.sha256, self.limits.max_model_bytes)
                )
                grad, _ = decode(data, max_bytes=self.limits.max_model_bytes)
            out = ComputeReply(loss=gh.loss, samples=gh.samples, grad=grad, inner_product=gh.inner_product)
            received = first.ByteSize() + len(data)
        else:  # (check_compute_kind: one of the three)
            raise AssertionError(kind)
        self.traffic.record(kind, sent=sent, received=received)
        self.timed(kind, t0)
        return out
