"""The peer table's alive → suspect → dead life cycle (driven by a controllable clock)."""
from __future__ import annotations

from coterie.node.peering import peer_table as membership
from coterie.node.peering.peer_table import ALIVE, DEAD, SUSPECT, PeerTable


def test_states_follow_silence_and_recover(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(membership.time, "monotonic", lambda: now[0])
    t = PeerTable("me", suspect_after_s=2, dead_after_s=5)
    t.upsert("a", "h:1")
    t.upsert("b", "h:2")
    assert t.alive() == ["a", "b"]
    now[0] += 3
    t.seen("b")
    assert t.refresh() == [("a", ALIVE, SUSPECT)]
    now[0] += 3
    t.seen("b")
    assert t.refresh() == [("a", SUSPECT, DEAD)]
    assert t.alive() == ["b"] and t.counts() == {ALIVE: 1, SUSPECT: 0, DEAD: 1}
    t.seen("a", round=7, version=8, rtt_s=0.01)
    assert t.records["a"].state == ALIVE and t.records["a"].round == 7
    t.refresh()
    assert t.alive() == ["a", "b"]


def test_restored_peers_start_dead_until_they_answer():
    t = PeerTable("me", 1, 2)
    t.load_json([{"node_id": "a", "address": "h:1", "labels": {"cluster": "1"}}])
    assert t.alive() == [] and t.records["a"].state == DEAD and t.records["a"].labels == {"cluster": "1"}
    t.upsert("a", "h:9")  # it came back on a new port
    assert t.alive() == ["a"] and t.records["a"].address == "h:9"
