"""The served side: what this node does for a peer's request — membership answers, its published
snapshot, and compute on its private data (cross-loss, cross-gradient incl. COBO's alignment,
FedeRiCo's gradient push) and strategy gossip. Implements ``interfaces.PeerHandler``; every
refusal is an ``errors.Refusal`` naming the peer and the problem."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

import torch

from ..learning.learner import Learner, Params
from ..strategies.base import PushedGradient
from ..wire.codec import Groups, WireError
from .errors import Refusal, invalid, not_cached
from .errors import UNAVAILABLE
from .inbox import PushInbox
from .membership import Membership
from .messages import (CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, Beat, ComputeReply, ComputeRequest, IndirectProbe,
                       LocalSnapshot, MemberUpdate, NodeInfo, PeerEntry)
from .problems import ProblemLog
from .snapshots import PublishBoard, SnapshotCache
from .validation import Spec, model_tensors

SPLITS = ("train", "val", "test")
REDUCTIONS = ("mean", "sum")
MAX_SNAPSHOT_WAIT_S = 60.0  # a round-aligned pull holds a call open at most this long


class StrategyHooks(Protocol):
    """What the served side tells the strategy (it never sees the transport)."""

    def on_gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None: ...
    def on_alignment(self, peer: str, inner_product: float) -> None: ...


class ServedRequests:
    def __init__(self, node_id: str, info: Callable[[], NodeInfo], membership: Membership,
                 learner: Learner, spec: Spec, hooks: StrategyHooks, board: PublishBoard,
                 cache: SnapshotCache, inbox: PushInbox, problems: ProblemLog,
                 on_refused: Callable[[str], None] | None = None):
        self.node_id = node_id
        self.info = info
        self.membership = membership
        self.learner = learner
        self.spec = spec
        self.hooks = hooks
        self.board = board
        self.cache = cache
        self.inbox = inbox
        self.problems = problems
        self.on_refused = on_refused or (lambda kind: None)

    # ------------------------------------------------------------------ membership
    def on_handshake(self, remote: NodeInfo) -> list[PeerEntry]:
        return self.membership.on_handshake(remote)

    def on_heartbeat(self, beat: Beat) -> Beat:
        self._count_unknown(beat.node_id)
        return self.membership.on_heartbeat(beat)

    async def on_indirect_probe(self, probe: IndirectProbe) -> tuple[bool, tuple[MemberUpdate, ...]]:
        self._count_unknown(probe.requester)
        return await self.membership.on_indirect_probe(probe)

    def on_peer_list(self, sender: str, entries: list[PeerEntry], members=(), incarnation: int = 0
                     ) -> tuple[list[PeerEntry], list[MemberUpdate], int]:
        self._count_unknown(sender)
        return self.membership.on_peer_list(sender, entries, members, incarnation)

    def _count_unknown(self, node_id: str) -> None:
        if node_id not in self.membership.peers.records:
            self.on_refused("unknown_peer")

    def check_known(self, node_id: str) -> None:
        try:
            self.membership.check_known(node_id)
        except Refusal:
            self.on_refused("unknown_peer")
            raise

    # ------------------------------------------------------------------ snapshots
    async def snapshot(self, requester: str, min_round: int = 0, wait_s: float = 0.0) -> LocalSnapshot:
        self.check_known(requester)
        if min_round > 0:
            snap = await self.board.wait_for_round(min_round, min(max(wait_s, 0.0), MAX_SNAPSHOT_WAIT_S))
        else:
            snap = self.board.current
        if snap is None:
            raise Refusal(UNAVAILABLE, "no snapshot published yet")
        return await snap.ready()  # encoded and hashed off the loop

    # ------------------------------------------------------------------ compute on my data
    async def _groups(self, req: ComputeRequest) -> Groups:
        if req.ref is None:
            if req.groups is None:
                raise invalid(f"{req.kind} from {req.requester}: neither a model nor a reference")
            return req.groups
        mine = self.board.current
        if mine is not None and req.ref.node_id == self.node_id:
            await mine.ready()
        if (req.ref.node_id == self.node_id and mine is not None and req.ref.version == mine.version
                and (not req.ref.digest or req.ref.digest == mine.digest)):
            return {"params": mine.params}
        snap = self.cache.resolve(req.ref)
        if snap is None:
            raise not_cached(f"{req.ref.node_id} v{req.ref.version}")
        return {"params": snap.params}

    def _tensors(self, req: ComputeRequest, groups: Groups, group: str) -> Params:
        """A tensor group of the request: this architecture's shapes, finite — or refused."""
        try:
            return model_tensors(groups, group, self.spec, f"{req.kind} from {req.requester}")
        except WireError as e:
            self.on_refused(req.kind)
            self.problems.note(req.requester, str(e), rejected=True)
            raise invalid(str(e)) from None

    @staticmethod
    def _options(req: ComputeRequest) -> tuple[str, int | None, str]:
        if req.split not in SPLITS:
            raise invalid(f"{req.kind} from {req.requester}: unknown split {req.split!r}")
        if req.reduction not in REDUCTIONS:
            raise invalid(f"{req.kind} from {req.requester}: unknown reduction {req.reduction!r}")
        return req.split, req.max_samples or None, req.reduction

    async def compute(self, req: ComputeRequest) -> ComputeReply:
        self.check_known(req.requester)
        groups = await self._groups(req)
        if req.kind == CROSS_LOSS:
            params = self._tensors(req, groups, "params")
            split, n, reduction = self._options(req)
            res = await asyncio.to_thread(self.learner.loss, params, split, n, reduction)
            return ComputeReply(loss=res.loss, samples=res.n)
        if req.kind == CROSS_GRADIENT:
            params = self._tensors(req, groups, "params")
            align = self._tensors(req, groups, "align") if req.align else None
            split, n, reduction = self._options(req)
            grad, res = await asyncio.to_thread(self.learner.gradient, params, split, n, reduction)
            if align is None:
                return ComputeReply(loss=res.loss, samples=res.n, grad={"grad": grad})
            ip = float(sum(torch.sum(grad[k] * align[k]) for k in grad))
            self.hooks.on_alignment(req.requester, ip)  # COBO: the served end updates its w too
            return ComputeReply(loss=res.loss, samples=res.n, inner_product=ip)
        if req.kind == PUSH_GRADIENT:
            grad = self._tensors(req, groups, "grad")
            self.inbox.put(PushedGradient(req.requester, int(req.target_version), grad))
            mine = self.board.current
            return ComputeReply(accepted=True,
                                message=f"queued for the update after version {mine.version if mine else 0}")
        raise invalid(f"unknown compute request kind {req.kind!r}")

    async def gossip(self, requester: str, key: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.check_known(requester)
        reply = self.hooks.on_gossip(requester, key, payload)
        if reply is None:
            raise invalid(f"this node's strategy does not understand gossip key {key!r}")
        return reply
