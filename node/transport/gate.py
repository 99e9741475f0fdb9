"""The gate: the one way from any transport to this node's ``PeerHandler``.

Every transport (the gRPC server, the in-process switchboard) decodes a request into domain
objects, hands it to the gate with the ``Caller`` it came from, and encodes what comes back. The
gate applies, once for all of them and in this order, what used to be written once per transport:

- **claimed id**: every node id a request claims (handshake node, heartbeat sender, requester,
  ...) must be well formed (``security/ids.py``) and vouched for by the caller — gRPC with mTLS:
  the id in its certificate (and on the allow-list); in-process: the node its client was opened
  for; plaintext gRPC: anyone (``Caller.vouch`` is the transport's part);
- **known peer**: snapshot, compute and gossip requests only from a node this one knows, before
  any payload of theirs is read;
- **references and sizes**: a snapshot reference names a well-formed id; a compute payload fits
  ``limits.max_model_bytes``; a gossip key ``MAX_GOSSIP_KEY`` and its payload
  ``limits.max_gossip_bytes`` (msgpack, a map);
- **admission**: the handler's per-peer slot (``admit(peer, kind)``) around the work, held by
  the transport's ``slot`` where the call outlives one step (a payload still to read, a reply
  still to send);
- **refusal → error**: ``refusal_of`` says what a failure means to the caller (a ``Refusal`` of
  its kind; a malformed tensor payload is ``invalid``), each transport then says it its way.

``limits`` is the node's ``SizeLimits``: shared with the transport's clients, set once by the node."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import msgpack

from ..peering.errors import INVALID, Refusal, invalid, short
from ..peering.interfaces import PeerHandler, SizeLimits
from ..peering.messages import (MAX_GOSSIP_KEY, Beat, ComputeReply, ComputeRequest, IndirectProbe, LocalSnapshot,
                                MemberUpdate, NodeInfo, PeerEntry)
from ..security.ids import node_id_problem
from ..wire.codec import WireError


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

    # --- membership ---
    def info(self) -> NodeInfo:
        return self.handler.info()

    def handshake(self, caller: Caller, remote: NodeInfo,
                  vouched: Callable[[], None] | None = None) -> list[PeerEntry]:
        """``vouched``: called once the caller is who it claims (its request counted)."""
        self.claimed(caller, remote.node_id, "handshake")
        if vouched is not None:
            vouched()
        return self.handler.on_handshake(remote)

    def heartbeat(self, caller: Caller, beat: Beat) -> Beat:
        self.claimed(caller, beat.node_id, "heartbeat")
        return self.handler.on_heartbeat(beat)

    def peer_list(self, caller: Caller, sender: str, entries: list[PeerEntry], members: tuple[MemberUpdate, ...],
                  incarnation: int) -> tuple[list[PeerEntry], list[MemberUpdate], int]:
        sender = self.claimed(caller, sender, "peer exchange")
        return self.handler.on_peer_list(sender, entries, members, incarnation)

    async def indirect_probe(self, caller: Caller, probe: IndirectProbe) -> tuple[bool, tuple[MemberUpdate, ...]]:
        self.claimed(caller, probe.requester, "indirect probe")
        return await self.handler.on_indirect_probe(probe)

    # --- snapshots ---
    async def snapshot(self, caller: Caller, requester: str, min_round: int, wait_s: float,
                       slot: contextlib.ExitStack, what: str = "snapshot request",
                       before_admit: Callable[[str], None] | None = None) -> tuple[str, LocalSnapshot]:
        """Who asks and the snapshot to answer with (waiting for ``min_round`` if asked); its
        admission slot is held by ``slot`` (until the answer is out). ``before_admit``: the
        transport's own bound on the call (a pull session's), checked before admission."""
        who = self.known(caller, requester, what)
        if before_admit is not None:
            before_admit(who)
        slot.enter_context(self.handler.admit(who, "snapshot"))
        return who, await self.handler.snapshot(who, min_round, wait_s)

    def open_watch(self, caller: Caller, requester: str, bound: Callable[[str], None]) -> str:
        """Who opens a subscription, once ``bound`` (the transport's count of open ones) lets it:
        opening one costs a request from the peer's budget."""
        who = self.known(caller, requester, "snapshot watch")
        bound(who)
        with self.handler.admit(who, "snapshot"):
            pass
        return who

    async def watched(self, who: str, min_round: int, wait_s: float) -> LocalSnapshot:
        """The next snapshot of a subscription (refused once ``who`` is no longer known)."""
        return await self.handler.snapshot(who, min_round, wait_s)

    # --- compute on my data ---
    def admit_compute(self, caller: Caller, req: ComputeRequest, size: int, slot: contextlib.ExitStack, *,
                      announced: bool = False) -> ComputeRequest:
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
            raise invalid(f"{who}: {'announced ' if announced else ''}payload of {size} bytes exceeds the limit "
                          f"of {limit}")
        slot.enter_context(self.handler.admit(req.requester, kind))
        return req

    async def compute(self, req: ComputeRequest) -> ComputeReply:
        """An admitted request (``admit_compute``), its payload read."""
        return await self.handler.compute(req)

    # --- gossip ---
    async def gossip(self, caller: Caller, sender: str, key: str, raw: bytes) -> bytes:
        """A strategy's gossip: ``raw`` msgpack in, the handler's reply as msgpack out."""
        sender = self.known(caller, sender, "gossip")
        if len(key) > MAX_GOSSIP_KEY:
            raise invalid(f"gossip from {sender}: key of {len(key)} characters, at most {MAX_GOSSIP_KEY}")
        with self.handler.admit(sender, "gossip"):
            limit = self.limits.max_gossip_bytes
            if len(raw) > limit:
                raise invalid(f"gossip from {sender}: {len(raw)} bytes exceeds the limit of {limit}")
            try:
                payload: Any = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            except Exception as e:  # msgpack raises a zoo of types on garbage
                raise invalid(f"gossip from {sender}: payload is not msgpack ({short(str(e), 200)})") from None
            if not isinstance(payload, dict):
                raise invalid(f"gossip from {sender}: payload is not a map")
            return msgpack.packb(await self.handler.gossip(sender, key, payload), use_bin_type=True)
