"""SWIM's failure detector (one part ``membership.Membership`` composes): each period one member is
pinged (round-robin over a shuffled list); a member that misses the ping is pinged again and, at
the same time, through ``k`` other members (``IndirectProbe``); no answer within the probe budget
makes it suspect. Probes run as their own tasks with their own short deadlines; a probe that
failed while this node's own event loop was stalled is inconclusive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence

from .deadlines import Deadlines
from .dissemination import Dissemination
from .errors import UNKNOWN_PEER, PeerCallError
from .interfaces import PeerTransport
from .loop_lag import LoopLag
from .membership_state import MembershipState, Tasks
from .messages import ALIVE, DEAD, Beat, IndirectProbe
from .peer_table import PeerRecord


async def first_ack(attempts: Sequence[Awaitable[bool | None]]) -> tuple[bool, int]:
    """Run the attempts until one returns True (the rest are cancelled). Returns (acked, how
    many returned False: a *nack*, i.e. the helper answered but the target did not)."""
    tasks = [asyncio.ensure_future(a) for a in attempts]
    nacks = 0
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                r = None if t.cancelled() or t.exception() is not None else t.result()
                if r is True:
                    return True, nacks
                nacks += r is False
        return False, nacks
    finally:
        for t in tasks:
            t.cancel()


class Probes:
    """Pings members over ``transport`` (round-robin, and out of turn on a hint), news riding on
    each ping through ``gossip``; suspects the ones that do not answer. Probes run as ``tasks``."""

    def __init__(
        self,
        state: MembershipState,
        transport: PeerTransport,
        gossip: Dissemination,
        tasks: Tasks,
        *,
        rtts: Deadlines | None = None,
        loop_lag: LoopLag | None = None,
    ):
        self.state = state
        self.transport = transport
        self.gossip = gossip
        self.tasks = tasks
        # ping round trips per member: the direct-ping deadline follows them
        self.rtts = rtts or Deadlines(state.probe_budget_s / 2, floor_s=state.s.probe_timeout_s, mult=4.0)
        self.loop_lag = loop_lag
        self._order: list[str] = []  # shuffled probe round-robin

    def ping_timeout(self, node_id: str) -> float:
        return self.rtts.timeout(node_id, "ping") + 2 * self.state.link_delay_s

    async def ping(self, node_id: str, address: str, timeout: float) -> bool:
        """One direct ping; True when ``node_id`` answered."""
        rnd, version = self.state.position()
        beat = Beat(
            self.state.node_id, rnd, version, time.time(), self.state.incarnation, self.gossip.piggyback(node_id)
        )
        try:
            reply, rtt = await self.transport.heartbeat(address, beat, timeout=timeout, peer=node_id)
        except PeerCallError as e:
            if e.kind == UNKNOWN_PEER:  # whoever answers there does not know us: handshake to see
                # (even if that address was forgotten after failed handshakes: it answers now)
                self.state.pending.add(address, source="self", node_id=node_id, revive=True)
                # it answered: alive, whatever this node's mode. A member past the threshold
                # forgets whoever is not in its views, so a node still on full membership (a late
                # starter) was refused by most of the network and, its full-membership helpers
                # refused too (nacks), buried it: 886 false deaths in 100 daemons (issue 32)
                return True
            return False
        if reply.node_id != node_id:  # someone else lives at that address now
            self.state.pending.add(address, source="self")
            return False
        self.rtts.observe(node_id, "ping", rtt)
        self.gossip.merge(reply.updates, source=node_id)
        self.gossip.evidence(
            node_id, reply.incarnation, revive=True, round=reply.round, version=reply.version, rtt_s=rtt
        )
        return True

    async def _ask(self, helper: str, target: str, timeout: float) -> bool | None:
        """Ask ``helper`` to ping ``target``: True (it answered the helper), False (the helper
        answered that it did not: a nack), None (the helper did not answer either)."""
        rec = self.state.peers.records.get(helper)
        if rec is None:
            return None
        req = IndirectProbe(
            self.state.node_id,
            target,
            max(0.05, timeout - 2 * self.state.link_delay_s) * 0.8,
            self.state.incarnation,
            self.gossip.piggyback(helper),
        )
        try:
            ack, updates = await self.transport.indirect_probe(rec.address, req, timeout=timeout, peer=helper)
        except PeerCallError:
            return None
        self.gossip.merge(updates, source=helper)
        self.state.peers.seen(helper)
        return bool(ack)

    async def probe(self, node_id: str) -> bool | None:
        """One SWIM probe: ping; on no answer, ping again and ask k members to ping it, within
        the probe budget. No answer → suspect, unless the evidence points at this node itself:
        its own loop was stalled, or none of the helpers answered it either (Lifeguard's nacks:
        a node cut off from everyone must not accuse everyone). Returns True (it answered),
        False (no answer: suspected) or None (inconclusive, or not probed); either way the
        verdict settles the third-party claims about it heard meanwhile (``claims.py``)."""
        rec = self.state.peers.records.get(node_id)
        if rec is None or rec.state == DEAD or node_id in self.state.probing:
            if rec is None or rec.state == DEAD:
                self.gossip.settle_claims(node_id, None)
            return None
        self.state.probing.add(node_id)
        verdict: bool | None = None
        try:
            verdict = await self._probe(node_id, rec)
            return verdict
        finally:
            self.state.probing.discard(node_id)
            self.gossip.settle_claims(node_id, verdict)

    async def _probe(self, node_id: str, rec: PeerRecord) -> bool | None:
        self.state.stats["probes"] += 1
        loop = asyncio.get_running_loop()
        t0, m0 = loop.time(), time.monotonic()
        health = self.state.health
        budget = health.scale(self.state.probe_budget_s)  # a slow node waits longer (Lifeguard)
        direct = min(health.scale(self.ping_timeout(node_id)), budget / 2)
        if await self.ping(node_id, rec.address, direct):
            health.better()
            return True
        left = budget - (loop.time() - t0)
        # past the threshold, the other active neighbours: they hold this node in their tables
        # (a member the views dropped may have forgotten it, and would refuse to help)
        pool = self.state.probe_targets() if self.state.partial() else self.state.peers.alive()
        helpers = [p for p in pool if p != node_id and self.state.peers.records[p].state == ALIVE]
        helpers = self.state.rng.sample(helpers, min(self.state.s.indirect_probes, len(helpers)))
        self.state.stats["indirect"] += 1
        nacks = 0
        if left > 0:

            async def again() -> bool | None:  # a second direct try is no helper: never a nack
                return await self.ping(node_id, rec.address, left) or None

            acked, nacks = await first_ack([again()] + [self._ask(h, node_id, left) for h in helpers])
            if acked:
                health.better()
                return True
        if self._stalled_since(m0) or (helpers and not nacks):
            self.state.stats["inconclusive"] += 1  # no evidence against it, only against us
            health.worse()
            return None
        if self.state.peers.records.get(node_id) is rec and self.state.peers.suspect(node_id):
            self.state.stats["suspected"] += 1
            self.state.announce(node_id)
        return False

    def _stalled_since(self, t: float) -> bool:
        """Was this node's own loop blocked (beyond a ping's floor) since monotonic time ``t``?"""
        return self.loop_lag is not None and self.loop_lag.worst_since(t) > self.state.s.probe_timeout_s

    def suspect_hint(self, node_id: str) -> None:
        """A request to ``node_id`` just failed (timeout, unreachable): probe it now, out of turn."""
        rec = self.state.peers.records.get(node_id)
        if rec is not None and rec.state == ALIVE:
            self.probe_soon(node_id)

    def probe_soon(self, node_id: str) -> None:
        """Probe ``node_id`` now, as a task of its own, unless a probe of it is under way."""
        if node_id not in self.state.probing:
            self.tasks.spawn(self.probe(node_id))

    def next_target(self) -> str | None:
        records = self.state.peers.records
        partial = self.state.partial()
        if partial:  # the active view changes: probe only who is still in it
            current = set(self.state.probe_targets())
            self._order = [p for p in self._order if p in current]
        while self._order:
            nid = self._order.pop()
            rec = records.get(nid)
            if rec is not None and rec.state != DEAD:
                return nid
        order = sorted(self.state.probe_targets())  # a new shuffled pass: O(N) once per N periods
        self.state.rng.shuffle(order)
        self._order = order
        return self._order.pop() if self._order else None
