"""The two seams of the peer plane, as protocols.

``PeerHandler`` is this node as its peers see it: what a transport's server calls when a request
arrives (implemented by ``served.ServedRequests``). ``PeerTransport`` is how this node reaches
others: what ``NodeNetwork`` and ``Membership`` call (implemented by the gRPC client in
``transport/client.py``). Both speak the domain objects of ``messages``; a transport converts them
to its own wire, so a second transport (in-process, ...) plugs in without touching either side.
``TransportFactory`` is the pair of them for one node, chosen by whoever composes the node (gRPC:
``transport/grpc_transport.py``; in-process: ``transport/inproc.py``)."""
from __future__ import annotations

from typing import Any, Protocol

from ..wire.codec import Groups
from .messages import Beat, ComputeReply, ComputeRequest, LocalSnapshot, NodeInfo, PeerEntry, SnapshotHeader


class Traffic(Protocol):
    """Byte and latency accounting a transport reports into."""

    def record(self, kind: str, *, sent: int = 0, received: int = 0) -> None: ...
    def latency(self, kind: str, seconds: float, side: str) -> None: ...


class PeerHandler(Protocol):
    """The served side. Every method raises ``errors.Refusal`` to refuse."""

    node_id: str

    def info(self) -> NodeInfo: ...
    def on_handshake(self, remote: NodeInfo) -> list[PeerEntry]: ...
    def on_heartbeat(self, beat: Beat) -> Beat: ...
    def on_peer_list(self, sender: str, entries: list[PeerEntry]) -> list[PeerEntry]: ...
    def check_known(self, node_id: str) -> None: ...
    async def snapshot(self, requester: str, min_round: int = 0, wait_s: float = 0.0) -> LocalSnapshot: ...
    async def compute(self, request: ComputeRequest) -> ComputeReply: ...
    async def gossip(self, requester: str, key: str, payload: dict[str, Any]) -> dict[str, Any]: ...


class PeerTransport(Protocol):
    """The calling side. Every method raises ``errors.PeerCallError`` when the call fails."""

    async def handshake(self, address: str, info: NodeInfo, timeout: float) -> tuple[NodeInfo, list[PeerEntry]]: ...
    async def heartbeat(self, address: str, beat: Beat, timeout: float) -> tuple[Beat, float]: ...
    async def exchange_peers(self, address: str, sender: str, entries: list[PeerEntry],
                             timeout: float) -> list[PeerEntry]: ...
    async def get_snapshot(self, address: str, requester: str, have_version: int = 0, *,
                           min_round: int = 0, wait_s: float = 0.0,
                           timeout: float | None = None) -> tuple[SnapshotHeader, Groups | None]: ...
    async def compute(self, address: str, request: ComputeRequest,
                      timeout: float | None = None) -> ComputeReply: ...
    async def gossip(self, address: str, sender: str, key: str, payload: dict[str, Any],
                     timeout: float | None = None) -> dict[str, Any]: ...
    async def forget(self, address: str) -> None: ...
    async def close(self) -> None: ...


class PeerServer(Protocol):
    """A node's served side, running: where peers reach it, and how to stop serving."""

    address: str

    async def stop(self) -> None: ...


class TransportFactory(Protocol):
    """One node's transport: serves its ``PeerHandler`` and opens its ``PeerTransport``. The
    composition root picks it (gRPC sockets, in-process memory); ``Node`` only sees this."""

    def connect(self, node_id: str, traffic: Traffic) -> PeerTransport: ...
    async def serve(self, handler: PeerHandler, traffic: Traffic) -> PeerServer: ...
