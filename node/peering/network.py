"""``NodeNetwork``: the ``PeerNetwork`` a strategy sees — the requesting side of the peer plane.

This is the one place where strategy requests become transport calls. Every failure (timeout,
dead peer, refusal, a snapshot that fails validation) is logged, noted and turned into ``None``,
so a strategy simply carries on without that peer."""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..learning.learner import Params
from ..strategies.base import GradientReply, PeerSnapshot, PushedGradient
from ..wire.codec import WireError
from .errors import NOT_CACHED, PeerCallError
from .inbox import PushInbox
from .interfaces import PeerTransport
from .messages import CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, ComputeReply, ComputeRequest, LocalSnapshot
from .peer_table import DEAD, PeerTable
from .problems import ProblemLog
from .snapshots import SnapshotCache
from .validation import Spec, model_tensors, snapshot_groups

log = logging.getLogger("coterie.node.network")


class NodeNetwork:
    def __init__(self, node_id: str, transport: PeerTransport, peers: PeerTable, cache: SnapshotCache,
                 inbox: PushInbox, published: Callable[[], LocalSnapshot | None], spec: Spec,
                 problems: ProblemLog, *, labels: dict[str, str], request_timeout_s: float):
        self.node_id = node_id
        self.transport = transport
        self.table = peers
        self.cache = cache
        self.inbox = inbox
        self.published = published
        self.spec = spec
        self.problems = problems
        self.labels = labels
        self.request_timeout_s = request_timeout_s

    # --- views ---
    def peers(self) -> list[str]:
        return self.table.alive()

    def known_peers(self) -> list[str]:
        return self.table.known()

    def true_cluster(self, node_id: str) -> int | None:
        labels = (self.labels if node_id == self.node_id
                  else getattr(self.table.records.get(node_id), "labels", {}))
        raw = (labels or {}).get("cluster")
        return int(raw) if raw not in (None, "") else None

    def cached(self, peer: str) -> PeerSnapshot | None:
        return self.cache.get(peer)

    def _address(self, peer: str) -> str | None:
        rec = self.table.records.get(peer)
        return rec.address if rec is not None and rec.state != DEAD else None

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
        wait = (self.request_timeout_s if wait_s is None else max(0.0, wait_s)) if min_round else 0.0
        try:
            header, groups = await self.transport.get_snapshot(
                address, self.node_id, cached.version if cached else 0, min_round=min_round or 0,
                wait_s=wait, timeout=self.request_timeout_s + wait, peer=peer)
            if header.node_id != peer:
                raise WireError(f"snapshot claims to be from {header.node_id!r}, expected {peer!r}")
            if groups is None:
                snap = cached
            else:
                what = f"snapshot v{header.version} of {peer}"
                params, extras = snapshot_groups(groups, self.spec, what)
                snap = PeerSnapshot(peer, header.version, header.round, params, extras, header.digest)
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

    # --- compute on peers' data ---
    async def _compute(self, peer: str, req: ComputeRequest) -> ComputeReply | None:
        """Send the request; a request naming my published snapshot by reference is re-sent with
        the snapshot itself when the peer has not cached it."""
        address = self._address(peer)
        if address is None:
            return None
        try:
            return await self.transport.compute(address, req, peer=peer)
        except PeerCallError as e:
            if e.kind != NOT_CACHED or req.ref is None:
                raise
        pub = self.published()
        req.ref, req.groups = None, {"params": pub.params}
        return await self.transport.compute(address, req, peer=peer)

    def _model_request(self, kind: str, params: Params | None, **fields: Any) -> ComputeRequest:
        pub = self.published()
        if params is None and pub is not None and not fields.get("align"):
            return ComputeRequest(kind, self.node_id, ref=pub.ref(), **fields)
        if params is None:
            params = pub.params
        return ComputeRequest(kind, self.node_id, groups={"params": params}, **fields)

    async def cross_loss(self, peer: str, params: Params | None = None, *, split: str = "train",
                         max_samples: int | None = None, reduction: str = "mean") -> tuple[float, int] | None:
        req = self._model_request(CROSS_LOSS, params, split=split, max_samples=max_samples or 0,
                                  reduction=reduction)
        try:
            reply = await self._compute(peer, req)
        except (PeerCallError, WireError) as e:
            self._failed("cross-loss", peer, e)
            return None
        return None if reply is None else (reply.loss, int(reply.samples))

    async def cross_gradient(self, peer: str, params: Params | None = None, *, split: str = "train",
                             max_samples: int | None = None, reduction: str = "mean",
                             align_with: Params | None = None) -> GradientReply | None:
        req = self._model_request(CROSS_GRADIENT, params, split=split, max_samples=max_samples or 0,
                                  reduction=reduction, align=align_with is not None)
        if align_with is not None:
            req.groups = {**(req.groups or {}), "align": align_with}
        try:
            reply = await self._compute(peer, req)
            if reply is None:
                return None
            if align_with is not None:
                return GradientReply(None, reply.loss, int(reply.samples), reply.inner_product)
            grad = model_tensors(reply.grad or {}, "grad", self.spec, f"gradient from {peer}")
        except (PeerCallError, WireError) as e:
            self._failed("cross-gradient", peer, e)
            return None
        return GradientReply(grad, reply.loss, int(reply.samples))

    async def push_gradient(self, peer: str, version: int, grad: Params) -> bool:
        req = ComputeRequest(PUSH_GRADIENT, self.node_id, groups={"grad": grad}, target_version=version)
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
            return await self.transport.gossip(address, self.node_id, key, payload, peer=peer)
        except (PeerCallError, WireError) as e:
            self._failed(f"gossip {key!r}", peer, e)
            return None
