"""Partial views (HyParView) in-process: bounded views, one component under churn, and an
insider's shuffles and forged joins bounded (each attack also run against a view without the
defence, where it succeeds)."""

from __future__ import annotations

import heapq
import random

from coterie.node.peering.overlay_sim import SimOverlay
from coterie.node.peering.partial_view import ForwardJoin, Neighbor, PartialView, Shuffle, ViewSettings


def _ids(n: int) -> list[str]:
    return [f"node-{i:05d}" for i in range(n)]


def _network(n: int, seed: int = 1, rounds: int = 10, **kw) -> SimOverlay:
    o = SimOverlay(_ids(n), ViewSettings.for_network(n, **kw), seed=seed)
    o.join_all()
    for _ in range(rounds):
        o.round()
    return o


def test_views_stay_bounded_by_log_n_and_the_overlay_is_connected():
    o = _network(300)
    s = ViewSettings.for_network(300)
    assert s.active_size == 10 and s.passive_size == 60  # log2(300) + 1, and 6x
    for v in o.views.values():
        assert 1 <= len(v.active) <= s.active_size
        assert len(v.passive) <= s.passive_size
        assert not set(v.active) & set(v.passive)
        assert v.me not in v.active and v.me not in v.passive
    # symmetric links: an active neighbour has me in its active view (joins and promotions are two-way)
    asym = sum(1 for v in o.views.values() for p in v.active if v.me not in o.views[p].active)
    assert asym <= 0.05 * sum(len(v.active) for v in o.views.values())
    assert len(o.components()) == 1
    # the passive view keeps being refreshed: shuffles ran everywhere
    assert all(v.counters.shuffles_sent >= 10 for v in o.views.values())


def test_killing_a_fifth_of_the_nodes_at_once_leaves_one_component():
    for seed in (1, 2, 3):
        o = _network(250, seed=seed)
        dead = set(random.Random(seed).sample(sorted(o.alive), 50))
        o.kill(dead)
        o.round()  # one period: the first probes and shuffles hit the dead
        comps = o.components()
        assert len(comps) == 1, [len(c) for c in comps]
        for _ in range(3 * o.views[next(iter(o.alive))].s.active_size):  # round-robin: each probed within 2 cycles
            o.round()
        assert len(o.components()) == 1
        for n in o.alive:  # dead neighbours are gone from active views, which are refilled
            assert not set(o.views[n].active) & dead
            assert len(o.views[n].active) >= 2


class NaiveView(PartialView):
    """A view without the insider defences: no per-source cap, random eviction."""

    def _evict(self) -> None:
        self._drop(self.rng.choice(list(self.passive)))


def _shuffle_attack(view: PartialView, clique: list[str], shuffles: int) -> float:
    """An insider (itself in the victim's active view) sends ``shuffles`` shuffles listing only
    its clique; the share of the victim's passive view the clique ends up holding."""
    rng = random.Random(0)
    for i in range(60):  # honest history: a full passive view from many sources
        view.on_message(f"honest-{i:03d}", Shuffle((f"honest-{i:03d}", *(f"h{i}-{k}" for k in range(7)))))
    view.on_message("insider", Neighbor(high_priority=False))
    for _ in range(shuffles):
        view.on_message("insider", Shuffle(tuple(rng.sample(clique, 8))))
        view.take_outbox()
    return sum(1 for p in view.passive if p in clique or p == "insider") / len(view.passive)


def test_an_insiders_shuffles_cannot_fill_the_passive_view_with_its_clique():
    s = ViewSettings(active_size=5, passive_size=30, per_source=4)
    clique = [f"sybil-{k:02d}" for k in range(40)]
    share = _shuffle_attack(PartialView("victim", s, random.Random(1)), clique, shuffles=50)
    assert share <= 4 / 30 + 1e-9  # at most per_source entries of hearsay from one sender
    naive = NaiveView("victim", ViewSettings(active_size=5, passive_size=30, per_source=10_000), random.Random(1))
    assert _shuffle_attack(naive, clique, shuffles=50) >= 0.8  # without the bound the clique takes it over


def test_forged_joins_only_reach_the_passive_view_and_an_identity_holds_one_active_slot():
    v = PartialView("victim", ViewSettings(active_size=4, passive_size=20, per_source=3), random.Random(2))
    for i in range(4):
        v.on_message(f"honest-{i}", Neighbor(high_priority=False))
    for k in range(30):  # the insider forwards joins of ids it made up, at the end of their walk
        v.on_message("insider", ForwardJoin(f"ghost-{k}", ttl=0))
    out = v.take_outbox()
    # the victim asked the ghosts themselves; none of them answered, so none is active
    assert {dst for dst, m in out if isinstance(m, Neighbor)} == {f"ghost-{k}" for k in range(30)}
    assert set(v.active) == {f"honest-{i}" for i in range(4)}
    for _ in range(20):  # repeated high-priority requests: one slot, however often asked
        v.on_message("insider", Neighbor(high_priority=True))
    assert sum(1 for p in v.active if p == "insider") == 1 and len(v.active) == 4
    # hearsay at the passive-walk hop is capped per sender
    for k in range(30):
        v.on_message("insider", ForwardJoin(f"ghost2-{k}", ttl=v.s.passive_walk))
    assert sum(1 for p in v.passive if p.startswith("ghost2-")) <= 3


def test_a_shuffle_longer_than_the_protocol_allows_is_truncated():
    s = ViewSettings(active_size=5, passive_size=100, per_source=100)
    v = PartialView("victim", s, random.Random(3))
    v.on_message("peer", Shuffle(tuple(f"x{k}" for k in range(500))))
    assert len(v.passive) == s.shuffle_length


class AuditedView(PartialView):
    """Checks every pick of "the oldest" against a scan of the ages (the rule as first written:
    max / nlargest over ``age``), so reading it off the view's order stays the same rule."""

    checked = 0

    def tick(self) -> None:
        ages = [e.age for e in self.passive.values()]
        assert ages == sorted(ages, reverse=True), "the passive view is not kept oldest first"
        oldest = max(self.passive, key=lambda p: self.passive[p].age + 1) if self.passive else None
        sent = len(self.outbox)
        super().tick()
        if oldest is not None:
            assert self.outbox[sent][0] == oldest
            AuditedView.checked += 1

    def _sample(self, exclude: str) -> tuple[str, ...]:
        want = heapq.nlargest(
            self.s.shuffle_passive, (p for p in self.passive if p != exclude), key=lambda p: self.passive[p].age
        )
        got = super()._sample(exclude)
        assert list(got[len(got) - len(want) :]) == want
        return got

    def _evict(self) -> None:
        most = max(self._placed.values())
        want = max(
            (n for n, e in self.passive.items() if self._placed[e.source] == most), key=lambda n: self.passive[n].age
        )
        super()._evict()
        assert want not in self.passive
        AuditedView.checked += 1


def test_the_oldest_passive_entry_is_read_off_the_views_order():
    # past saturation (300 nodes, passive views of 60): shuffles evict every period
    o = SimOverlay(_ids(300), ViewSettings.for_network(300), seed=4, view_factory=lambda i, s, r: AuditedView(i, s, r))
    o.join_all()
    for _ in range(15):
        o.round()
    dead = set(random.Random(4).sample(sorted(o.alive), 60))
    o.kill(dead)
    for _ in range(10):
        o.round()
    assert AuditedView.checked > 300 * 25  # every tick checked, and the evictions
    assert len(o.components()) == 1
