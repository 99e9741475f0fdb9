"""Snapshot subscriptions of the requesting side (``NodeNetwork.pull``'s fast path).

A peer pulled from round after round is subscribed to: it pushes each snapshot it publishes on
one long-lived stream (``transport.watch_snapshots``), and a pull reads the cache. A call a
round costs the most CPU of a small model's round (gRPC call set-up on both ends); a pushed
snapshot costs a fifth of that. Pushed snapshots are checked like pulled ones. A subscription
that fails or delivers a bad snapshot ends, and pulls take over for ``WATCH_RETRY_S``; one nobody
reads for ``WATCH_IDLE_S`` is closed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ..strategies.base import PeerSnapshot
from ..wire.codec import WireError
from .calls import PeerCalls
from .errors import PeerCallError


class Subscriptions:
    """The subscriptions of one ``NodeNetwork`` (``net``: its cache, table, transport, snapshot
    checks and pulls), one per peer at most; ``calls`` gives the round's exchange phase."""

    def __init__(self, net: Any, calls: PeerCalls, *, enabled: bool):
        self.net, self.calls = net, calls
        self.enabled = enabled  # the transport has them, and the node wants them
        self._watches: dict[str, asyncio.Task] = {}
        self._watch_news: dict[str, asyncio.Event] = {}  # set (and replaced) at each pushed snapshot
        self._pulled: dict[str, float] = {}  # peer -> when a strategy last asked for its snapshot
        self._watch_failed: dict[str, float] = {}  # peer -> when its last subscription failed

    def end(self, peer: str) -> None:
        """``peer`` turned suspect or dead: its subscription ends."""
        watch = self._watches.get(peer)
        if watch is not None:
            watch.cancel()

    WATCH_AFTER_S = 60.0  # subscribe to a peer pulled from again within this (once is not a habit)
    WATCH_MAX_BYTES = 1 << 20  # larger snapshots are pulled (see _watch)
    WATCH_IDLE_S = 60.0  # a subscription whose snapshots nobody asked for this long is closed
    WATCH_RETRY_S = 30.0  # after a subscription failed: pulls only, for this long
    MAX_WATCHES = 32  # subscriptions at once (the server allows each peer one)

    def serves(self, peer: str, address: str, cached: PeerSnapshot | None, aligned: bool) -> bool:
        """Whether ``peer``'s snapshots arrive by subscription (starting one when it is due).
        A subscription pushes every snapshot at the *publisher's* pace, so it starts only where
        every round of the peer is wanted — round-aligned pulls (D-PSGD, L2C, SCool), whose
        staleness bound keeps both ends in step — and only for small models, where a call costs
        more CPU than the bytes. Sampled pulls (FedFomo, FedeRiCo) keep pulling: pushing every
        snapshot to everyone saturated a slow link in the testbed and buried that peer's weight;
        on a 21 MB model subscriptions cost FedFomo +22% CPU and D-PSGD +16% peak RSS."""
        if not self.enabled:
            return False
        now = time.monotonic()
        last, self._pulled[peer] = self._pulled.get(peer), now
        task = self._watches.get(peer)
        if task is not None:
            return True
        if (
            last is None
            or now - last > self.WATCH_AFTER_S
            or len(self._watches) >= self.MAX_WATCHES
            or now - self._watch_failed.get(peer, float("-inf")) < self.WATCH_RETRY_S
            or not aligned
            or cached is None
            or self.net.cache.nbytes(cached) > self.WATCH_MAX_BYTES
        ):
            return False
        self._watches[peer] = asyncio.get_running_loop().create_task(
            self._run_watch(peer, address), name=f"watch-{peer}"
        )
        return False  # this pull still pulls; the subscription serves the next ones

    async def _run_watch(self, peer: str, address: str) -> None:
        cached = self.net.cache.get(peer)
        delivered = 0
        try:
            stream = self.net.transport.watch_snapshots(
                address, self.net.node_id, min_round=cached.round + 1 if cached else 0, peer=peer
            )
            async with contextlib.aclosing(stream):  # (leaving the loop early cancels the call)
                async for header, groups in stream:
                    if header.node_id != peer:
                        raise WireError(f"snapshot claims to be from {header.node_id!r}, expected {peer!r}")
                    self.net.cache.put(await self.net._validated(peer, header, groups))
                    self.net.table.seen(peer, version=header.version)
                    delivered += 1
                    news = self._watch_news.pop(peer, None)
                    if news is not None:
                        news.set()
                    if time.monotonic() - self._pulled.get(peer, 0.0) > self.WATCH_IDLE_S:
                        break  # nobody has used this peer's snapshots for a while
            if delivered < 2:  # the peer ends them at once (publishes nothing new): pull it instead
                self._watch_failed[peer] = time.monotonic()
        except (PeerCallError, WireError) as e:
            self.net._failed("snapshot watch", peer, e)
            self._watch_failed[peer] = time.monotonic()
        finally:
            if self._watches.get(peer) is asyncio.current_task():
                del self._watches[peer]
            news = self._watch_news.pop(peer, None)
            if news is not None:
                news.set()  # a pull waiting on it goes on without it

    async def from_watch(
        self, peer: str, cached: PeerSnapshot, min_round: int | None, wait_s: float | None
    ) -> PeerSnapshot | None:
        """A pull served by the subscription: the latest pushed snapshot, or — for a round not
        pushed yet — wait for it (within the pull's wait and the round's exchange deadline)."""
        if not min_round:
            return cached
        phase = self.calls._phase
        now = time.monotonic()
        wait = self.calls.request_timeout_s if wait_s is None else max(0.0, wait_s)
        if phase is not None:
            wait = min(wait, phase.begin(now))
        deadline = now + wait
        snap = cached
        while snap is not None and snap.round < min_round and peer in self._watches:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            news = self._watch_news.setdefault(peer, asyncio.Event())
            try:
                await asyncio.wait_for(news.wait(), left)
            except asyncio.TimeoutError:
                break
            snap = self.net.cache.get(peer)
        if phase is not None:
            phase.ended(now, time.monotonic())
        if snap is None or snap.round < min_round:
            if peer not in self._watches and snap is not None and self.net._address(peer):
                return await self.net.pull(peer, min_round=min_round, wait_s=max(0.0, deadline - time.monotonic()))
            return None  # it did not reach that round in time: proceed without it
        return snap

    async def close(self) -> None:
        """End the subscriptions (at shutdown)."""
        tasks = list(self._watches.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
