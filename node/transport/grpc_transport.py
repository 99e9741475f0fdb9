"""The gRPC transport of one node (``peering.interfaces.TransportFactory``): a gRPC server on the
configured listen address (``server.py``) and the channel-caching client (``client.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from ..peering.interfaces import PeerHandler, Traffic
from .client import PeerClient
from .server import serve


def hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def dialable(host: str) -> str:
    """The host peers should dial for a server bound to ``host`` (a wildcard means loopback here)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


@dataclass
class GrpcServer:
    """A running gRPC peer server (``peering.interfaces.PeerServer``)."""
    address: str
    server: grpc.aio.Server
    port: int

    async def stop(self) -> None:
        await self.server.stop(grace=0.5)


class GrpcTransport:
    def __init__(self, *, listen: str = "127.0.0.1:0", advertise: str | None = None,
                 chunk_bytes: int = 1 << 20, max_model_bytes: int = 1 << 31,
                 max_gossip_bytes: int = 1 << 20, timeout_s: float = 30.0, delay_ms: float = 0.0):
        self.listen, self.advertise = listen, advertise
        self.chunk_bytes, self.max_model_bytes, self.max_gossip_bytes = chunk_bytes, max_model_bytes, max_gossip_bytes
        self.timeout_s, self.delay_ms = timeout_s, delay_ms

    @classmethod
    def from_config(cls, cfg: Any) -> "GrpcTransport":
        """From a ``NodeConfig`` (its listen/advertise addresses, limits, timeout, emulated delay)."""
        return cls(listen=cfg.listen, advertise=cfg.advertise, chunk_bytes=cfg.chunk_bytes,
                   max_model_bytes=cfg.max_model_bytes, max_gossip_bytes=cfg.max_gossip_bytes,
                   timeout_s=cfg.request_timeout_s, delay_ms=cfg.delay_ms)

    def connect(self, node_id: str, traffic: Traffic) -> PeerClient:
        return PeerClient(node_id, traffic, chunk_bytes=self.chunk_bytes, max_model_bytes=self.max_model_bytes,
                          max_gossip_bytes=self.max_gossip_bytes, timeout_s=self.timeout_s,
                          delay_ms=self.delay_ms)

    async def serve(self, handler: PeerHandler, traffic: Traffic) -> GrpcServer:
        server, port = await serve(handler, traffic, self.listen, chunk_bytes=self.chunk_bytes,
                                   max_model_bytes=self.max_model_bytes, max_gossip_bytes=self.max_gossip_bytes)
        host, _ = hostport(self.listen)
        return GrpcServer(self.advertise or f"{dialable(host)}:{port}", server, port)
