"""Many nodes' real membership over the in-process transport, full or on partial views — for
tests and ``bench/overlay_cost.py``, as ``overlay_sim.py`` is for the bare views.

Each node is the daemon's membership (``full_membership``: SWIM probes, piggybacked news,
handshakes, push-pull) with its ``Overlay`` (HyParView over ``Shuffle`` and ``Link``) and, for
partial views, a ``ViewScope`` that puts membership on the views; its served side answers the
membership and overlay RPCs through the switchboard's gate (the caller's identity and the
tables' size checks of gRPC). Nodes are driven period by period (``period``: every node ticks,
then the calls it started are answered), so a loaded machine does not skip periods; the
clocks of suspicion and probe deadlines stay the wall clock's. ``traffic`` counts each node's
calls by kind (as the transport records them) and the bytes of its calls, request and reply
(estimated from the messages: in memory nothing is encoded)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .api import LinkRequest, ViewSample
from .interfaces import PeerServer
from .membership import Membership, Settings, full_membership
from .messages import Beat, IndirectProbe, NodeInfo
from .overlay import Overlay
from .partial_view import PartialView, ViewSettings
from .peer_table import ALIVE, PeerTable
from .problems import ProblemLog
from .view_scope import ViewScope

FRAMING_BYTES = 24  # per message: HTTP/2 frame and gRPC headers, roughly (as overlay_sim counts)


def wire_bytes(msg: Any) -> int:
    """About what ``msg`` takes as protobuf: strings and bytes their length + 2, numbers 5 (a
    varint; 9 for a float), nested messages and sequences their parts + 2."""
    if isinstance(msg, str | bytes):
        return len(msg) + 2
    if isinstance(msg, bool) or msg is None:
        return 2
    if isinstance(msg, int):
        return 5
    if isinstance(msg, float):
        return 9
    if isinstance(msg, dict):
        return sum(wire_bytes(k) + wire_bytes(v) for k, v in msg.items()) + 2
    if isinstance(msg, list | tuple):
        return sum(wire_bytes(m) for m in msg) + 2
    fields = getattr(msg, "__dataclass_fields__", None)
    if fields is not None:
        return sum(wire_bytes(getattr(msg, f)) for f in fields) + 2
    return 2


@dataclass
class Traffic:
    """One node's calls: their bytes (requests and replies, ``wire_bytes`` + framing, counted at
    the caller: a network's total over N is the bytes each node sends on average) and their
    kinds (``transport.Traffic``, as the transport records them)."""

    sent: int = 0
    kinds: Counter[str] = field(default_factory=Counter)

    def record(self, kind: str, *, sent: int = 0, received: int = 0) -> None:
        self.kinds[kind] += 1

    def latency(self, kind: str, seconds: float, side: str) -> None:
        pass


def _counted(client: Any, traffic: Traffic) -> Any:
    """``client`` whose unary calls (every membership and overlay call) count their bytes."""
    send = client.send

    async def counted(rpc, address, request, timeout=None, *, peer=None):
        traffic.sent += FRAMING_BYTES + wire_bytes(request)
        reply = await send(rpc, address, request, timeout, peer=peer)
        traffic.sent += FRAMING_BYTES + wire_bytes(reply)
        return reply

    client.send = counted
    return client


class Served:
    """A node's served side: membership's and the overlay's RPCs (nothing else is offered)."""

    def __init__(self, membership: Membership, overlay: Overlay):
        self.membership, self.overlay = membership, overlay
        self.node_id = membership.node_id

    def admit(self, peer: str, kind: str):
        return contextlib.nullcontext()

    def info(self) -> NodeInfo:
        return self.membership.state.info()

    def check_known(self, node_id: str) -> None:
        self.membership.check_known(node_id)

    def on_handshake(self, remote: NodeInfo):
        return self.membership.on_handshake(remote)

    def on_heartbeat(self, beat: Beat) -> Beat:
        return self.membership.on_heartbeat(beat)

    async def on_indirect_probe(self, probe: IndirectProbe):
        return await self.membership.on_indirect_probe(probe)

    def on_peer_list(self, sender, entries, members=(), incarnation: int = 0):
        return self.membership.on_peer_list(sender, entries, members, incarnation)

    def on_shuffle(self, sample: ViewSample) -> ViewSample:
        return self.overlay.on_shuffle(sample)

    def on_link(self, req: LinkRequest):
        return self.overlay.on_link(req)


@dataclass
class Member:
    node_id: str
    membership: Membership
    overlay: Overlay
    scope: ViewScope | None
    server: PeerServer
    traffic: Traffic
    deaths: list[str] = field(default_factory=list)  # members this node declared dead
    suspicions: list[str] = field(default_factory=list)  # ... and suspected
    stopped: bool = False

    @property
    def peers(self) -> PeerTable:
        return self.membership.peers

    async def settle(self) -> None:
        while self.membership.tasks._tasks or self.overlay._tasks:
            await asyncio.gather(self.membership.tasks.settle(), self.overlay.settle())


@dataclass(frozen=True)
class Timing:
    """Membership's clocks (wall clock, seconds): the protocol period and the probe and
    suspicion floors of the peer table."""

    period: float = 0.02
    suspect_after_s: float = 0.5
    dead_after_s: float = 1.0


def make_member(
    net: Any,
    node_id: str,
    views: ViewSettings,
    *,
    partial: bool,
    seed: int = 0,
    timing: Timing = Timing(),
    settings: Settings | None = None,
) -> Member:
    """One node on ``net`` (``transport.inproc.InProcNetwork``: peering does not import the
    transports); ``partial``: membership on its views from the start (else full membership,
    the overlay idle)."""
    t = net.transport()
    traffic = Traffic()
    client = _counted(t.connect(node_id, traffic), traffic)
    table = PeerTable(node_id, timing.suspect_after_s, timing.dead_after_s)
    box: list[str] = []
    info = lambda: NodeInfo(node_id, 1, "arch", address=box[0])  # noqa: E731 (its address once bound)
    m = full_membership(
        info,
        lambda: (0, 0),
        table,
        client,
        ProblemLog(),
        bootstrap=(),
        period=timing.period,
        settings=settings or Settings(),
        rng=random.Random(f"m{seed}-{node_id}"),
    )
    overlay = Overlay(
        PartialView(node_id, views, random.Random(f"v{seed}-{node_id}")),
        client,
        lambda: box[0],
        timeout_s=2.0,
        known_address=lambda p: r.address if (r := table.records.get(p)) is not None and r.state == ALIVE else None,
    )
    scope = None
    if partial:
        scope = ViewScope(overlay, table, m.handshakes, above=0, partial_from_start=True)
        m.state.scope = scope
    server = t.bind(Served(m, overlay), traffic, None)
    box.append(server.address)
    member = Member(node_id, m, overlay, scope, server, traffic)
    table.listeners.append(lambda p, old, new: member.deaths.append(p) if new == "dead" else None)
    table.listeners.append(lambda p, old, new: member.suspicions.append(p) if new == "suspect" else None)
    return member


async def period(members: Iterable[Member]) -> None:
    """One protocol period everywhere: membership's tick (probe, handshakes, push-pull when
    full), the overlay's (shuffle, keepalive, what its view queued), all calls answered."""
    ms = list(members)
    for x in ms:
        x.membership.tick()
        if x.scope is not None:
            x.overlay.tick()
    await asyncio.gather(*(x.settle() for x in ms))


async def join(member: Member, contact: Member) -> None:
    """``member`` enters through ``contact``: a handshake, then a HyParView join."""
    await member.membership.handshakes.contact(contact.server.address)
    member.overlay.join(contact.node_id, contact.server.address)
    await asyncio.gather(member.settle(), contact.settle())


def bootstrap_views(members: list[Member], rng: random.Random) -> None:
    """Views set up directly, as a converged overlay would hold them (each node's active view:
    links to random others, kept symmetric and within the size; its passive view: random
    others), each view member in the table as if handshaken — so that thousands of nodes start
    in O(N · view) instead of joining one by one."""
    by_id = {x.node_id: x for x in members}
    ids = list(by_id)
    s = members[0].overlay.view.s
    for x in members:
        view = x.overlay.view
        for p in rng.sample(ids, min(len(ids), 3 * s.active_size)):
            peer = by_id[p].overlay.view
            if len(view.active) >= s.active_size - 1:
                break
            if p != x.node_id and len(peer.active) < s.active_size - 1 and p not in view.active:
                view.active[p] = None
                peer.active[x.node_id] = None
    for x in members:
        view = x.overlay.view
        for p in rng.sample(ids, min(len(ids), s.passive_size + s.active_size + 1)):
            if len(view.passive) >= s.passive_size:
                break
            if p != x.node_id and p not in view.active:
                view._add_passive(p, p)
        for p in view.members():
            y = by_id[p]
            x.peers.upsert(p, y.server.address)
            x.overlay.addresses[p] = y.server.address


def converge_full(members: list[Member]) -> None:
    """Full membership's tables as converged: every member alive in every table."""
    for x in members:
        for y in members:
            if y is not x:
                x.peers.upsert(y.node_id, y.server.address)


async def stop(members: Iterable[Member]) -> None:
    """Stop serving and calling (a killed node); those stopped already are left as they are."""
    for x in members:
        if x.stopped:
            continue
        x.stopped = True
        x.membership.tasks.cancel()
        await x.overlay.close()
        await x.server.stop()
