"""The membership protocol: who is out there and whether they answer — SWIM (Das et al. 2002,
as HashiCorp memberlist runs it).

Each protocol period (``heartbeat_interval_s``) a node pings one member, taken round-robin from
a shuffled list; a member that misses the ping is pinged again and, at the same time, through
``k`` other members (``IndirectProbe``). No answer within the probe budget (``suspect_after_s``)
makes it *suspect*; a suspect that does not refute within the suspicion timeout is *dead*. News
(alive / suspect / dead, with the member's incarnation) rides piggybacked on pings, acks and
indirect probes, a bounded number per message, each retransmitted O(log N) times; a member that
hears it is suspected raises its incarnation and says it is alive. So a node sends O(1) messages
per period whatever the network size. A full push-pull view exchange with one member now and
then repairs what gossip missed. Dead members are not probed; they get reconnect attempts with
backoff, so a restarted node comes back.

New members enter the table only through their own handshake (protocol and architecture checked
both ways). Addresses heard from peers are *candidates*: a bounded set, handshaken a few per
period, backed off and forgotten when they fail — one peer listing thousands of bogus addresses
costs a handful of failed dials per period.

Probes run as their own tasks with their own short deadlines, never behind an exchange or a
snapshot pull; a probe that failed while this node's own event loop was stalled is inconclusive.

``Membership`` is the state and the period (``tick``, ``run``) and the served side; its parts
are mixed in from their own modules: ``probes.py`` (the failure detector), ``dissemination.py``
(piggybacked news, refutation, push-pull) and ``handshakes.py`` (compatibility, candidates,
contact and reconnects)."""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Callable

from .claims import Strikes
from .deadlines import Deadlines
from .dissemination import Dissemination
from .errors import invalid, refused, unknown_peer
from .handshakes import Handshakes
from .interfaces import PeerTransport
from .loop_lag import LoopLag
from .membership_state import Broadcasts, Candidate, Candidates, Settings  # noqa: F401 (re-exported)
from .messages import Beat, IndirectProbe, MemberUpdate, NodeInfo, PeerEntry
from .peer_table import PeerTable
from .probes import Probes
from .problems import ProblemLog

log = logging.getLogger("coterie.node")

HANDSHAKE_ENTRIES = 64  # addresses a handshake reply carries at most (a random sample)


# ---------------------------------------------------------------------------------- membership
class Membership(Dissemination, Handshakes, Probes):
    def __init__(self, info: Callable[[], NodeInfo], position: Callable[[], tuple[int, int]],
                 peers: PeerTable, transport: PeerTransport, problems: ProblemLog, *,
                 bootstrap: list[str], heartbeat_interval_s: float, request_timeout_s: float,
                 link_delay_s: float = 0.0, rng: random.Random | None = None,
                 on_gauges: Callable[[dict[str, int]], None] | None = None,
                 settings: Settings | None = None, loop_lag: LoopLag | None = None,
                 rtts: Deadlines | None = None, on_claim_struck: Callable[[], None] | None = None):
        self.info = info  # this node's NodeInfo (its address is known only once serving)
        self.position = position  # this node's (round, published version), sent in heartbeats
        self.peers = peers
        self.transport = transport
        self.problems = problems
        self.s = settings or Settings()
        self.period = heartbeat_interval_s
        self.request_timeout_s = request_timeout_s
        self.link_delay_s = link_delay_s
        self.rng = rng or random.Random()
        self.on_gauges = on_gauges
        self.loop_lag = loop_lag
        # ping round trips per member: the direct-ping deadline follows them
        self.rtts = rtts or Deadlines(self.probe_budget_s / 2, floor_s=self.s.probe_timeout_s, mult=4.0)
        # SWIM incarnation: only this node raises it. Starting from the clock (ms) makes a
        # restarted node's news win over what others remember of its previous life at once.
        self.incarnation = int(time.time() * 1000)
        self.pending = Candidates(max_total=self.s.max_candidates, max_per_source=self.s.max_candidates_per_source,
                                  attempts=self.s.candidate_attempts, forget_s=self.s.forget_failed_s,
                                  backoff_s=max(self.period, 0.5), backoff_max_s=self.s.reconnect_max_s)
        for a in bootstrap:
            self.pending.add(a, source="config", pinned=True)
        self.bootstrap = set(bootstrap)
        self.unreachable: set[str] = set()  # addresses already reported as unreachable
        self.broadcasts = Broadcasts(self._retransmit_limit)
        self._order: list[str] = []  # shuffled probe round-robin
        self._probing: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._next_push_pull = 0.0
        peers.suspicion_max_mult = self.s.suspicion_max_mult
        self.stats = {"probes": 0, "indirect": 0, "suspected": 0, "refuted": 0, "inconclusive": 0,
                      "handshakes_failed": 0, "claims_checked": 0, "claims_struck": 0, "claims_dropped": 0}
        # what third parties claim about others is checked, and lies counted (claims.py)
        self.claims = Strikes(on_strike=on_claim_struck)
        self._claimants: dict[str, set[str]] = {}
        peers.listeners.append(self._log_transition)

    @property
    def node_id(self) -> str:
        return self.peers.self_id

    @property
    def probe_budget_s(self) -> float:
        return self.peers.suspect_after_s + 2 * self.link_delay_s

    def _log_transition(self, node_id: str, old: str, new: str) -> None:
        log.info("peer %s: %s -> %s", node_id, old, new)

    # ------------------------------------------------------------------ calling side
    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def tick(self) -> None:
        """One protocol period's work; every call it starts runs as its own task."""
        n = len(self.peers.records)
        self.peers.suspicion_s = max(self.peers.dead_after_s,
                                     self.s.suspicion_mult * math.log10(n + 1) * self.period)
        self.peers.confirmations = max(1, min(self.s.indirect_probes, n - 1))
        for node_id, _, new in self.peers.refresh():
            self._announce(node_id)
        target = self._next_target()
        if target is not None and target not in self._probing:
            self._spawn(self.probe(target))
        budget = self.s.handshakes_per_period
        for c in self.pending.due(budget):
            self._spawn(self._contact_candidate(c.address))
            budget -= 1
        for rec in self.peers.due_reconnects():
            if budget <= 0:
                break
            if rec.node_id not in self._probing:
                self._spawn(self._reconnect(rec.node_id, rec.address))
                budget -= 1
        now = time.monotonic()
        if now >= self._next_push_pull:
            self._next_push_pull = now + self.push_pull_interval_s(n) * self.rng.uniform(0.8, 1.2)
            self._spawn(self._push_pull())
        if self.on_gauges is not None:
            self.on_gauges(self.peers.counts())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        try:
            while True:
                late = loop.time() - due
                if late > max(self.period, self.s.probe_timeout_s):
                    self.peers.pause(late)  # this node stalled: suspicion clocks did not run
                    due = loop.time()
                self.tick()
                due += self.period
                await asyncio.sleep(max(0.0, due - loop.time()))
        finally:
            for t in list(self._tasks):
                t.cancel()

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
        new = remote.node_id not in self.peers.records
        self.peers.upsert(remote.node_id, remote.address, labels=dict(remote.labels), admin_url=remote.admin_url)
        if new:
            self._announce(remote.node_id)  # SWIM join: the others learn of it by gossip
        self.pending.discard(remote.address)
        return self.entries(limit=HANDSHAKE_ENTRIES)

    def check_known(self, node_id: str) -> None:
        if node_id not in self.peers.records:
            raise unknown_peer(node_id)
        self.peers.seen(node_id, revive=False)

    def on_heartbeat(self, beat: Beat) -> Beat:
        if beat.node_id not in self.peers.records:
            raise unknown_peer(beat.node_id)
        belief = self.peers.update_of(beat.node_id)  # before this ping changes it
        self.merge(beat.updates, source=beat.node_id)
        self._evidence(beat.node_id, beat.incarnation, revive=False, round=beat.round, version=beat.version)
        rnd, version = self.position()
        return Beat(self.node_id, rnd, version, beat.sent_at, self.incarnation,
                    self._piggyback(beat.node_id, belief))

    async def on_indirect_probe(self, req: IndirectProbe) -> tuple[bool, tuple[MemberUpdate, ...]]:
        if req.requester not in self.peers.records:
            raise unknown_peer(req.requester)
        belief = self.peers.update_of(req.requester)
        self.merge(req.updates, source=req.requester)
        self._evidence(req.requester, req.incarnation, revive=False)
        if req.target == self.node_id:
            ack = True
        else:
            rec = self.peers.records.get(req.target)  # pinged where *we* know it, never where told
            ack = rec is not None and await self._ping(req.target, rec.address, max(0.05, req.timeout_s))
        return ack, self._piggyback(req.requester, belief)

    def on_peer_list(self, sender: str, entries: list[PeerEntry], members=(), incarnation: int = 0
                     ) -> tuple[list[PeerEntry], list[MemberUpdate], int]:
        if sender not in self.peers.records:
            raise unknown_peer(sender)
        self.learn(entries, source=sender)
        self.merge(members, source=sender)
        self._evidence(sender, incarnation, revive=False)
        return self.entries(), self.peers.members() + [self.me()], self.incarnation
