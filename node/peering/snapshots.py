"""Snapshots on both sides: the one this node publishes, and the peers' it has pulled."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from ..offload import OFF_LOOP_BYTES
from ..strategies.base import PeerSnapshot
from ..wire.codec import encoded_size
from .messages import LocalSnapshot, SnapshotRef


class PublishBoard:
    """The snapshot this node currently serves. Pullers that asked for a round this node has not
    reached yet wait here (bounded by their own deadline) and wake up when it is published."""

    def __init__(self) -> None:
        self.current: LocalSnapshot | None = None
        self._published = asyncio.Event()  # set (and replaced) at every publish

    def publish(self, snap: LocalSnapshot) -> None:
        self.current = snap
        if encoded_size(snap.groups) <= OFF_LOOP_BYTES:
            snap.prepare()  # small: cheaper here than a thread hop
        else:
            try:  # encode and hash it in a worker thread now, before the first puller asks
                asyncio.get_running_loop().run_in_executor(None, snap.prepare)
            except RuntimeError:
                pass  # no loop (tests): the first reader prepares it
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
    requests may reference instead of re-sending a model), bounded by bytes: when over
    ``max_bytes`` the least recently used snapshots are dropped (a strategy then pulls again)."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._by_peer: OrderedDict[str, PeerSnapshot] = OrderedDict()
        self._size: dict[str, int] = {}
        self.bytes = 0
        self.evicted = 0

    @staticmethod
    def nbytes(snap: PeerSnapshot) -> int:
        return sum(t.numel() * t.element_size() for ts in (snap.params, *snap.extras.values()) for t in ts.values())

    def get(self, peer: str) -> PeerSnapshot | None:
        snap = self._by_peer.get(peer)
        if snap is not None:
            self._by_peer.move_to_end(peer)
        return snap

    def put(self, snap: PeerSnapshot) -> None:
        peer = snap.node_id
        if peer in self._by_peer:
            self.bytes -= self._size[peer]
        self._by_peer[peer] = snap
        self._by_peer.move_to_end(peer)
        self._size[peer] = self.nbytes(snap)
        self.bytes += self._size[peer]
        while self.bytes > self.max_bytes and len(self._by_peer) > 1:
            old, _ = self._by_peer.popitem(last=False)
            self.bytes -= self._size.pop(old)
            self.evicted += 1

    def drop(self, peer: str) -> None:
        if self._by_peer.pop(peer, None) is not None:
            self.bytes -= self._size.pop(peer)

    def resolve(self, ref: SnapshotRef) -> PeerSnapshot | None:
        snap = self._by_peer.get(ref.node_id)
        if snap is not None and snap.version == ref.version and (not ref.digest or snap.sha256 == ref.digest):
            return snap
        return None

    def __contains__(self, peer: str) -> bool:
        return peer in self._by_peer

    def __len__(self) -> int:
        return len(self._by_peer)
