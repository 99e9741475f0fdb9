"""How much of the network a node has met, for collaborator discovery's re-explore rule
(``discovery.reexplore_after``).

The peers that enter a node's partial view are a sample of the network (shuffles bring them), so
the share of them the node had already evaluated estimates the share of the network it has
evaluated. While most of it is unmet, a blind draw meets more mates than a second look at a peer
scored low once (1,000 nodes, clean signal: a fixed re-explore slot cost ~40% of the mates); once
most is met, a second look is what finds a mate weighted rarely (100 nodes;
bench/results/scale.md). State is O(view)."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable


class Coverage:
    def __init__(self, me: str, after: float, window: int):
        if not 0.0 <= after <= 1.0:
            raise ValueError(f"discovery reexplore_after {after}: expected a share in [0, 1]")
        if window < 1:
            raise ValueError(f"discovery coverage_window {window}: expected at least 1")
        self.me, self.after, self.window = me, after, window
        self.share = 0.0  # running mean over the last ``window`` peers newly in view
        self._n = 0  # peers newly in view counted
        self._view_before: set[str] | None = None
        self._reexploring: bool | None = None  # ``reexploring()``, cached until the view or scores change

    def on_round(self, view: Iterable[str], scored: Container[str]) -> None:
        """Count the peers that entered ``view`` (mine: I am skipped) since the last round: O(view)."""
        self._reexploring = None
        view = [p for p in view if p != self.me]
        if self._view_before is not None:  # the first view: no arrivals to count yet
            # in the view's order, not a set's: the estimate must not depend on string hashing
            for p in (p for p in view if p not in self._view_before):
                self._n += 1
                self.share += ((p in scored) - self.share) / min(self._n, self.window)
        self._view_before = set(view)

    def on_scores(self) -> None:
        self._reexploring = None  # new scores: the view may hold no unmet peer now

    def reexploring(self, view: Callable[[], Iterable[str]], scored: Container[str]) -> bool:
        """Whether peers scored low on few evaluations get another look now: once the share met
        reaches ``after``, or while the view holds no peer never evaluated (nothing new to meet;
        an empty view too)."""
        if self._reexploring is None:
            self._reexploring = self.share >= self.after or all(p in scored for p in view() if p != self.me)
        return self._reexploring
