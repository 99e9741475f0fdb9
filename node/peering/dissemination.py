"""SWIM's dissemination (one part ``membership.Membership`` composes): membership news — alive,
suspect, dead, with the member's incarnation — piggybacked on pings, acks and indirect probes, a
bounded number per message, each retransmitted O(log N) times (``membership.Broadcasts``); this
node refutes a suspicion of itself by raising its incarnation; a full push-pull view exchange
with one member now and then repairs what gossip missed."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from .claims import MAX_INCARNATION, Strikes, implausible
from .errors import PeerCallError
from .interfaces import PeerTransport
from .membership_state import MembershipState
from .messages import ALIVE, DEAD, SUSPECT, MemberUpdate
from .problems import ProblemLog

log = logging.getLogger("coterie.node")

PUSH_PULL_SCALE_THRESHOLD = 32  # members beyond which the full exchange is spaced out (log2 N)


class Dissemination:
    """Membership news in and out: ``merge`` what a peer piggybacked (checking third-party claims
    with a probe of this node's own, ``probe_soon``), ``piggyback`` news on what this node sends,
    refute suspicions of itself, and the periodic full push-pull exchange over ``transport``."""

    def __init__(
        self,
        state: MembershipState,
        transport: PeerTransport,
        problems: ProblemLog,
        probe_soon: Callable[[str], None],
        *,
        claims: Strikes | None = None,
    ):
        self.state = state
        self.transport = transport
        self.problems = problems
        self.probe_soon = probe_soon  # probe a member now, unless a probe of it is under way
        # what third parties claim about others is checked, and lies counted (claims.py)
        self.claims = claims or Strikes()
        self._claimants: dict[str, set[str]] = {}  # member -> sources claiming it down, until a probe settles it

    def _refute(self, u: MemberUpdate, source: str = "") -> None:
        """Someone believes this node suspect or dead: outbid that belief — by one, and only a
        belief this node could have given rise to (no member knows a higher incarnation of this
        node than this node itself, save ``MAX_STEP`` of slack): 2^64 − 1 is refused, not
        outbid into an overflow."""
        why = implausible(u.incarnation, self.state.incarnation, restart=False)
        if why:
            self._strike(source, f"claimed this node {u.state}: {why}")
            return
        if u.incarnation >= self.state.incarnation:
            if u.incarnation >= MAX_INCARNATION:
                return  # unreachable past the check above; never overflow in any case
            self.state.incarnation = u.incarnation + 1
        self.state.stats["refuted"] += 1
        self.state.health.worse()  # suspected: likely this node is the slow one (Lifeguard)
        self.state.broadcasts.add(self.state.me())

    def _strike(self, source: str, reason: str, *, dropped: bool = False) -> None:
        first = source and not self.claims.muted(source)
        self.claims.strike(source, reason, dropped=dropped)
        self.state.stats["claims_dropped" if dropped else "claims_struck"] += bool(source)
        if first and self.claims.muted(source):
            msg = (
                f"membership claims from {source} are dropped for {self.claims.window_s:.0f} s: "
                f"{self.claims.limit} unconfirmed (last: {reason})"
            )
            log.warning(msg)
            self.problems.note(source, msg)

    def merge(self, updates: Iterable[MemberUpdate], source: str = "") -> None:
        """Apply piggybacked news from ``source`` (the member that called or answered us; ""
        for this node's own). A member's word about itself is first-hand; another's about it is
        a hint this node checks with its own probe (``claims.py``)."""
        for u in updates:
            if self.claims.muted(source) and u.state != ALIVE:
                self._strike(source, f"claimed {u.node_id} {u.state} while muted", dropped=True)
                continue
            if u.node_id == self.state.node_id:
                if u.state != ALIVE:
                    self._refute(u, source)
                continue
            rec = self.state.peers.records.get(u.node_id)
            if rec is None:  # (past the threshold, hearsay makes no candidates: the views decide)
                if u.state != DEAD and u.address and not self.state.partial():
                    self.state.pending.add(u.address, source=source, node_id=u.node_id)
                continue
            if u.node_id == source:
                if u.state == ALIVE:  # its own word: as good as the incarnation of its call
                    self.evidence(source, u.incarnation, revive=False)
                continue
            why = implausible(u.incarnation, rec.incarnation)
            if why:
                self._strike(source, f"claimed {u.node_id} {u.state}: {why}")
                continue
            if u.state == ALIVE:
                if u.incarnation > rec.incarnation:
                    if u.address and u.address != rec.address:
                        self.state.pending.add(
                            u.address, source=source, node_id=u.node_id
                        )  # it moved: its handshake decides
                    self._hint_alive(u.node_id)
                continue
            if u.incarnation < rec.incarnation or rec.state == DEAD:
                continue  # stale news, or nothing left to do: no claim to check
            if rec.state == SUSPECT:
                # this node suspects it on its own evidence already: another accuser shortens
                # the suspicion (Lifeguard), a death claim does not skip it
                if self.state.peers.apply(
                    MemberUpdate(u.node_id, rec.address, rec.incarnation, SUSPECT, u.accuser or source)
                ):
                    self.state.announce(u.node_id)
                continue
            self._check_claim(u.node_id, source)

    def _hint_alive(self, node_id: str) -> None:
        """Second-hand news of a newer life: worth a probe (suspect) or a reconnect now (dead)."""
        rec = self.state.peers.records[node_id]
        if rec.state == SUSPECT:
            self.probe_soon(node_id)
        elif rec.state == DEAD and node_id not in self.state.peers.banned:
            rec.reconnect_at = min(rec.reconnect_at, time.monotonic())

    def _check_claim(self, node_id: str, source: str) -> None:
        """``source`` says ``node_id`` (alive here) is suspect or dead: probe it ourselves; the
        probe's verdict settles every claim made meanwhile (``settle_claims``)."""
        self._claimants.setdefault(node_id, set()).add(source)
        self.state.stats["claims_checked"] += 1
        self.probe_soon(node_id)

    def settle_claims(self, node_id: str, answered: bool | None) -> None:
        """A probe of ``node_id`` ended: it answered (each claimant gets a strike), it did not
        (each claimant is an accuser of the suspicion this node now holds), or inconclusive."""
        claimants = self._claimants.pop(node_id, set())
        if answered is True:
            for s in claimants:
                self._strike(s, f"claimed {node_id} down; it answered this node's probe")
        elif answered is False:
            rec = self.state.peers.records.get(node_id)
            for s in claimants:
                if s and rec is not None:
                    self.state.peers.apply(MemberUpdate(node_id, rec.address, rec.incarnation, SUSPECT, s))

    def piggyback(self, counterpart: str, belief: MemberUpdate | None = None) -> tuple[MemberUpdate, ...]:
        """News for a message to/from ``counterpart``; when we (believed we) suspect or buried it,
        that belief goes first, so it can refute at once."""
        out = self.state.broadcasts.take(self.state.s.max_piggyback, exclude=counterpart)
        belief = belief or self.state.peers.update_of(counterpart)
        if belief is not None and belief.state != ALIVE:
            out = [belief] + out[: self.state.s.max_piggyback - 1]
        return tuple(out)

    def evidence(self, node_id: str, incarnation: int, *, revive: bool, **seen: Any) -> None:
        """``node_id`` answered us (``revive``: alive) or called us (noted; a new incarnation is
        its refutation and counts either way)."""
        rec = self.state.peers.records.get(node_id)
        if rec is None:
            return
        why = implausible(incarnation, rec.incarnation)
        if why:  # its own word, but not a possible one: noted, and not believed
            self._strike(node_id, f"its own {why}")
        elif incarnation > rec.incarnation:
            if self.state.peers.apply(MemberUpdate(node_id, rec.address, incarnation, ALIVE)):
                self.state.announce(node_id)
        self.state.peers.seen(node_id, revive=revive, **seen)

    async def push_pull(self) -> None:
        alive = self.state.peers.alive()
        if not alive:
            return
        target = self.state.peers.records[self.state.rng.choice(alive)]
        try:
            entries, members, inc = await self.transport.exchange_peers(
                target.address,
                self.state.node_id,
                self.state.entries(),
                timeout=self.state.probe_budget_s * 2,
                members=self.state.peers.members() + [self.state.me()],
                incarnation=self.state.incarnation,
                peer=target.node_id,
            )
        except PeerCallError:
            return
        self.state.learn(entries, source=target.node_id)
        self.merge(members, source=target.node_id)
        self.evidence(target.node_id, inc, revive=True)

    def push_pull_interval_s(self, n: int) -> float:
        """A full exchange carries the whole view (O(N)): past 32 members its interval grows with
        log2 N, as memberlist's ``pushPullScale`` does, so the network's total stays ~O(N log N)."""
        if n <= PUSH_PULL_SCALE_THRESHOLD:
            return self.state.s.push_pull_interval_s
        return self.state.s.push_pull_interval_s * (math.ceil(math.log2(n) - math.log2(PUSH_PULL_SCALE_THRESHOLD)) + 1)
