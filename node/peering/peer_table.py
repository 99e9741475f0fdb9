"""Who is out there: the peer table and its alive → suspect → dead life cycle (SWIM).

A member is *alive* until a probe of it goes unanswered (directly and through k other members,
see ``membership``) or another member spreads a suspicion about it; *suspect* until it refutes
the suspicion (a higher incarnation) or answers, else *dead* once the suspicion timeout runs out.
Dead members are not probed every period: they get reconnect attempts with backoff, and are alive
again as soon as they answer one (or call us).

Incarnation rules (Das et al. 2002, §4.2): news about a member with a higher incarnation wins; at
the same incarnation suspect beats alive and dead beats both. First-hand evidence — the member
answered one of our calls or made one to us — makes it alive whatever we believed.

Suspicion timeout (Lifeguard, Dadgar et al. 2018, as memberlist): a suspicion raised by one
member alone runs ``suspicion_max_mult`` times the base timeout; each further independent
accuser shortens it, down to the base with ``k`` of them. One overloaded prober cannot bury a
healthy member before it refutes; a member everyone finds silent is declared dead quickly."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .messages import ALIVE, DEAD, SUSPECT, MemberUpdate
from .versions import Agreement

_RANK = {ALIVE: 0, SUSPECT: 1, DEAD: 2}


@dataclass
class PeerRecord:
    node_id: str
    address: str
    last_seen: float = field(default_factory=time.monotonic)  # last first-hand evidence of life
    state: str = ALIVE
    round: int = 0
    snapshot_version: int = 0
    rtt_s: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    admin_url: str = ""
    incarnation: int = 0
    state_since: float = field(default_factory=time.monotonic)
    reconnect_at: float = 0.0  # dead members: when to try again
    reconnect_backoff_s: float = 0.0
    accusers: set[str] = field(default_factory=set)  # suspect: members whose probes failed
    paused_s: float = 0.0  # suspect: time its suspicion clock stood still (this node stalled)
    # what its last handshake agreed (peering/versions.py): the protocol spoken, the optional
    # features both have (asked only of members that have them), the release it runs
    protocol: int = 0
    features: tuple[str, ...] = ()
    release: str = ""

    def age(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.last_seen


Listener = Callable[[str, str, str], None]  # (node_id, old state, new state)


class PeerTable:
    """``suspect_after_s`` is the probe budget (how long a member may leave a probe unanswered
    before it is suspected; used by ``membership``); ``dead_after_s`` the suspicion timeout floor."""

    def __init__(
        self,
        self_id: str,
        suspect_after_s: float,
        dead_after_s: float,
        *,
        reconnect_min_s: float = 1.0,
        reconnect_max_s: float = 60.0,
        suspicion_max_mult: float = 6.0,
        confirmations: int = 3,
    ):
        self.self_id = self_id
        self.suspect_after_s = suspect_after_s
        self.dead_after_s = dead_after_s
        self.suspicion_s = dead_after_s  # base timeout; membership scales it with the network size
        self.suspicion_max_mult = suspicion_max_mult
        self.confirmations = confirmations
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.records: dict[str, PeerRecord] = {}
        self.listeners: list[Listener] = []
        self.on_forget: list[Callable[[str], None]] = []  # what else keeps per-peer state drops it
        # indexes kept with every change, so that a protocol period costs O(1) per node and not
        # O(members): a thousand in-process nodes each scanning a thousand records every period
        # is a million steps a second
        self._by_address: dict[str, str] = {}  # address -> node_id
        self._in_state: dict[str, set[str]] = {ALIVE: set(), SUSPECT: set(), DEAD: set()}
        self.banned: set[str] = set()  # revoked by the network CA: dead for good, never revived

    def ban(self, node_ids) -> list[str]:
        """Members the network CA revoked: dead now and never alive again (no gossip, call or
        reconnect revives them). Returns those that were known and not dead."""
        dropped = []
        for node_id in node_ids:
            self.banned.add(node_id)
            rec = self.records.get(node_id)
            if rec is not None and rec.state != DEAD:
                self._move(rec, DEAD)
                dropped.append(node_id)
            if rec is not None:
                rec.reconnect_at = math.inf
        return dropped

    # ------------------------------------------------------------------ transitions
    def _move(self, rec: PeerRecord, new: str, now: float | None = None) -> None:
        if new == rec.state:
            return
        now = time.monotonic() if now is None else now
        old, rec.state, rec.state_since = rec.state, new, now
        self._in_state[old].discard(rec.node_id)
        self._in_state[new].add(rec.node_id)
        if new != SUSPECT:
            rec.accusers.clear()
        rec.paused_s = 0.0
        if new == DEAD:
            rec.reconnect_backoff_s = self.reconnect_min_s
            rec.reconnect_at = now + rec.reconnect_backoff_s
        for listener in list(self.listeners):
            listener(rec.node_id, old, new)

    def upsert(
        self,
        node_id: str,
        address: str,
        *,
        labels: dict[str, str] | None = None,
        admin_url: str | None = None,
        seen: bool = True,
        agreed: Agreement | None = None,
    ) -> PeerRecord:
        """A member as its own handshake describes it (``seen``: it is talking to us now;
        ``agreed``: the protocol and features that handshake settled)."""
        rec = self.records.get(node_id)
        if rec is None:
            now = time.monotonic()
            rec = PeerRecord(
                node_id,
                address,
                last_seen=now if seen else 0.0,
                state=ALIVE if seen and node_id not in self.banned else DEAD,
                state_since=now,
                reconnect_at=now,
            )
            self.records[node_id] = rec
            self._in_state[rec.state].add(node_id)
        if address and address != rec.address:
            if self._by_address.get(rec.address) == node_id:  # it moved (rare): who else is there?
                del self._by_address[rec.address]
                other = next((r for r in self.records.values() if r.address == rec.address and r is not rec), None)
                if other is not None:
                    self._by_address[rec.address] = other.node_id
            rec.address = address
        if rec.address:
            self._by_address[rec.address] = node_id
        if labels is not None:
            rec.labels = dict(labels)
        if admin_url:
            rec.admin_url = admin_url
        if agreed is not None:
            rec.protocol, rec.features, rec.release = agreed.protocol, agreed.features, agreed.release
        if seen:
            self.seen(node_id)
        return rec

    def seen(
        self,
        node_id: str,
        *,
        round: int | None = None,
        version: int | None = None,
        rtt_s: float | None = None,
        incarnation: int | None = None,
        revive: bool = True,
    ) -> bool:
        """First-hand evidence of life. True when it changed the member's state. ``revive``:
        it answered us at its address (alive, whatever we believed); without, it only called us
        (last seen, round, version noted; a suspect or dead member must refute or answer a
        probe — a process that calls out but cannot be reached is no use as a peer)."""
        rec = self.records.get(node_id)
        if rec is None or node_id in self.banned:
            return False
        now = time.monotonic()
        rec.last_seen = now
        if round is not None:
            rec.round = round
        if version is not None:
            rec.snapshot_version = version
        if rtt_s is not None:
            rec.rtt_s = rtt_s
        if incarnation is not None and incarnation > rec.incarnation:
            rec.incarnation = incarnation
        was = rec.state
        if revive:
            self._move(rec, ALIVE, now)
        return was != rec.state

    def apply(self, u: MemberUpdate) -> bool:
        """Second-hand news about a known member, by SWIM's precedence. True when it changed what
        this table believes (the news is then worth passing on: a new state or incarnation, or a
        new accuser of a suspicion). Never changes an address: that takes the member's own
        handshake."""
        rec = self.records.get(u.node_id)
        if rec is None or u.node_id == self.self_id or u.node_id in self.banned:
            return False
        newer = u.incarnation > rec.incarnation
        same = u.incarnation == rec.incarnation
        if u.state == SUSPECT and same and rec.state == SUSPECT:
            return self._accuse(rec, u.accuser)
        if u.state == ALIVE:
            if not newer:
                return False
        elif not (newer or (same and _RANK[u.state] > _RANK[rec.state])):
            return False
        rec.incarnation = u.incarnation
        self._move(rec, u.state)
        if u.state == SUSPECT:
            self._accuse(rec, u.accuser)
        return True

    def _accuse(self, rec: PeerRecord, accuser: str) -> bool:
        if not accuser or accuser in rec.accusers or len(rec.accusers) > self.confirmations:
            return False
        rec.accusers.add(accuser)
        return True

    def suspect(self, node_id: str) -> bool:
        """This node's own probe failed: suspect it (or confirm a suspicion heard before)."""
        rec = self.records.get(node_id)
        if rec is None or rec.state == DEAD:
            return False
        if rec.state == SUSPECT:
            return self._accuse(rec, self.self_id)
        self._move(rec, SUSPECT)
        self._accuse(rec, self.self_id)
        return True

    def suspicion_timeout(self, rec: PeerRecord) -> float:
        """From ``suspicion_max_mult`` × base (one accuser) down to the base (k+1 accusers)."""
        lo, k = self.suspicion_s, max(1, self.confirmations)
        hi = lo * max(1.0, self.suspicion_max_mult)
        c = max(0, len(rec.accusers) - 1)
        return max(lo, hi - (hi - lo) * math.log(c + 1) / math.log(k + 1))

    def refresh(self) -> list[tuple[str, str, str]]:
        """Suspects whose suspicion timed out are dead. Returns the transitions (node_id, old, new)."""
        now = time.monotonic()
        changes = []
        for node_id in list(self._in_state[SUSPECT]):
            rec = self.records[node_id]
            if now - rec.state_since >= self.suspicion_timeout(rec):
                changes.append((rec.node_id, SUSPECT, DEAD))
                self._move(rec, DEAD, now)
        return changes

    def pause(self, seconds: float) -> None:
        """This node itself stalled for ``seconds`` (a stopped process, a starved loop): it could
        not hear refutations meanwhile, so suspicion clocks do not run for that time — up to
        the suspicion's own timeout in all, so a dead member is still declared dead within
        twice its timeout of wall time however slow this node is."""
        if seconds <= 0:
            return
        for node_id in self._in_state[SUSPECT]:
            rec = self.records[node_id]
            step = min(seconds, max(0.0, self.suspicion_timeout(rec) - rec.paused_s))
            rec.paused_s += step
            rec.state_since += step

    def forget(self, node_id: str) -> None:
        """Drop ``node_id`` from the table (past the size threshold, a node it no longer samples:
        ``view_scope.py``); it enters again only through a handshake."""
        rec = self.records.pop(node_id, None)
        if rec is None:
            return
        self._in_state[rec.state].discard(node_id)
        if self._by_address.get(rec.address) == node_id:
            del self._by_address[rec.address]
        for forget in list(self.on_forget):
            forget(node_id)

    # ------------------------------------------------------------------ dead members
    def due_reconnects(self, now: float | None = None) -> list[PeerRecord]:
        now = time.monotonic() if now is None else now
        return [
            r
            for r in map(self.records.__getitem__, self._in_state[DEAD])
            if r.reconnect_at <= now and r.node_id not in self.banned
        ]

    def reconnect_failed(self, node_id: str) -> None:
        rec = self.records.get(node_id)
        if rec is not None and rec.state == DEAD:
            if node_id in self.banned:
                return
            rec.reconnect_backoff_s = min(max(rec.reconnect_backoff_s * 2, self.reconnect_min_s), self.reconnect_max_s)
            rec.reconnect_at = time.monotonic() + rec.reconnect_backoff_s

    # ------------------------------------------------------------------ views
    def alive(self) -> list[str]:
        return sorted(self._in_state[ALIVE])

    def probe_targets(self) -> list[str]:
        """Members probed in the round-robin: all but the dead."""
        return [n for n, r in self.records.items() if r.state != DEAD]

    def known(self) -> list[str]:
        return sorted(self.records)

    def counts(self) -> dict[str, int]:
        return {state: len(ids) for state, ids in self._in_state.items()}

    def by_address(self, address: str) -> PeerRecord | None:
        node_id = self._by_address.get(address)
        return None if node_id is None else self.records.get(node_id)

    def update_of(self, node_id: str, accuser: str = "") -> MemberUpdate | None:
        rec = self.records.get(node_id)
        if rec is None:
            return None
        if rec.state == SUSPECT and not accuser:
            accuser = self.self_id if self.self_id in rec.accusers else next(iter(sorted(rec.accusers)), "")
        return MemberUpdate(rec.node_id, rec.address, rec.incarnation, rec.state, accuser)

    def members(self) -> list[MemberUpdate]:
        return [u for n in self.records if (u := self.update_of(n)) is not None]  # (all: n is known)

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"node_id": r.node_id, "address": r.address, "labels": r.labels, "admin_url": r.admin_url}
            for r in self.records.values()
        ]

    def load_json(self, rows: list[dict[str, Any]]) -> None:
        """Restore known peers as dead: they must answer before they count as alive again (the
        first reconnect attempt is due at once)."""
        for row in rows:
            self.upsert(
                row["node_id"], row["address"], labels=row.get("labels", {}), admin_url=row.get("admin_url"), seen=False
            )

    def view(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        hidden = {"last_seen", "state_since", "reconnect_at", "reconnect_backoff_s", "accusers", "paused_s"}
        return [
            {
                **{k: v for k, v in asdict(r).items() if k not in hidden},
                "last_seen_s": round(r.age(now), 3) if r.last_seen else None,
                "state_for_s": round(now - r.state_since, 3),
            }
            for r in sorted(self.records.values(), key=lambda r: r.node_id)
        ]
