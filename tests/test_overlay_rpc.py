"""Partial views carried by the peer RPCs (``Shuffle``, ``Link``; ``peering/overlay.py``): 30 nodes
on the in-process transport (every call through the same gate and table checks as gRPC) join
through one another, keep bounded views, stay one component, and stay one after 20% of them are
killed at once; an insider's shuffle is bounded by the table and the view, a stranger refused."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from coterie.node.peering import api
from coterie.node.peering.api import MAX_SAMPLE, MAX_TTL, LinkRequest, ViewSample
from coterie.node.peering.errors import INVALID, UNKNOWN_PEER, PeerCallError, unknown_peer
from coterie.node.peering.messages import PeerEntry
from coterie.node.peering.overlay import Overlay
from coterie.node.peering.partial_view import PartialView, ViewSettings, view_components
from coterie.node.transport.inproc import InProcNetwork

SETTINGS = ViewSettings(active_size=4, passive_size=12)


class _Traffic:
    def record(self, kind, *, sent=0, received=0):
        pass

    def latency(self, kind, seconds, side):
        pass


class _Node:
    """The served side of one node: its overlay answers; ``strangers`` are unknown to it."""

    def __init__(self, node_id: str, strangers: frozenset[str] = frozenset()):
        self.node_id = node_id
        self.strangers = strangers
        self.overlay: Overlay | None = None
        self.admitted: list[str] = []

    def check_known(self, node_id):
        if node_id in self.strangers:
            raise unknown_peer(node_id)

    def admit(self, peer, kind):
        self.admitted.append(kind)
        return contextlib.nullcontext()

    def on_shuffle(self, sample):
        assert self.overlay is not None
        return self.overlay.on_shuffle(sample)

    def on_link(self, req):
        assert self.overlay is not None
        return self.overlay.on_link(req)


async def _network(n: int, net: InProcNetwork, strangers: frozenset[str] = frozenset()):
    nodes: dict[str, tuple[Overlay, object, _Node]] = {}
    for i in range(n):
        node_id = f"n{i:02d}"
        t = net.transport()
        handler = _Node(node_id, strangers)
        server = t.bind(handler, _Traffic(), None)
        handler.overlay = Overlay(
            PartialView(node_id, SETTINGS, random.Random(i)),
            t.connect(node_id, _Traffic()),
            lambda a=server.address: a,
            timeout_s=1.0,
        )
        nodes[node_id] = (handler.overlay, server, handler)
    return nodes


async def _settle(overlays) -> None:
    """The period's calls answered (what they queue waits for the next period)."""
    await asyncio.gather(*(o.settle() for o in overlays))


async def _periods(overlays, k: int) -> None:
    for _ in range(k):
        for o in overlays:
            o.tick()
        await _settle(overlays)


def _components(overlays: dict[str, Overlay]) -> list[set[str]]:
    """Components of the active views' graph (links taken either way) among ``overlays``."""
    return view_components({p: o.view.active for p, o in overlays.items()})


def test_thirty_nodes_keep_bounded_connected_views_and_survive_a_fifth_killed():
    async def go():
        net = InProcNetwork()
        nodes = await _network(30, net)
        overlays = {p: o for p, (o, _, _) in nodes.items()}
        rng = random.Random(7)
        ids = list(overlays)
        for i, p in enumerate(ids[1:], start=1):  # each joins through a node that joined before it
            contact = ids[rng.randrange(i)]
            overlays[p].join(contact, nodes[contact][1].address)
            await _periods(list(overlays.values()), 1)
        await _periods(list(overlays.values()), 15)

        for p, o in overlays.items():
            assert 1 <= len(o.view.active) <= SETTINGS.active_size, (p, o.view.active)
            assert len(o.view.passive) <= SETTINGS.passive_size
            # addresses kept: the views' nodes and those a message waits for, O(view), not O(N)
            assert set(o.addresses) <= set(o.members()) | {to for to, _ in o.view.outbox}, p
        assert len(_components(overlays)) == 1
        links = [(p, q) for p, o in overlays.items() for q in o.view.active]
        one_sided = [(p, q) for p, q in links if p not in overlays[q].view.active]
        assert len(one_sided) <= len(links) // 10, one_sided  # active links are symmetric
        assert (
            sum(o.view.counters.shuffles_received for o in overlays.values()) >= 30 * 10
        )  # shuffles went over the RPC
        assert {"shuffle", "link"} <= {k for _, _, h in nodes.values() for k in h.admitted}

        killed = rng.sample(ids, 6)  # 20% at once
        for p in killed:
            await overlays[p].close()
            await nodes[p][1].stop()
        alive = {p: o for p, o in overlays.items() if p not in killed}
        await _periods(list(alive.values()), 12)
        assert len(_components(alive)) == 1, _components(alive)
        for p, o in alive.items():
            assert not set(o.view.active) & set(killed), (p, o.view.active)
            assert o.view.active, p
        for o in alive.values():
            await o.close()
        for p, (_, server, _) in nodes.items():
            if p not in killed:
                await server.stop()

    asyncio.run(go())


def test_an_insiders_shuffle_is_bounded_and_a_stranger_refused():
    async def go():
        net = InProcNetwork()
        nodes = await _network(2, net, strangers=frozenset({"stranger"}))
        (victim, server, _), (insider, _, _) = nodes["n00"], nodes["n01"]
        client = insider.transport
        sybils = tuple(PeerEntry(f"sybil-{k:02d}", f"addr-{k}") for k in range(MAX_SAMPLE + 1))

        with pytest.raises(PeerCallError) as e:  # the caller's own check
            await client.call(api.SHUFFLE, server.address, ViewSample("n01", sybils))
        assert e.value.kind == INVALID and f"at most {MAX_SAMPLE}" in e.value.message
        with pytest.raises(PeerCallError) as e:  # a caller that skips it: the gate refuses
            await client.send(api.SHUFFLE, server.address, ViewSample("n01", sybils))
        assert e.value.kind == INVALID and not victim.view.passive

        # at the limit: hearsay reaches the passive view only, at most per_source of it
        reply = await client.call(api.SHUFFLE, server.address, ViewSample("n01", sybils[:MAX_SAMPLE]))
        assert reply.sender == "n00"
        assert not victim.view.active
        assert sum(p.startswith("sybil") for p in victim.view.passive) <= SETTINGS.per_source
        assert len(victim.view.passive) <= SETTINGS.per_source + 1  # (and the insider itself)

        long_walk = LinkRequest("n01", api.FORWARD_JOIN, PeerEntry("sybil-00", "a"), MAX_TTL + 1, "x")
        with pytest.raises(PeerCallError) as e:
            await client.send(api.LINK, server.address, long_walk)
        assert e.value.kind == INVALID

        stranger = net.transport().connect("stranger", _Traffic())
        with pytest.raises(PeerCallError) as e:  # not a known peer: refused before the view hears of it
            await stranger.call(api.LINK, server.address, LinkRequest("stranger", api.NEIGHBOR_URGENT, address="x"))
        assert e.value.kind == UNKNOWN_PEER and "stranger" not in victim.view.active
        for o, s, _ in nodes.values():
            await o.close()
            await s.stop()

    asyncio.run(go())
