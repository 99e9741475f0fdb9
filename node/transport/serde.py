"""Protobuf <-> domain objects (Flower's ``common/serde.py`` idea): every message with a domain
counterpart is converted here — ``WIRE`` holds the serde pair of each unary call the table
``peering/api.py`` declares. The frames of the streams (``SnapshotChunk``, ``ComputeFrame``,
``GradientChunk``: a header built here, then raw data chunks) are assembled where they are sent,
in ``server.py``, ``compute_rpcs.py``, ``client.py`` and ``pulls.py``, which also read replies'
plain scalar fields. Tensor payloads travel as Coterie's tensor encoding (``wire/codec.py``);
chunking and hashing stay in the transport."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from ...proto.v1 import peer_pb2 as pb
from ..peering.api import LINK_KINDS, LinkReply, LinkRequest, RecommendAsk, Recommendations, RevocationList, ViewSample
from ..peering.errors import invalid, short
from ..peering.messages import (
    ALIVE,
    DEAD,
    SUSPECT,
    Beat,
    ComputeReply,
    ComputeRequest,
    Gossip,
    IndirectProbe,
    MemberUpdate,
    NodeInfo,
    PeerEntry,
    PeerList,
    ProbeReply,
    SnapshotHeader,
    SnapshotRef,
    Welcome,
)


def parse(cls, raw: bytes, what: str):
    """A request's raw bytes as a ``cls`` message; malformed: an ``invalid`` refusal naming it."""
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError, TypeError) as e:
        raise invalid(f"{what}: not a valid {cls.__name__} message ({short(str(e), 200)})") from None


async def parsed(raw_frames, cls, what: str) -> AsyncIterator[Any]:
    async for raw in raw_frames:
        yield parse(cls, raw, what)


# --- membership ---
def node_info_to_pb(n: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=n.node_id,
        protocol_version=n.protocol_version,
        arch_fingerprint=n.arch_fingerprint,
        capabilities=list(n.capabilities),
        address=n.address,
        admin_url=n.admin_url,
        labels=dict(n.labels),
        task=n.task,
        codecs=list(n.codecs),
        protocol_max=n.protocol_max,
        release=n.release,
    )


def node_info_from_pb(m: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(
        m.node_id,
        m.protocol_version,
        m.arch_fingerprint,
        tuple(m.capabilities),
        m.address,
        m.admin_url,
        dict(m.labels),
        m.task,
        tuple(m.codecs),
        m.protocol_max,
        m.release,
    )


def entries_to_pb(entries: list[PeerEntry]) -> list[pb.PeerEntry]:
    return [pb.PeerEntry(node_id=e.node_id, address=e.address, last_seen_age_s=e.last_seen_age_s) for e in entries]


def entries_from_pb(entries) -> list[PeerEntry]:
    return [PeerEntry(e.node_id, e.address, e.last_seen_age_s) for e in entries]


_STATE_TO_PB = {ALIVE: pb.MEMBER_ALIVE, SUSPECT: pb.MEMBER_SUSPECT, DEAD: pb.MEMBER_DEAD}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


def updates_to_pb(updates) -> list[pb.MemberUpdate]:
    return [
        pb.MemberUpdate(
            node_id=u.node_id,
            address=u.address,
            incarnation=u.incarnation,
            state=_STATE_TO_PB[u.state],
            accuser=u.accuser,
        )
        for u in updates
    ]


def updates_from_pb(updates) -> tuple[MemberUpdate, ...]:
    # an unknown enum value (a newer peer) reads as no news rather than a guess
    return tuple(
        MemberUpdate(u.node_id, u.address, u.incarnation, _STATE_FROM_PB[u.state], u.accuser)
        for u in updates
        if u.state in _STATE_FROM_PB
    )


def beat_to_request(b: Beat) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(
        node_id=b.node_id,
        round=b.round,
        snapshot_version=b.version,
        sent_at=b.sent_at,
        incarnation=b.incarnation,
        updates=updates_to_pb(b.updates),
    )


def beat_from_request(m: pb.HeartbeatRequest) -> Beat:
    return Beat(m.node_id, m.round, m.snapshot_version, m.sent_at, m.incarnation, updates_from_pb(m.updates))


def beat_to_reply(b: Beat) -> pb.HeartbeatReply:
    return pb.HeartbeatReply(
        node_id=b.node_id,
        round=b.round,
        snapshot_version=b.version,
        echo_sent_at=b.sent_at,
        incarnation=b.incarnation,
        updates=updates_to_pb(b.updates),
    )


def beat_from_reply(m: pb.HeartbeatReply) -> Beat:
    return Beat(m.node_id, m.round, m.snapshot_version, m.echo_sent_at, m.incarnation, updates_from_pb(m.updates))


def probe_to_pb(p: IndirectProbe) -> pb.IndirectProbeRequest:
    return pb.IndirectProbeRequest(
        node_id=p.requester,
        target_id=p.target,
        timeout_ms=min(int(p.timeout_s * 1000), 2**32 - 1),
        incarnation=p.incarnation,
        updates=updates_to_pb(p.updates),
    )


def probe_from_pb(m: pb.IndirectProbeRequest) -> IndirectProbe:
    return IndirectProbe(m.node_id, m.target_id, m.timeout_ms / 1000.0, m.incarnation, updates_from_pb(m.updates))


def probe_reply_to_pb(r: ProbeReply) -> pb.IndirectProbeReply:
    return pb.IndirectProbeReply(ack=r.ack, updates=updates_to_pb(r.updates))


def probe_reply_from_pb(m: pb.IndirectProbeReply) -> ProbeReply:
    return ProbeReply(m.ack, updates_from_pb(m.updates))


def welcome_to_pb(w: Welcome) -> pb.HandshakeReply:
    return pb.HandshakeReply(node=node_info_to_pb(w.node), peers=entries_to_pb(list(w.peers)))


def welcome_from_pb(m: pb.HandshakeReply) -> Welcome:
    return Welcome(node_info_from_pb(m.node), tuple(entries_from_pb(m.peers)))


def peer_list_to_pb(p: PeerList) -> pb.PeerList:
    return pb.PeerList(
        node_id=p.sender,
        peers=entries_to_pb(list(p.entries)),
        members=updates_to_pb(p.members),
        incarnation=p.incarnation,
    )


def peer_list_from_pb(m: pb.PeerList) -> PeerList:
    return PeerList(m.node_id, tuple(entries_from_pb(m.peers)), updates_from_pb(m.members), m.incarnation)


# --- gossip and revocation lists ---
def gossip_to_pb(g: Gossip) -> pb.GossipMessage:
    return pb.GossipMessage(node_id=g.sender, key=g.key, payload=g.payload)


def gossip_from_pb(m: pb.GossipMessage) -> Gossip:
    return Gossip(m.node_id, m.key, m.payload)


def revocations_to_pb(r: RevocationList) -> pb.RevocationList:
    return pb.RevocationList(node_id=r.sender, number=r.number, crl=r.crl)


def revocations_from_pb(m: pb.RevocationList) -> RevocationList:
    return RevocationList(m.node_id, m.number, m.crl)


def recommend_ask_to_pb(a: RecommendAsk) -> pb.RecommendRequest:
    return pb.RecommendRequest(node_id=a.sender, count=a.count)


def recommend_ask_from_pb(m: pb.RecommendRequest) -> RecommendAsk:
    return RecommendAsk(m.node_id, m.count)


def recommendations_to_pb(r: Recommendations) -> pb.Recommendations:
    return pb.Recommendations(node_id=r.sender, peers=entries_to_pb(list(r.peers)))


def recommendations_from_pb(m: pb.Recommendations) -> Recommendations:
    return Recommendations(m.node_id, tuple(entries_from_pb(m.peers)))


def sample_to_pb(v: ViewSample) -> pb.ViewSample:
    return pb.ViewSample(node_id=v.sender, peers=entries_to_pb(list(v.peers)))


def sample_from_pb(m: pb.ViewSample) -> ViewSample:
    return ViewSample(m.node_id, tuple(entries_from_pb(m.peers)))


def link_to_pb(r: LinkRequest) -> pb.LinkRequest:
    m = pb.LinkRequest(node_id=r.sender, kind=pb.LinkKind.Value(f"LINK_{r.kind.upper()}"), ttl=r.ttl, address=r.address)
    if r.joined is not None:
        m.joined.CopyFrom(entries_to_pb([r.joined])[0])
    return m


def link_from_pb(m: pb.LinkRequest) -> LinkRequest:
    # an unknown kind (a newer peer) reads as "", which the table's check refuses
    kind = LINK_KINDS[m.kind] if 0 <= m.kind < len(LINK_KINDS) else ""
    joined = entries_from_pb([m.joined])[0] if m.HasField("joined") else None
    return LinkRequest(m.node_id, kind, joined, m.ttl, m.address)


def link_reply_to_pb(r: LinkReply) -> pb.LinkReply:
    return pb.LinkReply(node_id=r.sender, accepted=r.accepted)


def link_reply_from_pb(m: pb.LinkReply) -> LinkReply:
    return LinkReply(m.node_id, m.accepted)


# --- snapshots ---
def snapshot_header_to_pb(
    h: SnapshotHeader, total_bytes: int, encoding: dict[str, Any] | None = None
) -> pb.SnapshotHeader:
    """``encoding``: codec, payload_sha256 and a delta's base_version/base_sha256, if any."""
    return pb.SnapshotHeader(
        node_id=h.node_id,
        version=h.version,
        round=h.round,
        sha256=h.digest,
        total_bytes=total_bytes,
        unchanged=h.unchanged,
        **(encoding or {}),
    )


def snapshot_header_from_pb(m: pb.SnapshotHeader) -> SnapshotHeader:
    return SnapshotHeader(m.node_id, m.version, m.round, m.sha256, m.unchanged)


# --- compute requests ---
def compute_header_to_pb(
    r: ComputeRequest, total_bytes: int = 0, digest: str = "", codec: str = ""
) -> pb.ComputeHeader:
    h = pb.ComputeHeader(
        requester=r.requester,
        total_bytes=total_bytes,
        sha256=digest,
        split=r.split,
        max_samples=r.max_samples,
        reduction=r.reduction,
        target_version=r.target_version,
        align=r.align,
        purpose=r.purpose,
        codec=codec,
    )
    if r.ref is not None:
        h.ref.CopyFrom(pb.SnapshotRef(node_id=r.ref.node_id, version=r.ref.version, sha256=r.ref.digest))
    return h


def compute_request_from_pb(kind: str, h: pb.ComputeHeader) -> ComputeRequest:
    """The request a header describes, without its tensors (the transport adds those)."""
    ref = SnapshotRef(h.ref.node_id, h.ref.version, h.ref.sha256) if h.HasField("ref") else None
    return ComputeRequest(
        kind=kind,
        requester=h.requester,
        ref=ref,
        split=h.split,
        max_samples=h.max_samples,
        reduction=h.reduction or "mean",
        target_version=h.target_version,
        align=h.align,
        purpose=h.purpose,
    )


def loss_reply_to_pb(r: ComputeReply) -> pb.LossReply:
    return pb.LossReply(loss=r.loss, samples=r.samples)


def gradient_header_to_pb(r: ComputeReply, total_bytes: int, digest: str) -> pb.GradientHeader:
    return pb.GradientHeader(
        loss=r.loss, samples=r.samples, total_bytes=total_bytes, sha256=digest, inner_product=r.inner_product
    )


def ack_to_pb(r: ComputeReply) -> pb.Ack:
    return pb.Ack(accepted=r.accepted, message=r.message)


# --- the unary calls (peering/api.py declares them; the servicer and the client are derived) ---
@dataclass(frozen=True)
class Wire:
    """One unary call's protobuf messages and its serde pair each way."""

    request: type  # the request's protobuf class (parsed from raw bytes by the servicer)
    reply: type
    request_to_pb: Callable[[Any], Any]
    request_from_pb: Callable[[Any], Any]
    reply_to_pb: Callable[[Any], Any]
    reply_from_pb: Callable[[Any], Any]


WIRE: dict[str, Wire] = {  # by ``api.Unary.name``
    "Handshake": Wire(
        pb.HandshakeRequest,
        pb.HandshakeReply,
        lambda n: pb.HandshakeRequest(node=node_info_to_pb(n)),
        lambda m: node_info_from_pb(m.node),
        welcome_to_pb,
        welcome_from_pb,
    ),
    "Heartbeat": Wire(
        pb.HeartbeatRequest, pb.HeartbeatReply, beat_to_request, beat_from_request, beat_to_reply, beat_from_reply
    ),
    "ExchangePeers": Wire(
        pb.PeerList, pb.PeerList, peer_list_to_pb, peer_list_from_pb, peer_list_to_pb, peer_list_from_pb
    ),
    "IndirectProbe": Wire(
        pb.IndirectProbeRequest,
        pb.IndirectProbeReply,
        probe_to_pb,
        probe_from_pb,
        probe_reply_to_pb,
        probe_reply_from_pb,
    ),
    "GossipState": Wire(pb.GossipMessage, pb.GossipMessage, gossip_to_pb, gossip_from_pb, gossip_to_pb, gossip_from_pb),
    "ExchangeRevocations": Wire(
        pb.RevocationList,
        pb.RevocationList,
        revocations_to_pb,
        revocations_from_pb,
        revocations_to_pb,
        revocations_from_pb,
    ),
    "Recommend": Wire(
        pb.RecommendRequest,
        pb.Recommendations,
        recommend_ask_to_pb,
        recommend_ask_from_pb,
        recommendations_to_pb,
        recommendations_from_pb,
    ),
    "Shuffle": Wire(pb.ViewSample, pb.ViewSample, sample_to_pb, sample_from_pb, sample_to_pb, sample_from_pb),
    "Link": Wire(pb.LinkRequest, pb.LinkReply, link_to_pb, link_from_pb, link_reply_to_pb, link_reply_from_pb),
}
