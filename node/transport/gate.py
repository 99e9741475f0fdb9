"""The gate: the one way from any transport to this node's ``PeerHandler``.

Every transport (the gRPC server, the in-process switchboard) decodes a request into domain
objects, hands it to the gate with the ``Caller`` it came from, and encodes what comes back. The
gate applies, once for all of them and in this order, what used to be written once per transport:

The unary calls take one path (``unary``), as their table (``peering/api.py``) declares each;
snapshots and compute requests, which are streams, have their own steps below.

- **claimed id**: every node id a request claims (handshake node, heartbeat sender, requester,
  ...) must be well formed (``security/ids.py``) and vouched for by the caller — gRPC with mTLS:
  the id in its certificate (and on the allow-list); in-process: the node its client was opened
  for; plaintext gRPC: anyone (``Caller.vouch`` is the transport's part);
- **known peer**: snapshot, compute and gossip requests only from a node this one knows, before
  any payload of theirs is read;
- **references and sizes**: a snapshot reference names a well-formed id; a compute payload fits
  ``limits.max_model_bytes``; a unary call's payload its entry's ``check`` (gossip: the key
  ``MAX_GOSSIP_KEY``, the payload ``limits.max_gossip_bytes``);
- **admission**: the handler's per-peer slot (``admit(peer, kind)``) around the work, held by
  the transport's ``slot`` where the call outlives one step (a payload still to read, a reply
  still to send);
- **refusal → error**: ``refusal_of`` says what a failure means to the caller (a ``Refusal`` of
  its kind; a malformed tensor payload is ``invalid``), each transport then says it its way.

``limits`` is the node's ``SizeLimits``: shared with the transport's clients, set once by the node."""

from __future__ import annotations

import contextlib
from typing import Protocol, TypeVar

from ..peering.api import Unary
from ..peering.errors import INVALID, Refusal, invalid
from ..peering.interfaces import PeerHandler, SizeLimits
from ..peering.messages import ComputeReply, ComputeRequest, LocalSnapshot
from ..security.ids import node_id_problem
from ..wire.codec import WireError

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class Caller(Protocol):
    """Who a request came from, as its transport knows it."""

    def vouch(self, claimed: str, what: str) -> str:
        """``claimed`` (a well-formed node id) if the caller may speak for it; else raise
        ``errors.forbidden`` naming ``what``."""
        ...


def refusal_of(e: BaseException) -> Refusal | None:
    """What a failure at the served side tells the caller: a ``Refusal`` (a malformed tensor
    payload, ``WireError``, is an ``invalid`` one); None for anything else (a bug here, not the
    peer's fault: the transport reports it as such)."""
    if isinstance(e, Refusal):
        return e
    if isinstance(e, WireError):
        return Refusal(INVALID, str(e))
    return None


class Gate:
    def __init__(self, handler: PeerHandler, limits: SizeLimits):
        self.handler = handler
        self.limits = limits

    @property
    def node_id(self) -> str:
        return self.handler.node_id

    # --- who asks ---
    def claimed(self, caller: Caller, claimed: str, what: str) -> str:
        """The node id a request claims, once well formed and vouched for by ``caller``."""
        problem = node_id_problem(claimed)
        if problem:
            raise invalid(f"{what}: {problem}")
        return caller.vouch(claimed, what)

    def known(self, caller: Caller, claimed: str, what: str) -> str:
        """``claimed`` as ``claimed`` says, and a peer this node knows."""
        who = self.claimed(caller, claimed, what)
        self.handler.check_known(who)
        return who

    # --- the unary calls (peering/api.py), one path for all ---
    async def unary(self, rpc: Unary[Req, Rep], caller: Caller, request: Req) -> Rep:
        """``request`` answered as ``rpc`` declares: its claimed id vouched for by ``caller``, a
        known peer's if it must be, within its size limits, in one of the caller's admission
        slots if it takes one."""
        who = self.claimed(caller, rpc.caller(request), rpc.said)
        if rpc.known:
            self.handler.check_known(who)
        if rpc.check is not None:
            rpc.check(request, self.limits)
        if not rpc.admit:
            return await rpc.answer(self.handler, request)
        with self.handler.admit(who, rpc.kind):
            return await rpc.answer(self.handler, request)

    # --- snapshots (the transport applies its own bounds on streams between the steps) ---
    def requester(self, caller: Caller, requester: str, what: str = "snapshot request") -> str:
        """Who asks for a snapshot: vouched for by ``caller`` and known."""
        return self.known(caller, requester, what)

    async def snapshot(self, who: str, min_round: int, wait_s: float, slot: contextlib.ExitStack) -> LocalSnapshot:
        """The snapshot to answer ``who`` (a ``requester``) with, waiting for ``min_round`` if
        asked; its admission slot held by ``slot`` (until the answer is out)."""
        slot.enter_context(self.handler.admit(who, "snapshot"))
        return await self.handler.snapshot(who, min_round, wait_s)

    def open_watch(self, who: str) -> None:
        """``who`` (a ``requester``) opens a subscription: it costs a request from its budget."""
        with self.handler.admit(who, "snapshot"):
            pass

    async def watched(self, who: str, min_round: int, wait_s: float) -> LocalSnapshot:
        """The next snapshot of a subscription (refused once ``who`` is no longer known)."""
        return await self.handler.snapshot(who, min_round, wait_s)

    # --- compute on my data ---
    def admit_compute(
        self, caller: Caller, req: ComputeRequest, size: int, slot: contextlib.ExitStack, *, announced: bool = False
    ) -> ComputeRequest:
        """``req`` once its requester is vouched for and known (before a payload is taken from a
        stranger), its reference well formed and its payload of ``size`` bytes (``announced``:
        not read yet) within ``max_model_bytes``; one of its admission slots held by ``slot``."""
        kind = req.kind
        req.requester = self.known(caller, req.requester, kind)
        who = f"{kind} from {req.requester}"
        if req.ref is not None and node_id_problem(req.ref.node_id):
            raise invalid(f"{who}: snapshot reference: {node_id_problem(req.ref.node_id)}")
        limit = self.limits.max_model_bytes
        if req.ref is None and size > limit:
            raise invalid(
                f"{who}: {'announced ' if announced else ''}payload of {size} bytes exceeds the limit of {limit}"
            )
        slot.enter_context(self.handler.admit(req.requester, kind))
        return req

    async def compute(self, req: ComputeRequest) -> ComputeReply:
        """An admitted request (``admit_compute``), its payload read."""
        return await self.handler.compute(req)
