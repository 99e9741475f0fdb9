"""A peer that forgot this node (past the partial-view threshold a table holds views, and a puller
in neither is pruned between two slow rounds) refuses its next call as from a stranger: the caller
handshakes once and calls once more, instead of losing that peer for the round (issue 32: on 100
daemons, 1,648 of 1,806 failed pulls were that refusal)."""

from __future__ import annotations

import asyncio

import pytest

from coterie.node.peering.calls import PeerCalls
from coterie.node.peering.deadlines import Deadlines
from coterie.node.peering.errors import FORBIDDEN, UNKNOWN_PEER, PeerCallError
from coterie.node.peering.peer_table import PeerTable


class ForgetfulPeer:
    """Answers only callers it knows; a handshake makes it know them again."""

    def __init__(self, knows_me: bool = False, refuse_as: str = UNKNOWN_PEER):
        self.knows_me, self.refuse_as = knows_me, refuse_as
        self.calls = self.handshakes = 0

    async def snapshot(self, timeout: float) -> str:
        self.calls += 1
        if not self.knows_me:
            raise PeerCallError(self.refuse_as, "unknown peer 'me': handshake first")
        return "snapshot of a"

    async def handshake(self, peer: str) -> bool:
        self.handshakes += 1
        self.knows_me = True
        return True


def _calls(peer: ForgetfulPeer | None) -> PeerCalls:
    table = PeerTable("me", 1.0, 2.0)
    table.upsert("a", "addr-a")
    calls = PeerCalls(table, Deadlines(5.0), request_timeout_s=5.0)
    if peer is not None:
        calls.reintroduce = peer.handshake
    return calls


def test_a_call_refused_as_from_a_stranger_is_made_again_after_one_handshake():
    a = ForgetfulPeer()
    calls = _calls(a)
    assert asyncio.run(calls.call("a", "snapshot", a.snapshot)) == "snapshot of a"
    assert (a.handshakes, a.calls, calls.reintroduced) == (1, 2, 1)
    # it knows me now: the next call goes straight through
    assert asyncio.run(calls.call("a", "snapshot", a.snapshot)) == "snapshot of a"
    assert (a.handshakes, a.calls) == (1, 3)


def test_the_retry_is_bounded_and_only_for_that_refusal():
    class Amnesiac(ForgetfulPeer):  # forgets again at once: one handshake, one retry, then the refusal
        async def handshake(self, peer: str) -> bool:
            self.handshakes += 1
            return True

    a = Amnesiac()
    calls = _calls(a)
    with pytest.raises(PeerCallError) as e:
        asyncio.run(calls.call("a", "snapshot", a.snapshot))
    assert e.value.kind == UNKNOWN_PEER and (a.handshakes, a.calls) == (1, 2)

    b = ForgetfulPeer(refuse_as=FORBIDDEN)  # any other refusal stands: no handshake, no retry
    calls = _calls(b)
    with pytest.raises(PeerCallError):
        asyncio.run(calls.call("a", "snapshot", b.snapshot))
    assert (b.handshakes, b.calls) == (0, 1)

    c = ForgetfulPeer()
    calls = _calls(None)  # no way to handshake (not wired): the refusal stands
    with pytest.raises(PeerCallError):
        asyncio.run(calls.call("a", "snapshot", c.snapshot))
    assert c.calls == 1


def test_a_node_handshakes_a_peer_that_refused_it_as_a_stranger(tmp_path):
    # the daemon's own calls carry the handshake: a peer it knows is contacted at its address
    from coterie.node.daemon import Node
    from tests.solo import solo_config

    node = Node(solo_config(tmp_path, 1))
    calls = node.plane.network.calls
    contacted: list[str] = []

    async def contact(address: str) -> bool:
        contacted.append(address)
        return False  # nobody answers there: the refusal stands

    node.plane.membership.handshakes.contact = contact
    assert calls.reintroduce is not None
    assert asyncio.run(calls.reintroduce("stranger")) is False and contacted == []  # unknown: no call
    node.plane.peers.upsert("a", "127.0.0.1:9")
    assert asyncio.run(calls.reintroduce("a")) is False and contacted == ["127.0.0.1:9"]
