"""The requests a strategy makes of its peers (``NodeNetwork`` holds them): compute on
a peer's data — cross-loss, cross-gradient (COBO's alignment), FedeRiCo's gradient push — and
strategy gossip; discovery's "whom do you weight?" (``recommend``); and the one door my own
gradients leave through (``private_gradient``).

Every request on a peer's data names a purpose (``privacy/purposes.py``), checked here so a wrong
call fails in the strategy's own round; a gradient on *my* data that a strategy sends out is
released through ``PrivateData`` (privatised, charged to my ledger). Every failure is logged,
noted and turned into ``None``: a strategy carries on without that peer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..learning.learner import Params
from ..offload import OFF_LOOP_BYTES
from ..privacy.ledger import BudgetSpent
from ..privacy.purposes import ALIGNMENT, GRADIENT, LOSS, PUSH, Purpose
from ..privacy.purposes import purpose as purpose_table
from ..strategies.base import GradientReply, PushedGradient
from ..wire.codec import WireError, encoded_size
from .api import MAX_RECOMMEND, RECOMMEND, RecommendAsk
from .errors import NOT_CACHED, PeerCallError
from .messages import CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, ComputeReply, ComputeRequest, PeerEntry
from .validation import model_tensors
from .versions import RECOMMEND as RECOMMEND_FEATURE

if TYPE_CHECKING:
    from ..privacy.mechanisms import PrivateData
    from .calls import PeerCalls
    from .inbox import PushInbox
    from .interfaces import PeerTransport
    from .messages import LocalSnapshot
    from .problems import ProblemLog
    from .releases import PeerReleases
    from .validation import Spec

log = logging.getLogger("coterie.node.network")


class PeerRequests:
    """Compute requests and gossip, carried by ``calls`` over ``transport`` to the address
    ``address_of`` gives (None: not called); a failure goes to ``failed``."""

    def __init__(
        self,
        node_id: str,
        transport: PeerTransport,
        calls: PeerCalls,
        inbox: PushInbox,
        published: Callable[[], LocalSnapshot | None],
        spec: Spec,
        private: PrivateData,
        releases: PeerReleases,
        problems: ProblemLog,
        *,
        address_of: Callable[[str], str | None],
        failed: Callable[[str, str, Exception], None],
    ):
        self.node_id = node_id
        self.transport = transport
        self.calls = calls
        self.inbox = inbox
        self.published = published
        self.spec = spec
        self.private = private  # my own gradients leave through it too
        self.releases = releases
        self.problems = problems
        self.address_of = address_of
        self.failed = failed

    async def _compute(self, peer: str, req: ComputeRequest) -> ComputeReply | None:
        """Send the request; a request naming my published snapshot by reference is re-sent with
        the snapshot itself when the peer has not cached it."""
        address = self.address_of(peer)
        if address is None:
            return None
        kind = f"compute:{req.kind}"
        try:
            return await self.calls.call(
                peer, kind, lambda timeout: self.transport.compute(address, req, timeout, peer=peer)
            )
        except PeerCallError as e:
            pub = self.published()  # (a request by reference named it: it is there)
            if e.kind != NOT_CACHED or req.ref is None or pub is None:
                raise
        req.ref, req.groups = None, {"params": pub.params}
        return await self.calls.call(
            peer, kind, lambda timeout: self.transport.compute(address, req, timeout, peer=peer)
        )

    async def _model_request(self, kind: str, params: Params | None, **fields: Any) -> ComputeRequest:
        pub = self.published()
        if params is None and pub is not None and not fields.get("align"):
            await pub.ready()  # its digest names it: hashed off the loop
            return ComputeRequest(kind, self.node_id, ref=pub.ref(), **fields)
        if params is None:
            if pub is None:  # (the node publishes its first snapshot before it serves or runs a round)
                raise RuntimeError("a model request for this node's published model before it published one")
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

    async def cross_loss(
        self,
        peer: str,
        params: Params | None = None,
        *,
        purpose: str,
        split: str | None = None,
        max_samples: int | None = None,
        reduction: str = "mean",
    ) -> tuple[float, int] | None:
        p = self._purpose(purpose, LOSS, split)
        req = await self._model_request(
            CROSS_LOSS, params, split=p.split, max_samples=max_samples or 0, reduction=reduction, purpose=p.name
        )
        try:
            reply = await self._compute(peer, req)
        except (PeerCallError, WireError) as e:
            self.failed("cross-loss", peer, e)
            return None
        if reply is None:
            return None
        self.releases.answered(peer)
        return reply.loss, int(reply.samples)

    async def cross_gradient(
        self,
        peer: str,
        params: Params | None = None,
        *,
        purpose: str,
        split: str | None = None,
        max_samples: int | None = None,
        reduction: str = "mean",
        align_with: Params | None = None,
    ) -> GradientReply | None:
        p = self._purpose(purpose, GRADIENT if align_with is None else ALIGNMENT, split)
        if reduction != "mean":
            raise ValueError("cross-gradients are mean-reduced (a private sum would reveal the batch size)")
        req = await self._model_request(
            CROSS_GRADIENT,
            params,
            split=p.split,
            max_samples=max_samples or 0,
            reduction=reduction,
            align=align_with is not None,
            purpose=p.name,
        )
        if align_with is not None:
            req.groups = {**(req.groups or {}), "align": align_with}
        try:
            reply = await self._compute(peer, req)
            if reply is None:
                return None
            self.releases.answered(peer)
            if align_with is not None:
                return GradientReply(None, reply.loss, int(reply.samples), reply.inner_product)
            check = (reply.grad or {}, "grad", self.spec, f"gradient from {peer}")
            grad = (
                await asyncio.to_thread(model_tensors, *check)
                if encoded_size(reply.grad or {}) > OFF_LOOP_BYTES
                else model_tensors(*check)
            )
        except (PeerCallError, WireError) as e:
            self.failed("cross-gradient", peer, e)
            return None
        return GradientReply(grad, reply.loss, int(reply.samples))

    async def private_gradient(
        self, peer: str, params: Params, *, purpose: str, max_samples: int | None = None
    ) -> Params | None:
        """The gradient of ``params`` on *my* data, released for ``peer`` (FedeRiCo's push,
        COBO's alignment vector): privatised and charged to my ledger; None once my budget is
        spent (the caller then skips that peer, as if it were unreachable)."""
        p = purpose_table(purpose)
        if p.kind not in (PUSH, ALIGNMENT):
            raise ValueError(f"purpose {purpose!r} does not send this node's own gradient out")
        try:
            rel, _ = await asyncio.to_thread(self.private.gradient, peer, p, params, max_samples or 0, True)
        except BudgetSpent as e:
            log.info("not sending %s to %s: %s", p.name, peer, e)
            self.problems.note(peer, f"{p.name}: {e}")
            return None
        return rel.value

    async def push_gradient(self, peer: str, version: int, grad: Params, *, purpose: str = "federico-push") -> bool:
        p = self._purpose(purpose, PUSH, None)
        req = ComputeRequest(PUSH_GRADIENT, self.node_id, groups={"grad": grad}, target_version=version, purpose=p.name)
        try:
            ack = await self._compute(peer, req)
        except (PeerCallError, WireError) as e:
            self.failed("gradient push", peer, e)
            return False
        return bool(ack and ack.accepted)

    def drain_pushed(self) -> list[PushedGradient]:
        return self.inbox.drain()

    def releases_noised(self) -> bool:
        noised = self.private.cfg.enabled and self.private.cfg.noise_multiplier > 0
        return bool(noised or self.private.withheld() is not None)  # withheld: too few samples to release

    async def gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        address = self.address_of(peer)
        if address is None:
            return None
        try:
            return await self.calls.call(
                peer,
                "gossip",
                lambda timeout: self.transport.gossip(address, self.node_id, key, payload, timeout, peer=peer),
            )
        except (PeerCallError, WireError) as e:
            self.failed(f"gossip {key!r}", peer, e)
            return None

    async def recommend(self, peer: str, count: int) -> list[PeerEntry] | None:
        """Whom ``peer`` weights (at most ``count``, hints for discovery); None if it did not say."""
        address = self.address_of(peer)
        rec = self.calls.table.records.get(peer)
        if address is None or rec is None or RECOMMEND_FEATURE not in rec.features:
            return None  # (a peer whose handshake did not name the feature is not asked: 0.1.0)
        ask = RecommendAsk(self.node_id, min(count, MAX_RECOMMEND))
        try:
            reply = await self.calls.call(
                peer, RECOMMEND.kind, lambda timeout: self.transport.call(RECOMMEND, address, ask, timeout, peer=peer)
            )
            if reply.sender != peer:
                raise WireError(f"recommendations claim to be from {reply.sender!r}, expected {peer!r}")
            return list(reply.peers)
        except (PeerCallError, WireError) as e:
            self.failed("recommendation request", peer, e)
            return None
