"""Snapshots on both sides: the one this node publishes, and the peers' it has pulled."""
from __future__ import annotations

import asyncio

from ..strategies.base import PeerSnapshot
from .messages import LocalSnapshot, SnapshotRef


class PublishBoard:
    """The snapshot this node currently serves. Pullers that asked for a round this node has not
    reached yet wait here (bounded by their own deadline) and wake up when it is published."""

    def __init__(self) -> None:
        self.current: LocalSnapshot | None = None
        self._published = asyncio.Event()  # set (and replaced) at every publish

    def publish(self, snap: LocalSnapshot) -> None:
        self.current = snap
        event, self._published = self._published, asyncio.Event()
        event.set()

    async def wait_for_round(self, min_round: int, timeout_s: float) -> LocalSnapshot | None:
        """The current snapshot once its round is >= ``min_round``, or whatever is current when
        ``timeout_s`` runs out (the caller decides what an older round means)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.current is None or self.current.round < min_round:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._published.wait(), left)
            except asyncio.TimeoutError:
                break
        return self.current


class SnapshotCache:
    """The latest snapshot pulled from each peer (what strategies mix, and what compute
    requests may reference instead of re-sending a model)."""

    def __init__(self) -> None:
        self._by_peer: dict[str, PeerSnapshot] = {}

    def get(self, peer: str) -> PeerSnapshot | None:
        return self._by_peer.get(peer)

    def put(self, snap: PeerSnapshot) -> None:
        self._by_peer[snap.node_id] = snap

    def resolve(self, ref: SnapshotRef) -> PeerSnapshot | None:
        snap = self._by_peer.get(ref.node_id)
        if snap is not None and snap.version == ref.version and (not ref.digest or snap.sha256 == ref.digest):
            return snap
        return None

    def __contains__(self, peer: str) -> bool:
        return peer in self._by_peer
