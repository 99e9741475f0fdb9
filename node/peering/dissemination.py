"""SWIM's dissemination (``membership.Membership``'s gossip part): membership news — alive,
suspect, dead, with the member's incarnation — piggybacked on pings, acks and indirect probes, a
bounded number per message, each retransmitted O(log N) times (``membership.Broadcasts``); this
node refutes a suspicion of itself by raising its incarnation; a full push-pull view exchange
with one member now and then repairs what gossip missed."""
from __future__ import annotations

import math

from .errors import PeerCallError
from .membership_state import MembershipState
from .messages import ALIVE, DEAD, MemberUpdate

PUSH_PULL_SCALE_THRESHOLD = 32  # members beyond which the full exchange is spaced out (log2 N)


class Dissemination(MembershipState):
    """Mixed into ``membership.Membership`` (its table, settings, broadcasts and transport)."""

    def _retransmit_limit(self) -> int:
        return max(1, math.ceil(self.s.retransmit_mult * math.log10(len(self.peers.records) + 2)))

    def _announce(self, node_id: str) -> None:
        u = self.peers.update_of(node_id)
        if u is not None:
            self.broadcasts.add(u)

    def _refute(self, u: MemberUpdate) -> None:
        """Someone believes this node suspect or dead: outbid that belief."""
        if u.incarnation >= self.incarnation:
            self.incarnation = u.incarnation + 1
        self.stats["refuted"] += 1
        self.broadcasts.add(self.me())

    def me(self) -> MemberUpdate:
        return MemberUpdate(self.node_id, self.info().address, self.incarnation, ALIVE)

    def merge(self, updates, source: str = "") -> None:
        """Apply piggybacked news; what changed our view is passed on."""
        for u in updates:
            if u.node_id == self.node_id:
                if u.state != ALIVE:
                    self._refute(u)
                continue
            rec = self.peers.records.get(u.node_id)
            if rec is None:
                if u.state != DEAD and u.address:
                    self.pending.add(u.address, source=source, node_id=u.node_id)
                continue
            if u.address and u.address != rec.address and u.incarnation > rec.incarnation and u.state == ALIVE:
                self.pending.add(u.address, source=source, node_id=u.node_id)  # it moved: its handshake decides
            if self.peers.apply(u):
                self.broadcasts.add(u)

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
        if incarnation > rec.incarnation:
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
