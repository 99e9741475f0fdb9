"""The routing transport: a node in a process that runs several (a Ray actor's group of nodes).

It is the one mixed mode: it serves the node over gRPC (reachable from other processes and
machines) and registers it on the process's switchboard (``inproc.InProcNetwork``) under that
same gRPC address — both served sides behind the same ``gate`` checks and the node's one
``SizeLimits``. A call goes where its address is served:

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
from typing import Any, TypeVar

from ..peering.api import Unary, UnaryCalls
from ..peering.interfaces import PeerHandler, PeerServer, PeerTransport, Traffic, TransportFactory
from ..peering.messages import ComputeReply, ComputeRequest, NodeInfo, SnapshotHeader
from ..wire.codec import Groups
from .inproc import InProcClient, InProcNetwork, InProcServer

Req = TypeVar("Req")
Rep = TypeVar("Rep")

MEMORY, GRPC = "memory", "grpc"


@dataclass
class RouteStats:
    """One node's outgoing calls and payload bytes, by route."""

    calls: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "calls": {r: self.calls[r] for r in (MEMORY, GRPC)},
            "bytes_sent": {r: self.sent[r] for r in (MEMORY, GRPC)},
            "bytes_received": {r: self.received[r] for r in (MEMORY, GRPC)},
        }


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


@dataclass
class RoutingServer:
    """The node served both ways (``peering.interfaces.PeerServer``); stopping stops both."""

    address: str
    memory: InProcServer
    also: PeerServer  # the gRPC server

    async def stop(self) -> None:
        await self.memory.stop()
        await self.also.stop()


class RoutingTransport:
    """One node's routing transport (``peering.interfaces.TransportFactory``): memory for this
    process's nodes, its gRPC factory for the rest, with every call counted by route. Identity,
    mTLS and health are the gRPC side's; so are the ``limits``, shared with the memory side."""

    def __init__(
        self,
        switchboard: InProcNetwork,
        grpc: TransportFactory,
        *,
        timeout_s: float = 30.0,
        delay_ms: float = 0.0,
        max_model_bytes: int | None = None,
        max_gossip_bytes: int | None = None,
    ):
        self.switchboard, self.grpc = switchboard, grpc
        self.stats = RouteStats()
        self.limits = grpc.limits  # one per node: both served sides and both routes' clients read it
        if max_model_bytes is not None:
            self.limits.max_model_bytes = max_model_bytes
        if max_gossip_bytes is not None:
            self.limits.max_gossip_bytes = max_gossip_bytes
        self._memory = switchboard.transport(timeout_s=timeout_s, delay_ms=delay_ms, limits=self.limits)
        self.identity, self.mtls, self.health = grpc.identity, grpc.mtls, grpc.health

    @classmethod
    def from_config(
        cls, switchboard: InProcNetwork, cfg: Any, grpc: TransportFactory | None = None
    ) -> RoutingTransport:
        """From a ``NodeConfig``; the gRPC side is ``GrpcTransport.from_config(cfg)`` unless given."""
        if grpc is None:
            from .grpc_transport import GrpcTransport

            grpc = GrpcTransport.from_config(cfg)
        return cls(
            switchboard,
            grpc,
            timeout_s=cfg.request_timeout_s,
            delay_ms=cfg.delay_ms,
            max_model_bytes=cfg.max_model_bytes,
            max_gossip_bytes=cfg.max_gossip_bytes,
        )

    def connect(self, node_id: str, traffic: Traffic) -> RoutingClient:
        memory = self._memory.connect(node_id, _RouteTraffic(traffic, self.stats, MEMORY))
        remote = self.grpc.connect(node_id, _RouteTraffic(traffic, self.stats, GRPC))
        return RoutingClient(self.switchboard, memory, remote, self.stats)

    async def serve(self, handler: PeerHandler, traffic: Traffic) -> RoutingServer:
        """Serve over gRPC, and on the switchboard under the gRPC address (stopping stops both)."""
        also = await self.grpc.serve(handler, traffic)
        try:
            memory = self._memory.bind(handler, traffic, also.address)
        except OSError:
            await also.stop()
            raise
        return RoutingServer(also.address, memory, also)


class RoutingClient(UnaryCalls):
    """The calling side (``peering.interfaces.PeerTransport``): each call to the client of its
    route — the unary ones through the one ``send`` (``peering/api.py``), the streams by hand."""

    def __init__(self, switchboard: InProcNetwork, memory: InProcClient, remote: PeerTransport, stats: RouteStats):
        self.switchboard, self.memory, self.remote, self.stats = switchboard, memory, remote, stats
        self.limits = memory.limits  # (the remote route's are the same object)

    def channels(self) -> int:
        return self.remote.channels()

    @property
    def evicted(self) -> int:
        return self.remote.evicted

    def route(self, address: str) -> str:
        return MEMORY if self.switchboard.lookup(address) is not None else GRPC

    def _via(self, address: str) -> PeerTransport:
        route = self.route(address)
        self.stats.calls[route] += 1
        return self.memory if route == MEMORY else self.remote

    async def send(
        self, rpc: Unary[Req, Rep], address: str, request: Req, timeout: float | None = None, *, peer: str | None = None
    ) -> Rep:
        return await self._via(address).send(rpc, address, request, timeout, peer=peer)

    async def welcomed(self, address: str, remote: NodeInfo, timeout: float) -> None:
        route = self.memory if self.route(address) == MEMORY else self.remote
        await route.welcomed(address, remote, timeout)  # gRPC: the id proven by its certificate

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
        return await self._via(address).get_snapshot(
            address,
            requester,
            have_version,
            min_round=min_round,
            wait_s=wait_s,
            timeout=timeout,
            peer=peer,
            lazy=lazy,
        )

    async def compute(
        self, address: str, request: ComputeRequest, timeout: float | None = None, *, peer: str | None = None
    ) -> ComputeReply:
        return await self._via(address).compute(address, request, timeout, peer=peer)

    async def forget(self, address: str) -> None:
        await self.remote.forget(address)  # only gRPC holds per-address state (a channel)

    async def close(self) -> None:
        await self.memory.close()
        await self.remote.close()
