"""The gRPC transport of one node (``peering.interfaces.TransportFactory``): a gRPC server on the
configured listen address (``server.py``) and the channel-caching client (``client.py``), both
on mTLS with the node's certificate (``tls.py``) unless the config says ``security.insecure``.

Everything gRPC-specific a node's config asks for lives here, so ``Node`` stays
transport-agnostic: the certificate (which also proves the node's id), the server-side stream
deadlines and the cap on calls in flight (``cfg.limits``), the standard gRPC health service the
node's failure tracking sets, and idle-channel eviction (``cfg.membership.idle_channel_s``)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc

from ..peering.interfaces import UNSET_MODEL_BYTES, PeerHandler, SizeLimits, Traffic
from .client import PeerClient
from .relay_address import RelayAddress, is_relayed, reachability
from .relay_dialer import RelayDialer
from .relay_fallback import RelayFallback
from .relay_housekeeping import RelayHousekeeping
from .relay_reservations import RelayReservations
from .relay_service import RelayBudget, RelayService
from .served_versions import CodecPolicy
from .server import HealthStatus, StreamLimits, serve
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
    port: int  # 0: no peer port (outbound-only, reached through relays)
    reservations: RelayReservations | None = None
    relay: RelayService | None = None  # the relay this node runs for outbound-only peers
    dialer: RelayDialer | None = None  # the node's relayed dials: they end with it
    fallback: RelayFallback | None = None  # dial-back, and relays when nobody can dial this node
    private_dir: str | None = None  # an outbound-only node's peer socket directory
    tasks: list[asyncio.Task] = field(default_factory=list)  # background checks: they end with it
    upkeep: asyncio.Task | None = None  # relay housekeeping, while this node is relayed

    async def stop(self) -> None:
        for task in [*self.tasks, *([self.upkeep] if self.upkeep else [])]:
            task.cancel()
        if self.dialer is not None:
            await self.dialer.close()
        if self.reservations is not None:
            await self.reservations.stop()
        if self.fallback is not None:
            await self.fallback.stop()
        await self.server.stop(grace=0.5)
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)

    def relayed(self) -> RelayReservations | None:
        """This node's reservations: outbound-only, or switched to relays by the dial-back check."""
        return self.reservations or (self.fallback.reservations if self.fallback is not None else None)


class GrpcTransport:
    """``tls``: the node's mTLS identity; ``None`` (plaintext, anyone may claim any node id) only
    when the caller says so on purpose."""

    def __init__(
        self,
        *,
        tls: TLS | None,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        chunk_bytes: int = 1 << 20,
        max_model_bytes: int = UNSET_MODEL_BYTES,
        max_gossip_bytes: int = 1 << 20,
        timeout_s: float = 30.0,
        delay_ms: float = 0.0,
        streams: StreamLimits = StreamLimits(),
        max_rpcs: int | None = None,
        idle_channel_s: float = 120.0,
        health: HealthStatus | None = None,
        sessions: bool = True,
        reflection: bool = False,
        codecs: CodecPolicy = CodecPolicy(),
        no_listen: bool = False,
        relays: tuple[str, ...] = (),
        relay_budget: RelayBudget | None = RelayBudget(),
        dial_back_peers: tuple[str, ...] = (),
        pinned_relays: tuple[str, ...] = (),
        relay_upkeep: RelayUpkeep | None = None,
    ):
        """``no_listen``: no peer port; reserve at ``relays`` instead. ``relay_budget``: relay for
        outbound-only peers within it (None: never relay)."""
        self.upkeep = relay_upkeep or RelayUpkeep()
        # set by the node before serving: its alive members' addresses (relay candidates), and
        # what it does when this node's address changes (relays dropped or added, dial-back)
        self.members: Callable[[], list[str]] = list
        self.on_moved: Callable[[str], None] | None = None
        self.tls = tls
        self.no_listen, self.relays, self.relay_budget = no_listen, tuple(relays), relay_budget
        self.dialer = RelayDialer(tls)  # for peers whose address is a relay address
        self.server: GrpcServer | None = None
        # asked once serving (and every ``upkeep.recheck_s``) whether they can dial this node;
        # relays when none can
        self.fallback = RelayFallback(tls, dial_back_peers, pinned_relays) if tls and dial_back_peers else None
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
    def from_config(cls, cfg: Any, *, tls: Any = _FROM_CONFIG, health: HealthStatus | None = None) -> GrpcTransport:
        """From a ``NodeConfig``: its certificate (``load_tls``: a node without one refuses to
        start unless ``security.insecure``), addresses, size limits, timeouts, server-side stream
        limits, emulated delay."""
        lim = cfg.limits
        return cls(
            tls=load_tls(cfg) if tls is _FROM_CONFIG else tls,
            listen=cfg.listen,
            advertise=cfg.advertise,
            chunk_bytes=cfg.chunk_bytes,
            max_model_bytes=cfg.max_model_bytes or UNSET_MODEL_BYTES,
            max_gossip_bytes=cfg.max_gossip_bytes,
            timeout_s=cfg.request_timeout_s,
            delay_ms=cfg.delay_ms,
            streams=StreamLimits(
                lim.upload_timeout_s, lim.upload_idle_s, lim.send_timeout_s, lim.min_stream_bytes_per_s, lim.max_watches
            ),
            max_rpcs=lim.max_rpcs,
            idle_channel_s=cfg.membership.idle_channel_s,
            health=health,
            sessions=cfg.pull_sessions,
            reflection=cfg.security.reflection,
            codecs=CodecPolicy(
                tuple(cfg.snapshots.codecs),
                cfg.snapshots.delta,
                cfg.snapshots.delta_history,
                int(cfg.snapshots.bases_mb * (1 << 20)),
            ),
            no_listen=cfg.no_listen,
            relays=tuple(cfg.relays()),
            relay_budget=_relay_budget(cfg),
            dial_back_peers=tuple(p for p in cfg.peers if not is_relayed(p)),
            pinned_relays=tuple(cfg.relay.via[: cfg.relay.max_relays]),
            relay_upkeep=RelayUpkeep(
                every_s=cfg.heartbeat_interval_s,
                drop_after_s=max(3 * cfg.heartbeat_interval_s, 3.0),
                recheck_s=cfg.relay.recheck_s,
                max_relays=cfg.relay.max_relays,
            ),
        )

    # --- TransportFactory ---
    @property
    def identity(self) -> str | None:
        """The node id the certificate proves (None: plaintext, no identity)."""
        return self.tls.node_id if self.tls is not None else None

    @property
    def mtls(self) -> bool:
        return self.tls is not None

    def connect(self, node_id: str, traffic: Traffic) -> PeerClient:
        return PeerClient(
            node_id,
            traffic,
            chunk_bytes=self.chunk_bytes,
            limits=self.limits,
            timeout_s=self.timeout_s,
            tls=self.tls,
            delay_ms=self.delay_ms,
            idle_channel_s=self.idle_channel_s,
            sessions=self.sessions,
            codecs=self.codecs,
            relay_dialer=self.dialer,
        )

    async def serve(self, handler: PeerHandler, traffic: Traffic) -> GrpcServer:
        if self.tls is None:
            log.warning(
                "peer port WITHOUT TLS (security.insecure = true): anyone who can reach it can "
                "claim any node id; use only on a network you trust"
            )
        relay = None
        if self.relay_budget is not None and self.tls is not None and not self.no_listen:
            relay = RelayService(self.tls, self.relay_budget)
        listen = self.listen
        if self.no_listen:  # a private Unix socket in a fresh 0700 directory: no port at all
            if self.tls is None:
                raise ValueError("no_listen needs mTLS: relays know a node only by its certificate")
            private_dir = tempfile.mkdtemp(prefix="coterie-peer-")
            listen = f"unix:{private_dir}/peer.sock"
        server, port = await serve(
            handler,
            traffic,
            listen,
            tls=self.tls,
            chunk_bytes=self.chunk_bytes,
            limits=self.limits,
            streams=self.streams,
            max_rpcs=self.max_rpcs,
            health_status=self.health,
            reflection_on=self.reflection,
            codecs=self.codecs,
            relay=relay,
        )
        if self.no_listen:
            assert self.tls is not None
            reservations = RelayReservations(self.tls, list(self.relays), listen)
            reservations.start()
            srv = self.server = GrpcServer(
                str(RelayAddress(self.relays, self.tls.node_id)),
                server,
                0,
                reservations=reservations,
                dialer=self.dialer,
                private_dir=private_dir,
            )
            self._keep(srv, reservations)
            return srv
        host, _ = hostport(self.listen)
        srv = self.server = GrpcServer(
            self.advertise or f"{dialable(host)}:{port}", server, port, relay=relay, dialer=self.dialer
        )
        if self.fallback is not None:
            srv.fallback = fb = self.fallback
            fb.members = lambda: self.members()
            # peers dial the advertised port back; relays' tunnels come in at the bound one
            check = fb.watch(
                srv.address,
                hostport(srv.address)[1],
                f"{dialable(host)}:{port}",
                partial(self._fallback_moved, srv, fb),
                self.upkeep.recheck_s,
            )
            srv.tasks.append(asyncio.ensure_future(check))
        return srv

    def _advertise(self, srv: GrpcServer, address: str) -> None:
        srv.address = address
        if self.on_moved is not None:
            self.on_moved(address)

    def _fallback_moved(self, srv: GrpcServer, fb: RelayFallback, address: str) -> None:
        """The dial-back check moved this node behind relays, or back to its own address."""
        if srv.upkeep is not None:
            srv.upkeep.cancel()
            srv.upkeep = None
        if fb.reservations is not None:
            self._keep(srv, fb.reservations)
        self._advertise(srv, address)

    def _keep(self, srv: GrpcServer, reservations: RelayReservations) -> None:
        """Relay housekeeping for as long as this node is relayed (``relay_housekeeping.py``)."""
        assert self.tls is not None
        u = self.upkeep
        keeper = RelayHousekeeping(
            reservations,
            self.tls.node_id,
            partial(self._advertise, srv),
            lambda: self.members(),
            drop_after_s=u.drop_after_s,
            max_relays=u.max_relays,
        )
        srv.upkeep = asyncio.ensure_future(keeper.run(u.every_s))

    def retune_relay(self, cfg: Any) -> bool:
        """A reloaded ``NodeConfig``'s relay budget, live (SIGHUP): the relay serving now takes it
        for every reservation, tunnel and byte from here on. False when relaying itself was switched
        on or off (``relay.serve``): the Relay service is added to the server at start only."""
        budget = _relay_budget(cfg)
        if (budget is None) != (self.relay_budget is None):
            return False
        self.relay_budget = budget
        relay = self.server.relay if self.server is not None else None
        if relay is not None and budget is not None:
            relay.retune(budget)
        return True

    def relay_view(self) -> dict[str, Any]:
        """For /status: how this node is reached, its reservations, whom it relays for, and why
        relays failed this node's recent dials."""
        srv = self.server
        out: dict[str, Any] = {"reachability": reachability(srv.address) if srv else "not serving"}
        reservations = srv.relayed() if srv is not None else None
        if reservations is not None:
            out["reservations"] = dict(reservations.state)
        if srv is not None and srv.relay is not None:
            out["relaying_for"] = srv.relay.reserved()
            out["relayed_bytes"] = srv.relay.relayed_bytes
        out["dial_problems"] = dict(self.dialer.problems)
        if self.fallback is not None and self.fallback.answers:
            out["dial_back"] = dict(self.fallback.answers)
        return out


@dataclass(frozen=True)
class RelayUpkeep:
    """How a relayed node keeps its relays (docs/nat.md, "Relay housekeeping")."""

    every_s: float = 1.0  # look at the reservations this often (the heartbeat period)
    drop_after_s: float = 3.0  # a relay without this node's reservation this long leaves its address
    recheck_s: float = 300.0  # the dial-back check is repeated this often
    max_relays: int = 3  # relays reserved at when every one is gone


def _relay_budget(cfg: Any) -> RelayBudget | None:
    r = cfg.relay
    if not r.serve:
        return None
    return RelayBudget(r.max_reservations, r.max_tunnels_per_peer, r.max_bytes_per_s, r.accept_timeout_s)
