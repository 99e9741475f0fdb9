"""The membership protocol: who is out there and whether they answer.

Handshakes with addresses learned from the config or from peers (protocol and architecture must
match), heartbeats to every known peer, periodic anti-entropy peer exchange with a random alive
peer; and the served side of the same three calls. The peer table (``peer_table``) holds the
result; ``Node`` runs ``run()`` as one of its loops."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable

from .errors import UNKNOWN_PEER, PeerCallError, invalid, refused, unknown_peer
from .interfaces import PeerTransport
from .messages import Beat, NodeInfo, PeerEntry
from .peer_table import DEAD, PeerTable
from .problems import ProblemLog

log = logging.getLogger("coterie.node")


class Membership:
    def __init__(self, info: Callable[[], NodeInfo], position: Callable[[], tuple[int, int]],
                 peers: PeerTable, transport: PeerTransport, problems: ProblemLog, *,
                 bootstrap: list[str], heartbeat_interval_s: float, request_timeout_s: float,
                 link_delay_s: float = 0.0, rng: random.Random | None = None,
                 on_gauges: Callable[[dict[str, int]], None] | None = None):
        self.info = info  # this node's NodeInfo (its address is known only once serving)
        self.position = position  # this node's (round, published version), sent in heartbeats
        self.peers = peers
        self.transport = transport
        self.problems = problems
        self.pending: set[str] = set(bootstrap)  # addresses to handshake
        self.bootstrap = set(bootstrap)
        self.unreachable: set[str] = set()  # addresses already reported as unreachable
        self.heartbeat_interval_s = heartbeat_interval_s
        self.request_timeout_s = request_timeout_s
        self.link_delay_s = link_delay_s
        self.rng = rng or random.Random()
        self.on_gauges = on_gauges

    @property
    def node_id(self) -> str:
        return self.peers.self_id

    # ------------------------------------------------------------------ compatibility
    def incompatible(self, remote: NodeInfo) -> str | None:
        me = self.info()
        if remote.protocol_version != me.protocol_version:
            return (f"node {remote.node_id!r} speaks protocol version {remote.protocol_version}, "
                    f"this node speaks {me.protocol_version}")
        if remote.arch_fingerprint != me.arch_fingerprint:
            return (f"node {remote.node_id!r} runs another model architecture (fingerprint "
                    f"{remote.arch_fingerprint[:12]}…, this node {me.arch_fingerprint[:12]}…)")
        return None

    def entries(self) -> list[PeerEntry]:
        now = time.monotonic()
        return [PeerEntry(r.node_id, r.address, r.age(now)) for r in self.peers.records.values()
                if r.state != DEAD]

    def learn(self, entries: list[PeerEntry]) -> None:
        for e in entries:
            if e.node_id != self.node_id and e.node_id not in self.peers.records and e.address:
                self.pending.add(e.address)

    # ------------------------------------------------------------------ calling side
    async def contact(self, address: str) -> None:
        if address == self.info().address:
            self.pending.discard(address)
            return
        try:
            remote, entries = await self.transport.handshake(
                address, self.info(), timeout=max(2.0, self.heartbeat_interval_s * 2))
        except PeerCallError as e:
            if e.kind == "refused":
                self.problems.note(address, f"handshake refused: {e.message}")
                log.error("peer at %s refused us: %s", address, e.message)
            elif address not in self.unreachable:  # once per address, not every heartbeat
                self.unreachable.add(address)
                what = "bootstrap peer" if address in self.bootstrap else "peer"
                msg = f"cannot reach {what} at {address} ({e.kind}: {e.message}); still trying"
                log.warning(msg)
                self.problems.note(address, msg)
            return
        if address in self.unreachable:
            self.unreachable.discard(address)
            log.info("reached peer at %s", address)
        why = self.incompatible(remote)
        if why:
            self.problems.note(address, f"handshake: {why}")
            log.error("refusing peer at %s: %s", address, why)
            return
        self.pending.discard(address)
        if remote.node_id != self.node_id:
            self.peers.upsert(remote.node_id, remote.address or address, labels=dict(remote.labels),
                              admin_url=remote.admin_url)
        self.learn(entries)

    async def ping(self, node_id: str, address: str) -> None:
        rnd, version = self.position()
        try:
            reply, rtt = await self.transport.heartbeat(
                address, Beat(self.node_id, rnd, version, time.time()),
                timeout=max(1.0, self.heartbeat_interval_s) + 2 * self.link_delay_s)
        except PeerCallError as e:
            if e.kind == UNKNOWN_PEER:  # it forgot us (fresh restart)
                self.pending.add(address)
            return
        if reply.node_id != node_id:  # someone else lives at that address now
            self.pending.add(address)
            return
        self.peers.seen(node_id, round=reply.round, version=reply.version, rtt_s=rtt)

    async def exchange(self) -> None:
        """Anti-entropy: swap peer lists with one random alive peer."""
        alive = self.peers.alive()
        if not alive:
            return
        target = self.peers.records[self.rng.choice(alive)]
        try:
            self.learn(await self.transport.exchange_peers(target.address, self.node_id, self.entries(),
                                                           timeout=self.request_timeout_s))
        except PeerCallError:
            pass

    async def run(self) -> None:
        tick = 0
        while True:
            jobs = [self.contact(a) for a in list(self.pending)]
            jobs += [self.ping(r.node_id, r.address) for r in list(self.peers.records.values())]
            await asyncio.gather(*jobs, return_exceptions=True)
            if tick % 3 == 0:
                await self.exchange()
            for node_id, old, new in self.peers.refresh():
                log.info("peer %s: %s -> %s", node_id, old, new)
            if self.on_gauges is not None:
                self.on_gauges(self.peers.counts())
            tick += 1
            await asyncio.sleep(self.heartbeat_interval_s)  # heartbeat period

    # ------------------------------------------------------------------ served side
    def on_handshake(self, remote: NodeInfo) -> list[PeerEntry]:
        why = self.incompatible(remote)
        if why:
            self.problems.note(remote.node_id or "?", f"handshake: {why}")
            raise refused(why)
        if remote.node_id == self.node_id:
            raise refused(f"node id {remote.node_id!r} is this node's own id")
        if not remote.node_id or not remote.address:
            raise invalid("handshake lacks node_id or address")
        self.peers.upsert(remote.node_id, remote.address, labels=dict(remote.labels), admin_url=remote.admin_url)
        self.pending.discard(remote.address)
        return self.entries()

    def check_known(self, node_id: str) -> None:
        if node_id not in self.peers.records:
            raise unknown_peer(node_id)
        self.peers.seen(node_id)

    def on_heartbeat(self, beat: Beat) -> Beat:
        self.check_known(beat.node_id)
        self.peers.seen(beat.node_id, round=beat.round, version=beat.version)
        rnd, version = self.position()
        return Beat(self.node_id, rnd, version, beat.sent_at)

    def on_peer_list(self, sender: str, entries: list[PeerEntry]) -> list[PeerEntry]:
        self.check_known(sender)
        self.learn(entries)
        return self.entries()
