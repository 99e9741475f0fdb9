"""The two seams of the peer plane, as protocols.

``PeerHandler`` is this node as its peers see it: what a transport's server calls when a request
arrives (implemented by ``served.ServedRequests``). ``PeerTransport`` is how this node reaches
others: what ``NodeNetwork`` and ``Membership`` call (implemented by the gRPC client in
``transport/client.py``). The unary calls are declared once in ``api.py``: the named methods here
are ``api.UnaryCalls``'s, and every transport's client implements its ``call``. Both speak the domain objects of ``messages``; a transport converts them
to its own wire, so a second transport (in-process, ...) plugs in without touching either side.
``TransportFactory`` is the pair of them for one node, chosen by whoever composes the node (gRPC:
``transport/grpc_transport.py``; in-process: ``transport/inproc.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from ..wire.codec import Groups
from .messages import (
    Beat,
    ComputeReply,
    ComputeRequest,
    IndirectProbe,
    LocalSnapshot,
    MemberUpdate,
    NodeInfo,
    PeerEntry,
    SnapshotHeader,
)

UNSET_MODEL_BYTES = 1 << 31  # until the node fixes its limit from its own model size (Node.model_limit)


@dataclass
class SizeLimits:
    """The largest payloads this node takes or sends, one object per node: its transport's gate
    (served side) and every client it opens read it, so the node sets ``max_model_bytes`` once —
    when its own model's size is known — and every side follows."""

    max_model_bytes: int = UNSET_MODEL_BYTES  # a snapshot, a compute payload, a gradient
    max_gossip_bytes: int = 1 << 20  # one gossip payload (msgpack bytes)


class Traffic(Protocol):
    """Byte and latency accounting a transport reports into."""

    def record(self, kind: str, *, sent: int = 0, received: int = 0) -> None: ...
    def latency(self, kind: str, seconds: float, side: str) -> None: ...


class PeerHandler(Protocol):
    """The served side. Every method raises ``errors.Refusal`` to refuse.

    A transport calls these only with node ids it has authenticated (the gRPC one: the id in the
    caller's certificate equals the one the request claims), and wraps every compute or bulk
    request, payload reading included, in ``admit(peer, kind)``."""

    node_id: str

    def info(self) -> NodeInfo: ...
    def on_handshake(self, remote: NodeInfo) -> list[PeerEntry]: ...
    def on_heartbeat(self, beat: Beat) -> Beat: ...
    async def on_indirect_probe(self, probe: IndirectProbe) -> tuple[bool, tuple[MemberUpdate, ...]]: ...
    def on_peer_list(
        self, sender: str, entries: list[PeerEntry], members: tuple[MemberUpdate, ...] = (), incarnation: int = 0
    ) -> tuple[list[PeerEntry], list[MemberUpdate], int]: ...
    def check_known(self, node_id: str) -> None: ...
    def admit(self, peer: str, kind: str) -> AbstractContextManager[None]: ...
    async def snapshot(self, requester: str, min_round: int = 0, wait_s: float = 0.0) -> LocalSnapshot: ...
    async def compute(self, request: ComputeRequest) -> ComputeReply: ...
    async def gossip(self, requester: str, key: str, payload: dict[str, Any]) -> dict[str, Any]: ...


class PeerTransport(Protocol):
    """The calling side. Every method raises ``errors.PeerCallError`` when the call fails.

    ``peer``: the node id expected at ``address``; a transport with identities (mTLS) refuses to
    talk to anyone else there. ``handshake`` learns and authenticates the id at an address; a
    secure transport then holds every later call to that address to it."""

    @property  # (read-only here: a transport may hold it as a plain attribute or derive it)
    def limits(self) -> SizeLimits: ...  # largest model (snapshot, gradient) and gossip accepted from a peer
    @property
    def evicted(self) -> int: ...  # connections closed for being idle, for /status (0 where there are none)

    def channels(self) -> int: ...  # connections held open now, for /status

    async def call(
        self, rpc: Any, address: str, request: Any, timeout: float | None = None, *, peer: str | None = None
    ) -> Any: ...  # rpc: an ``api.Unary`` (api imports this module), checked as it declares
    async def send(
        self, rpc: Any, address: str, request: Any, timeout: float | None = None, *, peer: str | None = None
    ) -> Any: ...  # ``call`` without its checks (a transport's own)
    async def welcomed(self, address: str, remote: NodeInfo, timeout: float) -> None: ...  # after a handshake
    async def handshake(self, address: str, info: NodeInfo, timeout: float) -> tuple[NodeInfo, list[PeerEntry]]: ...
    async def heartbeat(
        self, address: str, beat: Beat, timeout: float, *, peer: str | None = None
    ) -> tuple[Beat, float]: ...
    async def indirect_probe(
        self, address: str, probe: IndirectProbe, timeout: float, *, peer: str | None = None
    ) -> tuple[bool, tuple[MemberUpdate, ...]]: ...
    async def exchange_peers(
        self,
        address: str,
        sender: str,
        entries: list[PeerEntry],
        timeout: float,
        *,
        members: Sequence[MemberUpdate] = (),
        incarnation: int = 0,
        peer: str | None = None,
    ) -> tuple[list[PeerEntry], tuple[MemberUpdate, ...], int]: ...
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
        lazy: bool = False,  # tensors not kept may stay encoded (``wire/folding.py``), checked all the same
    ) -> tuple[SnapshotHeader, Groups | None]: ...
    # optional: ``watch_snapshots(address, requester, *, min_round, peer)``, an async iterator of
    # (SnapshotHeader, Groups), every snapshot the peer publishes from min_round on (gRPC: the
    # WatchSnapshots stream). ``NodeNetwork`` subscribes where a transport has it, pulls otherwise.
    async def compute(
        self, address: str, request: ComputeRequest, timeout: float | None = None, *, peer: str | None = None
    ) -> ComputeReply: ...
    async def gossip(
        self,
        address: str,
        sender: str,
        key: str,
        payload: dict[str, Any],
        timeout: float | None = None,
        *,
        peer: str | None = None,
    ) -> dict[str, Any]: ...
    async def forget(self, address: str) -> None: ...
    async def close(self) -> None: ...


class PeerServer(Protocol):
    """A node's served side, running: where peers reach it, and how to stop serving."""

    address: str

    async def stop(self) -> None: ...


class Health(Protocol):
    """Whether this node says it is serving (the node clears it while something keeps it from
    progressing, ``failures.py``); the gRPC transport answers the standard health check from it."""

    serving: bool

    async def set(self, serving: bool) -> None: ...


class TransportFactory(Protocol):
    """One node's transport: serves its ``PeerHandler`` and opens its ``PeerTransport``. The
    composition root picks it (gRPC sockets, in-process memory); ``Node`` only sees this.

    ``identity``: the node id the transport's credentials prove (gRPC with mTLS: the certificate's),
    ``None`` when it has none; ``mtls``: whether peers are authenticated by certificates.
    ``limits``: the largest model sent or served either way (``SizeLimits``, shared by the served
    side and every client) — the node sets ``limits.max_model_bytes`` once its own model's size is
    known, before ``serve``; clients already opened follow it."""

    # read-only here: a transport may hold them as plain attributes or derive them (properties)
    @property
    def identity(self) -> str | None: ...
    @property
    def mtls(self) -> bool: ...
    @property
    def health(self) -> Health: ...
    @property
    def limits(self) -> SizeLimits: ...

    def connect(self, node_id: str, traffic: Traffic) -> PeerTransport: ...
    async def serve(self, handler: PeerHandler, traffic: Traffic) -> PeerServer: ...
