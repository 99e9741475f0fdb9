"""``NodeNetwork``: the ``PeerNetwork`` a strategy sees — the requesting side of the peer plane.

This is the one place where strategy requests become transport calls. Every failure (timeout,
dead peer, refusal, a snapshot that fails validation) is logged, noted and turned into ``None``,
so a strategy simply carries on without that peer.

Deadlines follow the peer (``deadlines.Deadlines``: a multiple of that peer's recent latency for
that kind of call, capped by ``request_timeout_s``), and the exchange phase of a round has its
own deadline (``exchange_phase``), so a round goes on with the peers that answered — strategies
gather their calls as before and simply see ``None`` for the rest. A call to a peer that turns
suspect or dead meanwhile is abandoned at once; suspect and dead peers are not called at all; a
call that times out asks membership to probe that peer now. Snapshot validation (architecture,
finiteness) runs in a worker thread, over tensors that are views of the received buffer.

A peer with a small model that a strategy pulls round-aligned again is subscribed to (``watch_snapshots``): it pushes each snapshot
as it publishes it, and pulls are served from the cache (a round not pushed yet is waited for on
the subscription). A subscription that fails or delivers a bad snapshot ends, and pulls take
over for ``WATCH_RETRY_S``; one nobody reads for ``WATCH_IDLE_S`` is closed.

Every request on a peer's data names a purpose (``privacy/purposes.py``); a gradient on *my*
data that a strategy sends out (FedeRiCo's push, COBO's alignment vector) is released through
``private_gradient``."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from ..learning.learner import Params
from ..privacy.ledger import BudgetSpent
from ..privacy.mechanisms import PrivateData
from ..privacy.purposes import ALIGNMENT, GRADIENT, LOSS, PUSH, Purpose
from ..privacy.purposes import purpose as purpose_table
from ..strategies.base import GradientReply, PeerSnapshot, PushedGradient
from ..offload import OFF_LOOP_BYTES
from ..wire.codec import Groups, WireError, encoded_size
from .deadlines import Deadlines, Phase, quantile
from .errors import NOT_CACHED, UNAVAILABLE, PeerCallError
from .inbox import PushInbox
from .interfaces import PeerTransport
from .messages import (CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, ComputeReply, ComputeRequest, LocalSnapshot,
                       SnapshotHeader)
from .peer_table import ALIVE, DEAD, SUSPECT, PeerTable
from .problems import ProblemLog
from .snapshots import SnapshotCache
from .validation import Spec, model_tensors, snapshot_groups

log = logging.getLogger("coterie.node.network")
T = TypeVar("T")


class NodeNetwork:
    def __init__(self, node_id: str, transport: PeerTransport, peers: PeerTable, cache: SnapshotCache,
                 inbox: PushInbox, published: Callable[[], LocalSnapshot | None], spec: Spec,
                 problems: ProblemLog, private: PrivateData, *, labels: dict[str, str],
                 request_timeout_s: float, deadlines: Deadlines | None = None,
                 exchange_timeout_s: float = 0.0, on_call_failed: Callable[[str], None] | None = None,
                 watch: bool = True):
        self.node_id = node_id
        self.transport = transport
        self.table = peers
        self.cache = cache
        self.inbox = inbox
        self.published = published
        self.spec = spec
        self.problems = problems
        self.private = private  # my own gradients leave through it too
        self.labels = labels
        self.request_timeout_s = request_timeout_s
        self.deadlines = deadlines or Deadlines(request_timeout_s)
        self.exchange_timeout_s = exchange_timeout_s  # 0: adaptive
        self.on_call_failed = on_call_failed or (lambda peer: None)
        self._inflight: dict[str, set[asyncio.Task]] = {}
        self._timed_out: dict[str, float] = {}  # peer -> when a call to it last timed out
        self._abandoned: set[asyncio.Task] = set()
        self._phases: deque[float] = deque(maxlen=32)  # recent exchange-phase durations
        self._phase: Phase | None = None
        # snapshot subscriptions (see ``_watch``): a transport without them is pulled from only
        self.watch = watch and hasattr(transport, "watch_snapshots")
        self._watches: dict[str, asyncio.Task] = {}
        self._watch_news: dict[str, asyncio.Event] = {}  # set (and replaced) at each pushed snapshot
        self._pulled: dict[str, float] = {}  # peer -> when a strategy last asked for its snapshot
        self._watch_failed: dict[str, float] = {}  # peer -> when its last subscription failed
        peers.listeners.append(self._on_state)

    # --- deadlines ---
    def exchange_budget(self) -> float:
        """How long a round's exchange phase may last: ``exchange_timeout_s`` if set, else
        ``deadline_mult`` × the 90th percentile of recent phases (at least twice the deadline
        floor), capped by the request timeout."""
        cap = self.request_timeout_s
        if self.exchange_timeout_s:
            return min(self.exchange_timeout_s, cap)
        if len(self._phases) < 5:
            return cap
        d = self.deadlines
        return min(cap, max(2 * d.floor_s, d.mult * quantile(self._phases, 0.9)))

    @contextlib.contextmanager
    def exchange_phase(self) -> Iterator[Phase]:
        """Around a round: its peer calls share one deadline, counted from the first call."""
        self._phase = phase = Phase(self.exchange_budget())
        try:
            yield phase
        finally:
            self._phase = None
            took = phase.close()
            if took is not None:
                self._phases.append(took)

    def _on_state(self, node_id: str, old: str, new: str) -> None:
        if new in (SUSPECT, DEAD):  # abandon what is in flight to it: the round goes on without it
            for t in self._inflight.get(node_id, ()):
                self._abandoned.add(t)
                t.cancel()
            watch = self._watches.get(node_id)
            if watch is not None:
                watch.cancel()

    async def _call(self, peer: str, kind: str, make: Callable[[float], Awaitable[T]], wait_s: float = 0.0) -> T:
        """``make(timeout)`` under this peer's deadline and the round's; abandoned if the peer
        turns suspect or dead meanwhile."""
        timeout = self.deadlines.timeout(peer, kind)
        phase = self._phase
        now = time.monotonic()
        if phase is not None:
            left = phase.begin(now)
            if left <= 0:
                phase.skipped += 1
                raise PeerCallError(UNAVAILABLE, f"the round's exchange phase ({phase.budget_s:.1f}s) is over")
            timeout = min(timeout, left)
        task = asyncio.ensure_future(make(timeout + wait_s))
        calls = self._inflight.setdefault(peer, set())
        calls.add(task)
        ok = False
        try:
            out = await task
            ok = True
            return out
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task in self._abandoned and not (me is not None and me.cancelling()):
                if phase is not None:
                    phase.abandoned += 1
                rec = self.table.records.get(peer)
                raise PeerCallError(UNAVAILABLE, f"{peer} turned {rec.state if rec else 'unknown'}: "
                                                 f"call abandoned") from None
            raise
        except PeerCallError as e:
            if e.kind == UNAVAILABLE:  # a timeout or refused connection: membership probes it now,
                self._timed_out[peer] = time.monotonic()  # and it is not called again until it answers
                self.on_call_failed(peer)
            raise
        finally:
            calls.discard(task)
            self._abandoned.discard(task)
            if not calls:
                self._inflight.pop(peer, None)
            end = time.monotonic()
            if ok and not wait_s:
                self.deadlines.observe(peer, kind, end - now)
            if phase is not None:
                phase.ended(now, end, ok)

    async def _validated(self, peer: str, header: SnapshotHeader, groups: Groups) -> PeerSnapshot:
        """A received snapshot of ``peer``, once its architecture and finiteness are checked (a
        whole model: a large one in a worker thread)."""
        what = f"snapshot v{header.version} of {peer}"
        params, extras = (await asyncio.to_thread(snapshot_groups, groups, self.spec, what)
                          if encoded_size(groups) > OFF_LOOP_BYTES else snapshot_groups(groups, self.spec, what))
        return PeerSnapshot(peer, header.version, header.round, params, extras, header.digest)

    # --- views ---
    def peers(self) -> list[str]:
        """Alive peers, less those whose last call timed out with no sign of life since."""
        return [p for p in self.table.alive() if self._responsive(p)]

    def known_peers(self) -> list[str]:
        return self.table.known()

    def true_cluster(self, node_id: str) -> int | None:
        labels = (self.labels if node_id == self.node_id
                  else getattr(self.table.records.get(node_id), "labels", {}))
        raw = (labels or {}).get("cluster")
        return int(raw) if raw not in (None, "") else None

    def cached(self, peer: str) -> PeerSnapshot | None:
        return self.cache.get(peer)

    def _responsive(self, peer: str) -> bool:
        rec = self.table.records.get(peer)
        return rec is not None and self._timed_out.get(peer, float("-inf")) < rec.last_seen

    def _address(self, peer: str) -> str | None:
        """Where to call ``peer``; None for a suspect or dead one, or one whose last call timed
        out and which has not shown a sign of life since (membership is probing it): such a peer
        is not waited for twice."""
        rec = self.table.records.get(peer)
        return rec.address if rec is not None and rec.state == ALIVE and self._responsive(peer) else None

    def _failed(self, what: str, peer: str, err: Exception) -> None:
        rejected = isinstance(err, WireError)
        log.warning("%s %s with %s: %s", what, "refused" if rejected else "failed", peer, err)
        self.problems.note(peer, f"{what}: {err}", rejected=rejected)

    # --- snapshots ---
    async def pull(self, peer: str, *, min_round: int | None = None,
                   wait_s: float | None = None) -> PeerSnapshot | None:
        """The peer's latest snapshot (from cache if its version did not change). With
        ``min_round``: one of round >= min_round, the peer holding the call open up to ``wait_s``
        (default: the request timeout) until it publishes it; None if it does not in time."""
        address = self._address(peer)
        if address is None:
            return None
        cached = self.cache.get(peer)
        if min_round and cached is not None and cached.round >= min_round:
            return cached
        if self._watch(peer, address, cached, bool(min_round)) and cached is not None:
            return await self._from_watch(peer, cached, min_round, wait_s)
        wait = (self.request_timeout_s if wait_s is None else max(0.0, wait_s)) if min_round else 0.0
        try:
            header, groups = await self._call(peer, "snapshot", lambda timeout: self.transport.get_snapshot(
                address, self.node_id, cached.version if cached else 0, min_round=min_round or 0,
                wait_s=wait, timeout=timeout, peer=peer), wait_s=wait)
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
        self.cache.put(snap)
        self.table.seen(peer, version=snap.version)
        if min_round and snap.round < min_round:
            return None  # it did not reach that round in time: proceed without it
        return snap

    # --- snapshot subscriptions ---
    # A peer pulled from round after round is subscribed to: it pushes each snapshot it publishes
    # on one long-lived stream (``transport.watch_snapshots``), and a pull reads the cache. A
    # call a round costs the most CPU of a small model's round (gRPC call set-up on both ends);
    # a pushed snapshot costs a fifth of that. Pushed snapshots are checked like pulled ones.
    WATCH_AFTER_S = 60.0  # subscribe to a peer pulled from again within this (once is not a habit)
    WATCH_MAX_BYTES = 1 << 20  # larger snapshots are pulled (see _watch)
    WATCH_IDLE_S = 60.0  # a subscription whose snapshots nobody asked for this long is closed
    WATCH_RETRY_S = 30.0  # after a subscription failed: pulls only, for this long
    MAX_WATCHES = 32  # subscriptions at once (the server allows each peer one)

    def _watch(self, peer: str, address: str, cached: PeerSnapshot | None, aligned: bool) -> bool:
        """Whether ``peer``'s snapshots arrive by subscription (starting one when it is due).
        A subscription pushes every snapshot at the *publisher's* pace, so it starts only where
        every round of the peer is wanted — round-aligned pulls (D-PSGD, L2C, SCool), whose
        staleness bound keeps both ends in step — and only for small models, where a call costs
        more CPU than the bytes. Sampled pulls (FedFomo, FedeRiCo) keep pulling: pushing every
        snapshot to everyone saturated a slow link in the testbed and buried that peer's weight;
        on a 21 MB model subscriptions cost FedFomo +22% CPU and D-PSGD +16% peak RSS."""
        if not self.watch:
            return False
        now = time.monotonic()
        last, self._pulled[peer] = self._pulled.get(peer), now
        task = self._watches.get(peer)
        if task is not None:
            return True
        if (last is None or now - last > self.WATCH_AFTER_S or len(self._watches) >= self.MAX_WATCHES
                or now - self._watch_failed.get(peer, float("-inf")) < self.WATCH_RETRY_S
                or not aligned or cached is None or self.cache.nbytes(cached) > self.WATCH_MAX_BYTES):
            return False
        self._watches[peer] = asyncio.get_running_loop().create_task(self._run_watch(peer, address),
                                                                     name=f"watch-{peer}")
        return False  # this pull still pulls; the subscription serves the next ones

    async def _run_watch(self, peer: str, address: str) -> None:
        cached = self.cache.get(peer)
        delivered = 0
        try:
            stream = self.transport.watch_snapshots(address, self.node_id,
                                                    min_round=cached.round + 1 if cached else 0, peer=peer)
            async with contextlib.aclosing(stream):  # (leaving the loop early cancels the call)
                async for header, groups in stream:
                    if header.node_id != peer:
                        raise WireError(f"snapshot claims to be from {header.node_id!r}, expected {peer!r}")
                    self.cache.put(await self._validated(peer, header, groups))
                    self.table.seen(peer, version=header.version)
                    delivered += 1
                    news = self._watch_news.pop(peer, None)
                    if news is not None:
                        news.set()
                    if time.monotonic() - self._pulled.get(peer, 0.0) > self.WATCH_IDLE_S:
                        break  # nobody has used this peer's snapshots for a while
            if delivered < 2:  # the peer ends them at once (publishes nothing new): pull it instead
                self._watch_failed[peer] = time.monotonic()
        except (PeerCallError, WireError) as e:
            self._failed("snapshot watch", peer, e)
            self._watch_failed[peer] = time.monotonic()
        finally:
            if self._watches.get(peer) is asyncio.current_task():
                del self._watches[peer]
            news = self._watch_news.pop(peer, None)
            if news is not None:
                news.set()  # a pull waiting on it goes on without it

    async def _from_watch(self, peer: str, cached: PeerSnapshot, min_round: int | None,
                          wait_s: float | None) -> PeerSnapshot | None:
        """A pull served by the subscription: the latest pushed snapshot, or — for a round not
        pushed yet — wait for it (within the pull's wait and the round's exchange deadline)."""
        if not min_round:
            return cached
        phase = self._phase
        now = time.monotonic()
        wait = self.request_timeout_s if wait_s is None else max(0.0, wait_s)
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
            snap = self.cache.get(peer)
        if phase is not None:
            phase.ended(now, time.monotonic())
        if snap is None or snap.round < min_round:
            if peer not in self._watches and snap is not None and self._address(peer):
                return await self.pull(peer, min_round=min_round, wait_s=max(0.0, deadline - time.monotonic()))
            return None  # it did not reach that round in time: proceed without it
        return snap

    async def close(self) -> None:
        """End the subscriptions (at shutdown)."""
        tasks = list(self._watches.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- compute on peers' data ---
    async def _compute(self, peer: str, req: ComputeRequest) -> ComputeReply | None:
        """Send the request; a request naming my published snapshot by reference is re-sent with
        the snapshot itself when the peer has not cached it."""
        address = self._address(peer)
        if address is None:
            return None
        kind = f"compute:{req.kind}"
        try:
            return await self._call(peer, kind, lambda timeout: self.transport.compute(address, req, timeout, peer=peer))
        except PeerCallError as e:
            if e.kind != NOT_CACHED or req.ref is None:
                raise
        pub = self.published()
        req.ref, req.groups = None, {"params": pub.params}
        return await self._call(peer, kind, lambda timeout: self.transport.compute(address, req, timeout, peer=peer))

    async def _model_request(self, kind: str, params: Params | None, **fields: Any) -> ComputeRequest:
        pub = self.published()
        if params is None and pub is not None and not fields.get("align"):
            await pub.ready()  # its digest names it: hashed off the loop
            return ComputeRequest(kind, self.node_id, ref=pub.ref(), **fields)
        if params is None:
            params = pub.params
        return ComputeRequest(kind, self.node_id, groups={"params": params}, **fields)

    @staticmethod
    def _purpose(name: str, kind: str, split: str | None) -> Purpose:
        """The purpose a strategy names, checked here so a wrong call fails loudly in the
        strategy's own round instead of as a refusal from every peer."""
        p = purpose_table(name)
        if p.kind != kind:
            raise ValueError(f"purpose {name!r} is for {p.kind} requests, not {kind}")
        if split is not None and split != p.split:
            raise ValueError(f"purpose {name!r} is answered on the {p.split!r} split, not {split!r}")
        return p

    async def cross_loss(self, peer: str, params: Params | None = None, *, purpose: str,
                         split: str | None = None, max_samples: int | None = None,
                         reduction: str = "mean") -> tuple[float, int] | None:
        p = self._purpose(purpose, LOSS, split)
        req = await self._model_request(CROSS_LOSS, params, split=p.split, max_samples=max_samples or 0,
                                  reduction=reduction, purpose=p.name)
        try:
            reply = await self._compute(peer, req)
        except (PeerCallError, WireError) as e:
            self._failed("cross-loss", peer, e)
            return None
        return None if reply is None else (reply.loss, int(reply.samples))

    async def cross_gradient(self, peer: str, params: Params | None = None, *, purpose: str,
                             split: str | None = None, max_samples: int | None = None,
                             reduction: str = "mean", align_with: Params | None = None) -> GradientReply | None:
        p = self._purpose(purpose, GRADIENT if align_with is None else ALIGNMENT, split)
        if reduction != "mean":
            raise ValueError("cross-gradients are mean-reduced (a private sum would reveal the batch size)")
        req = await self._model_request(CROSS_GRADIENT, params, split=p.split, max_samples=max_samples or 0,
                                  reduction=reduction, align=align_with is not None, purpose=p.name)
        if align_with is not None:
            req.groups = {**(req.groups or {}), "align": align_with}
        try:
            reply = await self._compute(peer, req)
            if reply is None:
                return None
            if align_with is not None:
                return GradientReply(None, reply.loss, int(reply.samples), reply.inner_product)
            check = (model_tensors, reply.grad or {}, "grad", self.spec, f"gradient from {peer}")
            grad = (await asyncio.to_thread(*check) if encoded_size(reply.grad or {}) > OFF_LOOP_BYTES
                    else model_tensors(*check[1:]))
        except (PeerCallError, WireError) as e:
            self._failed("cross-gradient", peer, e)
            return None
        return GradientReply(grad, reply.loss, int(reply.samples))

    async def private_gradient(self, peer: str, params: Params, *, purpose: str,
                               max_samples: int | None = None) -> Params | None:
        """The gradient of ``params`` on *my* data, released for ``peer`` (FedeRiCo's push,
        COBO's alignment vector): privatised and charged to my ledger; None once my budget is
        spent (the caller then skips that peer, as if it were unreachable)."""
        p = purpose_table(purpose)
        if p.kind not in (PUSH, ALIGNMENT):
            raise ValueError(f"purpose {purpose!r} does not send this node's own gradient out")
        try:
            rel, _ = await asyncio.to_thread(self.private.gradient, peer, p, params, max_samples or 0)
        except BudgetSpent as e:
            log.info("not sending %s to %s: %s", p.name, peer, e)
            self.problems.note(peer, f"{p.name}: {e}")
            return None
        return rel.value

    async def push_gradient(self, peer: str, version: int, grad: Params, *,
                            purpose: str = "federico-push") -> bool:
        p = self._purpose(purpose, PUSH, None)
        req = ComputeRequest(PUSH_GRADIENT, self.node_id, groups={"grad": grad}, target_version=version,
                             purpose=p.name)
        try:
            ack = await self._compute(peer, req)
        except (PeerCallError, WireError) as e:
            self._failed("gradient push", peer, e)
            return False
        return bool(ack and ack.accepted)

    def drain_pushed(self) -> list[PushedGradient]:
        return self.inbox.drain()

    async def gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        address = self._address(peer)
        if address is None:
            return None
        try:
            return await self._call(peer, "gossip", lambda timeout: self.transport.gossip(
                address, self.node_id, key, payload, timeout, peer=peer))
        except (PeerCallError, WireError) as e:
            self._failed(f"gossip {key!r}", peer, e)
            return None
