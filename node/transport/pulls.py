"""Snapshots by stream on the gRPC calling side (``client.PeerClient``'s ``streams``): pull sessions
(``PullSnapshots``: a peer pulled from again gets one long-lived stream on which each pull is a
request and its answer), subscriptions (``WatchSnapshots``), and reading one snapshot off a
stream with its size and hash checks, decoded as zero-copy views of one buffer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from ...proto.v1 import peer_pb2 as pb
from ..peering.errors import UNAVAILABLE, PeerCallError
from ..peering.messages import SnapshotHeader
from ..wire import codecs as wire_codecs
from ..wire.codec import Groups, WireError, encoded_size
from ..wire.folding import decoded
from . import serde
from .chunks import Assembler, data_field
from .errors import in_flight as _in_flight
from .served_versions import CodecPolicy, Held, HeldVersions

if TYPE_CHECKING:
    from ...proto.v1 import peer_pb2_grpc as rpc
    from ..peering.interfaces import SizeLimits, Traffic

# Pull sessions (PullSnapshots): a peer pulled from again gets one long-lived stream on which each
# pull is a request and its answer. A gRPC call costs ~0.5 ms of CPU on each end on this kind of
# machine, a request and answer on an open stream ~0.2 ms: most of a small model's pull.
SESSION_AFTER_S = 60.0  # open one for an address pulled again within this (once is not a habit)
SESSION_IDLE_S = 60.0  # close one unused this long (the server ends its side at 120 s)
SESSION_RETRY_S = 30.0  # after a server refused one (its limit): plain calls there for this long
CONTROL, BULK = "control", "bulk"  # the two channels to each peer (client.py opens them)


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


class Channels(Protocol):
    """What the snapshot streams need of the client that holds the channels (``client.PeerClient``)."""

    _busy: dict[str, int]  # address -> calls in flight (``errors.in_flight`` counts them)

    def channel(self, address: str, plane: str, peer: str | None = None) -> tuple[grpc.aio.Channel, rpc.PeerStub]: ...
    def raw_snapshot_call(self, address: str, peer: str | None = None) -> Callable[..., Any]: ...
    def touch(self, address: str) -> None: ...  # in use now (idle eviction spares it)
    async def link(self) -> None: ...  # the emulated link delay, if any
    def timed(self, kind: str, t0: float) -> None: ...  # a call's latency, client side


class SnapshotStreams:
    """Snapshot pulls (plain calls and pull sessions) and subscriptions over the channels of
    ``channels``; it owns the pull sessions and what it knows of which peers refuse them."""

    def __init__(
        self,
        channels: Channels,
        traffic: Traffic,
        limits: SizeLimits,
        codecs: CodecPolicy,
        held: HeldVersions,
        *,
        chunk_bytes: int,
        timeout_s: float,
        sessions: bool,
    ):
        self.channels, self.traffic, self.limits, self.codecs, self.held = channels, traffic, limits, codecs, held
        self.chunk_bytes, self.timeout_s, self.sessions = chunk_bytes, timeout_s, sessions
        self._sessions: dict[tuple[str, str | None], _Session] = {}  # (address, peer) -> open session
        self._pulled: dict[tuple[str, str | None], float] = {}  # -> last pull made with a plain call
        self._session_refused: dict[str, float] = {}  # address -> when its server refused one

    async def get_snapshot(
        self,
        address: str,
        requester: str,
        have_version: int = 0,
        *,
        min_round: int = 0,
        wait_s: float = 0.0,
        timeout: float | None = None,
        peer: str | None = None,
        lazy: bool = False,
    ) -> tuple[SnapshotHeader, Groups | None]:
        """``lazy``: a payload this node will not keep as a delta base is left encoded where its
        values need computing (``folding.Encoded``: checked, decoded only as it is added into
        another tensor); one it keeps is decoded, as it always is."""
        with _in_flight(self.channels, address):
            return await self._get_snapshot(
                address,
                requester,
                have_version,
                min_round=min_round,
                wait_s=wait_s,
                timeout=timeout,
                peer=peer,
                lazy=lazy,
            )

    async def _get_snapshot(
        self,
        address: str,
        requester: str,
        have_version: int = 0,
        *,
        min_round: int = 0,
        wait_s: float = 0.0,
        timeout: float | None = None,
        peer: str | None = None,
        lazy: bool = False,
    ) -> tuple[SnapshotHeader, Groups | None]:
        """The peer's current snapshot; groups is None when it is still ``have_version``. On the
        peer's pull session when it has one (see ``_session``), else a call of its own."""
        t0 = time.perf_counter()
        await self.channels.link()
        request = self._snapshot_request(requester, min_round=min_round, wait_ms=int(wait_s * 1000))
        request.have_version = have_version
        held = self.held.get(peer or address)
        base = None
        # a copy this node will not keep is no base: it says it takes no deltas, and the server
        # keeps no reconstruction for it (else one per payload kind: whole and delta, 2 models)
        request.delta = self.codecs.delta and self.held.room_for(peer or address)
        if request.delta and held is not None and held.version == have_version:
            request.have_sha256 = held.digest  # a delta against it is welcome
            base = held  # kept until the answer is decoded, whatever arrives meanwhile
        with self.held.keeping(peer or address, base):
            return await self._pull_answer(address, peer, request, timeout, t0, lazy)

    async def _pull_answer(
        self, address: str, peer: str | None, request, timeout: float | None, t0: float, lazy: bool = False
    ) -> tuple[SnapshotHeader, Groups | None]:
        deadline = time.monotonic() + (timeout or self.timeout_s)
        h = None
        session = self._session(address, peer)
        if session is not None:
            try:
                h, groups = await self._session_pull(session, address, peer, request, deadline, lazy)
            except _SessionGone:
                h = None  # not answered: a plain call asks again
        if h is None:
            call = self.channels.raw_snapshot_call(address, peer)(
                request, timeout=max(deadline - time.monotonic(), 0.001)
            )
            h, groups, _ = await self._read_snapshot(address, call.__aiter__(), whole_stream=True, peer=peer, lazy=lazy)
        self.channels.timed("snapshot", t0)
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
        if (
            last is None
            or now - last > SESSION_AFTER_S
            or now - self._session_refused.get(address, float("-inf")) < SESSION_RETRY_S
        ):
            return None
        call = self.channels.channel(address, BULK, peer)[0].stream_stream(
            "/coterie.v1.Peer/PullSnapshots",
            request_serializer=pb.SnapshotRequest.SerializeToString,
            response_deserializer=None,
        )()
        s = self._sessions[key] = _Session(call)
        return s

    async def _session_pull(
        self, s: _Session, address: str, peer: str | None, request, deadline: float, lazy: bool = False
    ) -> tuple[Any, Groups | None]:
        """One request and its answer on ``s``. A session whose answer did not come in full
        (deadline, refusal, broken stream, the caller gave up) is closed: what is still in
        flight on it is unknown. ``_SessionGone``: it ended before answering, or its server
        refused to open it (a plain call takes the request)."""
        s.busy = True
        try:
            try:  # bounded too: a write waits for the stream's flow-control window
                await asyncio.wait_for(s.call.write(request), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise PeerCallError(UNAVAILABLE, f"snapshot of {peer or address}: deadline exceeded") from None
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                raise _SessionGone(str(e)) from None
            try:
                h, groups, _ = await asyncio.wait_for(
                    self._read_snapshot(address, s, whole_stream=False, peer=peer, lazy=lazy),
                    max(deadline - time.monotonic(), 0.001),
                )
            except asyncio.TimeoutError:
                raise PeerCallError(UNAVAILABLE, f"snapshot of {peer or address}: deadline exceeded") from None
            except StopAsyncIteration:
                raise _SessionGone("ended by the server") from None
            except grpc.aio.AioRpcError as e:
                if not s.served and (
                    e.code() == grpc.StatusCode.UNIMPLEMENTED
                    or (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "snapshot session" in (e.details() or ""))
                ):
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

    def drop_sessions(self, address: str) -> list[Any]:
        calls = [self._drop_session(key) for key in [k for k in self._sessions if k[0] == address]]
        for key in [k for k in self._pulled if k[0] == address]:
            del self._pulled[key]
        return calls

    def _snapshot_request(self, requester: str, **fields: Any) -> pb.SnapshotRequest:
        """A snapshot request naming this node's codecs (preferred first) and whether it takes deltas."""
        return pb.SnapshotRequest(
            requester=requester,
            chunk_bytes=self.chunk_bytes,
            codecs=list(self.codecs.codecs),
            delta=self.codecs.delta,
            **fields,
        )

    async def _read_snapshot(
        self, address: str, it, *, whole_stream: bool, peer: str | None = None, pin: bool = False, lazy: bool = False
    ) -> tuple[Any, Groups | None, int]:
        """One snapshot off a stream: its header, then chunks up to the announced size (size and
        sha256 of the payload checked while reassembling), decoded in the codec the header names
        (a plain fp32 payload as zero-copy views of the one buffer; a delta added to the version
        of ``peer`` this node holds, which must be the one the header names).
        ``whole_stream``: the stream ends after it (a pull), else more snapshots follow (a watch).
        ``pin``: the decoded copy is pinned as it is held (a watch: its next delta is against it).
        ``lazy``: a copy the bases' budget will not keep stays encoded (``get_snapshot``)."""
        first = pb.SnapshotChunk.FromString(await it.__anext__())
        if first.WhichOneof("body") != "header":
            raise WireError(f"snapshot stream from {address} did not start with a header")
        h = first.header
        groups, size = None, 0
        if not h.unchanged:
            asm = Assembler(
                f"snapshot of {h.node_id or address}",
                h.total_bytes,
                h.payload_sha256 or h.sha256,
                self.limits.max_model_bytes,
            )
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
                    raise WireError(
                        f"snapshot v{h.version} of {h.node_id or address}: stream ended "
                        f"after {asm.size} of {asm.total} bytes"
                    ) from None
            data = asm.finish()
            size = len(data)
            key = peer or address
            try:  # fp32: zero-copy, the tensors are views of that one buffer
                groups = self._decode_snapshot(h, data, key, lazy=lazy)
            except WireError as e:  # (the versions held stay: they are this node's own decoded copies)
                raise WireError(f"snapshot v{h.version} of {h.node_id or address} is malformed: {e}") from None
            if self.codecs.delta:
                if lazy and not self.held.room_for(key, encoded_size(groups)):
                    self.held.not_keeping(key, encoded_size(groups))  # left encoded: no decoded copy
                else:  # kept as the base of this peer's next delta: decoded now
                    groups = decoded(groups) if lazy else groups
                    self.held.put(key, Held(h.version, h.payload_sha256 or h.sha256, groups), pin=pin)
        # (an inline payload is already part of the header's message)
        self.traffic.record("snapshot", received=first.ByteSize() + (0 if first.inline else size))
        return h, groups, size

    def _watch_request(self, requester: str, min_round: int, key: str) -> pb.SnapshotRequest:
        request = self._snapshot_request(requester, min_round=min_round)
        held = self.held.get(key)
        if self.codecs.delta and held is not None:  # the first snapshot pushed may be a delta against it
            request.have_version, request.have_sha256 = held.version, held.digest
        return request

    def _decode_snapshot(self, h: Any, data: memoryview, key: str, *, lazy: bool = False) -> Groups:
        """The payload's tensors, checked against what the header says: its codec (one this node
        asked for), its version, and for a delta the base it applies to (which must be the
        versions this node holds of that peer, by payload digest)."""
        codec = h.codec or wire_codecs.FP32
        wire_codecs.check_codec(codec)
        if codec not in self.codecs.advertised:
            raise WireError(f"payload in codec {codec!r}, which this node did not ask for")
        base = None
        if h.base_version:
            held = self.held.find(key, h.base_version, h.base_sha256)
            if held is None:
                newest = self.held.get(key)
                holds = f"v{newest.version} ({newest.digest[:12]})" if newest is not None else "no version"
                raise WireError(
                    f"a delta against v{h.base_version} ({h.base_sha256[:12]}), but this node "
                    f"holds {holds} of that peer"
                )
            base = held.groups
        groups, meta = wire_codecs.decode(data, max_bytes=self.limits.max_model_bytes, base=base, lazy=lazy)
        section = wire_codecs.codec_of(meta)
        sent = section.get("name") if section else wire_codecs.FP32
        if sent != codec:
            raise WireError(f"header says codec {codec!r}, payload is {sent!r}")
        if meta.get("version", h.version) != h.version:
            raise WireError(f"header says v{h.version}, payload is v{meta.get('version')}")
        if wire_codecs.delta_base(meta) != ((h.base_version, h.base_sha256) if h.base_version else None):
            raise WireError("header and payload disagree on the delta's base")
        return groups

    async def watch_snapshots(
        self, address: str, requester: str, *, min_round: int = 0, peer: str | None = None
    ) -> AsyncIterator[tuple[SnapshotHeader, Groups]]:
        """Every snapshot the peer publishes from ``min_round`` on, as it publishes it: one
        long-lived stream instead of a call a round. Checked like a pull; ends by raising
        ``PeerCallError`` / ``WireError`` (or when the caller stops iterating: the call is
        cancelled). The channel counts as busy meanwhile, so idle eviction spares it."""
        call, key = None, peer or address
        base: tuple[int, str] | None = None  # the (version, digest) the watch's next delta may be against
        try:
            with _in_flight(self.channels, address):
                await self.channels.link()
                call = self.channels.channel(address, BULK, peer)[0].unary_stream(
                    "/coterie.v1.Peer/WatchSnapshots",
                    request_serializer=pb.SnapshotRequest.SerializeToString,
                    response_deserializer=None,
                )(request := self._watch_request(requester, min_round, key))
                it = call.__aiter__()
                if request.have_sha256:  # the watch's next delta is against the last it brought
                    self.held.pin(key, *(base := (request.have_version, request.have_sha256)))
                while True:
                    try:
                        h, groups, _ = await self._read_snapshot(
                            address, it, whole_stream=False, peer=peer, pin=self.codecs.delta
                        )
                    except StopAsyncIteration:  # the server ended it between two snapshots
                        return
                    if groups is None:
                        raise WireError(f"snapshot watch on {address}: an empty snapshot (only a header)")
                    if self.codecs.delta:  # pinned as ``_read_snapshot`` held it, whatever the bases' budget
                        last = (h.version, h.payload_sha256 or h.sha256)
                        if base is not None:
                            self.held.unpin(key, *base)
                        base = last
                    self.channels.touch(address)
                    await self.channels.link()  # the emulated link delays every snapshot, as it does a pull
                    yield serde.snapshot_header_from_pb(h), groups
        finally:
            if base is not None:
                self.held.unpin(key, *base)
            if call is not None:
                call.cancel()
