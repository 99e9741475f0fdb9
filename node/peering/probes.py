"""SWIM's failure detector (``membership.Membership``'s probe part): each period one member is
pinged (round-robin over a shuffled list); a member that misses the ping is pinged again and, at
the same time, through ``k`` other members (``IndirectProbe``); no answer within the probe budget
makes it suspect. Probes run as their own tasks with their own short deadlines; a probe that
failed while this node's own event loop was stalled is inconclusive."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Sequence

from .errors import UNKNOWN_PEER, PeerCallError
from .membership_state import MembershipState
from .messages import ALIVE, DEAD, Beat, IndirectProbe


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


class Probes(MembershipState):
    """Mixed into ``membership.Membership`` (its table, settings, round trips and transport)."""

    def ping_timeout(self, node_id: str) -> float:
        return self.rtts.timeout(node_id, "ping") + 2 * self.link_delay_s

    async def _ping(self, node_id: str, address: str, timeout: float) -> bool:
        """One direct ping; True when ``node_id`` answered."""
        rnd, version = self.position()
        beat = Beat(self.node_id, rnd, version, time.time(), self.incarnation, self._piggyback(node_id))
        try:
            reply, rtt = await self.transport.heartbeat(address, beat, timeout=timeout, peer=node_id)
        except PeerCallError as e:
            if e.kind == UNKNOWN_PEER:  # whoever answers there does not know us: handshake to see
                # (even if that address was forgotten after failed handshakes: it answers now)
                self.pending.add(address, source="self", node_id=node_id, revive=True)
            return False
        if reply.node_id != node_id:  # someone else lives at that address now
            self.pending.add(address, source="self")
            return False
        self.rtts.observe(node_id, "ping", rtt)
        self.merge(reply.updates, source=node_id)
        self._evidence(node_id, reply.incarnation, revive=True, round=reply.round, version=reply.version, rtt_s=rtt)
        return True

    async def _ask(self, helper: str, target: str, timeout: float) -> bool | None:
        """Ask ``helper`` to ping ``target``: True (it answered the helper), False (the helper
        answered that it did not: a nack), None (the helper did not answer either)."""
        rec = self.peers.records.get(helper)
        if rec is None:
            return None
        req = IndirectProbe(self.node_id, target, max(0.05, timeout - 2 * self.link_delay_s) * 0.8,
                            self.incarnation, self._piggyback(helper))
        try:
            ack, updates = await self.transport.indirect_probe(rec.address, req, timeout=timeout, peer=helper)
        except PeerCallError:
            return None
        self.merge(updates, source=helper)
        self.peers.seen(helper)
        return bool(ack)

    async def probe(self, node_id: str) -> bool | None:
        """One SWIM probe: ping; on no answer, ping again and ask k members to ping it, within
        the probe budget. No answer → suspect, unless the evidence points at this node itself:
        its own loop was stalled, or none of the helpers answered it either (Lifeguard's nacks:
        a node cut off from everyone must not accuse everyone). Returns True (it answered),
        False (no answer: suspected) or None (inconclusive, or not probed); either way the
        verdict settles the third-party claims about it heard meanwhile (``claims.py``)."""
        rec = self.peers.records.get(node_id)
        if rec is None or rec.state == DEAD or node_id in self._probing:
            if rec is None or rec.state == DEAD:
                self._settle_claims(node_id, None)
            return None
        self._probing.add(node_id)
        verdict: bool | None = None
        try:
            verdict = await self._probe(node_id, rec)
            return verdict
        finally:
            self._probing.discard(node_id)
            self._settle_claims(node_id, verdict)

    async def _probe(self, node_id: str, rec) -> bool | None:
        self.stats["probes"] += 1
        loop = asyncio.get_running_loop()
        t0, m0 = loop.time(), time.monotonic()
        budget = self.probe_budget_s
        direct = min(self.ping_timeout(node_id), budget / 2)
        if await self._ping(node_id, rec.address, direct):
            return True
        left = budget - (loop.time() - t0)
        helpers = [p for p in self.peers.alive() if p != node_id]
        helpers = self.rng.sample(helpers, min(self.s.indirect_probes, len(helpers)))
        self.stats["indirect"] += 1
        nacks = 0
        if left > 0:
            async def again() -> bool | None:  # a second direct try is no helper: never a nack
                return await self._ping(node_id, rec.address, left) or None
            acked, nacks = await first_ack([again()] + [self._ask(h, node_id, left) for h in helpers])
            if acked:
                return True
        if self._stalled_since(m0) or (helpers and not nacks):
            self.stats["inconclusive"] += 1  # no evidence against it, only against us
            return None
        if self.peers.records.get(node_id) is rec and self.peers.suspect(node_id):
            self.stats["suspected"] += 1
            self._announce(node_id)
        return False

    def _stalled_since(self, t: float) -> bool:
        """Was this node's own loop blocked (beyond a ping's floor) since monotonic time ``t``?"""
        return self.loop_lag is not None and self.loop_lag.worst_since(t) > self.s.probe_timeout_s

    def suspect_hint(self, node_id: str) -> None:
        """A request to ``node_id`` just failed (timeout, unreachable): probe it now, out of turn."""
        rec = self.peers.records.get(node_id)
        if rec is not None and rec.state == ALIVE and node_id not in self._probing:
            self._spawn(self.probe(node_id))

    def _next_target(self) -> str | None:
        records = self.peers.records
        while self._order:
            nid = self._order.pop()
            rec = records.get(nid)
            if rec is not None and rec.state != DEAD:
                return nid
        order = sorted(self.peers.probe_targets())  # a new shuffled pass: O(N) once per N periods
        self.rng.shuffle(order)
        self._order = order
        return self._order.pop() if self._order else None
