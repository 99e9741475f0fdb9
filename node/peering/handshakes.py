"""How members enter (``membership.Membership``'s handshake part): only through their own
handshake, protocol and architecture checked both ways (``incompatible``); addresses heard from
peers are candidates (``membership.Candidates``), handshaken a few per period, backed off and
forgotten when they fail; dead members get reconnect attempts with backoff."""
from __future__ import annotations

import logging
import time

from ..learning.task import task_difference
from .errors import PeerCallError
from .membership_state import MembershipState
from .messages import DEAD, NodeInfo, PeerEntry

log = logging.getLogger("coterie.node")


class Handshakes(MembershipState):
    """Mixed into ``membership.Membership`` (its table, candidates, transport and problems)."""

    def incompatible(self, remote: NodeInfo) -> str | None:
        me = self.info()
        if remote.protocol_version != me.protocol_version:
            return (f"node {remote.node_id!r} speaks protocol version {remote.protocol_version}, "
                    f"this node speaks {me.protocol_version}")
        task = task_difference(me.task, remote.task, remote.node_id, me.node_id)  # before shapes: it says more
        if task:
            return task
        if remote.arch_fingerprint != me.arch_fingerprint:
            return (f"node {remote.node_id!r} runs another model architecture (fingerprint "
                    f"{remote.arch_fingerprint[:12]}…, this node {me.arch_fingerprint[:12]}…)")
        return None

    def entries(self, limit: int | None = None) -> list[PeerEntry]:
        """The members not dead, as addresses to pass on; ``limit``: a random sample of at most
        that many (a handshake's reply: the full view travels only in the push-pull exchange, or
        N joins would each carry N entries to every member they meet — O(N³) in all)."""
        now = time.monotonic()
        records = self.peers.records
        ids = list(records)
        if limit is not None and len(ids) > limit:
            # a window at a random offset of the table (join order): O(limit), where sampling
            # the whole table costs O(N) per handshake
            start = self.rng.randrange(len(ids))
            ids = (ids[start:] + ids[:start])[:2 * limit]
        out = [PeerEntry(n, r.address, r.age(now)) for n in ids if (r := records[n]).state != DEAD]
        return out if limit is None else out[:limit]

    def learn(self, entries: list[PeerEntry], source: str = "") -> None:
        """Addresses a peer told us about: unknown members become handshake candidates (as many
        as that peer's share of the candidate set allows; the rest of a long list is not read)."""
        for e in entries:
            if not self.pending.room(source):
                self.pending.dropped += 1
                return
            if e.node_id != self.node_id and e.node_id not in self.peers.records and e.address \
                    and self.peers.by_address(e.address) is None:
                self.pending.add(e.address, source=source, node_id=e.node_id)

    async def contact(self, address: str) -> bool:
        """Handshake an address (a candidate, or a dead member's last address)."""
        if address == self.info().address:
            self.pending.discard(address)
            return False
        timeout = max(2.0, self.period * 2) + 2 * self.link_delay_s
        try:
            remote, entries = await self.transport.handshake(address, self.info(), timeout=timeout)
        except PeerCallError as e:
            if e.kind == "refused":
                self.problems.note(address, f"handshake refused: {e.message}")
                log.error("peer at %s refused us: %s", address, e.message)
            elif address not in self.unreachable and (address in self.bootstrap or self.peers.by_address(address)):
                # once per address, and only for addresses this node was told to use or a member's:
                # what peers merely mention could be thousands of bogus ones
                self.unreachable.add(address)
                what = "bootstrap peer" if address in self.bootstrap else "peer"
                msg = f"cannot reach {what} at {address} ({e.kind}: {e.message}); still trying"
                log.warning(msg)
                self.problems.note(address, msg)
            self.stats["handshakes_failed"] += 1
            return False
        if address in self.unreachable:
            self.unreachable.discard(address)
            log.info("reached peer at %s", address)
        why = self.incompatible(remote)
        if why:
            self.problems.note(address, f"handshake: {why}")
            log.error("refusing peer at %s: %s", address, why)
            return False
        self.pending.discard(address)
        if remote.node_id != self.node_id:
            new = remote.node_id not in self.peers.records
            self.peers.upsert(remote.node_id, remote.address or address, labels=dict(remote.labels),
                              admin_url=remote.admin_url)
            if new:
                self._announce(remote.node_id)
        self.learn(entries, source=remote.node_id)
        return True

    async def _contact_candidate(self, address: str) -> None:
        self.pending.in_flight.add(address)
        try:
            if not await self.contact(address) and address in self.pending:
                if self.pending.failed(address) and self.peers.by_address(address) is None:
                    await self.transport.forget(address)  # no member lives there: drop the channel
        finally:
            self.pending.in_flight.discard(address)

    async def _reconnect(self, node_id: str, address: str) -> None:
        self._probing.add(node_id)
        try:
            if not await self.contact(address):
                self.peers.reconnect_failed(node_id)
        finally:
            self._probing.discard(node_id)
