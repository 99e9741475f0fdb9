"""The budget of decoded peer bases a requester keeps for deltas (``HeldVersions``,
``snapshots.bases_mb``): bounded whatever the number of peers, slots kept by the peers pulled
round after round (D-PSGD pulls every neighbour each round: least recently used eviction would
drop each base before its next use), a slot unused for two rounds of every peer given up, pinned
copies (a request in flight) kept whatever the budget."""

from __future__ import annotations

import pytest
import torch

from coterie.node.transport.served_versions import Held, HeldVersions

MODEL = 1000 * 4  # bytes of one decoded model below


def _held(version: int, peer: str = "") -> Held:
    return Held(version, f"{peer}-v{version}", {"params": {"w": torch.full((1000,), float(version))}})


def _round_robin(held: HeldVersions, peers: list[str], version: int) -> None:
    for p in peers:
        held.put(p, _held(version, p))
        assert held.counted() <= held.budget, (p, version, held.counted())


def test_more_peers_than_the_budget_holds_are_bounded_and_the_first_keep_their_slots():
    held = HeldVersions(2 * MODEL)
    peers = [f"p{i}" for i in range(7)]
    for v in range(1, 6):
        _round_robin(held, peers, v)
        assert [p for p in peers if held.get(p) is not None] == ["p0", "p1"]  # the same two every round
        assert held.get("p0").version == v  # their newest, the base of their next delta
    assert held.not_kept == 5 * 5


def test_least_recently_used_eviction_would_keep_no_useful_base():
    """Why the slots are sticky: pulled in turn, each peer's base would be gone by its next pull."""
    held = HeldVersions(2 * MODEL)
    peers = [f"p{i}" for i in range(4)]
    hits = 0
    for v in range(1, 5):
        for p in peers:
            hits += held.get(p) is not None and held.get(p).version == v - 1
            held.put(p, _held(v, p))
    assert hits == 2 * 3  # p0, p1 found their base in rounds 2-4 (LRU: 0)


def test_a_slot_unused_for_two_rounds_of_every_peer_goes_to_a_newcomer():
    held = HeldVersions(2 * MODEL)
    _round_robin(held, ["a", "b", "c"], 1)  # a, b hold the slots
    for v in range(2, 6):  # a is no longer pulled; b and c are
        _round_robin(held, ["b", "c"], v)
    assert held.get("a") is None and held.get("c") is not None and held.get("b") is not None


def test_a_pinned_copy_is_kept_over_the_budget_until_unpinned():
    held = HeldVersions(MODEL)
    held.put("a", _held(1, "a"))
    held.put("w", _held(1, "w"), pin=True)  # a watch's last: its next delta is against it
    assert held.get("w") is not None and held.get("a") is None  # the unpinned one made room
    held.put("x", _held(1, "x"), pin=True)
    assert held.get("w") is not None and held.get("x") is not None  # over the budget while pinned
    held.unpin("x", 1, "x-v1")
    held.unpin("w", 1, "w-v1")
    assert held.counted() <= MODEL


def test_a_base_pinned_by_a_pull_in_flight_survives_other_peers_and_its_successor_is_counted_once():
    held = HeldVersions(2 * MODEL)
    _round_robin(held, ["a", "b"], 1)
    with held.keeping("a", held.get("a")):  # a pull of a named v1 as its base
        held.put("c", _held(1, "c"))  # no room for c: not kept
        held.put("a", _held(2, "a"))  # the answer
        assert held.find("a", 1, "a-v1") is not None and held.copies("a") == 2
        assert held.counted() == 2 * MODEL  # the older copy goes with the request: not counted
    assert held.copies("a") == 1 and held.get("a").version == 2 and held.get("c") is None


def test_by_default_a_small_models_peers_all_keep_a_base_and_a_large_ones_none():
    small = HeldVersions()  # 16 MiB of 4 KB models: every peer's base
    _round_robin(small, [f"p{i}" for i in range(20)], 1)
    assert len(small) == 20 and small.budget == 16 << 20
    large = HeldVersions()
    big = Held(1, "big", {"params": {"w": torch.zeros((16 << 20) // 4 + 1)}})  # one value over 16 MiB
    large.put("a", big)
    assert large.get("a") is None and not large.room_for("b")


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="bases budget must be >= 0 bytes"):
        HeldVersions(-1)
