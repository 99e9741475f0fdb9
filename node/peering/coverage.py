"""How much of the network a node has met, for collaborator discovery's re-explore rule
(``discovery.reexplore_after``).

The peers that enter a node's partial view are a sample of the peers *outside* it (shuffles bring
them), so the share of them the node had already evaluated estimates the share evaluated out
there, and from it how many peers are out there: the scored ones not in view over that share. The
view itself is known exactly. So the share of the network evaluated is

    scored / (view + scored outside the view / share of arrivals scored)

(the scored outside counted as each peer arrived, as its chance of being scored was).

Taking the arrivals' share alone for the network's (the first version) read low wherever the view
is a large part of the network — a node draws its peers from its view, so what it evaluated is in
its view more than out of it: at 100 nodes (view ~56 of 99) 0.11 when it had evaluated 0.37 of the
network (round 10), and the rule turned on 5-10 rounds late. While most of it is unmet, a blind draw meets more mates than a second look at a peer
scored low once (1,000 nodes, clean signal: a fixed re-explore slot cost ~40% of the mates); once
most is met, a second look is what finds a mate weighted rarely (100 nodes;
bench/results/scale.md). State is O(view)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable


class Coverage:
    def __init__(self, me: str, after: float, window: int):
        if not 0.0 <= after <= 1.0:
            raise ValueError(f"discovery reexplore_after {after}: expected a share in [0, 1]")
        if window < 1:
            raise ValueError(f"discovery coverage_window {window}: expected at least 1")
        self.me, self.after, self.window = me, after, window
        self.share = 0.0  # the share of the network evaluated (estimated at each round)
        # over peers newly in view (exponential memory of ``window``): the peers I had scored
        # outside my view when each arrived, and the arrivals I had scored
        self._scored_outside = 0.0
        self._arrivals_scored = 0.0
        self._arrivals = 0.0  # all arrivals, with the same memory
        self._view_before: set[str] | None = None
        self._reexploring: bool | None = None  # ``reexploring()``, cached until the view or scores change

    def on_round(self, view: Iterable[str], scored: Collection[str]) -> None:
        """Count the peers that entered ``view`` (mine: I am skipped) since the last round, and
        estimate the share of the network ``scored`` covers: O(view)."""
        self._reexploring = None
        view = [p for p in view if p != self.me]
        if self._view_before is not None:  # the first view: no arrivals to count yet
            # each arrival was a draw from outside my view as it was: scored with chance (scored
            # outside it) / (peers outside it), so sum(scored outside) / sum(arrivals scored)
            # estimates the peers outside — the scored counted when each arrived, as the share is
            # (a share of arrivals against today's count lagged: 0.22 for 0.33 at 100 nodes)
            outside = len(scored) - sum(p in scored for p in self._view_before) - (self.me in scored)
            keep = 1.0 - 1.0 / self.window  # the sums run over about the last ``window`` arrivals
            # in the view's order, not a set's: the estimate must not depend on string hashing
            for p in (p for p in view if p not in self._view_before):
                self._scored_outside = keep * self._scored_outside + outside
                self._arrivals_scored = keep * self._arrivals_scored + (p in scored)
                self._arrivals = keep * self._arrivals + 1.0
        self._view_before = set(view)
        # no arrival met yet: the network may be any size; and a ratio over a handful of arrivals
        # is not evidence (a node that just joined, one of its first arrivals one it had scored:
        # it read ~a view's worth of network and re-explored having met 2 % of 1,000 nodes)
        if self._arrivals_scored <= 0.0 or self._arrivals < self.window / 3:
            self.share = 0.0
        else:
            network = len(self._view_before) + self._scored_outside / self._arrivals_scored
            self.share = min(1.0, len(scored) / network)

    def on_scores(self) -> None:
        self._reexploring = None  # new scores: the view may hold no unmet peer now

    def reexploring(self, view: Callable[[], Iterable[str]], scored: Container[str]) -> bool:
        """Whether peers scored low on few evaluations get another look now: once the share met
        reaches ``after``, or while the view holds no peer never evaluated (nothing new to meet;
        an empty view too)."""
        if self._reexploring is None:
            self._reexploring = self.share >= self.after or all(p in scored for p in view() if p != self.me)
        return self._reexploring
