"""``NodeNetwork``: the PeerNetwork a strategy sees, built from the node's transport.

This is the one place where strategy requests become wire calls. Every failure (timeout, dead
peer, refusal, a snapshot that fails validation) is logged, counted and turned into ``None`` so a
strategy simply carries on without that peer."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import grpc

from ..proto.v1 import peer_pb2 as pb
from .learning.learner import Params
from .strategies.base import GradientReply, PeerSnapshot, PushedGradient
from .wire.codec import WireError, check_finite, check_spec, decode, encode

if TYPE_CHECKING:
    from .daemon import Node

log = logging.getLogger(__name__)


class NodeNetwork:
    def __init__(self, node: "Node"):
        self.node = node
        self.node_id = node.node_id
        self.cache: dict[str, PeerSnapshot] = {}
        self.pushed: list[PushedGradient] = []

    # --- views ---
    def peers(self) -> list[str]:
        return self.node.peers.alive()

    def known_peers(self) -> list[str]:
        return self.node.peers.known()

    def true_cluster(self, node_id: str) -> int | None:
        labels = (self.node.cfg.labels if node_id == self.node_id
                  else getattr(self.node.peers.records.get(node_id), "labels", {}))
        raw = (labels or {}).get("cluster")
        return int(raw) if raw not in (None, "") else None

    def cached(self, peer: str) -> PeerSnapshot | None:
        return self.cache.get(peer)

    def _address(self, peer: str) -> str | None:
        rec = self.node.peers.records.get(peer)
        return rec.address if rec is not None and rec.state != "dead" else None

    def _failed(self, what: str, peer: str, err: BaseException) -> None:
        kind = "refused" if isinstance(err, WireError) else "failed"
        msg = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        log.warning("%s %s with %s: %s", what, kind, peer, msg)
        self.node.note_problem(peer, f"{what}: {msg}", rejected=isinstance(err, WireError))

    # --- snapshots ---
    async def pull(self, peer: str) -> PeerSnapshot | None:
        address = self._address(peer)
        if address is None:
            return None
        cached = self.cache.get(peer)
        try:
            header, data = await self.node.client.get_snapshot(address, cached.version if cached else 0)
            if data is None:
                return cached
            if header.node_id != peer:
                raise WireError(f"snapshot claims to be from {header.node_id!r}, expected {peer!r}")
            snap = self.validate_snapshot(peer, header, data)
        except (grpc.aio.AioRpcError, WireError, ValueError, StopAsyncIteration, OSError) as e:
            self._failed("snapshot pull", peer, e)
            return None
        self.cache[peer] = snap
        self.node.peers.seen(peer, version=snap.version)
        return snap

    def validate_snapshot(self, peer: str, header: pb.SnapshotHeader, data: bytes) -> PeerSnapshot:
        """Size and hash were checked while assembling; here: decodable, right architecture, finite."""
        try:
            groups, _meta = decode(data, max_bytes=self.node.cfg.max_model_bytes)
        except WireError as e:
            raise WireError(f"snapshot v{header.version} of {peer} is malformed: {e}") from None
        params = groups.pop("params", None)
        if params is None:
            raise WireError(f"snapshot v{header.version} of {peer} has no params")
        check_spec(params, self.node.spec, f"snapshot v{header.version} of {peer}")
        try:
            check_finite({"params": params, **groups})
        except WireError as e:
            raise WireError(f"snapshot v{header.version} of {peer}: {e}") from None
        extras = {k[2:]: v for k, v in groups.items() if k.startswith("x:")}
        for name, tensors in extras.items():
            check_spec(tensors, self.node.spec, f"snapshot v{header.version} of {peer} extra {name!r}")
        return PeerSnapshot(peer, header.version, header.round, params, extras, header.sha256)

    # --- compute on peers' data ---
    async def _with_model(self, peer: str, call, params: Params | None, extra: dict[str, Params] | None,
                          **fields: Any):
        """Send ``params`` (or, if None, a reference to my published snapshot, falling back to the
        full model if the peer has not cached it)."""
        address = self._address(peer)
        if address is None:
            return None
        client = self.node.client
        if params is None and not extra:
            pub = self.node.published()
            ref = pb.SnapshotRef(node_id=self.node_id, version=pub.version, sha256=pub.sha256)
            try:
                return await call(address, client.header_for(None, requester=self.node_id, ref=ref, **fields), None)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            payload = pub.data
        else:
            payload = encode({"params": params if params is not None else self.node.published_params(),
                              **(extra or {})})
        return await call(address, client.header_for(payload, requester=self.node_id, **fields), payload)

    async def cross_loss(self, peer: str, params: Params | None = None, *, split: str = "train",
                         max_samples: int | None = None, reduction: str = "mean") -> tuple[float, int] | None:
        try:
            reply = await self._with_model(peer, self.node.client.cross_loss, params, None, split=split,
                                           max_samples=max_samples or 0, reduction=reduction)
        except (grpc.aio.AioRpcError, ValueError, OSError) as e:
            self._failed("cross-loss", peer, e)
            return None
        return None if reply is None else (reply.loss, int(reply.samples))

    async def cross_gradient(self, peer: str, params: Params | None = None, *, split: str = "train",
                             max_samples: int | None = None, reduction: str = "mean",
                             align_with: Params | None = None) -> GradientReply | None:
        extra = {"align": align_with} if align_with is not None else None
        if extra and params is None:
            params = self.node.published_params()
        try:
            out = await self._with_model(peer, self.node.client.cross_gradient, params, extra, split=split,
                                         max_samples=max_samples or 0, reduction=reduction,
                                         align=align_with is not None)
            if out is None:
                return None
            gh, data = out
            if align_with is not None:
                return GradientReply(None, gh.loss, int(gh.samples), gh.inner_product)
            groups, _ = decode(data, max_bytes=self.node.cfg.max_model_bytes)
            grad = groups.get("grad", {})
            check_spec(grad, self.node.spec, f"gradient from {peer}")
            check_finite(groups)
        except (grpc.aio.AioRpcError, WireError, ValueError, OSError, StopAsyncIteration) as e:
            self._failed("cross-gradient", peer, e)
            return None
        return GradientReply(grad, gh.loss, int(gh.samples))

    async def push_gradient(self, peer: str, version: int, grad: Params) -> bool:
        address = self._address(peer)
        if address is None:
            return False
        payload = encode({"grad": grad})
        client = self.node.client
        try:
            ack = await client.push_gradient(
                address, client.header_for(payload, requester=self.node_id, target_version=version), payload)
        except (grpc.aio.AioRpcError, ValueError, OSError) as e:
            self._failed("gradient push", peer, e)
            return False
        return ack.accepted

    def drain_pushed(self) -> list[PushedGradient]:
        out, self.pushed = self.pushed, []
        return out

    async def gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        address = self._address(peer)
        if address is None:
            return None
        try:
            return await self.node.client.gossip(address, key, payload)
        except (grpc.aio.AioRpcError, ValueError, OSError) as e:
            self._failed(f"gossip {key!r}", peer, e)
            return None
