"""Membership past the size threshold: SWIM on the partial views (issue 32), so that what a node
holds and sends per period is bounded by its views (O(log N)), not by N.

Below the threshold membership is full (every member probed in turn, push-pull of the whole
table). Once a node has seen more than ``above`` members alive it switches for good (a latch:
the table it then prunes would otherwise fall back under the threshold and refill by push-pull,
back and forth), or sooner where members it has been told of and not yet met take it past
(``ViewScope.partial``), and ``MembershipState`` asks this scope:

- failure detection probes the active view only (``neighbours``); a neighbour membership
  suspects is replaced from the passive view at once, as HyParView replaces a failed link, and
  forgotten (a suspicion nobody here can settle declares nobody dead);
- no push-pull, and hearsay (piggybacked news of unknown members, handshake samples) makes no
  handshake candidates: the views alone decide whom a node knows;
- the table holds what ``keep`` names — the views' nodes, those the overlay is calling, and what
  the node is exchanging with (discovery's candidates and collaborators) — plus the nodes heard
  from within a grace period (``membership_state.PRUNE_GRACE_PERIODS``); the rest is forgotten;
- a node the overlay calls that the table does not hold is handshaken first (``introduce``):
  Link and Shuffle are known-peer calls, and a forgotten peer comes back only that way."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .handshakes import Handshakes
from .messages import ALIVE, DEAD, SUSPECT
from .overlay import Overlay
from .partial_view import Disconnect
from .peer_table import PeerTable

HEARSAY_SHARE = 4  # one source's named members count for at most above / HEARSAY_SHARE


class ViewScope:
    """``overlay``'s views as membership's scope once ``peers`` holds more than ``above`` alive
    members (``partial_from_start``: at once — a node bootstrapped straight into a large
    network's views); ``also_keep``: the peers a node is exchanging with beyond its views;
    ``hold_s``: how long a member heard from is held beyond membership's own grace."""

    def __init__(
        self,
        overlay: Overlay,
        peers: PeerTable,
        handshakes: Handshakes,
        *,
        above: int,
        also_keep: Callable[[], Iterable[str]] = tuple,
        hold_s: Callable[[], float] = lambda: 0.0,
        partial_from_start: bool = False,
    ):
        self.overlay = overlay
        self.peers = peers
        self.handshakes = handshakes
        self.above = above
        self.also_keep = also_keep
        self.hold_s = hold_s  # how long a caller outside ``keep`` is held at least (its grace)
        self._partial = partial_from_start
        self._heard = (-1, 0)  # (the candidates' change count, members named and not yet met)
        self.replaced = 0  # neighbours declared dead by membership, replaced from the passive view
        self.dropped_candidates = 0  # handshake candidates from hearsay dropped at the switch
        overlay.introduce = self.introduce
        overlay.keepalives = False  # the overlay ticks only past the threshold: SWIM probes its neighbours
        peers.listeners.append(self._on_state)

    def partial(self) -> bool:
        if not self._partial:
            alive = self.peers.counts()[ALIVE]
            # the members named to it and not yet met count too: a node joining a large network
            # would otherwise handshake ``above`` of them one by one before switching (~200 each
            # at start-up, 38 handshakes a node-round in bench/results/scale.md's profile). One
            # peer's word moves the count by a quarter of the threshold at most: an insider
            # naming made-up members cannot switch a small network's node on its own.
            pending = self.handshakes.state.pending
            if self._heard[0] != pending.changes:  # (asked at every message: derived once a change)
                self._heard = (pending.changes, pending.heard_of(per_source=max(1, self.above // HEARSAY_SHARE)))
            self._partial = alive > self.above or alive + self._heard[1] > self.above
            if self._partial:  # what full membership's hearsay queued: the views decide now. Left,
                # they were handshaken for rounds after the switch (300 in-process nodes: 15,095
                # of the 24,071 handshakes made on the views), each a member the table then prunes
                self.dropped_candidates = pending.drop_unpinned()
        return self._partial

    def neighbours(self) -> list[str]:
        return list(self.overlay.view.active)

    def keep(self) -> set[str]:
        return self.overlay.held() | set(self.also_keep())

    def grace_s(self) -> float:
        return self.hold_s()

    async def introduce(self, node_id: str, address: str, timeout: float | None = None) -> bool:
        """Handshake ``node_id`` at ``address``: both tables hold the other after it (and the
        handshake, not hearsay, says who is there). True when ``node_id`` is known alive now."""
        if not await self.handshakes.contact(address, timeout):
            return False
        rec = self.peers.records.get(node_id)
        return rec is not None and rec.state == ALIVE and rec.address == address

    def _on_state(self, node_id: str, old: str, new: str) -> None:
        """HyParView replaces a neighbour whose link failed at once: here, once membership
        suspects it. It moves to the passive view (a live one may be promoted again later) and
        the table forgets it at the next period (``MembershipState.prune``: nobody probes a
        node outside the active view, so nobody here could settle the suspicion — and nobody
        declares it dead); one that died meanwhile leaves both views."""
        if not self._partial:
            return
        view = self.overlay.view
        if new == SUSPECT and node_id in view.active:
            self.replaced += 1
            view.on_message(node_id, Disconnect())  # to the passive view; a passive node asked in
        elif new == DEAD and (node_id in view.active or node_id in view.passive):
            self.replaced += node_id in view.active
            view.on_failed(node_id)
