"""Partial views over the peer RPCs: one node's HyParView (``partial_view.PartialView``, a pure
object driven by messages) carried by ``api.SHUFFLE`` and ``api.LINK``.

The view speaks in node ids; the wire in (id, address) entries. This driver keeps the address of
every node its views hold (what the node said of itself, else what a peer said of it — hearsay
that a call to it settles), pruned to the views each period, so its state stays O(view).

- calling side: each ``tick`` runs the view's period (age, shuffle, refill) and probes one active
  neighbour (a ``neighbor`` link request: an accepted one is a keepalive; refused, the neighbour
  dropped me, so I drop it; unanswered, it failed and is replaced from the passive view). What
  the view queued since the last period is delivered then, each message as its own task; a
  failed delivery is ``on_failed``. So a message goes one hop a period (a join's walk takes a
  few periods): sent as soon as queued, refused neighbour requests and their retries chased each
  other without end, and each node's calls per period are bounded by what its view queues.
- served side: ``on_shuffle`` and ``on_link`` (``served.py`` hands them on) feed the view the
  authenticated sender's message and answer with what the view answers it (a shuffle's sample,
  a link's acceptance); what else the view queued is delivered as above.

Insider bounds are the view's (an active slot per identity that asked or accepted itself,
hearsay to the passive view only, ``per_source`` entries from one sender) and the table's (a
sample of at most ``MAX_SAMPLE`` entries, a walk of at most ``MAX_TTL`` hops)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from ..wire.codec import WireError
from .api import (
    DISCONNECT,
    FORWARD_JOIN,
    JOIN,
    LINK,
    NEIGHBOR,
    NEIGHBOR_URGENT,
    SHUFFLE,
    LinkReply,
    LinkRequest,
    ViewSample,
)
from .errors import UNAVAILABLE, UNKNOWN_PEER, PeerCallError, invalid
from .interfaces import PeerTransport
from .messages import PeerEntry
from .partial_view import (
    Disconnect,
    ForwardJoin,
    Join,
    Message,
    Neighbor,
    NeighborReply,
    PartialView,
    Shuffle,
    ShuffleReply,
)

log = logging.getLogger("coterie.node.overlay")
A = TypeVar("A", ShuffleReply, NeighborReply)


class Overlay:
    """``view`` carried over ``transport``; ``address``: where peers reach this node (asked when
    it is said: a daemon knows it once it listens); ``known_address``: the peer table's address of
    a node, if it has one (first-hand)."""

    def __init__(
        self,
        view: PartialView,
        transport: PeerTransport,
        address: Callable[[], str],
        *,
        timeout_s: float = 2.0,
        known_address: Callable[[str], str | None] = lambda node_id: None,
        introduce: Callable[[str, str], Awaitable[bool]] | None = None,
    ):
        self.view = view
        self.me = view.me
        self.transport = transport
        self.my_address = address
        self.timeout_s = timeout_s
        self.known_address = known_address
        # past the threshold membership holds the views only: a node this one calls must have
        # handshaken first (Link and Shuffle are known-peer calls), ``introduce(id, address)``
        # does it and says whether ``id`` is known now
        self.introduce = introduce
        # a Link a period to one active neighbour; off where membership probes the active view
        # (view_scope.py): its failure detector replaces a dead neighbour
        self.keepalives = True
        self.addresses: dict[str, str] = {}  # the views' nodes (pruned after every change)
        self._tasks: set[asyncio.Task] = set()
        self._calling: Counter[str] = Counter()  # nodes with a call in flight (their address kept)
        self.failed_calls = 0

    # --- reading ---
    def members(self) -> list[str]:
        return self.view.members()

    def address_of(self, node_id: str) -> str | None:
        return self.known_address(node_id) or self.addresses.get(node_id)

    def counts(self) -> dict[str, object]:
        """For ``/status``: the active view (ids) and how many the passive one holds."""
        return {"active": list(self.view.active), "passive": len(self.view.passive), **vars(self.view.counters)}

    # --- calling side ---
    def join(self, contact: str, address: str) -> None:
        """Enter the overlay through ``contact`` (a node this one knows at ``address``)."""
        self.addresses[contact] = address
        self.view.join(contact)
        self._flush()

    def tick(self) -> None:
        """One period: the view's own work, a keepalive to one active neighbour, the address book
        pruned to the views."""
        self.view.tick()
        probe = self.view.next_probe() if self.keepalives else None
        if probe is not None:
            self._spawn(probe, self._keepalive(probe))
        self._flush()
        self._prune()

    async def run(self, period_s: float, wanted: Callable[[], bool], contacts: Callable[[], Sequence[str]]) -> None:
        """A daemon's overlay: each period past the threshold (``wanted``), join through a known
        peer (of ``contacts``) while both views are empty, then the period's work."""
        try:
            while True:
                await asyncio.sleep(period_s)
                if not wanted():
                    continue
                if not self.view.active and not self.view.passive:
                    # through the lowest id known alive, the same for every node while membership
                    # is full: nodes crossing the threshold at once, each joining a random peer,
                    # formed islands (a 5-node clique with full active views never merged again)
                    known = [p for p in contacts() if p != self.me and self.address_of(p)]
                    contact = min([*known, self.me])
                    if contact != self.me:
                        self.join(contact, self.address_of(contact) or "")
                self.tick()
        finally:
            await self.close()

    async def settle(self) -> None:
        """Wait for the deliveries in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # --- served side (the gate has vouched for the sender, a known peer, and checked sizes) ---
    def on_shuffle(self, sample: ViewSample) -> ViewSample:
        mine = [e for e in sample.peers[:1] if e.node_id == sample.sender]  # the sender on itself
        self._learn(mine, first_hand=True)
        self._learn(sample.peers[: self.view.s.shuffle_length])
        entries = tuple(e.node_id for e in sample.peers)
        reply = self._answer(sample.sender, Shuffle(entries), ShuffleReply)
        out = ViewSample(self.me, self._entries(reply.entries if reply else ()))
        self._prune()
        return out

    def on_link(self, req: LinkRequest) -> LinkReply:
        msg: Message
        self._learn((PeerEntry(req.sender, req.address),), first_hand=True)
        if req.kind == FORWARD_JOIN:
            assert req.joined is not None  # (the table's check)
            self._learn((req.joined,))
            msg = ForwardJoin(req.joined.node_id, req.ttl)
        elif req.kind in (NEIGHBOR, NEIGHBOR_URGENT, JOIN):
            msg = Join() if req.kind == JOIN else Neighbor(high_priority=req.kind == NEIGHBOR_URGENT)
        elif req.kind == DISCONNECT:
            msg = Disconnect()
        else:
            raise invalid(f"link request from {req.sender}: unknown kind")
        reply = self._answer(req.sender, msg, NeighborReply)
        self._prune()
        return LinkReply(self.me, bool(reply and reply.accepted))

    # --- internals ---
    def _answer(self, sender: str, msg: Message, answer: type[A]) -> A | None:
        """The view's answer to ``sender``'s ``msg`` (the RPC's reply); the rest it queued waits
        for the next period."""
        self.view.on_message(sender, msg)
        for i, (to, out) in enumerate(self.view.outbox):
            if to == sender and isinstance(out, answer):
                del self.view.outbox[i]
                return out
        return None

    def held(self) -> set[str]:
        """The views' nodes and those a message is queued or in flight to."""
        return set(self.view.members()) | set(self._calling) | {to for to, _ in self.view.outbox}

    def _prune(self) -> None:
        """Addresses of ``held`` nodes only."""
        held = self.held()
        if len(held) < len(self.addresses):
            self.addresses = {p: a for p, a in self.addresses.items() if p in held}

    def _flush(self) -> None:
        self._send(self.view.take_outbox())

    def _send(self, messages: Iterable[tuple[str, Message]]) -> None:
        for to, msg in messages:
            if isinstance(msg, ShuffleReply | NeighborReply):
                continue  # answers ride on the reply of the call they answer
            self._spawn(to, self._deliver(to, msg))

    def _spawn(self, to: str, coro) -> None:
        self._calling[to] += 1
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(to, t))

    def _done(self, to: str, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._calling[to] -= 1
        if not self._calling[to]:
            del self._calling[to]
            self._prune()

    def _learn(self, entries: Iterable[PeerEntry], *, first_hand: bool = False) -> None:
        """Addresses of nodes: hearsay fills a gap only; a node's word on itself replaces it."""
        for e in entries:
            if e.node_id != self.me and e.address and (first_hand or e.node_id not in self.addresses):
                self.addresses[e.node_id] = e.address

    def _entries(self, ids: Iterable[str]) -> tuple[PeerEntry, ...]:
        out = []
        for p in ids:
            address = self.my_address() if p == self.me else self.address_of(p)
            if address:
                out.append(PeerEntry(p, address))
        return tuple(out)

    async def _call(self, to: str, rpc, request):
        address = self.address_of(to)
        if address is None:
            raise PeerCallError(UNAVAILABLE, f"no address known for {to}")
        if self.introduce is not None and to not in self.view.active:
            # past the threshold tables hold views: a node outside my active view may have
            # forgotten me (or I it), so a handshake first — one more call, never a refusal
            await self._introduce(to, address)
            address = self.address_of(to) or address
        try:
            return await self.transport.call(rpc, address, request, self.timeout_s, peer=to)
        except PeerCallError as e:
            if e.kind != UNKNOWN_PEER or self.introduce is None:
                raise
        # it forgot me (its table holds its views, not me): handshake again, then once more
        await self._introduce(to, address)
        return await self.transport.call(rpc, address, request, self.timeout_s, peer=to)

    async def _introduce(self, to: str, address: str) -> None:
        assert self.introduce is not None
        if not await self.introduce(to, address):
            raise PeerCallError(UNAVAILABLE, f"no handshake with {to} at {address}")

    async def _deliver(self, to: str, msg: Message) -> None:
        try:
            if isinstance(msg, Shuffle):
                reply = await self._call(to, SHUFFLE, ViewSample(self.me, self._entries(msg.entries)))
                if reply.sender != to:
                    raise WireError(f"shuffle answer claims to be from {reply.sender!r}, expected {to!r}")
                self._learn(reply.peers[: self.view.s.shuffle_length])
                self.view.on_message(to, ShuffleReply(tuple(e.node_id for e in reply.peers)))
            else:
                accepted = await self._link(to, msg)
                if isinstance(msg, Join | Neighbor):
                    self.view.on_message(to, NeighborReply(accepted))
        except (PeerCallError, WireError) as e:
            self.failed_calls += 1
            log.debug("overlay %s to %s failed: %s", type(msg).__name__, to, e)
            self.view.on_failed(to)

    async def _link(self, to: str, msg: Message) -> bool:
        if isinstance(msg, ForwardJoin):
            joined = self._entries((msg.node,))
            if not joined:
                return False  # its address is forgotten: the walk ends here
            req = LinkRequest(self.me, FORWARD_JOIN, joined[0], msg.ttl, self.my_address())
        elif isinstance(msg, Join):
            req = LinkRequest(self.me, JOIN, address=self.my_address())
        elif isinstance(msg, Neighbor):
            req = LinkRequest(self.me, NEIGHBOR_URGENT if msg.high_priority else NEIGHBOR, address=self.my_address())
        else:
            req = LinkRequest(self.me, DISCONNECT, address=self.my_address())
        reply = await self._call(to, LINK, req)
        return bool(reply.accepted)

    async def _keepalive(self, neighbour: str) -> None:
        """A neighbour's keepalive: refused means it dropped me (I drop it too); unanswered, failed."""
        try:
            reply = await self._call(neighbour, LINK, LinkRequest(self.me, NEIGHBOR, address=self.my_address()))
        except (PeerCallError, WireError):
            self.failed_calls += 1
            self.view.on_failed(neighbour)
        else:
            if not reply.accepted and neighbour in self.view.active:
                self.view.on_message(neighbour, Disconnect())
