"""Forged membership gossip from a certified insider (issue 22), on real daemons over mTLS.

Mallory holds a valid certificate and has handshaken n1: its heartbeats are authenticated, so
what it says about *itself* counts; what it says about others is checked (``peering/claims.py``).
Each test would fail on the code before: "n2 is DEAD" every 0.5 s kept n2 dead at n1 in 15 of
15 polls, and a suspicion at incarnation 2^64 − 1 made n2 refute with 2^64, after which every
heartbeat failed (``ValueError: Value out of range``) and n2 flapped at its peers."""

from __future__ import annotations

import asyncio
import time

import pytest

from coterie.node.peering.claims import MAX_INCARNATION, STRIKE_LIMIT
from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.messages import ALIVE, DEAD, SUSPECT, Beat, MemberUpdate
from tests.nodeproc import CertifiedPeer, NodeProc, tiny_learner, wait_for

pytestmark = pytest.mark.slow


class Mallory(CertifiedPeer):
    """A certified insider that gossips lies in its own (authenticated) heartbeats."""

    async def beat(self, updates, incarnation: int = 1) -> Beat:
        reply, _ = await self.client.heartbeat(
            self.target.address,
            Beat(self.node_id, 0, 0, time.time(), incarnation, tuple(updates)),
            timeout=5,
            peer=self.target.node_id,
        )
        return reply


def _falls(node: NodeProc, node_id: str) -> int:
    """How often ``node`` logged ``node_id`` leaving ALIVE (its membership logs transitions)."""
    text = (node.dir / "node.log").read_text(errors="replace")
    return sum(text.count(f"peer {node_id}: alive -> {s}") for s in (SUSPECT, DEAD))


def _peer(node: NodeProc, node_id: str) -> dict:
    return next(p for p in node.get("/peers") if p["node_id"] == node_id)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("members")
    base = {"strategy": "local", "round_interval_s": 0.3}
    n1 = NodeProc(root, "n1", {**base, "learner": tiny_learner(2, 0)}).start()
    n2 = NodeProc(root, "n2", {**base, "learner": tiny_learner(2, 1), "peers": [n1.address]}).start()
    wait_for(
        lambda: _peer(n1, "n2")["state"] == ALIVE and any(p["node_id"] == "n1" for p in n2.get("/peers")),
        30,
        "n1 and n2 to know each other",
    )
    yield root, n1, n2
    n2.stop()
    n1.stop()


def test_a_repeated_death_claim_is_checked_not_believed_and_mutes_its_source(pair):
    """Mallory tells n1 "n2 is DEAD" (at n2's current incarnation, so the claim wins on SWIM's
    precedence) every 0.5 s for 10 s. n1 probes n2 itself, n2 answers: n2 stays alive at n1 in
    every poll and keeps being heard from; each refuted claim is a strike against Mallory, and
    past the limit its claims are dropped unread."""
    root, n1, n2 = pair
    falls = _falls(n1, "n2")

    async def go() -> list[dict]:
        m = Mallory(root, n1, "mallory")
        polls = []
        try:
            await m.join()
            end = time.monotonic() + 10
            while time.monotonic() < end:
                inc = _peer(n1, "n2")["incarnation"]
                await m.beat(
                    [MemberUpdate("n2", n2.address, inc, DEAD), MemberUpdate("n2", n2.address, inc, SUSPECT, "mallory")]
                )
                polls.append(_peer(n1, "n2"))  # at once, and half a period on
                await asyncio.sleep(0.5)
                polls.append(_peer(n1, "n2"))
            return polls
        finally:
            await m.close()

    polls = asyncio.run(go())
    states = [p["state"] for p in polls]
    assert states.count(ALIVE) == len(states), states
    assert _falls(n1, "n2") == falls, n1.log_tail(40)  # not even briefly (n2 refuting at once)
    assert max(p["last_seen_s"] for p in polls[len(polls) // 2 :]) < 3.0, polls  # still in contact
    ms = n1.status()["membership"]
    strikes = ms["claim_strikes"]["mallory"]
    assert strikes["strikes"] >= STRIKE_LIMIT and strikes["dropped"] > 0 and strikes["muted"], strikes
    assert ms["claims_checked"] >= 1 and ms["claims_dropped"] > 0, ms
    assert 'coterie_rejected_total{kind="membership_claim"}' in n1.get_text("/metrics")
    assert any("mallory" in p["peer"] and "dropped" in p["message"] for p in n1.status()["problems"])
    print(f"n2 alive at n1 in {states.count(ALIVE)}/{len(states)} polls; mallory: {strikes}")


def test_a_suspicion_at_2_64_minus_1_is_refused_and_the_subject_keeps_beating(pair):
    """Mallory tells n2 itself, and n1, that n2 is suspect at incarnation 2^64 − 1. n2 refuses
    to outbid it (no 2^64, no overflow), n1 refuses it as an absurd jump; n2 keeps answering
    heartbeats — Mallory's own and n1's — and never leaves ALIVE at n1."""
    root, n1, n2 = pair
    before = n2.status()["membership"]
    falls = _falls(n1, "n2")

    async def go() -> tuple[list[str], list[Beat]]:
        m1, m2 = Mallory(root, n1, "mallory2"), Mallory(root, n2, "mallory2")
        states, replies = [], []
        try:
            await m1.join()
            await m2.join()
            bomb = MemberUpdate("n2", n2.address, 2**64 - 1, SUSPECT, "mallory2")
            for _ in range(3):
                replies.append(await m2.beat([bomb]))
                await m1.beat([bomb, MemberUpdate("n2", n2.address, 2**64 - 1, DEAD)])
            end = time.monotonic() + 6
            while time.monotonic() < end:  # n2 keeps answering, n1 keeps it alive
                replies.append(await m2.beat([]))
                states.append(_peer(n1, "n2")["state"])
                await asyncio.sleep(0.3)
            return states, replies
        finally:
            await m1.close()
            await m2.close()

    states, replies = asyncio.run(go())
    after = n2.status()["membership"]
    assert all(r.incarnation == before["incarnation"] for r in replies), (before["incarnation"], replies[-1])
    assert after["incarnation"] < MAX_INCARNATION and after["incarnation"] == before["incarnation"]
    assert after["claim_strikes"]["mallory2"]["strikes"] >= 3, after["claim_strikes"]
    assert n1.status()["membership"]["claim_strikes"]["mallory2"]["strikes"] >= 1
    assert states and set(states) == {ALIVE}, states
    assert _falls(n1, "n2") == falls, n1.log_tail(40)
    assert _peer(n1, "n2")["incarnation"] < MAX_INCARNATION
    for node in (n1, n2):
        assert "out of range" not in node.log_tail(400), node.log_tail(40)


def test_an_insider_cannot_claim_an_absurd_incarnation_for_itself(pair):
    """Mallory's own heartbeat says its incarnation is 2^64 − 1: authenticated, but impossible.
    n1 still answers it, does not believe the incarnation (so nothing it gossips about Mallory
    can overflow a +1), and counts it against Mallory."""
    root, n1, _ = pair

    async def go() -> Beat:
        m = Mallory(root, n1, "mallory3")
        try:
            await m.join()
            await m.beat([], incarnation=2**64 - 1)
            return await m.beat([], incarnation=2**64 - 1)
        finally:
            await m.close()

    reply = asyncio.run(go())
    assert reply.node_id == "n1"
    assert _peer(n1, "mallory3")["incarnation"] < MAX_INCARNATION
    assert n1.status()["membership"]["claim_strikes"]["mallory3"]["strikes"] >= 2


def test_the_heartbeat_of_a_peer_nobody_handshook_is_still_refused(pair):
    """The claim checks sit behind the door: an unknown caller is refused before any is read."""
    root, n1, _ = pair

    async def go():
        m = Mallory(root, n1, "stranger")
        try:
            with pytest.raises(PeerCallError) as err:
                await m.beat([MemberUpdate("n2", "", 1, DEAD)])
            return err.value
        finally:
            await m.close()

    assert asyncio.run(go()).kind == "unknown_peer"
