"""Partial views: HyParView (Leitão, Pereira & Rodrigues, DSN 2007), so that what a node keeps
and sends about the network does not grow with the network.

Why HyParView rather than Cyclon: its *active view* is a small symmetric set of neighbours
(≈ log2 N + 1) that a node keeps connections to and runs failure detection on (SWIM probes over
the active view only), and a failed neighbour is replaced at once from the *passive view*
(≈ 6 × active, refreshed by shuffles) — the paper's evaluation keeps the overlay connected at
very high failure rates, where pure Cyclon-style shuffling partitions under churn (Baldoni et
al.). The passive view is shuffled Cyclon-style (each period an exchange with its oldest
entry, the oldest entries sent) so it stays a fresh, mixing sample of the network.

The protocol is a pure object: handlers take a message from an *authenticated* sender and queue
what to send (``outbox``); a driver (the in-process simulation in tests and ``bench/scale.py``,
the peer RPCs on a daemon) delivers it and reports failed deliveries (``on_failed``).

Insider bounds (one peer must not fill a view with itself or a clique):

- the active view only holds nodes that asked or accepted *themselves* (``Neighbor`` /
  ``NeighborReply`` come from the node they name), so one identity holds at most one slot;
- hearsay (shuffle entries, forwarded joins) goes to the passive view only, at most
  ``per_source`` entries of it from one sender (a new one replaces that sender's oldest, so
  the view keeps turning over), a shuffle's entries truncated to its length;
- a full passive view evicts from the source that placed the most entries (then the oldest),
  so the view keeps many sources; promotions to the active view draw uniformly from it.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


# ------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ViewSettings:
    active_size: int = 5  # HyParView: log2(N) + 1
    passive_size: int = 30  # ... and about 6 × that
    shuffle_active: int = 3  # k_a: active entries a shuffle carries
    shuffle_passive: int = 4  # k_p: passive entries a shuffle carries
    join_walk: int = 6  # ARWL: hops a forwarded join travels
    passive_walk: int = 3  # PRWL: hop at which it is also kept in a passive view
    per_source: int = 4  # passive entries one sender may have placed (insider bound)

    @classmethod
    def for_network(cls, n: int, **kw) -> ViewSettings:
        """Views sized for a network of about ``n`` nodes (O(log N))."""
        active = max(3, math.ceil(math.log2(max(n, 2))) + 1)
        return cls(active_size=active, passive_size=6 * active, **kw)

    @property
    def shuffle_length(self) -> int:
        return self.shuffle_active + self.shuffle_passive + 1


# ------------------------------------------------------------------------------- messages
@dataclass(frozen=True)
class Join:  # sender wants in; I am its contact
    pass


@dataclass(frozen=True)
class ForwardJoin:  # ``node`` joined; walk ``ttl`` more hops
    node: str
    ttl: int


@dataclass(frozen=True)
class Neighbor:  # sender asks for a slot in my active view
    high_priority: bool  # the sender's active view is empty: I must make room


@dataclass(frozen=True)
class NeighborReply:
    accepted: bool


@dataclass(frozen=True)
class Disconnect:  # sender dropped me from its active view
    pass


@dataclass(frozen=True)
class Shuffle:  # a sample of the sender's views
    entries: tuple[str, ...]


@dataclass(frozen=True)
class ShuffleReply:
    entries: tuple[str, ...]


Message = Join | ForwardJoin | Neighbor | NeighborReply | Disconnect | Shuffle | ShuffleReply


def message_bytes(msg: Message) -> int:
    """What a message costs on the wire, roughly as the peer RPCs would carry it (ids of ~16
    bytes plus a few bytes of framing each): the unit the cost figures count in."""
    ids = getattr(msg, "entries", ()) or ((msg.node,) if isinstance(msg, ForwardJoin) else ())
    return 24 + sum(len(i) + 2 for i in ids)


@dataclass
class Passive:
    source: str  # who told me (the node itself when it spoke to me)
    age: int = 0  # periods since I heard of it


@dataclass
class ViewCounters:
    shuffles_sent: int = 0
    shuffles_received: int = 0
    promotions: int = 0
    failures: int = 0
    replaced_hearsay: int = 0  # a sender at its cap: its own oldest entry made room


# ------------------------------------------------------------------------------- protocol
class PartialView:
    """One node's HyParView state. ``outbox``: (destination, message) pairs to deliver."""

    def __init__(self, me: str, settings: ViewSettings | None = None, rng: random.Random | None = None):
        self.me = me
        self.s = settings or ViewSettings()
        self.rng = rng or random.Random()
        self.active: dict[str, None] = {}  # insertion-ordered set
        self.passive: dict[str, Passive] = {}
        self._placed: Counter[str] = Counter()  # passive entries per source (kept with every change)
        self.outbox: list[tuple[str, Message]] = []
        self.counters = ViewCounters()
        self._asking: str | None = None  # passive node asked for a slot, awaiting its reply
        self._asked_at = 0  # ... since this many periods
        self._probe_order: list[str] = []
        self._requested: dict[str, None] = {}  # nodes I asked for a link: only their acceptances count

    # --- reading ---
    def members(self) -> list[str]:
        """Every node this view holds (active first): the network as this node samples it."""
        return list(self.active) + [p for p in self.passive if p not in self.active]

    def take_outbox(self) -> list[tuple[str, Message]]:
        out, self.outbox = self.outbox, []
        return out

    def next_probe(self) -> str | None:
        """The active neighbour to probe this period (round-robin over a shuffled order): failure
        detection runs on the active view only."""
        self._probe_order = [p for p in self._probe_order if p in self.active]
        if not self._probe_order:
            self._probe_order = list(self.active)
            self.rng.shuffle(self._probe_order)
        return self._probe_order.pop() if self._probe_order else None

    # --- driving ---
    def join(self, contact: str) -> None:
        if contact != self.me:
            self._request(contact, Join())

    def tick(self) -> None:
        """One period: age the passive view, shuffle with one active neighbour, refill the active
        view from the passive one if it lost members."""
        for e in self.passive.values():
            e.age += 1
        self._asked_at += 1
        if self._asking is not None and self._asked_at > 3:  # no answer: ask someone else
            self._asking = None
        # Cyclon: shuffle with the oldest passive entry — it answers (and is fresh again) or fails
        # (and goes), so the passive view keeps mixing and holds no long-dead node; else an
        # active neighbour
        target = (
            next(iter(self.passive))  # the oldest: the passive view is kept oldest first
            if self.passive
            else self.rng.choice(list(self.active))
            if self.active
            else None
        )
        if target is not None:
            self._send(target, Shuffle(self._sample(exclude=target)))
            self.counters.shuffles_sent += 1
        self._refill()

    def on_failed(self, peer: str) -> None:
        """A delivery to ``peer`` failed or its probe did: it leaves both views; a replacement is
        asked for."""
        self.counters.failures += 1
        self._drop(peer)
        if self._asking == peer:
            self._asking = None
        if self.active.pop(peer, ...) is not ...:
            self._refill()

    def on_message(self, sender: str, msg: Message) -> None:
        """``sender`` is authenticated by the transport; everything else in ``msg`` is hearsay."""
        if sender == self.me:
            return
        if isinstance(msg, Join):
            self._add_active(sender)
            self._send(sender, NeighborReply(True))
            for p in self.active:
                if p != sender:
                    self._send(p, ForwardJoin(sender, self.s.join_walk))
        elif isinstance(msg, ForwardJoin):
            self._forward_join(sender, msg)
        elif isinstance(msg, Neighbor):
            ok = msg.high_priority or len(self.active) < self.s.active_size or sender in self.active
            if ok:
                self._add_active(sender)
            self._send(sender, NeighborReply(ok))
        elif isinstance(msg, NeighborReply):
            if self._asking == sender:
                self._asking = None
            if self._requested.pop(sender, ...) is not ... and msg.accepted:
                self._add_active(sender)
            self._refill()
        elif isinstance(msg, Disconnect):
            if self.active.pop(sender, ...) is not ...:
                self._add_passive(sender, sender)
                self._refill()
        elif isinstance(msg, Shuffle):
            self.counters.shuffles_received += 1
            self._send(sender, ShuffleReply(self._sample(exclude=sender)))
            self._integrate(sender, msg.entries)
        elif isinstance(msg, ShuffleReply):
            self._integrate(sender, (sender, *msg.entries))  # it answered: fresh again

    # --- internals ---
    def _send(self, to: str, msg: Message) -> None:
        self.outbox.append((to, msg))

    def _request(self, to: str, msg: Message) -> None:
        """Ask ``to`` for a link; an unasked acceptance is ignored (no one joins my active view by
        saying yes to a question I never asked). Bounded: the oldest requests are forgotten."""
        self._requested.pop(to, None)
        self._requested[to] = None
        while len(self._requested) > 4 * self.s.active_size:
            del self._requested[next(iter(self._requested))]
        self._send(to, msg)

    def _forward_join(self, sender: str, msg: ForwardJoin) -> None:
        new = msg.node
        if new == self.me or new in self.active:
            return
        if msg.ttl <= 0 or len(self.active) <= 1:
            # the new node must accept me itself: it joins my active view on its reply
            self._request(new, Neighbor(high_priority=False))
            return
        if msg.ttl == self.s.passive_walk:
            self._add_passive(new, sender)
        nxt = [p for p in self.active if p not in (sender, new)]
        if nxt:
            self._send(self.rng.choice(nxt), ForwardJoin(new, msg.ttl - 1))
        else:
            self._request(new, Neighbor(high_priority=False))

    def _add_active(self, node: str) -> None:
        if node == self.me or node in self.active:
            return
        if len(self.active) >= self.s.active_size:
            dropped = self.rng.choice(list(self.active))
            del self.active[dropped]
            self._send(dropped, Disconnect())
            self._add_passive(dropped, dropped)
        self._drop(node)
        self.active[node] = None
        # probed within this round-robin cycle, at a random place in it (as memberlist does)
        self._probe_order.insert(self.rng.randrange(len(self._probe_order) + 1), node)

    def _put(self, node: str, entry: Passive) -> None:
        # Every entry enters here, at age 0, at the end, and every age grows by one a period:
        # so the dict stays oldest first (ties in arrival order), and "the oldest entry that..."
        # is the first one found that... — no scan of the whole view for a maximum (issue 32: at
        # 1,000+ nodes each shuffle evicts, and those scans were the cost that grew with N).
        self._drop(node)
        self.passive[node] = entry
        self._placed[entry.source] += 1

    def _drop(self, node: str) -> None:
        entry = self.passive.pop(node, None)
        if entry is not None:
            self._placed[entry.source] -= 1
            if not self._placed[entry.source]:
                del self._placed[entry.source]

    def _add_passive(self, node: str, source: str) -> bool:
        if node == self.me or node in self.active:
            return False
        if node in self.passive:
            if source == node:  # it spoke for itself: fresh, and no longer anyone's hearsay
                self._put(node, Passive(node))
            return False
        if source != node and self._placed[source] >= self.s.per_source:
            # the sender's share stays capped: its own oldest entry makes room
            self.counters.replaced_hearsay += 1
            self._drop(next(n for n, e in self.passive.items() if e.source == source))
        if len(self.passive) >= self.s.passive_size:
            self._evict()
        self._put(node, Passive(source))
        return True

    def _evict(self) -> None:
        """Drop one passive entry: the oldest of those placed by the sources that placed the
        most, so no sender dominates the view."""
        most = max(self._placed.values())
        self._drop(next(n for n, e in self.passive.items() if self._placed[e.source] == most))

    def _sample(self, exclude: str) -> tuple[str, ...]:
        act = [p for p in self.active if p != exclude]
        picked = self.rng.sample(act, min(self.s.shuffle_active, len(act)))
        # the oldest: Cyclon's aging keeps the sample fresh
        picked += itertools.islice((p for p in self.passive if p != exclude), self.s.shuffle_passive)
        return (self.me, *picked)

    def _integrate(self, sender: str, entries: tuple[str, ...]) -> None:
        seen: set[str] = set()
        for node in entries[: self.s.shuffle_length]:
            if node in seen:
                continue
            seen.add(node)
            self._add_passive(node, sender)

    def _refill(self) -> None:
        """Below the active size: ask one passive node (uniformly drawn) for a slot."""
        if len(self.active) >= self.s.active_size or self._asking is not None or not self.passive:
            return
        node = self.rng.choice(list(self.passive))
        self._asking, self._asked_at = node, 0
        self.counters.promotions += 1
        self._request(node, Neighbor(high_priority=not self.active))


def view_components(active: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The connected components of the nodes in ``active`` (node -> its active view), links taken
    either way and only between those nodes: one component is a connected overlay."""
    adj: dict[str, set[str]] = {n: set() for n in active}
    for n, view in active.items():
        for p in view:
            if p in adj and p != n:
                adj[n].add(p)
                adj[p].add(n)
    out: list[set[str]] = []
    left = set(adj)
    while left:
        start = left.pop()
        comp, stack = {start}, [start]
        while stack:
            for q in adj[stack.pop()]:
                if q not in comp:
                    comp.add(q)
                    stack.append(q)
        left -= comp
        out.append(comp)
    return out
