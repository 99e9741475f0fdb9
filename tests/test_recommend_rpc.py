"""Discovery's "whom do you weight?" as its own RPC (``Recommend``, declared in node/peering/api.py),
attacked through the in-process transport (the same gate and table checks as gRPC;
tests/test_discovery_daemons.py runs it over mTLS between real daemons and tests/test_fuzz.py fuzzes
it): a stranger is refused before discovery hears of it, an answer lists only peers the answerer
weights and can call (never the asker), an oversized question or answer is refused on either side,
and an insider answering with itself and a clique is bounded by the asker's ``Discovery`` — the
same attack against a discovery without the bounds fills the candidates."""

from __future__ import annotations

import asyncio
import contextlib
import random
from types import SimpleNamespace

import pytest

from coterie.node.peering import api
from coterie.node.peering.api import MAX_RECOMMEND, RecommendAsk, Recommendations
from coterie.node.peering.calls import PeerCalls
from coterie.node.peering.deadlines import Deadlines
from coterie.node.peering.discovery import Discovery, DiscoverySettings
from coterie.node.peering.errors import FORBIDDEN, INVALID, UNKNOWN_PEER, PeerCallError, unknown_peer
from coterie.node.peering.inbox import PushInbox
from coterie.node.peering.messages import PeerEntry
from coterie.node.peering.network import NetworkSettings, NodeNetwork
from coterie.node.peering.peer_table import PeerTable
from coterie.node.peering.problems import ProblemLog
from coterie.node.peering.served import ServedRequests
from coterie.node.peering.snapshots import SnapshotCache
from coterie.node.peering.versions import RECOMMEND
from coterie.node.transport.inproc import InProcNetwork
from coterie.node.wire.codec import WireError


class _Traffic:
    def record(self, kind, *, sent=0, received=0):
        pass

    def latency(self, kind, seconds, side):
        pass


class _Answerer:
    """The served side of one node, answering with the node's own ``ServedRequests.on_recommend``
    over a real peer table and ``Discovery``."""

    node_id = "answerer"
    on_recommend = ServedRequests.on_recommend

    def __init__(self):
        self.table = PeerTable(self.node_id, 5.0, 10.0)
        self.membership = SimpleNamespace(peers=self.table)
        usable = lambda p: p in self.table.records and self.table.records[p].state == "alive"  # noqa: E731
        self.discovery = Discovery(self.node_id, self.table.alive, usable=usable, rng=random.Random(1))
        self.admitted: list[tuple[str, str]] = []

    def check_known(self, node_id):
        if node_id not in self.table.records:
            raise unknown_peer(node_id)

    def admit(self, peer, kind):
        self.admitted.append((peer, kind))
        return contextlib.nullcontext()


def test_recommend_answers_only_known_callers_with_peers_it_weights_and_can_call():
    async def go():
        net = InProcNetwork()
        me = _Answerer()
        server = net.transport().bind(me, _Traffic(), None)
        honest = net.transport().connect("honest", _Traffic())
        stranger = net.transport().connect("stranger", _Traffic())
        for p in ("honest", "mate-1", "mate-2", "mate-3", "down"):
            me.table.upsert(p, f"addr-of-{p}")
        me.table.suspect("down")
        # weighted: mates, a peer now suspect, one it no longer knows; by noise alone: "meh"
        for _ in range(2):  # kept and evaluated again: collaborators (``collaborator_after``)
            me.discovery.observe({"down": 1.0, "mate-1": 0.9, "gone": 0.85, "mate-2": 0.8, "meh": 0.1})

        with pytest.raises(PeerCallError) as e:  # not a known peer: refused before discovery hears of it
            await stranger.recommend(server.address, "stranger", 5)
        assert e.value.kind == UNKNOWN_PEER and not me.discovery.hints and not me.admitted
        with pytest.raises(PeerCallError) as e:  # speaking for another node
            await honest.recommend(server.address, "mate-1", 5)
        assert e.value.kind == FORBIDDEN and not me.discovery.hints

        too_many = RecommendAsk("honest", MAX_RECOMMEND + 1)
        with pytest.raises(PeerCallError) as e:  # the caller's own check
            await honest.call(api.RECOMMEND, server.address, too_many)
        assert e.value.kind == INVALID and f"at most {MAX_RECOMMEND}" in e.value.message
        with pytest.raises(PeerCallError) as e:  # a caller that skips it: the gate refuses, before admission
            await honest.send(api.RECOMMEND, server.address, too_many)
        assert e.value.kind == INVALID and "recommendation request from honest" in e.value.message
        assert not me.admitted

        reply = await honest.recommend(server.address, "honest", 5)
        assert reply.sender == "answerer"
        # best first; not the suspect one, not the forgotten one, not the noise
        assert [(e.node_id, e.address) for e in reply.peers] == [
            ("mate-1", "addr-of-mate-1"),
            ("mate-2", "addr-of-mate-2"),
        ]
        assert [e.node_id for e in (await honest.recommend(server.address, "honest", 1)).peers] == ["mate-1"]
        assert ("honest", "recommend") in me.admitted  # it cost the asker its admission budget
        assert ("honest", "honest") in me.discovery.hints  # whoever asks is a hint (evaluated before weighted)
        mate = net.transport().connect("mate-1", _Traffic())
        # never the asker; after the peers it weights, the one that asked it lately (it weights
        # the answerer: a hint that spreads a mate two hops)
        assert [e.node_id for e in (await mate.recommend(server.address, "mate-1", 5)).peers] == [
            "mate-2",
            "honest",
        ]
        await server.stop()

    asyncio.run(go())


class _Insider:
    """A peer that answers "whom do you weight?" with whatever ``answer(round)`` says."""

    node_id = "insider"

    def __init__(self, answer):
        self.answer = answer
        self.asked = 0

    def check_known(self, node_id):
        pass

    def admit(self, peer, kind):
        return contextlib.nullcontext()

    def on_recommend(self, ask: RecommendAsk) -> Recommendations:
        self.asked += 1
        return self.answer(self.asked)


def _victim(
    net: InProcNetwork, insider_address: str, settings: DiscoverySettings, known: list[str], view: list[str]
) -> NodeNetwork:
    """The asking side as a node wires it: its ``NodeNetwork`` over the in-process transport,
    the insider its best collaborator, ``known`` peers alive in its table, ``view`` the sample of
    the network its discovery draws from."""
    table = PeerTable("victim", 5.0, 10.0)
    table.upsert("insider", insider_address)
    for p in known:
        table.upsert(p, f"addr-of-{p}")
    table.records["insider"].features = (RECOMMEND,)  # its handshake named the feature
    client = net.transport().connect("victim", _Traffic())
    calls = PeerCalls(table, Deadlines(5.0), request_timeout_s=5.0)
    network = NodeNetwork(
        NetworkSettings("victim", {}), client, calls, SnapshotCache(), PushInbox(), lambda: None, None, ProblemLog()
    )
    network.discovery = Discovery(
        "victim",
        lambda: view,
        usable=lambda p: network._address(p) is not None,
        settings=settings,
        rng=random.Random(5),
    )
    return network


def _clique_answer(clique: list[str]):
    """Itself first, then 15 clique members, fresh ones each round (half of them unknown to the victim)."""

    def answer(r: int) -> Recommendations:
        ids = ["insider"] + [clique[(15 * r + k) % len(clique)] for k in range(MAX_RECOMMEND - 1)]
        return Recommendations("insider", tuple(PeerEntry(p, f"addr-of-{p}") for p in ids))

    return answer


async def _attack(settings: DiscoverySettings, rounds: int = 12) -> tuple[float, int, int]:
    """The clique's share of the victim's candidates, how many clique members were introduced to
    its membership, and how many times the insider was asked."""
    net = InProcNetwork()
    honest = [f"node-{i:03d}" for i in range(200)]
    clique = [f"sybil-{k:03d}" for k in range(240)]
    insider = _Insider(_clique_answer(clique))
    server = net.transport().bind(insider, _Traffic(), None)
    # it can call half the clique (they reach its candidates only as hints: its view is honest)
    victim = _victim(net, server.address, settings, honest + clique[::2], honest)
    introduced: list[tuple[str, str, str]] = []
    victim.introduce = lambda source, node_id, address: introduced.append((source, node_id, address))
    d = victim.discovery
    assert d is not None
    seen = total = 0
    for _ in range(rounds):
        victim.begin_round()
        cands = victim.peers()
        seen += sum(p in clique for p in cands)
        total += len(cands)
        await victim.end_round({"insider": 1.0}, cands)  # the victim evaluated them: not helpful
    assert all(src == "insider" and addr == f"addr-of-{p}" for src, p, addr in introduced)
    await server.stop()
    return seen / total, len(introduced), insider.asked


def test_an_insiders_answers_over_the_rpc_take_at_most_one_exploring_slot_a_round():
    share, introduced, asked = asyncio.run(_attack(DiscoverySettings()))
    # it was asked every round over the RPC, from the second: a collaborator once evaluated twice
    assert asked == 12 - 1
    assert share <= 1 / 5  # one of five candidates a round at most; the rest is the view
    assert introduced <= 2 * 12  # at most per_recommender of its answer is taken up a round
    naive = DiscoverySettings(recommend=MAX_RECOMMEND, per_recommender=1000, hints_per_recommender_round=1000)
    share, introduced, _ = asyncio.run(_attack(naive))
    assert share >= 0.5 and introduced >= 5 * 12  # unbounded: the clique crowds out the view


def test_an_oversized_or_misattributed_answer_is_refused_by_the_asker():
    async def go():
        net = InProcNetwork()
        n = MAX_RECOMMEND + 1
        huge = Recommendations("insider", tuple(PeerEntry(f"sybil-{k}", "a") for k in range(n)))
        other = Recommendations("someone-else", (PeerEntry("x", "a"),))
        insider = _Insider(lambda r: huge if r <= 2 else other)
        server = net.transport().bind(insider, _Traffic(), None)
        with pytest.raises(WireError, match=f"{n} peers, at most {MAX_RECOMMEND}"):  # the table's check, caller side
            await net.transport().connect("victim", _Traffic()).recommend(server.address, "victim", 5)

        victim = _victim(net, server.address, DiscoverySettings(), [], [])
        victim.introduce = lambda *a: pytest.fail(f"introduced {a}")
        d = victim.discovery
        assert d is not None
        await victim.end_round({"insider": 1.0}, [])  # its first evaluation: not asked yet
        for _ in range(2):  # round 1: too long; round 2: an answer that claims to come from another node
            await victim.end_round({"insider": 1.0}, [])
        assert insider.asked == 3 and not d.hints and d.counters.hints_received == 0
        noted = " ".join(str(p) for p in victim.problems.recent(50) if "insider" in str(p))
        assert "at most 16" in noted and "claim to be from 'someone-else'" in noted
        await server.stop()

    asyncio.run(go())


def test_a_peer_whose_handshake_did_not_name_the_feature_is_not_asked():
    async def go():
        net = InProcNetwork()
        insider = _Insider(_clique_answer([f"sybil-{k}" for k in range(30)]))
        server = net.transport().bind(insider, _Traffic(), None)
        victim = _victim(net, server.address, DiscoverySettings(), [], [])
        victim.table.records["insider"].features = ()  # a 0.1.0 node: it asked under gossip, never Recommend
        await victim.end_round({"insider": 1.0}, [])
        assert insider.asked == 0 and not victim.problems.recent(50)
        await server.stop()

    asyncio.run(go())
