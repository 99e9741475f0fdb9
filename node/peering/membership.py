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

``Membership`` runs the period (``tick``, ``run``) and answers peers; it composes four objects,
each with its collaborators declared in its constructor: ``membership_state.MembershipState``
(what this node knows about members and itself), ``probes.Probes`` (the failure detector),
``dissemination.Dissemination`` (piggybacked news, refutation, push-pull) and
``handshakes.Handshakes`` (compatibility, candidates, contact and reconnects).
``full_membership`` wires them for a node that knows every member."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .claims import Strikes
from .deadlines import Deadlines
from .dissemination import Dissemination
from .errors import unknown_peer
from .handshakes import HANDSHAKE_ENTRIES, Handshakes  # noqa: F401 (re-exported)
from .interfaces import PeerTransport
from .loop_lag import LoopLag
from .membership_state import Broadcasts, Candidate, Candidates, MembershipState, Settings, Tasks  # noqa: F401
from .messages import Beat, IndirectProbe, MemberUpdate, NodeInfo, PeerEntry
from .peer_table import PeerTable
from .probes import Probes
from .problems import ProblemLog

log = logging.getLogger("coterie.node")


def _log_transition(node_id: str, old: str, new: str) -> None:
    log.info("peer %s: %s -> %s", node_id, old, new)


# ---------------------------------------------------------------------------------- membership
class Membership:
    def __init__(
        self,
        state: MembershipState,
        gossip: Dissemination,
        probes: Probes,
        handshakes: Handshakes,
        tasks: Tasks,
        *,
        on_gauges: Callable[[dict[str, int]], None] | None = None,
    ):
        self.state = state
        self.gossip = gossip
        self.probes = probes
        self.handshakes = handshakes
        self.tasks = tasks
        self.on_gauges = on_gauges
        self._next_push_pull = 0.0
        state.peers.listeners.append(_log_transition)

    @property
    def peers(self) -> PeerTable:
        return self.state.peers

    @property
    def node_id(self) -> str:
        return self.state.node_id

    @property
    def pending(self) -> Candidates:
        return self.state.pending

    # ------------------------------------------------------------------ calling side
    def tick(self) -> None:
        """One protocol period's work; every call it starts runs as its own task."""
        st, peers, spawn = self.state, self.state.peers, self.tasks.spawn
        n = len(peers.records)
        peers.suspicion_s = max(peers.dead_after_s, st.s.suspicion_mult * math.log10(n + 1) * st.period)
        peers.confirmations = max(1, min(st.s.indirect_probes, n - 1))
        for node_id, _, _new in peers.refresh():
            st.announce(node_id)
        target = self.probes.next_target()
        if target is not None and target not in st.probing:
            spawn(self.probes.probe(target))
        budget = st.s.handshakes_per_period
        for c in st.pending.due(budget):
            spawn(self.handshakes.contact_candidate(c.address))
            budget -= 1
        partial = st.partial()
        if partial:
            st.prune()  # the table holds the views (and who is calling), not the network
        for rec in peers.due_reconnects():
            if budget <= 0:
                break
            if rec.node_id not in st.probing:
                spawn(self.handshakes.reconnect(rec.node_id, rec.address))
                budget -= 1
        now = time.monotonic()
        if now >= self._next_push_pull and not partial:  # past the threshold: no O(N) exchange
            self._next_push_pull = now + self.gossip.push_pull_interval_s(n) * st.rng.uniform(0.8, 1.2)
            spawn(self.gossip.push_pull())
        if self.on_gauges is not None:
            self.on_gauges(peers.counts())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        period, floor = self.state.period, self.state.s.probe_timeout_s
        lag = self.probes.loop_lag
        stalled = lag.total_s if lag is not None else 0.0
        due = loop.time()
        try:
            while True:
                late = loop.time() - due
                if lag is not None:
                    # every second this node's loop ran late since the last period, however short
                    # each stall (a starved process is late a little all the time): suspicion
                    # clocks did not run meanwhile, refutations could not be heard
                    self.state.peers.pause(lag.total_s - stalled)
                    stalled = lag.total_s
                elif late > max(period, floor):
                    self.state.peers.pause(late)  # this node stalled: suspicion clocks did not run
                if late > max(period, floor):
                    due = loop.time()
                self.tick()
                due += self.state.health.scale(period)  # a slow node probes less often (Lifeguard)
                await asyncio.sleep(max(0.0, due - loop.time()))
        finally:
            self.tasks.cancel()

    def suspect_hint(self, node_id: str) -> None:
        """A request to ``node_id`` just failed (timeout, unreachable): probe it now, out of turn."""
        self.probes.suspect_hint(node_id)

    # ------------------------------------------------------------------ served side
    def on_handshake(self, remote: NodeInfo) -> list[PeerEntry]:
        return self.handshakes.accept(remote)

    def check_known(self, node_id: str) -> None:
        if node_id not in self.state.peers.records:
            raise unknown_peer(node_id)
        self.state.peers.seen(node_id, revive=False)

    def _heard_from(self, sender: str, updates: Iterable[MemberUpdate], incarnation: int) -> MemberUpdate | None:
        """A member called with news: merged, its own incarnation noted. Returns what this node
        believed of it before (its reply leads with that belief, so it can refute at once)."""
        if sender not in self.state.peers.records:
            raise unknown_peer(sender)
        belief = self.state.peers.update_of(sender)  # before this call changes it
        self.gossip.merge(updates, source=sender)
        return belief

    def on_heartbeat(self, beat: Beat) -> Beat:
        belief = self._heard_from(beat.node_id, beat.updates, beat.incarnation)
        self.gossip.evidence(beat.node_id, beat.incarnation, revive=False, round=beat.round, version=beat.version)
        rnd, version = self.state.position()
        return Beat(
            self.node_id,
            rnd,
            version,
            beat.sent_at,
            self.state.incarnation,
            self.gossip.piggyback(beat.node_id, belief),
        )

    async def on_indirect_probe(self, req: IndirectProbe) -> tuple[bool, tuple[MemberUpdate, ...]]:
        belief = self._heard_from(req.requester, req.updates, req.incarnation)
        self.gossip.evidence(req.requester, req.incarnation, revive=False)
        if req.target == self.node_id:
            ack = True
        else:
            rec = self.state.peers.records.get(req.target)  # pinged where *we* know it, never where told
            ack = rec is not None and await self.probes.ping(req.target, rec.address, max(0.05, req.timeout_s))
        return ack, self.gossip.piggyback(req.requester, belief)

    def on_peer_list(
        self, sender: str, entries: list[PeerEntry], members: Iterable[MemberUpdate] = (), incarnation: int = 0
    ) -> tuple[list[PeerEntry], list[MemberUpdate], int]:
        if sender not in self.state.peers.records:
            raise unknown_peer(sender)
        self.state.learn(entries, source=sender)
        self.gossip.merge(members, source=sender)
        self.gossip.evidence(sender, incarnation, revive=False)
        return self.state.entries(), self.state.peers.members() + [self.state.me()], self.state.incarnation


@dataclass
class Observers:
    """What membership reports to, beyond its table: the node's gauges and metrics, and the event
    loop's lag (a probe that failed while this node stalled is inconclusive)."""

    on_gauges: Callable[[dict[str, int]], None] | None = None
    on_claim_struck: Callable[[], None] | None = None
    loop_lag: LoopLag | None = None


def full_membership(
    info: Callable[[], NodeInfo],
    position: Callable[[], tuple[int, int]],
    peers: PeerTable,
    transport: PeerTransport,
    problems: ProblemLog,
    *,
    bootstrap: Sequence[str],
    period: float,
    settings: Settings | None = None,
    link_delay_s: float = 0.0,
    rng: random.Random | None = None,
    observers: Observers | None = None,
    rtts: Deadlines | None = None,
) -> Membership:
    """SWIM over every member: the parts wired to one ``MembershipState``. ``period``: the
    protocol period (``heartbeat_interval_s``); ``link_delay_s``: an emulated one-way delay each
    deadline allows for twice."""
    obs = observers or Observers()
    state = MembershipState(
        info, position, peers, settings or Settings(), period=period, link_delay_s=link_delay_s, rng=rng
    )
    tasks = Tasks()
    probes: Probes | None = None

    def probe_soon(node_id: str) -> None:  # gossip asks for probes; probes carry gossip
        assert probes is not None
        probes.probe_soon(node_id)

    gossip = Dissemination(state, transport, problems, probe_soon, claims=Strikes(on_strike=obs.on_claim_struck))
    probes = Probes(state, transport, gossip, tasks, rtts=rtts, loop_lag=obs.loop_lag)
    peers.on_forget.append(probes.rtts.forget)  # past the threshold the table forgets members
    handshakes = Handshakes(state, transport, problems, bootstrap)
    return Membership(state, gossip, probes, handshakes, tasks, on_gauges=obs.on_gauges)
