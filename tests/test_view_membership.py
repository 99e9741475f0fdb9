"""Membership on partial views past the size threshold (``peering/view_scope.py``): 200 nodes of
the daemon's real membership (SWIM, handshakes) with their HyParView overlays, over the
in-process transport (every call through the gate, as over gRPC). Each node's table holds its
views, not the network; no push-pull runs; probes go to active neighbours only. Killing 20% of
the nodes at once leaves one component, no killed node in an active view, and no living node
declared dead by another. Below the threshold membership is full, as before."""

from __future__ import annotations

import asyncio
import random
import statistics

from coterie.node.peering import views_inproc as vi
from coterie.node.peering.handshakes import VIEW_HANDSHAKE_ENTRIES
from coterie.node.peering.membership import Settings
from coterie.node.peering.messages import Beat, MemberUpdate
from coterie.node.peering.partial_view import ViewSettings, view_components
from coterie.node.peering.view_scope import ViewScope
from coterie.node.transport.inproc import InProcNetwork

N = 200
SETTINGS = ViewSettings.for_network(N)  # active 9, passive 54


def _components(members) -> list[set[str]]:
    return view_components({x.node_id: x.overlay.view.active for x in members})


async def _joined(n: int, rng: random.Random) -> list[vi.Member]:
    """``n`` nodes on partial views, each joined through a node that joined before it
    (a handshake, then a HyParView join), periods running meanwhile, then 15 more."""
    net = InProcNetwork()
    members = [vi.make_member(net, f"n{i:04d}", SETTINGS, partial=True) for i in range(n)]
    for i in range(1, n):
        await vi.join(members[i], members[rng.randrange(i)])
        if i % 10 == 0:
            await vi.period(members[: i + 1])
    for _ in range(15):
        await vi.period(members)
    return members


def test_two_hundred_nodes_hold_their_views_not_the_network_and_survive_a_fifth_killed():
    async def go():
        rng = random.Random(5)
        members = await _joined(N, rng)
        try:
            cap = SETTINGS.active_size + SETTINGS.passive_size
            held = [len(x.peers.records) for x in members]
            print(f"\ntable sizes: median {statistics.median(held)}, max {max(held)} (views hold {cap}; N {N})")
            # bounded by the views (O(log N)); full membership would hold 199 each
            assert max(held) <= cap, max(held)
            assert statistics.median(held) <= cap / 2, statistics.median(held)
            for x in members:
                assert set(x.overlay.view.active) <= set(x.peers.records), x.node_id  # neighbours known
                assert x.traffic.kinds["peers"] == 0, x.node_id  # no push-pull of the whole table
            assert sum(x.traffic.kinds["heartbeat"] for x in members) >= N * 10  # SWIM probes ran
            assert len(_components(members)) == 1
            assert not [d for x in members for d in x.deaths]

            killed = {x.node_id for x in rng.sample(members, N // 5)}  # 20% at once
            await vi.stop([x for x in members if x.node_id in killed])
            alive = [x for x in members if x.node_id not in killed]
            for _ in range(20):
                await vi.period(alive)
            false_suspicions = sum(len(set(x.suspicions) - killed) for x in alive)
            print(f"after the kill: {false_suspicions} living members ever suspected (replaced in a view, never dead)")
            comps = _components(alive)
            assert len(comps) == 1, [len(c) for c in comps]
            for x in alive:
                assert x.overlay.view.active, x.node_id
                assert not set(x.overlay.view.active) & killed, (x.node_id, x.overlay.view.active)
                # no false death: every member a living node declared dead was killed
                assert set(x.deaths) <= killed, (x.node_id, set(x.deaths) - killed)
                assert len(x.peers.records) <= cap, x.node_id
        finally:
            await vi.stop(members)

    asyncio.run(go())


def test_below_the_threshold_membership_stays_full_and_past_it_the_switch_holds():
    async def go():
        net = InProcNetwork()
        settings = Settings(push_pull_interval_s=0.01)
        members = [vi.make_member(net, f"n{i}", SETTINGS, partial=False, settings=settings) for i in range(8)]
        scopes = []
        for x in members:  # the daemon's wiring: partial views past 10 alive members
            x.scope = ViewScope(x.overlay, x.peers, x.membership.handshakes, above=10)
            x.membership.state.scope = x.scope
            scopes.append(x.scope)
        vi.converge_full(members)
        try:
            for _ in range(10):
                await vi.period(members)
            for x in members:
                assert not x.scope.partial()
                assert len(x.peers.records) == 7  # full membership: everyone
                assert sorted(x.membership.state.probe_targets()) == sorted(x.peers.records)
            assert sum(x.traffic.kinds["peers"] for x in members) > 0  # push-pull still runs

            extra = [vi.make_member(net, f"m{i}", SETTINGS, partial=False, settings=settings) for i in range(4)]
            vi.converge_full(members + extra)  # 11 alive members each: past the threshold
            assert all(x.scope.partial() for x in members)
            before = sum(x.traffic.kinds["peers"] for x in members)
            for x in members:
                x.peers.forget(next(iter(x.peers.records)))  # under the threshold again: still partial
                assert x.scope.partial() and x.membership.state.probe_targets() == []  # views empty
            for _ in range(5):
                await vi.period(members)
            assert sum(x.traffic.kinds["peers"] for x in members) == before  # no push-pull since
            await vi.stop(extra)
        finally:
            await vi.stop(members)

    asyncio.run(go())


def test_past_the_threshold_an_insiders_hearsay_and_a_handshakes_sample_add_nobody():
    """An insider (a known peer) piggybacks news of members the views do not hold, and a
    handshake's reply lists addresses: below the threshold these become handshake candidates
    (the table grows towards the network); past it, nobody is added — the views alone decide
    whom a node knows — and the reply to a joiner's handshake carries 8 entries, not 64."""

    async def go():
        net = InProcNetwork()
        members = [vi.make_member(net, f"n{i:02d}", SETTINGS, partial=i == 0) for i in range(70)]
        node, insider = members[0], members[1]
        vi.converge_full(members[1:])
        for x in members[2:]:  # node knows 68 members, the insider among them
            node.peers.upsert(x.node_id, x.server.address)
            x.peers.upsert(node.node_id, node.server.address)
        node.peers.upsert(insider.node_id, insider.server.address)
        joiner = vi.make_member(net, "joiner", SETTINGS, partial=False)
        members.append(joiner)
        try:
            fakes = tuple(MemberUpdate(f"sybil-{k}", f"inproc:{9000 + k}", 1) for k in range(8))
            client = insider.membership.probes.transport
            beat = Beat(insider.node_id, 0, 0, 0.0, insider.membership.state.incarnation, fakes)
            await client.heartbeat(node.server.address, beat, timeout=1.0, peer=node.node_id)
            assert len(node.membership.pending) == 0  # no candidate from hearsay
            assert not any(p.startswith("sybil") for p in node.peers.records)

            await joiner.membership.handshakes.contact(node.server.address)  # node answers a joiner
            assert 0 < len(joiner.membership.pending) <= VIEW_HANDSHAKE_ENTRIES  # a seed sample, not 64

            # the same news to a node with full membership: candidates (the defence is the switch)
            full = members[3]
            await client.heartbeat(full.server.address, beat, timeout=1.0, peer=full.node_id)
            assert len(full.membership.pending) == len(fakes)
        finally:
            await vi.stop(members)

    asyncio.run(go())


def test_a_node_told_of_members_past_the_threshold_switches_before_meeting_them():
    """A node joining a large network hears of many more members than it has met (piggybacked
    news, handshake samples). Counting them, it switches to the views at once instead of first
    handshaking ``above`` of them one by one (~200 per node at start-up; on the old rule the node
    below stays on full membership with 4 members met). One peer's word counts for a quarter of
    the threshold at most: an insider naming made-up members does not switch a small network."""

    async def go():
        net = InProcNetwork()
        settings = Settings(push_pull_interval_s=3600.0)
        members = [vi.make_member(net, f"n{i}", SETTINGS, partial=False, settings=settings) for i in range(5)]
        node, sources = members[0], members[1:]
        node.scope = ViewScope(node.overlay, node.peers, node.membership.handshakes, above=12)  # a source: 3
        node.membership.state.scope = node.scope
        vi.converge_full(members)
        try:

            async def news(source, first: int, count: int) -> None:
                named = tuple(MemberUpdate(f"far-{k}", f"inproc:{7000 + k}", 1) for k in range(first, first + count))
                beat = Beat(source.node_id, 0, 0, 0.0, source.membership.state.incarnation, named)
                await source.membership.probes.transport.heartbeat(
                    node.server.address, beat, timeout=1.0, peer=node.node_id
                )

            node.membership.pending.add("inproc:6999", source="config", pinned=True)  # a configured peer
            await news(sources[0], 0, 60)  # one insider names 60: 4 met + 3 counted, no switch
            assert len(node.membership.pending) == 61 and not node.scope.partial()
            await news(sources[0], 100, 60)  # ... nor does naming more
            assert not node.scope.partial()
            for i, s in enumerate(sources[1:], 1):  # three more peers name four members each
                await news(s, 1000 * i, 4)
            # 4 met + 3 heard through each of 4 sources > 12 (passed at the third's third name):
            # on the views now, for good
            assert node.scope.partial()
            assert len(node.peers.alive()) == 4
            # what hearsay queued goes at the switch: past it the views decide whom a node meets
            # (the configured address stays a candidate)
            assert list(node.membership.pending) == ["inproc:6999"] and node.scope.dropped_candidates >= 120
        finally:
            await vi.stop(members)

    asyncio.run(go())
