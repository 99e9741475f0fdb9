"""``membership.Membership``'s state, in a module of its own so that its parts (``probes.py``,
``dissemination.py``, ``handshakes.py``) can name it without an import cycle: the tunables
(``Settings``), the handshake candidates (``Candidates``), the gossip queue (``Broadcasts``) and
``MembershipState``, what this node knows about members, which each part holds (no part reaches
into another's attributes)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..config import MembershipConfig
from .local_health import LocalHealth
from .messages import ALIVE, DEAD, SUSPECT, MemberUpdate, NodeInfo, PeerEntry

if TYPE_CHECKING:
    from .peer_table import PeerTable


def _from_config(cls, cfg) -> Settings:
    return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


# Tunables: ``config.MembershipConfig``'s fields, with its defaults (defined there, once), as a
# plain record the protocol reads.
if TYPE_CHECKING:  # the same fields, names and types, as the type checker can read them

    class Settings(MembershipConfig):
        @classmethod
        def from_config(cls, cfg: MembershipConfig) -> Settings: ...
else:
    # __module__: membership.py, where the protocol reads them (and where they always lived)
    Settings = make_dataclass(
        "Settings",
        [(name, f.annotation, field(default=f.default)) for name, f in MembershipConfig.model_fields.items()],
        namespace={"from_config": classmethod(_from_config), "__module__": "coterie.node.peering.membership"},
    )


# ---------------------------------------------------------------------------------- candidates
@dataclass
class Candidate:
    address: str
    node_id: str = ""
    source: str = ""
    attempts: int = 0
    next_try: float = 0.0
    pinned: bool = False  # a configured bootstrap address: retried (with backoff), never forgotten


class Candidates:
    """Addresses to handshake: bounded in total and per source; each failure backs off, and an
    address that failed ``attempts`` times is forgotten and ignored for ``forget_s``."""

    def __init__(
        self,
        *,
        max_total: int = 512,
        max_per_source: int = 128,
        attempts: int = 3,
        forget_s: float = 600.0,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ):
        self.max_total, self.max_per_source, self.attempts = max_total, max_per_source, attempts
        self.forget_s, self.backoff_s, self.backoff_max_s = forget_s, backoff_s, backoff_max_s
        self._c: OrderedDict[str, Candidate] = OrderedDict()
        self._per_source: dict[str, int] = {}
        self._forgotten: OrderedDict[str, float] = OrderedDict()  # address -> ignored until
        self.in_flight: set[str] = set()
        self.dropped = 0  # addresses turned away because a bound was full
        self.forgotten_total = 0
        self.changes = 0  # adds and discards so far: a reader caches what it derived from the set

    def add(
        self, address: str, *, source: str = "", node_id: str = "", pinned: bool = False, revive: bool = False
    ) -> bool:
        """``revive``: the address has just answered (a member there refused us as unknown), so it
        is taken up again even if it was forgotten: forgetting is for addresses that never answer,
        and a member that forgot us while we keep it alive would otherwise stay one-sided."""
        if not address:
            return False
        now = time.monotonic()
        if address in self._c:
            if pinned:
                self._c[address].pinned = True
            return False
        if revive:
            self._forgotten.pop(address, None)
        until = self._forgotten.get(address)
        if until is not None and not pinned:
            if until > now:
                return False
            del self._forgotten[address]
        if not pinned and (len(self._c) >= self.max_total or self._per_source.get(source, 0) >= self.max_per_source):
            self.dropped += 1
            return False
        self._c[address] = Candidate(address, node_id, source, pinned=pinned)
        self._per_source[source] = self._per_source.get(source, 0) + 1
        self.changes += 1
        return True

    def unpin(self, address: str) -> None:
        """No longer a configured address: a pending one is dropped (never answered, no longer asked for)."""
        c = self._c.get(address)
        if c is not None and c.pinned and address not in self.in_flight:
            self.discard(address)
        elif c is not None:
            c.pinned = False

    def room(self, source: str) -> bool:
        return len(self._c) < self.max_total and self._per_source.get(source, 0) < self.max_per_source

    # set-like surface (the daemon adds restored peers' addresses with ``update``)
    def update(self, addresses) -> None:
        for a in addresses:
            self.add(a, source="restored")

    def discard(self, address: str) -> None:
        c = self._c.pop(address, None)
        if c is not None:
            self.changes += 1
            self._per_source[c.source] -= 1
            if not self._per_source[c.source]:
                del self._per_source[c.source]

    def __contains__(self, address: object) -> bool:
        return address in self._c

    def __len__(self) -> int:
        return len(self._c)

    def __iter__(self):
        return iter(list(self._c))

    def drop_unpinned(self) -> int:
        """Forget every candidate but the configured addresses; returns how many went."""
        gone = [a for a, c in self._c.items() if not c.pinned]
        for a in gone:
            self.discard(a)
        return len(gone)

    def heard_of(self, per_source: int) -> int:
        """Members named to this node and not yet met: the distinct node ids among the
        candidates, each source counted for at most ``per_source`` of them (what one peer says
        moves the count that far, however many it names)."""
        ids: set[str] = set()
        per: dict[str, int] = {}
        for c in self._c.values():
            if c.node_id and c.node_id not in ids and per.get(c.source, 0) < per_source:
                ids.add(c.node_id)
                per[c.source] = per.get(c.source, 0) + 1
        return len(ids)

    def due(self, n: int) -> list[Candidate]:
        now = time.monotonic()
        out: list[Candidate] = []
        for c in self._c.values():
            if len(out) >= n:
                break
            if c.next_try <= now and c.address not in self.in_flight:
                out.append(c)
        return out

    def failed(self, address: str) -> bool:
        """A handshake with ``address`` failed. True when the address is now forgotten."""
        c = self._c.get(address)
        if c is None:
            return False
        c.attempts += 1
        if c.attempts >= self.attempts and not c.pinned:
            self.discard(address)
            self._forgotten[address] = time.monotonic() + self.forget_s
            self._forgotten.move_to_end(address)
            while len(self._forgotten) > 8 * self.max_total:
                self._forgotten.popitem(last=False)
            self.forgotten_total += 1
            return True
        c.next_try = time.monotonic() + min(self.backoff_s * 2 ** (c.attempts - 1), self.backoff_max_s)
        return False


# ---------------------------------------------------------------------------------- gossip queue
class Broadcasts:
    """Membership news waiting to be piggybacked: one entry per member (newer news replaces
    older), each sent ``limit()`` times, least-sent first. Kept in buckets by times sent, so a
    message takes its few updates without sorting the whole queue (which holds up to one entry
    per member)."""

    def __init__(self, limit: Callable[[], int]):
        self.limit = limit
        self._sent: dict[str, int] = {}  # node_id -> times sent
        self._buckets: dict[int, dict[str, MemberUpdate]] = {}  # times sent -> updates, oldest first

    def add(self, u: MemberUpdate) -> None:
        self._discard(u.node_id)
        self._sent[u.node_id] = 0
        self._buckets.setdefault(0, {})[u.node_id] = u

    def _discard(self, node_id: str) -> None:
        sent = self._sent.pop(node_id, None)
        if sent is not None:
            bucket = self._buckets[sent]
            del bucket[node_id]
            if not bucket:
                del self._buckets[sent]

    def take(self, n: int, exclude: str = "") -> list[MemberUpdate]:
        if not self._sent:
            return []
        limit = self.limit()
        picked: list[tuple[int, MemberUpdate]] = []
        for sent in sorted(self._buckets):
            for nid, u in self._buckets[sent].items():
                if len(picked) >= n:
                    break
                if nid != exclude:
                    picked.append((sent, u))
            if len(picked) >= n:
                break
        for sent, u in picked:
            self._discard(u.node_id)
            if sent + 1 < limit:
                self._sent[u.node_id] = sent + 1
                self._buckets.setdefault(sent + 1, {})[u.node_id] = u
        return [u for _, u in picked]

    def __len__(self) -> int:
        return len(self._sent)


class Tasks:
    """The calls membership starts as tasks of their own (probes, handshakes, push-pulls): kept
    so that stopping membership cancels them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def settle(self) -> None:
        """Wait for the calls in flight (in-process drivers: a period's calls answered)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class Scope(Protocol):
    """What membership runs on past the size threshold (``view_scope.ViewScope``: a partial
    view): ``partial`` says whether it does now; then ``neighbours`` are the members probed (the
    active view) and the table holds ``keep`` (the views, the candidates a node is exchanging
    with) and the nodes heard from within a grace period, nobody else."""

    def partial(self) -> bool: ...

    def neighbours(self) -> list[str]: ...

    def keep(self) -> set[str]: ...

    def grace_s(self) -> float: ...


PRUNE_GRACE_PERIODS = 10  # past the threshold: a member heard from this recently is kept


class MembershipState:
    """What this node knows about members and itself: the table (``PeerTable``), its own
    incarnation, the handshake candidates, the gossip queue, the members being probed and the
    counters. The protocol's parts (``probes.Probes``, ``dissemination.Dissemination``,
    ``handshakes.Handshakes``) each hold this one object; a partial view would hold another."""

    def __init__(
        self,
        info: Callable[[], NodeInfo],
        position: Callable[[], tuple[int, int]],
        peers: PeerTable,
        settings: Settings,
        *,
        period: float,
        link_delay_s: float = 0.0,
        rng: random.Random | None = None,
    ):
        self.info = info  # this node's NodeInfo (its address is known only once serving)
        self.position = position  # this node's (round, published version), sent in heartbeats
        self.peers = peers
        self.s = settings
        self.period = period
        self.link_delay_s = link_delay_s
        self.rng = rng or random.Random()
        # SWIM incarnation: only this node raises it. Starting from the clock (ms) makes a
        # restarted node's news win over what others remember of its previous life at once.
        self.incarnation = int(time.time() * 1000)
        self.pending = Candidates(
            max_total=settings.max_candidates,
            max_per_source=settings.max_candidates_per_source,
            attempts=settings.candidate_attempts,
            forget_s=settings.forget_failed_s,
            backoff_s=max(period, 0.5),
            backoff_max_s=settings.reconnect_max_s,
        )
        self.broadcasts = Broadcasts(self.retransmit_limit)
        self.probing: set[str] = set()  # members a probe or a reconnect is under way for
        self.health = LocalHealth()  # Lifeguard: stretches the period and probe budget when this node is slow
        self.stats = {
            "probes": 0,
            "indirect": 0,
            "suspected": 0,
            "refuted": 0,
            "inconclusive": 0,
            "handshakes_failed": 0,
            "claims_checked": 0,
            "claims_struck": 0,
            "claims_dropped": 0,
            "declared_dead": 0,  # members this table moved to dead (first-hand or by news)
        }
        # who, latest last: with no node killed, every one is a false death (bench/daemons_discovery.py)
        self.deaths: deque[str] = deque(maxlen=16)
        peers.listeners.append(self._count_death)
        peers.suspicion_max_mult = settings.suspicion_max_mult
        self.scope: Scope | None = None  # full membership (None), or partial views past a threshold

    def _count_death(self, node_id: str, old: str, new: str) -> None:
        if new == DEAD:
            self.stats["declared_dead"] += 1
            self.deaths.append(node_id)

    def partial(self) -> bool:
        """Membership on a partial view now: probes, gossip and the table bounded by the views."""
        return self.scope is not None and self.scope.partial()

    def probe_targets(self) -> list[str]:
        """Members probed in the round-robin: every one not dead, or past the threshold the
        active view's (failure detection runs on it only)."""
        if self.scope is None or not self.scope.partial():
            return self.peers.probe_targets()
        records = self.peers.records
        return [p for p in self.scope.neighbours() if (r := records.get(p)) is not None and r.state != DEAD]

    def prune(self) -> list[str]:
        """Past the threshold: forget the members the views no longer hold (``scope.keep``),
        unless one was heard from within the grace period (it may be calling this node: a
        neighbour being linked, a shuffle's partner) or a probe of it is under way. Dead ones
        go at once, and suspects outside the active view (not probed, their suspicion would
        turn into a death nobody checked). So the table stays O(view) whatever N. Returns
        those forgotten."""
        if self.scope is None or not self.scope.partial():
            return []
        neighbours = set(self.scope.neighbours())
        keep = self.scope.keep() | self.probing
        # the grace is the longer of 10 periods and what the scope asks (two of this node's
        # rounds: a mate pulls once a round, and under load rounds outlast 10 periods — 100
        # daemons, run 7: rounds of 11-20 s against 10 s, and pullers refused as strangers)
        now = time.monotonic()
        grace = max(PRUNE_GRACE_PERIODS * self.period, self.scope.grace_s())
        gone = [
            p
            for p, r in self.peers.records.items()
            if p not in self.probing
            and (
                (r.state == SUSPECT and p not in neighbours)  # not probed: its suspicion cannot settle
                or (p not in keep and (r.state == DEAD or now - r.last_seen > grace))
            )
        ]
        for p in gone:
            self.peers.forget(p)
        return gone

    @property
    def node_id(self) -> str:
        return self.peers.self_id

    @property
    def probe_budget_s(self) -> float:
        return self.peers.suspect_after_s + 2 * self.link_delay_s

    def retransmit_limit(self) -> int:
        return max(1, math.ceil(self.s.retransmit_mult * math.log10(len(self.peers.records) + 2)))

    def announce(self, node_id: str) -> None:
        """Queue what this node believes of ``node_id`` for piggybacking."""
        u = self.peers.update_of(node_id)
        if u is not None:
            self.broadcasts.add(u)

    def me(self) -> MemberUpdate:
        return MemberUpdate(self.node_id, self.info().address, self.incarnation, ALIVE)

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
            ids = (ids[start:] + ids[:start])[: 2 * limit]
        out = [PeerEntry(n, r.address, r.age(now)) for n in ids if (r := records[n]).state != DEAD]
        return out if limit is None else out[:limit]

    def learn(self, entries: Iterable[PeerEntry], source: str = "") -> None:
        """Addresses a peer told us about: unknown members become handshake candidates (as many
        as that peer's share of the candidate set allows; the rest of a long list is not read).
        Past the threshold, nothing: the views alone decide whom this node knows."""
        if self.partial():
            return
        for e in entries:
            if not self.pending.room(source):
                self.pending.dropped += 1
                return
            if (
                e.node_id != self.node_id
                and e.node_id not in self.peers.records
                and e.address
                and self.peers.by_address(e.address) is None
            ):
                self.pending.add(e.address, source=source, node_id=e.node_id)
