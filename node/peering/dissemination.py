"""SWIM's dissemination (``membership.Membership``'s gossip part): membership news — alive,
suspect, dead, with the member's incarnation — piggybacked on pings, acks and indirect probes, a
bounded number per message, each retransmitted O(log N) times (``membership.Broadcasts``); this
node refutes a suspicion of itself by raising its incarnation; a full push-pull view exchange
with one member now and then repairs what gossip missed."""
from __future__ import annotations

import logging
import math
import time

from .claims import MAX_INCARNATION, implausible
from .errors import PeerCallError
from .membership_state import MembershipState
from .messages import ALIVE, DEAD, SUSPECT, MemberUpdate

log = logging.getLogger("coterie.node")

PUSH_PULL_SCALE_THRESHOLD = 32  # members beyond which the full exchange is spaced out (log2 N)


class Dissemination(MembershipState):
    """Mixed into ``membership.Membership`` (its table, settings, broadcasts and transport)."""

    def _retransmit_limit(self) -> int:
        return max(1, math.ceil(self.s.retransmit_mult * math.log10(len(self.peers.records) + 2)))

    def _announce(self, node_id: str) -> None:
        u = self.peers.update_of(node_id)
        if u is not None:
            self.broadcasts.add(u)

    def _refute(self, u: MemberUpdate, source: str = "") -> None:
        """Someone believes this node suspect or dead: outbid that belief — by one, and only a
        belief this node could have given rise to (no member knows a higher incarnation of this
        node than this node itself, save ``MAX_STEP`` of slack): 2^64 − 1 is refused, not
        outbid into an overflow."""
        why = implausible(u.incarnation, self.incarnation, restart=False)
        if why:
            self._strike(source, f"claimed this node {u.state}: {why}")
            return
        if u.incarnation >= self.incarnation:
            if u.incarnation >= MAX_INCARNATION:
                return  # unreachable past the check above; never overflow in any case
            self.incarnation = u.incarnation + 1
        self.stats["refuted"] += 1
        self.broadcasts.add(self.me())

    def me(self) -> MemberUpdate:
        return MemberUpdate(self.node_id, self.info().address, self.incarnation, ALIVE)

    def _strike(self, source: str, reason: str, *, dropped: bool = False) -> None:
        first = source and not self.claims.muted(source)
        self.claims.strike(source, reason, dropped=dropped)
        self.stats["claims_dropped" if dropped else "claims_struck"] += bool(source)
        if first and self.claims.muted(source):
            msg = (f"membership claims from {source} are dropped for {self.claims.window_s:.0f} s: "
                   f"{self.claims.limit} unconfirmed (last: {reason})")
            log.warning(msg)
            self.problems.note(source, msg)

    def merge(self, updates, source: str = "") -> None:
        """Apply piggybacked news from ``source`` (the member that called or answered us; ""
        for this node's own). A member's word about itself is first-hand; another's about it is
        a hint this node checks with its own probe (``claims.py``)."""
        for u in updates:
            if self.claims.muted(source) and u.state != ALIVE:
                self._strike(source, f"claimed {u.node_id} {u.state} while muted", dropped=True)
                continue
            if u.node_id == self.node_id:
                if u.state != ALIVE:
                    self._refute(u, source)
                continue
            rec = self.peers.records.get(u.node_id)
            if rec is None:
                if u.state != DEAD and u.address:
                    self.pending.add(u.address, source=source, node_id=u.node_id)
                continue
            if u.node_id == source:
                if u.state == ALIVE:  # its own word: as good as the incarnation of its call
                    self._evidence(source, u.incarnation, revive=False)
                continue
            why = implausible(u.incarnation, rec.incarnation)
            if why:
                self._strike(source, f"claimed {u.node_id} {u.state}: {why}")
                continue
            if u.state == ALIVE:
                if u.incarnation > rec.incarnation:
                    if u.address and u.address != rec.address:
                        self.pending.add(u.address, source=source, node_id=u.node_id)  # it moved: its handshake decides
                    self._hint_alive(u.node_id)
                continue
            if u.incarnation < rec.incarnation or rec.state == DEAD:
                continue  # stale news, or nothing left to do: no claim to check
            if rec.state == SUSPECT:
                # this node suspects it on its own evidence already: another accuser shortens
                # the suspicion (Lifeguard), a death claim does not skip it
                if self.peers.apply(MemberUpdate(u.node_id, rec.address, rec.incarnation, SUSPECT,
                                                 u.accuser or source)):
                    self._announce(u.node_id)
                continue
            self._check_claim(u.node_id, source)

    def _hint_alive(self, node_id: str) -> None:
        """Second-hand news of a newer life: worth a probe (suspect) or a reconnect now (dead)."""
        rec = self.peers.records[node_id]
        if rec.state == SUSPECT and node_id not in self._probing:
            self._spawn(self.probe(node_id))
        elif rec.state == DEAD and node_id not in self.peers.banned:
            rec.reconnect_at = min(rec.reconnect_at, time.monotonic())

    def _check_claim(self, node_id: str, source: str) -> None:
        """``source`` says ``node_id`` (alive here) is suspect or dead: probe it ourselves; the
        probe's verdict settles every claim made meanwhile (``_settle_claims``)."""
        self._claimants.setdefault(node_id, set()).add(source)
        self.stats["claims_checked"] += 1
        if node_id not in self._probing:
            self._spawn(self.probe(node_id))

    def _settle_claims(self, node_id: str, answered: bool | None) -> None:
        """A probe of ``node_id`` ended: it answered (each claimant gets a strike), it did not
        (each claimant is an accuser of the suspicion this node now holds), or inconclusive."""
        claimants = self._claimants.pop(node_id, set())
        if answered is True:
            for s in claimants:
                self._strike(s, f"claimed {node_id} down; it answered this node's probe")
        elif answered is False:
            rec = self.peers.records.get(node_id)
            for s in claimants:
                if s and rec is not None:
                    self.peers.apply(MemberUpdate(node_id, rec.address, rec.incarnation, SUSPECT, s))

    def _piggyback(self, counterpart: str, belief: MemberUpdate | None = None) -> tuple[MemberUpdate, ...]:
        """News for a message to/from ``counterpart``; when we (believed we) suspect or buried it,
        that belief goes first, so it can refute at once."""
        out = self.broadcasts.take(self.s.max_piggyback, exclude=counterpart)
        belief = belief or self.peers.update_of(counterpart)
        if belief is not None and belief.state != ALIVE:
            out = [belief] + out[: self.s.max_piggyback - 1]
        return tuple(out)

    def _evidence(self, node_id: str, incarnation: int, *, revive: bool, **seen) -> None:
        """``node_id`` answered us (``revive``: alive) or called us (noted; a new incarnation is
        its refutation and counts either way)."""
        rec = self.peers.records.get(node_id)
        if rec is None:
            return
        why = implausible(incarnation, rec.incarnation)
        if why:  # its own word, but not a possible one: noted, and not believed
            self._strike(node_id, f"its own {why}")
        elif incarnation > rec.incarnation:
            if self.peers.apply(MemberUpdate(node_id, rec.address, incarnation, ALIVE)):
                self._announce(node_id)
        self.peers.seen(node_id, revive=revive, **seen)

    async def _push_pull(self) -> None:
        alive = self.peers.alive()
        if not alive:
            return
        target = self.peers.records[self.rng.choice(alive)]
        try:
            entries, members, inc = await self.transport.exchange_peers(
                target.address, self.node_id, self.entries(), timeout=self.probe_budget_s * 2,
                members=self.peers.members() + [self.me()], incarnation=self.incarnation,
                peer=target.node_id)
        except PeerCallError:
            return
        self.learn(entries, source=target.node_id)
        self.merge(members, source=target.node_id)
        self._evidence(target.node_id, inc, revive=True)

    def push_pull_interval_s(self, n: int) -> float:
        """A full exchange carries the whole view (O(N)): past 32 members its interval grows with
        log2 N, as memberlist's ``pushPullScale`` does, so the network's total stays ~O(N log N)."""
        if n <= PUSH_PULL_SCALE_THRESHOLD:
            return self.s.push_pull_interval_s
        return self.s.push_pull_interval_s * (math.ceil(math.log2(n) - math.log2(PUSH_PULL_SCALE_THRESHOLD)) + 1)
