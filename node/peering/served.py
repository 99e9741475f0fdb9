"""The served side: what this node does for a peer's request — membership answers, its published
snapshot, and compute on its private data (cross-loss, cross-gradient incl. COBO's alignment,
FedeRiCo's gradient push) and strategy gossip. Implements ``interfaces.PeerHandler``; every
refusal is an ``errors.Refusal`` naming the peer and the problem.

A request on my data names a purpose (``privacy/purposes.py``); I answer only the purposes I
serve, on the purpose's split, through ``privacy.mechanisms.PrivateData`` (minimum batch, DP
noise, ledger) — a spent privacy budget is a ``PRIVACY_BUDGET`` refusal.

Peers' compute runs on a small executor of its own (``compute_workers`` threads), so however many
requests arrive the node's own training never queues behind them, and each request's time is
billed to the peer that asked (``admission``)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..learning.learner import Learner, Params
from ..privacy.ledger import BudgetSpent
from ..privacy.mechanisms import PrivateData
from ..privacy.purposes import ALIGNMENT, GRADIENT, LOSS, PURPOSES, PUSH, Purpose
from ..strategies.base import PushedGradient
from ..wire.codec import Groups, WireError
from .admission import Admission
from .api import LinkReply, LinkRequest, RecommendAsk, Recommendations, RevocationList, ViewSample
from .discovery import Discovery
from .errors import PRIVACY_BUDGET, UNAVAILABLE, Refusal, budget_spent, invalid, not_cached, refused
from .inbox import PushInbox
from .membership import Membership
from .messages import (
    CROSS_GRADIENT,
    CROSS_LOSS,
    PUSH_GRADIENT,
    Beat,
    ComputeReply,
    ComputeRequest,
    IndirectProbe,
    LocalSnapshot,
    MemberUpdate,
    NodeInfo,
    PeerEntry,
)
from .overlay import Overlay
from .problems import ProblemLog
from .snapshots import PublishBoard, SnapshotCache
from .validation import Spec, model_tensors
from .versions import LEGACY_CRL_KEY

REDUCTIONS = ("mean", "sum")
MAX_SNAPSHOT_WAIT_S = 60.0  # a round-aligned pull holds a call open at most this long
NORM_SAMPLES = 64  # minibatch of this node's own gradient that pushed gradients are compared with
NORM_HISTORY = 8  # own gradient norms kept (one per published version a push was checked against)


def _norm(tensors: Params) -> float:
    return math.sqrt(sum(float(torch.sum(t.double() ** 2)) for t in tensors.values()))


class RevocationExchange(Protocol):
    """The CA's revocation list exchange (``security/crl_gossip.py``)."""

    def answer(self, theirs: RevocationList) -> RevocationList: ...
    def answer_legacy(self, peer: str, payload: dict[str, Any]) -> dict[str, Any]: ...


class StrategyHooks(Protocol):
    """What the served side tells the strategy (it never sees the transport)."""

    def on_gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None: ...
    def on_alignment(self, peer: str, inner_product: float) -> None: ...


@dataclass(frozen=True)
class ServedSettings:
    """What the served side is told once: this node's id and architecture, the purposes it
    answers (its strategy's, by default), how pushed gradients are bounded, and how many threads
    serve peers' compute."""

    node_id: str
    spec: Spec
    serves: tuple[str, ...]
    max_push_lag: int  # a pushed gradient's target version at most this far behind mine
    push_norm_factor: float  # pushes clipped to this × my own recent gradient norm
    compute_workers: int = 2


class ServedRequests:
    def __init__(
        self,
        settings: ServedSettings,
        info: Callable[[], NodeInfo],
        membership: Membership,
        learner: Learner,
        hooks: StrategyHooks,
        private: PrivateData,
        board: PublishBoard,
        cache: SnapshotCache,
        inbox: PushInbox,
        problems: ProblemLog,
        *,
        admission: Admission,
        on_refused: Callable[[str], None] | None = None,
        revocations: RevocationExchange | None = None,
        discovery: Discovery | None = None,
        overlay: Overlay | None = None,
    ):
        """``board``: what I publish; ``cache``: peers' snapshots a request may name; ``inbox``:
        where accepted gradient pushes wait for the strategy; ``on_refused``: counts refusals by
        kind; ``revocations``: None without a network CA (plaintext); ``discovery``: whom this node
        weights, answered to "whom do you weight?" (None: the question is refused); ``overlay``:
        this node's partial views (None: full membership; shuffles and link requests refused)."""
        self.settings = settings
        self.node_id = settings.node_id
        self.info = info
        self.membership = membership
        self.learner = learner  # my own work (the push-norm reference); answers go through private
        self.hooks = hooks
        self.private = private  # every answer computed on my data leaves through it
        self.board = board
        self.cache = cache
        self.inbox = inbox
        self.problems = problems
        self.admission = admission
        self.on_refused = on_refused or (lambda kind: None)
        self.revocations = revocations
        self.discovery = discovery
        self.overlay = overlay
        self._pool = ThreadPoolExecutor(settings.compute_workers, thread_name_prefix="served-compute")
        self._own_norms: deque[tuple[int, float]] = deque(maxlen=NORM_HISTORY)  # (version, ‖g‖)
        self._norm_lock = asyncio.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def admit(self, peer: str, kind: str) -> AbstractContextManager[None]:
        """One of ``peer``'s slots for a ``kind`` request (``admission.Admission``)."""
        return self.admission.admit(peer, kind)

    async def _run(self, peer: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn`` on the served-compute threads; the CPU time it took is billed to ``peer`` (not
        wall time: on a loaded node a request waiting for the CPU, a lock or a warm-up would be
        billed for everyone else's work, and one slow request locked its peer out for ~36 s)."""

        def timed():
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                if peer is not None:
                    spent = time.thread_time() - t0
                    loop.call_soon_threadsafe(self.admission.charge, peer, spent)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, timed)

    # ------------------------------------------------------------------ membership
    def on_handshake(self, remote: NodeInfo) -> list[PeerEntry]:
        return self.membership.on_handshake(remote)

    def on_heartbeat(self, beat: Beat) -> Beat:
        self._count_unknown(beat.node_id)
        return self.membership.on_heartbeat(beat)

    async def on_indirect_probe(self, probe: IndirectProbe) -> tuple[bool, tuple[MemberUpdate, ...]]:
        self._count_unknown(probe.requester)
        return await self.membership.on_indirect_probe(probe)

    def on_peer_list(
        self, sender: str, entries: list[PeerEntry], members=(), incarnation: int = 0
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
        if (
            req.ref.node_id == self.node_id
            and mine is not None
            and req.ref.version == mine.version
            and (not req.ref.digest or req.ref.digest == mine.digest)
        ):
            return {"params": mine.params}
        snap = self.cache.resolve(req.ref)
        if snap is None:
            raise not_cached(f"{req.ref.node_id} v{req.ref.version}")
        return {"params": snap.params}

    def _tensors(self, req: ComputeRequest, groups: Groups, group: str) -> Params:
        """A tensor group of the request: this architecture's shapes, finite — or refused."""
        try:
            return model_tensors(groups, group, self.settings.spec, f"{req.kind} from {req.requester}")
        except WireError as e:
            self.on_refused(req.kind)
            self.problems.note(req.requester, str(e), rejected=True)
            raise invalid(str(e)) from None

    def _purpose(self, req: ComputeRequest) -> Purpose:
        """The purpose the request names, if this node serves it for this kind of request, on
        its split — or refused, naming what was wrong."""
        who = f"{req.kind} from {req.requester}"
        if not req.purpose:
            raise invalid(
                f"{who} names no purpose; every request on this node's data must say "
                f"which strategy step it serves (one of {sorted(PURPOSES)})"
            )
        p = PURPOSES.get(req.purpose)
        if p is None:
            raise invalid(f"{who}: unknown purpose {req.purpose!r}; known: {sorted(PURPOSES)}")
        kind = {CROSS_LOSS: LOSS, PUSH_GRADIENT: PUSH}.get(req.kind, ALIGNMENT if req.align else GRADIENT)
        if p.kind != kind:
            raise invalid(f"{who}: purpose {p.name!r} is for {p.kind} requests, not {kind}")
        if p.name not in self.settings.serves:
            raise refused(
                f"{who}: this node does not serve purpose {p.name!r} (it serves "
                f"{list(self.settings.serves) or 'none'}: only what its strategy needs)"
            )
        if req.split == "test":
            raise invalid(f"{who}: the test split is never served")
        if req.split and req.split != p.split:
            raise invalid(f"{who}: purpose {p.name!r} is answered on the {p.split!r} split only, not {req.split!r}")
        if req.kind == CROSS_LOSS and req.reduction not in REDUCTIONS:
            raise invalid(f"{who}: unknown reduction {req.reduction!r}")
        return p

    def _release(self, req: ComputeRequest, fn, *args):
        """Run a release on my data off the event loop; a spent budget becomes a refusal."""
        try:
            return fn(req.requester, *args)
        except BudgetSpent as e:
            self.on_refused(PRIVACY_BUDGET)
            raise budget_spent(str(e)) from None

    async def compute(self, req: ComputeRequest) -> ComputeReply:
        try:  # (the gate checked the requester is known)
            purpose = self._purpose(req)
        except Refusal:
            self.on_refused(req.kind)
            raise
        groups = await self._groups(req)
        if req.kind == CROSS_LOSS:
            params = self._tensors(req, groups, "params")
            rel = await self._run(
                req.requester, self._release, req, self.private.loss, purpose, params, req.max_samples, req.reduction
            )
            return ComputeReply(loss=rel.value, samples=rel.samples)
        if req.kind == CROSS_GRADIENT:
            params = self._tensors(req, groups, "params")
            align = self._tensors(req, groups, "align") if req.align else None
            rel, loss = await self._run(
                req.requester, self._release, req, self.private.gradient, purpose, params, req.max_samples
            )
            if align is None:
                return ComputeReply(loss=loss, samples=rel.samples, grad={"grad": rel.value})
            # COBO: ⟨my released gradient, theirs⟩ is post-processing of the release
            ip = float(sum(torch.sum(rel.value[k].double() * align[k].double()) for k in rel.value))
            self.hooks.on_alignment(req.requester, ip)  # the served end updates its w too
            return ComputeReply(loss=loss, samples=rel.samples, inner_product=ip)
        if req.kind == PUSH_GRADIENT:
            return await self._push(req, groups)
        raise invalid(f"unknown compute request kind {req.kind!r}")

    # ------------------------------------------------------------------ pushed gradients
    def _reject_push(self, req: ComputeRequest, message: str) -> Refusal:
        self.on_refused(req.kind)
        self.problems.note(req.requester, message, rejected=True)
        return invalid(message)

    async def _own_norm(self, mine: LocalSnapshot) -> float:
        """This node's recent gradient norm: the largest of its own minibatch gradient norms at
        the last few published versions (one computed per version, on demand)."""
        async with self._norm_lock:
            if not self._own_norms or self._own_norms[-1][0] != mine.version:
                g, _ = await self._run(None, self.learner.gradient, mine.params, "train", NORM_SAMPLES, "mean")
                self._own_norms.append((mine.version, _norm(g)))
            return max(n for _, n in self._own_norms)

    async def _push(self, req: ComputeRequest, groups: Groups) -> ComputeReply:
        """FedeRiCo's M-step gradient from a peer, checked before the strategy ever sees it: its
        target version must be one this node published lately, and its norm is clipped to
        ``push_norm_factor`` × this node's own recent gradient norm (a 1e30 gradient is finite,
        so the NaN check alone lets it through)."""
        grad = self._tensors(req, groups, "grad")
        mine = self.board.current
        current = mine.version if mine is not None else 0
        target, lag = int(req.target_version), self.settings.max_push_lag
        who = f"gradient push from {req.requester}"
        if target > current:
            raise self._reject_push(
                req, f"{who}: target version {target} is ahead of this node's published version {current}"
            )
        if target < max(1, current - lag):
            raise self._reject_push(
                req,
                f"{who}: target version {target} is more than {lag} versions "
                f"behind this node's {current} (or not a version at all)",
            )
        assert mine is not None  # (else current is 0 and every target was refused above)
        norm = await self._run(req.requester, _norm, grad)
        ceiling = self.settings.push_norm_factor * await self._own_norm(mine)
        message = f"queued for the update after version {current}"
        if norm > ceiling:
            scale = ceiling / norm
            grad = await self._run(req.requester, lambda: {k: t * scale for k, t in grad.items()})
            message = (
                f"clipped: norm {norm:.3g} exceeds {self.settings.push_norm_factor:g}× this "
                f"node's own gradient norm ({ceiling:.3g}); {message}"
            )
            self.on_refused("push_clipped")
            self.problems.note(req.requester, f"{who}: {message}", rejected=True)
        self.inbox.put(PushedGradient(req.requester, target, grad))
        return ComputeReply(accepted=True, message=message)

    async def gossip(self, requester: str, key: str, payload: dict[str, Any]) -> dict[str, Any]:
        if key == LEGACY_CRL_KEY and self.revocations is not None:  # a 0.1.0 peer's revocation list
            return self.revocations.answer_legacy(requester, payload)
        reply = self.hooks.on_gossip(requester, key, payload)
        if reply is None:
            raise invalid(f"this node's strategy does not understand gossip key {key!r}")
        return reply

    def on_revocations(self, theirs: RevocationList) -> RevocationList:
        """A peer's revocation list offered (taken if newer and the CA's), this node's in answer."""
        if self.revocations is None:
            raise refused(f"revocation list from {theirs.sender}: this node has no network CA (no mTLS)")
        return self.revocations.answer(theirs)

    def on_recommend(self, ask: RecommendAsk) -> Recommendations:
        """ "Whom do you weight?": the peers I weight most and know alive, with their addresses
        (never the asker); the asker, a known peer that evaluates me, becomes a hint for me."""
        if self.discovery is None:
            raise refused(f"recommendation request from {ask.sender}: this node runs no discovery")
        self.discovery.on_contacted(ask.sender)
        records = self.membership.peers.records
        ids = [p for p in self.discovery.recommend(ask.sender, ask.count) if p in records]
        return Recommendations(self.node_id, tuple(PeerEntry(p, records[p].address, records[p].age()) for p in ids))

    def _overlay(self, what: str) -> Overlay:
        if self.overlay is None:
            raise refused(f"{what}: this node runs full membership, not partial views")
        return self.overlay

    def on_shuffle(self, sample: ViewSample) -> ViewSample:
        return self._overlay(f"shuffle from {sample.sender}").on_shuffle(sample)

    def on_link(self, req: LinkRequest) -> LinkReply:
        return self._overlay(f"link request from {req.sender}").on_link(req)
