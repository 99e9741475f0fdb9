"""The gRPC transport of one node (``peering.interfaces.TransportFactory``): a gRPC server on the
configured listen address (``server.py``) and the channel-caching client (``client.py``), both
on mTLS with the node's certificate (``tls.py``) unless the config says ``security.insecure``.

Everything gRPC-specific a node's config asks for lives here, so ``Node`` stays
transport-agnostic: the certificate (which also proves the node's id), the server-side stream
deadlines and the cap on calls in flight (``cfg.limits``), the standard gRPC health service the
node's failure tracking sets, and idle-channel eviction (``cfg.membership.idle_channel_s``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from ..peering.interfaces import UNSET_MODEL_BYTES, PeerHandler, SizeLimits, Traffic
from .client import PeerClient
from .server import HealthStatus, StreamLimits, serve
from .served_versions import CodecPolicy
from .tls import TLS, load_tls

log = logging.getLogger(__name__)

_FROM_CONFIG = object()


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
    """``tls``: the node's mTLS identity; ``None`` (plaintext, anyone may claim any node id) only
    when the caller says so on purpose."""

    def __init__(self, *, tls: TLS | None, listen: str = "127.0.0.1:0", advertise: str | None = None,
                 chunk_bytes: int = 1 << 20, max_model_bytes: int = UNSET_MODEL_BYTES,
                 max_gossip_bytes: int = 1 << 20, timeout_s: float = 30.0, delay_ms: float = 0.0,
                 streams: StreamLimits = StreamLimits(), max_rpcs: int | None = None,
                 idle_channel_s: float = 120.0, health: HealthStatus | None = None, sessions: bool = True,
                 reflection: bool = False, codecs: CodecPolicy = CodecPolicy()):
        self.tls = tls
        self.reflection = reflection  # gRPC server reflection (security.reflection, off by default)
        self.listen, self.advertise = listen, advertise
        self.chunk_bytes = chunk_bytes
        self.limits = SizeLimits(max_model_bytes, max_gossip_bytes)  # the server's and every client's
        self.timeout_s, self.delay_ms = timeout_s, delay_ms
        self.streams, self.max_rpcs, self.idle_channel_s = streams, max_rpcs, idle_channel_s
        self.health = health or HealthStatus()
        self.sessions = sessions
        self.codecs = codecs  # snapshots.codecs / .delta: asked for as a client, served as a server

    @classmethod
    def from_config(cls, cfg: Any, *, tls: Any = _FROM_CONFIG, health: HealthStatus | None = None) -> "GrpcTransport":
        """From a ``NodeConfig``: its certificate (``load_tls``: a node without one refuses to
        start unless ``security.insecure``), addresses, size limits, timeouts, server-side stream
        limits, emulated delay."""
        lim = cfg.limits
        return cls(tls=load_tls(cfg) if tls is _FROM_CONFIG else tls,
                   listen=cfg.listen, advertise=cfg.advertise, chunk_bytes=cfg.chunk_bytes,
                   max_model_bytes=cfg.max_model_bytes or UNSET_MODEL_BYTES,
                   max_gossip_bytes=cfg.max_gossip_bytes, timeout_s=cfg.request_timeout_s, delay_ms=cfg.delay_ms,
                   streams=StreamLimits(lim.upload_timeout_s, lim.upload_idle_s, lim.send_timeout_s,
                                        lim.min_stream_bytes_per_s, lim.max_watches),
                   max_rpcs=lim.max_rpcs, idle_channel_s=cfg.membership.idle_channel_s, health=health,
                   sessions=cfg.pull_sessions, reflection=cfg.security.reflection,
                   codecs=CodecPolicy(tuple(cfg.snapshots.codecs), cfg.snapshots.delta, cfg.snapshots.delta_history))

    # --- TransportFactory ---
    @property
    def identity(self) -> str | None:
        """The node id the certificate proves (None: plaintext, no identity)."""
        return self.tls.node_id if self.tls is not None else None

    @property
    def mtls(self) -> bool:
        return self.tls is not None

    def connect(self, node_id: str, traffic: Traffic) -> PeerClient:
        return PeerClient(node_id, traffic, chunk_bytes=self.chunk_bytes, limits=self.limits, timeout_s=self.timeout_s,
                          tls=self.tls, delay_ms=self.delay_ms, idle_channel_s=self.idle_channel_s,
                          sessions=self.sessions, codecs=self.codecs)

    async def serve(self, handler: PeerHandler, traffic: Traffic) -> GrpcServer:
        if self.tls is None:
            log.warning("peer port WITHOUT TLS (security.insecure = true): anyone who can reach it can "
                        "claim any node id; use only on a network you trust")
        server, port = await serve(handler, traffic, self.listen, tls=self.tls, chunk_bytes=self.chunk_bytes,
                                   limits=self.limits, streams=self.streams, max_rpcs=self.max_rpcs,
                                   health_status=self.health, reflection_on=self.reflection, codecs=self.codecs)
        host, _ = hostport(self.listen)
        return GrpcServer(self.advertise or f"{dialable(host)}:{port}", server, port)
