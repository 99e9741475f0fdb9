"""How members enter (one part ``membership.Membership`` composes): only through their own
handshake, protocol range, task and architecture checked both ways (``compatible``; the
protocol and features agreed are ``versions.agree``'s, kept on the member's record); addresses heard from
peers are candidates (``membership.Candidates``), handshaken a few per period, backed off and
forgotten when they fail; dead members get reconnect attempts with backoff."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..learning.task import task_difference
from .errors import PeerCallError, invalid, refused
from .interfaces import PeerTransport
from .membership_state import MembershipState
from .messages import NodeInfo, PeerEntry
from .problems import ProblemLog
from .versions import Agreement, agree, peer_range

log = logging.getLogger("coterie.node")

HANDSHAKE_ENTRIES = 64  # addresses a handshake reply carries at most (a random sample)
VIEW_HANDSHAKE_ENTRIES = 8  # ... past the threshold (the table is the views: a joiner's seed sample)


class Handshakes:
    """Handshakes both ways over ``transport``: ``contact`` dials a candidate or a dead member's
    address, ``accept`` answers one; a member enters ``state``'s table only through one."""

    def __init__(
        self, state: MembershipState, transport: PeerTransport, problems: ProblemLog, bootstrap: Sequence[str] = ()
    ):
        self.state = state
        self.transport = transport
        self.problems = problems
        for a in bootstrap:  # in the configured order: the first listed is dialled first
            state.pending.add(a, source="config", pinned=True)
        self.bootstrap = set(bootstrap)
        self.unreachable: set[str] = set()  # addresses already reported as unreachable

    def set_bootstrap(self, addresses: Sequence[str]) -> None:
        """The configured seed peers, replaced live (a SIGHUP reload): new ones are pinned
        candidates at once; dropped ones lose their pin (a member there stays a member)."""
        for a in addresses:
            self.state.pending.add(a, source="config", pinned=True)
        for a in self.bootstrap - set(addresses):
            self.state.pending.unpin(a)
            self.unreachable.discard(a)
        self.bootstrap = set(addresses)

    def compatible(self, remote: NodeInfo) -> Agreement | str:
        """The protocol and features agreed with ``remote``, or why this node cannot talk to it."""
        me = self.state.info()
        agreed = agree(
            remote.node_id,
            remote.protocol_version,
            remote.protocol_max,
            remote.capabilities,
            remote.release,
            mine=peer_range(me.protocol_version, me.protocol_max),
        )
        if isinstance(agreed, str):
            return agreed  # before the task: a node of another protocol may describe it differently
        task = task_difference(me.task, remote.task, remote.node_id, me.node_id)  # before shapes: it says more
        if task:
            return task
        if remote.arch_fingerprint != me.arch_fingerprint:
            return (
                f"node {remote.node_id!r} runs another model architecture (fingerprint "
                f"{remote.arch_fingerprint[:12]}…, this node {me.arch_fingerprint[:12]}…)"
            )
        return agreed

    def accept(self, remote: NodeInfo) -> list[PeerEntry]:
        """A member's handshake: checked, then into the table (the others learn of it by gossip);
        the reply is a sample of the members this node knows."""
        agreed = self.compatible(remote)
        if isinstance(agreed, str):
            self.problems.note(remote.node_id or "?", f"handshake: {agreed}")
            raise refused(agreed)
        if remote.node_id == self.state.node_id:
            raise refused(f"node id {remote.node_id!r} is this node's own id")
        if not remote.node_id or not remote.address:
            raise invalid("handshake lacks node_id or address")
        new = remote.node_id not in self.state.peers.records
        self.state.peers.upsert(
            remote.node_id, remote.address, labels=dict(remote.labels), admin_url=remote.admin_url, agreed=agreed
        )
        if new:
            self.state.announce(remote.node_id)  # SWIM join: the others learn of it by gossip
        self.state.pending.discard(remote.address)
        return self.state.entries(limit=VIEW_HANDSHAKE_ENTRIES if self.state.partial() else HANDSHAKE_ENTRIES)

    async def contact(self, address: str, timeout: float | None = None) -> bool:
        """Handshake an address (a candidate, or a dead member's last address); ``timeout``: at
        least membership's own (a probe-sized 2 s or two periods)."""
        if address == self.state.info().address:
            self.state.pending.discard(address)
            return False
        timeout = max(2.0, self.state.period * 2, timeout or 0.0) + 2 * self.state.link_delay_s
        try:
            remote, entries = await self.transport.handshake(address, self.state.info(), timeout=timeout)
        except PeerCallError as e:
            if e.kind == "refused":
                self.problems.note(address, f"handshake refused: {e.message}")
                log.error("peer at %s refused us: %s", address, e.message)
            elif address not in self.unreachable and (
                address in self.bootstrap or (self.state.peers.by_address(address) and not self.state.partial())
            ):
                # once per address, and only for addresses this node was told to use or a member's:
                # what peers merely mention could be thousands of bogus ones (past the threshold,
                # a view's node that went is the overlay's business: it is replaced, not reported)
                self.unreachable.add(address)
                what = "bootstrap peer" if address in self.bootstrap else "peer"
                msg = f"cannot reach {what} at {address} ({e.kind}: {e.message}); still trying"
                log.warning(msg)
                self.problems.note(address, msg)
            self.state.stats["handshakes_failed"] += 1
            return False
        if address in self.unreachable:
            self.unreachable.discard(address)
            log.info("reached peer at %s", address)
        agreed = self.compatible(remote)
        if isinstance(agreed, str):
            self.problems.note(address, f"handshake: {agreed}")
            log.error("refusing peer at %s: %s", address, agreed)
            return False
        self.state.pending.discard(address)
        if remote.node_id != self.state.node_id:
            new = remote.node_id not in self.state.peers.records
            self.state.peers.upsert(
                remote.node_id,
                remote.address or address,
                labels=dict(remote.labels),
                admin_url=remote.admin_url,
                agreed=agreed,
            )
            if new:
                self.state.announce(remote.node_id)
        self.state.learn(entries, source=remote.node_id)
        return True

    async def contact_candidate(self, address: str) -> None:
        self.state.pending.in_flight.add(address)
        try:
            if not await self.contact(address) and address in self.state.pending:
                if self.state.pending.failed(address) and self.state.peers.by_address(address) is None:
                    await self.transport.forget(address)  # no member lives there: drop the channel
        finally:
            self.state.pending.in_flight.discard(address)

    async def reconnect(self, node_id: str, address: str) -> None:
        self.state.probing.add(node_id)
        try:
            if not await self.contact(address):
                self.state.peers.reconnect_failed(node_id)
        finally:
            self.state.probing.discard(node_id)
