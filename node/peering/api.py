"""The peer API's unary calls, each declared once (the domain side; the wire side of each is its
serde pair in ``transport/serde.py``'s ``WIRE``).

A ``Unary`` says everything a transport needs to serve and make the call: its name (the proto
method), the domain request and reply, which field of the request names the caller (vouched by
the transport: the certificate's id over mTLS), whether the caller must be a peer this node knows,
its admission kind (a per-peer slot held while it is answered), the size checks on its payload,
and how the ``PeerHandler`` answers it. From the table:

- the gate (``transport/gate.py``) runs one path for every entry: claimed id, known peer, sizes,
  admission, then ``serve``;
- the gRPC servicer (``transport/server.py``) gets one method per entry: parse → gate → encode;
- each client (gRPC ``transport/client.py``, in-process ``transport/inproc.py``, routing
  ``transport/routing.py``) implements one ``call(rpc, address, request, ...)``; the named methods
  callers use (``heartbeat``, ``gossip``, ...) are ``UnaryCalls``'s, written once for all three,
  with the calling-side checks;
- tests/peer_fuzz.py fuzzes every entry; tests/test_architecture.py checks every entry is served
  by both transports, through the gate, with a serde pair.

Adding a unary RPC: its messages in ``proto/coterie/v1/peer.proto`` (stubs: proto/generate.sh),
its domain types and entry here, its serde pair in ``serde.WIRE``, the handler method that answers
it, and the caller. See docs/extending.md. Streams (snapshot pulls and watches, compute uploads)
are written by hand where their flow control needs it."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgpack

from ..wire.codec import WireError
from .errors import INVALID, PeerCallError, Refusal, invalid, short
from .interfaces import PeerHandler, SizeLimits
from .messages import (
    CROSS_GRADIENT,
    CROSS_LOSS,
    MAX_GOSSIP_KEY,
    PUSH_GRADIENT,
    Beat,
    Gossip,
    IndirectProbe,
    MemberUpdate,
    NodeInfo,
    PeerEntry,
    PeerList,
    ProbeReply,
    Welcome,
)

Req = TypeVar("Req")
Rep = TypeVar("Rep")

MAX_CRL_BYTES = 1 << 20  # a revocation list (PEM); a CA revoking ~10^4 certificates fits
MAX_RECOMMEND = 16  # peers in one answer to "whom do you weight?" (discovery asks for 5)
MAX_ID_CHARS = 128  # a node id in an answer (security/ids.py's limit; the handshake checks the rest)
MAX_ADDRESS_CHARS = 512  # an address in an answer
MAX_SAMPLE = 32  # entries in one shuffle of partial views (a shuffle sends about 8)
MAX_TTL = 16  # hops a forwarded join may still walk


# --- messages of calls whose types live nowhere else (the membership ones are in messages.py) ---
@dataclass(frozen=True)
class RevocationList:
    """The network CA's certificate revocation list as a node holds it (``number`` 0 and no
    ``crl``: none), both ways. Self-authenticating: the receiver checks the CA's signature."""

    sender: str
    number: int = 0
    crl: bytes = b""


@dataclass(frozen=True)
class RecommendAsk:
    """ "Whom do you weight?" (``discovery.py``): ``sender`` asks for at most ``count`` peers."""

    sender: str
    count: int = 5


@dataclass(frozen=True)
class Recommendations:
    """The answer: the peers ``sender`` weights most that it knows alive, best first (hints)."""

    sender: str
    peers: tuple[PeerEntry, ...] = ()


@dataclass(frozen=True)
class ViewSample:
    """A shuffle of partial views (``overlay.py``) and its answer: a sample of the sender's views."""

    sender: str
    peers: tuple[PeerEntry, ...] = ()


JOIN, FORWARD_JOIN, NEIGHBOR, NEIGHBOR_URGENT, DISCONNECT = (
    "join",
    "forward_join",
    "neighbor",
    "neighbor_urgent",
    "disconnect",
)
LINK_KINDS = (JOIN, FORWARD_JOIN, NEIGHBOR, NEIGHBOR_URGENT, DISCONNECT)  # in the proto enum's order


@dataclass(frozen=True)
class LinkRequest:
    """A request about the active view of partial views (``kind``: one of ``LINK_KINDS``; ""
    for a kind this node does not know, refused)."""

    sender: str
    kind: str
    joined: PeerEntry | None = None  # FORWARD_JOIN: who joined
    ttl: int = 0
    address: str = ""  # where the sender is reached


@dataclass(frozen=True)
class LinkReply:
    sender: str
    accepted: bool = False


# --- the declaration ---
@dataclass(frozen=True)
class Unary(Generic[Req, Rep]):
    name: str  # the proto method (peer.proto's ``service Peer``)
    kind: str  # traffic and latency label, admission kind, and the word refusals use
    request: type[Req]
    reply: type[Rep]
    caller: Callable[[Req], str]  # the node id the request claims to come from
    serve: Callable[[PeerHandler, Req], Rep | Awaitable[Rep]]  # how this node answers (after the gate)
    known: bool = False  # only from a peer this node knows (checked before anything is read)
    admit: bool = False  # hold one of the caller's admission slots (``kind``) while answering
    check: Callable[[Req, SizeLimits], None] | None = None  # raise ``invalid`` if over a limit
    waits: bool = False  # its answer may take a while (in-process: own task, bounded by the deadline)
    control: bool = False  # membership traffic: never queued behind a model-sized transfer
    payload: Callable[[Any], int] = field(default=lambda m: 0)  # payload bytes, for traffic in memory
    what: str = ""  # in messages ("heartbeat from n1: ..."); default: kind

    @property
    def said(self) -> str:
        return self.what or self.kind

    async def answer(self, handler: PeerHandler, request: Req) -> Rep:
        out = self.serve(handler, request)
        return await out if inspect.isawaitable(out) else out


# --- how the handler answers each (the table's ``serve``) ---
def answered_by(method: str) -> Callable[[PeerHandler, Any], Any]:
    """``serve`` for a call the handler answers with one method: request in, reply out (the
    method need not be on the ``PeerHandler`` protocol; tests/test_architecture.py checks the
    node's handler has it)."""
    return lambda h, request: getattr(h, method)(request)


def _handshake(h: PeerHandler, remote: NodeInfo) -> Welcome:
    peers = h.on_handshake(remote)
    return Welcome(h.info(), tuple(peers))


def _peer_list(h: PeerHandler, r: PeerList) -> PeerList:
    entries, members, inc = h.on_peer_list(r.sender, list(r.entries), tuple(r.members), r.incarnation)
    return PeerList(h.node_id, tuple(entries), tuple(members), inc)


async def _probe(h: PeerHandler, p: IndirectProbe) -> ProbeReply:
    ack, updates = await h.on_indirect_probe(p)
    return ProbeReply(bool(ack), tuple(updates))


def unpack_map(raw: bytes, what: str) -> dict[str, Any]:
    """A msgpack map, or an ``invalid`` refusal naming ``what``."""
    try:
        out: Any = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise invalid(f"{what}: payload is not msgpack ({short(str(e), 200)})") from None
    if not isinstance(out, dict):
        raise invalid(f"{what}: payload is not a map")
    return out


def pack(payload: dict[str, Any]) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


async def _gossip(h: PeerHandler, g: Gossip) -> Gossip:
    payload = unpack_map(g.payload, f"gossip from {g.sender}")
    return Gossip(h.node_id, g.key, pack(await h.gossip(g.sender, g.key, payload)))


def _gossip_fits(g: Gossip, limits: SizeLimits) -> None:
    if len(g.key) > MAX_GOSSIP_KEY:
        raise invalid(f"gossip from {g.sender}: key of {len(g.key)} characters, at most {MAX_GOSSIP_KEY}")
    if len(g.payload) > limits.max_gossip_bytes:
        raise invalid(f"gossip from {g.sender}: {len(g.payload)} bytes exceeds the limit of {limits.max_gossip_bytes}")


def _crl_fits(r: RevocationList, limits: SizeLimits) -> None:
    if len(r.crl) > MAX_CRL_BYTES:
        raise invalid(f"revocation list from {r.sender}: {len(r.crl)} bytes exceeds the limit of {MAX_CRL_BYTES}")


def _recommend_fits(m: RecommendAsk | Recommendations, limits: SizeLimits) -> None:
    """A question asks for at most ``MAX_RECOMMEND``; an answer lists at most that many, each
    id and address of bounded length (checked by the asker on what comes back)."""
    if isinstance(m, RecommendAsk):
        if m.count > MAX_RECOMMEND:
            raise invalid(f"recommendation request from {m.sender}: asks for {m.count} peers, at most {MAX_RECOMMEND}")
        return
    _entries_fit(f"recommendations from {m.sender}", m.peers, MAX_RECOMMEND)


def _entries_fit(who: str, entries: Sequence[PeerEntry], most: int) -> None:
    if len(entries) > most:
        raise invalid(f"{who}: {len(entries)} peers, at most {most}")
    for e in entries:
        if not 0 < len(e.node_id) <= MAX_ID_CHARS or len(e.address) > MAX_ADDRESS_CHARS:
            raise invalid(f"{who}: a malformed entry ({short(e.node_id, 40)!r})")


def _sample_fits(m: ViewSample, limits: SizeLimits) -> None:
    _entries_fit(f"shuffle from {m.sender}", m.peers, MAX_SAMPLE)


def _link_fits(m: LinkRequest | LinkReply, limits: SizeLimits) -> None:
    if isinstance(m, LinkReply):
        return
    who = f"link request from {m.sender}"
    if len(m.address) > MAX_ADDRESS_CHARS:
        raise invalid(f"{who}: an address of {len(m.address)} characters")
    if m.kind not in LINK_KINDS:
        raise invalid(f"{who}: unknown kind")
    if m.kind == FORWARD_JOIN:
        if m.joined is None or m.ttl > MAX_TTL:
            raise invalid(f"{who}: a forwarded join needs the node that joined and a ttl of at most {MAX_TTL}")
        _entries_fit(who, (m.joined,), 1)


HANDSHAKE = Unary(
    "Handshake", "handshake", NodeInfo, Welcome, caller=lambda r: r.node_id, serve=_handshake, control=True
)
HEARTBEAT = Unary(
    "Heartbeat", "heartbeat", Beat, Beat, caller=lambda r: r.node_id, serve=lambda h, b: h.on_heartbeat(b), control=True
)
EXCHANGE_PEERS = Unary(
    "ExchangePeers",
    "peers",
    PeerList,
    PeerList,
    caller=lambda r: r.sender,
    serve=_peer_list,
    control=True,
    what="peer exchange",
)
INDIRECT_PROBE = Unary(
    "IndirectProbe",
    "probe",
    IndirectProbe,
    ProbeReply,
    caller=lambda r: r.requester,
    serve=_probe,
    waits=True,
    control=True,
    what="indirect probe",
)
GOSSIP = Unary(
    "GossipState",
    "gossip",
    Gossip,
    Gossip,
    caller=lambda r: r.sender,
    serve=_gossip,
    known=True,
    admit=True,
    check=_gossip_fits,
    waits=True,
    payload=lambda g: len(g.payload),
)
REVOCATIONS = Unary(
    "ExchangeRevocations",
    "revocations",
    RevocationList,
    RevocationList,
    caller=lambda r: r.sender,
    serve=answered_by("on_revocations"),
    known=True,
    admit=True,
    check=_crl_fits,
    payload=lambda r: len(r.crl),
    what="revocation list",
)

RECOMMEND = Unary(
    "Recommend",
    "recommend",
    RecommendAsk,
    Recommendations,
    caller=lambda r: r.sender,
    serve=answered_by("on_recommend"),
    known=True,
    admit=True,
    check=_recommend_fits,
    what="recommendation request",
)

SHUFFLE = Unary(
    "Shuffle",
    "shuffle",
    ViewSample,
    ViewSample,
    caller=lambda r: r.sender,
    serve=answered_by("on_shuffle"),
    known=True,
    admit=True,
    check=_sample_fits,
    control=True,
)
LINK = Unary(
    "Link",
    "link",
    LinkRequest,
    LinkReply,
    caller=lambda r: r.sender,
    serve=answered_by("on_link"),
    known=True,
    admit=True,
    check=_link_fits,
    control=True,
    what="link request",
)

UNARY: tuple[Unary, ...] = (
    HANDSHAKE,
    HEARTBEAT,
    EXCHANGE_PEERS,
    INDIRECT_PROBE,
    GOSSIP,
    REVOCATIONS,
    RECOMMEND,
    SHUFFLE,
    LINK,
)
BY_NAME = {rpc.name: rpc for rpc in UNARY}

# the compute requests (streams) a node serves on its private data: kind -> proto method
COMPUTE = {CROSS_LOSS: "CrossLoss", CROSS_GRADIENT: "CrossGradient", PUSH_GRADIENT: "PushGradient"}


def check_compute_kind(kind: str) -> None:
    if kind not in COMPUTE:
        raise ValueError(f"unknown compute request kind {kind!r}")


def _fits(rpc: Unary, limits: SizeLimits, msg: Any, address: str, *, reply: bool) -> None:
    """The calling side's check of the table's size limits on a request or a reply."""
    if rpc.check is None:
        return
    try:
        rpc.check(msg, limits)
    except Refusal as e:
        if reply:  # the peer's answer is over what this node takes
            raise WireError(f"{rpc.said} reply from {address}: {e.message}") from None
        raise PeerCallError(INVALID, f"{rpc.said} for {address}: {e.message}") from None


class UnaryCalls:
    """The calling side's named unary calls (``interfaces.PeerTransport``), written once for every
    transport in terms of its ``send``; the checks a caller makes (its own payload within the
    limits it sends, the reply's within those it accepts) are here too."""

    limits: SizeLimits

    async def send(
        self, rpc: Unary[Req, Rep], address: str, request: Req, timeout: float | None = None, *, peer: str | None = None
    ) -> Rep:  # the call as the transport makes it (``call`` adds the table's checks)
        raise NotImplementedError

    async def call(
        self, rpc: Unary[Req, Rep], address: str, request: Req, timeout: float | None = None, *, peer: str | None = None
    ) -> Rep:
        """Any call of the table, with its size checks on what goes out and what comes back."""
        _fits(rpc, self.limits, request, address, reply=False)
        reply = await self.send(rpc, address, request, timeout, peer=peer)
        _fits(rpc, self.limits, reply, address, reply=True)
        return reply

    async def welcomed(self, address: str, remote: NodeInfo, timeout: float) -> None:
        """After a handshake's answer: a transport with identities proves ``remote`` is at ``address``."""

    async def handshake(self, address: str, info: NodeInfo, timeout: float) -> tuple[NodeInfo, list[PeerEntry]]:
        welcome = await self.call(HANDSHAKE, address, info, timeout)
        await self.welcomed(address, welcome.node, timeout)
        return welcome.node, list(welcome.peers)

    async def heartbeat(
        self, address: str, beat: Beat, timeout: float, *, peer: str | None = None
    ) -> tuple[Beat, float]:
        t0 = time.perf_counter()
        reply = await self.call(HEARTBEAT, address, beat, timeout, peer=peer)
        return reply, time.perf_counter() - t0

    async def indirect_probe(
        self, address: str, probe: IndirectProbe, timeout: float, *, peer: str | None = None
    ) -> tuple[bool, tuple[MemberUpdate, ...]]:
        reply = await self.call(INDIRECT_PROBE, address, probe, timeout, peer=peer)
        return reply.ack, reply.updates

    async def exchange_peers(
        self,
        address: str,
        sender: str,
        entries: list[PeerEntry],
        timeout: float,
        *,
        members: Sequence[MemberUpdate] = (),
        incarnation: int = 0,
        peer: str | None = None,
    ) -> tuple[list[PeerEntry], tuple[MemberUpdate, ...], int]:
        reply = await self.call(
            EXCHANGE_PEERS, address, PeerList(sender, tuple(entries), tuple(members), incarnation), timeout, peer=peer
        )
        return list(reply.entries), reply.members, reply.incarnation

    async def gossip(
        self,
        address: str,
        sender: str,
        key: str,
        payload: dict[str, Any],
        timeout: float | None = None,
        *,
        peer: str | None = None,
    ) -> dict[str, Any]:
        reply = await self.call(GOSSIP, address, Gossip(sender, key, pack(payload)), timeout, peer=peer)
        try:
            return unpack_map(reply.payload, f"gossip reply from {address}")
        except Refusal as e:
            raise WireError(e.message) from None

    async def exchange_revocations(
        self, address: str, mine: RevocationList, timeout: float | None = None, *, peer: str | None = None
    ) -> RevocationList:
        return await self.call(REVOCATIONS, address, mine, timeout, peer=peer)

    async def recommend(
        self, address: str, sender: str, count: int, timeout: float | None = None, *, peer: str | None = None
    ) -> Recommendations:
        """Ask the node at ``address`` whom it weights (an answer over ``MAX_RECOMMEND`` is refused)."""
        return await self.call(RECOMMEND, address, RecommendAsk(sender, count), timeout, peer=peer)
