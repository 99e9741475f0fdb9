"""``NodeNetwork``: the ``PeerNetwork`` a strategy sees — the requesting side of the peer plane.

This is the one place where strategy requests become transport calls. Every failure (timeout,
dead peer, refusal, a snapshot that fails validation) is logged, noted and turned into ``None``,
so a strategy simply carries on without that peer. Its concerns live in their own modules:

- ``calls.py``: per-peer deadlines and the round's exchange phase (``exchange_phase``), so a round
  goes on with the peers that answered; a call to a peer that turns suspect or dead meanwhile is
  abandoned at once; suspect and dead peers are not called at all; a call that times out asks
  membership to probe that peer now;
- ``subscriptions.py``: a peer with a small model that a strategy pulls round-aligned again is
  subscribed to (``watch_snapshots``), and pulls are served from the cache;
- ``requests.py``: compute requests on peers' data and gossip, each naming a purpose
  (``privacy/purposes.py``), and ``private_gradient``, the door my own gradients leave through
  (an object the network holds; its methods are the network's).

Here: the views of the peer table, snapshot pulls, and snapshot validation (architecture,
finiteness; in a worker thread for a large model, over tensors that are views of the received
buffer), written once for pulled and pushed snapshots."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..offload import OFF_LOOP_BYTES
from ..privacy.mechanisms import PrivateData
from ..strategies.base import PeerSnapshot
from ..wire.codec import Groups, WireError, encoded_size
from ..wire.folding import Encoded
from .calls import PeerCalls
from .deadlines import Phase, RoundPace
from .discovery import Discovery
from .errors import PeerCallError
from .inbox import PushInbox
from .interfaces import PeerTransport
from .messages import LocalSnapshot, SnapshotHeader
from .overlay import Overlay
from .peer_table import ALIVE, DEAD, SUSPECT
from .problems import ProblemLog
from .releases import PeerReleases, is_privacy_refusal
from .requests import PeerRequests
from .snapshots import SnapshotCache
from .subscriptions import Subscriptions
from .validation import Spec, snapshot_groups

COLLABORATORS = "discovery:collaborators"  # the source membership's candidates name for a recalled collaborator
log = logging.getLogger("coterie.node.network")


@dataclass(frozen=True)
class NetworkSettings:
    """What the requesting side knows of this node: its id, its labels, the architecture every
    received snapshot is checked against, and whether it subscribes to peers' snapshots."""

    node_id: str
    spec: Spec
    labels: dict[str, str] = field(default_factory=dict)
    watch: bool = True  # subscribe where the transport can (else every snapshot is pulled)


class NodeNetwork:
    def __init__(
        self,
        settings: NetworkSettings,
        transport: PeerTransport,
        calls: PeerCalls,
        cache: SnapshotCache,
        inbox: PushInbox,
        published: Callable[[], LocalSnapshot | None],
        private: PrivateData,
        problems: ProblemLog,
    ):
        """``calls``: the peer table, deadlines and timeouts every call runs under (``calls.py``);
        ``published``: this node's latest snapshot; ``private``: the door my own gradients leave
        through; ``problems``: where every failed or refused call is noted."""
        self.node_id = settings.node_id
        self.transport = transport
        self.calls = calls
        self.table = peers = calls.table
        self.request_timeout_s = calls.request_timeout_s
        self.cache = cache
        self.inbox = inbox
        self.published = published
        self.spec = settings.spec
        self.labels = settings.labels
        self.problems = problems
        self.private = private  # my own gradients leave through it too
        self.releases = PeerReleases()  # what peers released to me (releases.py)
        self.pace = RoundPace()  # how long my rounds take (a table past the threshold keeps callers that long)
        self._addresses: dict[str, str] = {}  # discovery's collaborators' last known addresses
        # snapshot subscriptions: a transport without them is pulled from only
        self.subscriptions = Subscriptions(
            self, calls, enabled=settings.watch and hasattr(transport, "watch_snapshots")
        )
        self.requests = PeerRequests(
            self.node_id,
            transport,
            calls,
            inbox,
            published,
            self.spec,
            private,
            self.releases,
            problems,
            address_of=self._address,
            failed=self._failed,
        )
        # compute on peers' data and gossip (requests.py), as the PeerNetwork a strategy sees
        req = self.requests
        self.cross_loss, self.cross_gradient, self.private_gradient = (
            req.cross_loss,
            req.cross_gradient,
            req.private_gradient,
        )
        self.push_gradient, self.drain_pushed, self.gossip = req.push_gradient, req.drain_pushed, req.gossip
        self.releases_noised = req.releases_noised
        peers.listeners.append(self._on_state)
        # past ``discovery_above`` alive peers, a strategy's candidates come from discovery
        self.discovery: Discovery | None = None
        self.discovery_above = 0
        # a recommended peer this node does not know yet: (recommender, node id, address) to
        # membership's bounded candidates, so it can be handshaken and then explored
        self.introduce: Callable[[str, str, str], None] = lambda source, node_id, address: None
        self.overlay: Overlay | None = None  # partial views past the threshold (overlay.py)
        # whether membership runs on the views (view_scope.py, a latch); then discovery runs
        self.partial: Callable[[], bool] | None = None

    # --- deadlines (calls.py) ---
    def exchange_phase(self) -> AbstractContextManager[Phase]:
        """Around a round: its peer calls share one deadline, counted from the first call."""
        return self.calls.exchange_phase()

    def _on_state(self, node_id: str, old: str, new: str) -> None:
        if new in (SUSPECT, DEAD):  # abandon what is in flight to it: the round goes on without it
            self.calls.abandon(node_id)
            self.subscriptions.end(node_id)

    async def _validated(self, peer: str, header: SnapshotHeader, groups: Groups) -> PeerSnapshot:
        """A received snapshot of ``peer``, once its architecture and finiteness are checked (a
        whole model: a large one in a worker thread)."""
        what = f"snapshot v{header.version} of {peer}"
        params, extras = (
            await asyncio.to_thread(snapshot_groups, groups, self.spec, what)
            if encoded_size(groups) > OFF_LOOP_BYTES
            else snapshot_groups(groups, self.spec, what)
        )
        return PeerSnapshot(peer, header.version, header.round, params, extras, header.digest)

    # --- views ---
    def peers(self) -> list[str]:
        """Alive peers, less those whose last call timed out with no sign of life since; past
        the discovery threshold, this round's candidates among them (``discovery.py``)."""
        alive = [p for p in self.table.alive() if self._responsive(p)]
        if not self.discovering(len(alive)):
            return alive
        usable = set(alive)
        assert self.discovery is not None
        if not self.discovery.current():  # the threshold was crossed mid-round: pick them now
            self.discovery.begin_round()
        return [p for p in self.discovery.current() if p in usable]

    # --- discovery (a round's candidates, past the threshold) ---
    def discovering(self, alive: int | None = None) -> bool:
        if self.discovery is not None and self.partial is not None:
            return self.partial()
        n = len(self.table.alive()) if alive is None else alive
        return self.discovery is not None and n > self.discovery_above

    def begin_round(self) -> None:
        self.pace.tick()
        if self.discovering() and self.discovery is not None:
            self._recall_collaborators()
            self.discovery.begin_round()

    def _recall_collaborators(self) -> None:
        """A collaborator the table forgot comes back through a handshake at its last address.
        Past the threshold a suspect outside the active view is forgotten at once, and under load
        one timed-out call makes a suspect: a found mate was then never offered again (it is no
        longer callable, and nothing but the views or a hint brought it back — 100 daemons,
        run 8: 8 nodes kept a mate as a collaborator and pulled none in their last 5 rounds)."""
        assert self.discovery is not None
        kept = self.discovery.collaborators(self.discovery.s.candidates)
        for p in kept:
            address = self._addresses.get(p)
            if p not in self.table.records and address:
                self.introduce(COLLABORATORS, p, address)
        # the address book holds the collaborators, whose addresses the table may drop
        self._addresses = {p: a for p in kept if (a := self._address_of(p) or self._addresses.get(p))}

    def _address_of(self, peer: str) -> str | None:
        rec = self.table.records.get(peer)
        return rec.address if rec is not None else None

    def discovery_view(self) -> dict[str, Any]:
        """For ``/status`` and metrics: whether discovery supplies the candidates, and its state."""
        d = self.discovery
        if d is None:
            return {"active": False}
        return {
            "active": self.discovering(),
            "above": self.discovery_above,
            # membership on the views past the threshold (view_scope.py), else on every member
            "membership": "views" if self.partial is not None and self.partial() else "full",
            "candidates": d.current(),
            "collaborators": d.collaborators(5),
            "hints": len(d.hints),
            "scored": len(d.scores),
            # calls refused as from a stranger (a peer that forgot this node) and what came of them
            "reintroductions": dict(self.calls.reintroductions),
            **vars(d.counters),
            **({"views": self.overlay.counts()} if self.overlay is not None else {}),
        }

    def roles(self) -> dict[str, dict[str, Any]]:
        """Per peer, past the threshold: the overlay view it is in (``view``: "active" or
        "passive"), and whether discovery offers it to the strategy this round (``candidate``)
        and counts it a collaborator (``collaborator``). Empty below the threshold."""
        out: dict[str, dict[str, Any]] = {}
        if self.overlay is not None and self.partial is not None and self.partial():
            view = self.overlay.view
            for name, members in (("passive", view.passive), ("active", view.active)):
                for p in members:
                    out.setdefault(p, {})["view"] = name
        d = self.discovery
        if d is not None and self.discovering():
            for p in d.current():
                out.setdefault(p, {})["candidate"] = True
            for p in d.collaborators(len(d.scores)):
                out.setdefault(p, {})["collaborator"] = True
        return out

    async def end_round(self, weights: dict[str, float], contacted) -> None:
        """The strategy's weights feed discovery; then a few of my best collaborators are asked
        whom they weight (hints for the next rounds)."""
        if not self.discovering() or self.discovery is None:
            return
        d = self.discovery
        d.observe(weights, [p for p in (contacted or ()) if isinstance(p, str)])
        for p in d.collaborators(d.s.candidates):  # while the table still has them
            if (address := self._address_of(p)) is not None:
                self._addresses[p] = address
        asked = d.whom_to_ask()
        replies = await asyncio.gather(*(self.requests.recommend(peer, d.s.recommend) for peer in asked))
        for peer, entries in zip(asked, replies, strict=True):
            addresses = {e.node_id: e.address for e in entries or ()}
            for p in d.on_recommendations(peer, list(addresses)):  # those discovery kept (bounded)
                if p not in self.table.records:
                    self.introduce(peer, p, addresses[p])

    def known_peers(self) -> list[str]:
        return self.table.known()

    def true_cluster(self, node_id: str) -> int | None:
        labels = self.labels if node_id == self.node_id else getattr(self.table.records.get(node_id), "labels", {})
        raw = (labels or {}).get("cluster")
        return int(raw) if raw not in (None, "") else None

    def cached(self, peer: str) -> PeerSnapshot | None:
        return self.cache.get(peer)

    def release(self, peer: str) -> None:
        self.cache.drop(peer)

    def _responsive(self, peer: str) -> bool:
        return self.calls.responsive(peer)

    def _address(self, peer: str) -> str | None:
        """Where to call ``peer``; None for a suspect or dead one, or one whose last call timed
        out and which has not shown a sign of life since (membership is probing it): such a peer
        is not waited for twice."""
        rec = self.table.records.get(peer)
        return rec.address if rec is not None and rec.state == ALIVE and self._responsive(peer) else None

    def _failed(self, what: str, peer: str, err: Exception) -> None:
        rejected = isinstance(err, WireError)
        if what.startswith("cross-") and is_privacy_refusal(str(err)):
            self.releases.refused(peer, str(err))
        log.warning("%s %s with %s: %s", what, "refused" if rejected else "failed", peer, err)
        self.problems.note(peer, f"{what}: {err}", rejected=rejected)

    # --- snapshots ---
    async def pull(
        self, peer: str, *, min_round: int | None = None, wait_s: float | None = None, lazy: bool = False
    ) -> PeerSnapshot | None:
        """The peer's latest snapshot (from cache if its version did not change). With
        ``min_round``: one of round >= min_round, the peer holding the call open up to ``wait_s``
        (default: the request timeout) until it publishes it; None if it does not in time.
        ``lazy``: its tensors may stay encoded, validated all the same (``PeerNetwork.pull``);
        such a snapshot is not cached (only ``add_to_params`` can use it)."""
        address = self._address(peer)
        if address is None:
            return None
        cached = self.cache.get(peer)
        if min_round and cached is not None and cached.round >= min_round:
            return cached
        if self.subscriptions.serves(peer, address, cached, bool(min_round)) and cached is not None:
            return await self.subscriptions.from_watch(peer, cached, min_round, wait_s)
        wait = (self.request_timeout_s if wait_s is None else max(0.0, wait_s)) if min_round else 0.0
        try:
            header, groups = await self.calls.call(
                peer,
                "snapshot",
                lambda timeout: self.transport.get_snapshot(
                    address,
                    self.node_id,
                    cached.version if cached else 0,
                    min_round=min_round or 0,
                    wait_s=wait,
                    timeout=timeout,
                    peer=peer,
                    **({"lazy": True} if lazy else {}),  # (a transport that knows no lazy pulls decodes)
                ),
                wait_s=wait,
            )
            if header.node_id != peer:
                raise WireError(f"snapshot claims to be from {header.node_id!r}, expected {peer!r}")
            if groups is None:
                snap = cached
            else:
                snap = await self._validated(peer, header, groups)
        except (PeerCallError, WireError) as e:
            self._failed("snapshot pull", peer, e)
            return None
        if snap is None:
            return None
        if not any(isinstance(t, Encoded) for ts in (snap.params, *snap.extras.values()) for t in ts.values()):
            self.cache.put(snap)  # (an encoded one is its caller's alone: nothing else could use it)
        self.table.seen(peer, version=snap.version)
        if min_round and snap.round < min_round:
            return None  # it did not reach that round in time: proceed without it
        return snap

    async def close(self) -> None:
        """End the subscriptions (at shutdown)."""
        await self.subscriptions.close()
