"""The routing transport: a node in a process that runs several (a Ray actor's group of nodes).

It serves the node over gRPC (reachable from other processes and machines) and registers it on
the process's switchboard (``inproc.InProcNetwork``) under that same gRPC address. A call goes
where its address is served:

- an address some node of this process serves → ``inproc.InProcClient``: through memory, with
  the in-process transport's checks, limits and failures;
- any other address → the gRPC client (``client.PeerClient``, whatever credentials the gRPC
  transport factory gives it).

Peers never know the difference: an address is a gRPC address either way, so bootstrap lists,
peer exchange and results look as they do for a network of daemon processes. Each node's
transport counts its calls and payload bytes per route (``RouteStats``: ``memory`` / ``grpc``),
so a launcher can report — and a test assert — how much crossed process boundaries."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..peering.interfaces import PeerHandler, PeerServer, PeerTransport, Traffic, TransportFactory
from ..peering.messages import Beat, ComputeReply, ComputeRequest, NodeInfo, PeerEntry, SnapshotHeader
from ..wire.codec import Groups
from .inproc import InProcClient, InProcNetwork

MEMORY, GRPC = "memory", "grpc"


@dataclass
class RouteStats:
    """One node's outgoing calls and payload bytes, by route."""
    calls: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"calls": {r: self.calls[r] for r in (MEMORY, GRPC)},
                "bytes_sent": {r: self.sent[r] for r in (MEMORY, GRPC)},
                "bytes_received": {r: self.received[r] for r in (MEMORY, GRPC)}}


class _RouteTraffic:
    """The node's own ``Traffic``, tallying the bytes of one route on the way."""

    def __init__(self, inner: Traffic, stats: RouteStats, route: str):
        self.inner, self.stats, self.route = inner, stats, route

    def record(self, kind: str, *, sent: int = 0, received: int = 0) -> None:
        self.stats.sent[self.route] += sent
        self.stats.received[self.route] += received
        self.inner.record(kind, sent=sent, received=received)

    def latency(self, kind: str, seconds: float, side: str) -> None:
        self.inner.latency(kind, seconds, side)


class RoutingTransport:
    """One node's routing transport (``peering.interfaces.TransportFactory``)."""

    def __init__(self, switchboard: InProcNetwork, grpc: TransportFactory, *, timeout_s: float = 30.0,
                 delay_ms: float = 0.0, max_model_bytes: int = 1 << 31, max_gossip_bytes: int = 1 << 20):
        self.switchboard, self.grpc = switchboard, grpc
        self.timeout_s, self.delay_ms = timeout_s, delay_ms
        self.max_model_bytes, self.max_gossip_bytes = max_model_bytes, max_gossip_bytes
        self.stats = RouteStats()

    @classmethod
    def from_config(cls, switchboard: InProcNetwork, cfg: Any,
                    grpc: TransportFactory | None = None) -> "RoutingTransport":
        """From a ``NodeConfig``; the gRPC side is ``GrpcTransport.from_config(cfg)`` unless given."""
        if grpc is None:
            from .grpc_transport import GrpcTransport
            grpc = GrpcTransport.from_config(cfg)
        return cls(switchboard, grpc, timeout_s=cfg.request_timeout_s, delay_ms=cfg.delay_ms,
                   max_model_bytes=cfg.max_model_bytes, max_gossip_bytes=cfg.max_gossip_bytes)

    def connect(self, node_id: str, traffic: Traffic) -> "RoutingClient":
        memory = InProcClient(self.switchboard, node_id, _RouteTraffic(traffic, self.stats, MEMORY),
                              timeout_s=self.timeout_s, delay_ms=self.delay_ms,
                              max_model_bytes=self.max_model_bytes, max_gossip_bytes=self.max_gossip_bytes)
        remote = self.grpc.connect(node_id, _RouteTraffic(traffic, self.stats, GRPC))
        return RoutingClient(self.switchboard, memory, remote, self.stats)

    async def serve(self, handler: PeerHandler, traffic: Traffic) -> PeerServer:
        """Serve over gRPC, and on the switchboard under the gRPC address (stopping stops both)."""
        both = self.switchboard.transport(timeout_s=self.timeout_s, delay_ms=self.delay_ms,
                                          max_model_bytes=self.max_model_bytes,
                                          max_gossip_bytes=self.max_gossip_bytes, grpc=self.grpc)
        return await both.serve(handler, traffic)


class RoutingClient:
    """The calling side (``peering.interfaces.PeerTransport``): each call to the client of its route."""

    def __init__(self, switchboard: InProcNetwork, memory: InProcClient, remote: PeerTransport, stats: RouteStats):
        self.switchboard, self.memory, self.remote, self.stats = switchboard, memory, remote, stats

    def route(self, address: str) -> str:
        return MEMORY if self.switchboard.lookup(address) is not None else GRPC

    def _via(self, address: str) -> PeerTransport:
        route = self.route(address)
        self.stats.calls[route] += 1
        return self.memory if route == MEMORY else self.remote

    async def handshake(self, address: str, info: NodeInfo, timeout: float) -> tuple[NodeInfo, list[PeerEntry]]:
        return await self._via(address).handshake(address, info, timeout)

    async def heartbeat(self, address: str, beat: Beat, timeout: float) -> tuple[Beat, float]:
        return await self._via(address).heartbeat(address, beat, timeout)

    async def exchange_peers(self, address: str, sender: str, entries: list[PeerEntry],
                             timeout: float) -> list[PeerEntry]:
        return await self._via(address).exchange_peers(address, sender, entries, timeout)

    async def get_snapshot(self, address: str, requester: str, have_version: int = 0, *,
                           min_round: int = 0, wait_s: float = 0.0,
                           timeout: float | None = None) -> tuple[SnapshotHeader, Groups | None]:
        return await self._via(address).get_snapshot(address, requester, have_version, min_round=min_round,
                                                     wait_s=wait_s, timeout=timeout)

    async def compute(self, address: str, request: ComputeRequest, timeout: float | None = None) -> ComputeReply:
        return await self._via(address).compute(address, request, timeout)

    async def gossip(self, address: str, sender: str, key: str, payload: dict[str, Any],
                     timeout: float | None = None) -> dict[str, Any]:
        return await self._via(address).gossip(address, sender, key, payload, timeout)

    async def forget(self, address: str) -> None:
        await self.remote.forget(address)  # only gRPC holds per-address state (a channel)

    async def close(self) -> None:
        await self.memory.close()
        await self.remote.close()
