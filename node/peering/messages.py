"""What nodes say to each other, as plain domain objects.

Both transports speak these: the gRPC one converts them to and from protobuf (``serde``), the
in-process one hands them over as they are. Model-sized payloads are tensor ``Groups``
({"params": θ, "x:delta": Δθ, ...}); only the gRPC transport ever encodes them to bytes."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

from ..wire.codec import Groups, decode, encode_buffer

# kinds of compute request a node serves on its private data
CROSS_LOSS, CROSS_GRADIENT, PUSH_GRADIENT = "cross_loss", "cross_gradient", "push_gradient"

MAX_GOSSIP_KEY = 64  # characters in a gossip key (a strategy's message name)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    protocol_version: int  # the oldest protocol version it speaks (peering/versions.py)
    arch_fingerprint: str
    capabilities: tuple[str, ...] = ()
    address: str = ""
    admin_url: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    task: str = ""  # what the model learns: input shape and class names (learning/task.py)
    codecs: tuple[str, ...] = ()  # snapshot codecs it speaks (wire/codecs.py); () = fp32 only
    protocol_max: int = 0  # the newest it speaks; 0: protocol_version only (0.1.0 nodes)
    release: str = ""  # the release it runs; "" from 0.1.0 nodes


@dataclass(frozen=True)
class PeerEntry:
    node_id: str
    address: str
    last_seen_age_s: float = 0.0


# a member's state as SWIM spreads it
ALIVE, SUSPECT, DEAD = "alive", "suspect", "dead"


@dataclass(frozen=True)
class MemberUpdate:
    """What one node believes about a member: news with a higher incarnation wins; at the same
    incarnation dead > suspect > alive. Only the member itself raises its incarnation."""

    node_id: str
    address: str
    incarnation: int
    state: str = ALIVE
    accuser: str = ""  # suspect: the member whose probe failed


@dataclass(frozen=True)
class Beat:
    """A heartbeat (SWIM ping) and its answer: who, at which round and published snapshot
    version, the sender's incarnation and piggybacked membership news."""

    node_id: str
    round: int
    version: int
    sent_at: float = 0.0
    incarnation: int = 0
    updates: tuple[MemberUpdate, ...] = ()


@dataclass(frozen=True)
class IndirectProbe:
    """SWIM's ping-req: ``requester`` asks the receiver to ping ``target`` within ``timeout_s``."""

    requester: str
    target: str
    timeout_s: float
    incarnation: int = 0
    updates: tuple[MemberUpdate, ...] = ()


# --- the unary calls' own messages (peering/api.py declares the calls) ---
@dataclass(frozen=True)
class Welcome:
    """A handshake's answer: who answers, and some peers it knows (peer exchange piggybacks)."""

    node: NodeInfo
    peers: tuple[PeerEntry, ...] = ()


@dataclass(frozen=True)
class PeerList:
    """Push-pull peer exchange, both ways: the sender's peers and its whole membership view."""

    sender: str
    entries: tuple[PeerEntry, ...] = ()
    members: tuple[MemberUpdate, ...] = ()
    incarnation: int = 0


@dataclass(frozen=True)
class ProbeReply:
    ack: bool
    updates: tuple[MemberUpdate, ...] = ()


@dataclass(frozen=True)
class Gossip:
    """A strategy's gossip, both ways: ``payload`` is msgpack (a map) — msgpack says what a
    payload may hold, and its size is what the limit bounds, whatever the transport."""

    sender: str
    key: str
    payload: bytes


@dataclass(frozen=True)
class SnapshotRef:
    """A snapshot the receiving node already caches, named instead of sent again."""

    node_id: str
    version: int
    digest: str = ""


@dataclass(frozen=True)
class SnapshotHeader:
    node_id: str
    version: int
    round: int
    digest: str = ""
    unchanged: bool = False  # the requester already holds this version: no groups follow


@dataclass
class ComputeRequest:
    """A peer's model (or a reference to a cached snapshot) to evaluate or differentiate on this
    node's private data. ``groups`` holds "params" and, for COBO's alignment, "align"; "grad"
    for a FedeRiCo push."""

    kind: str
    requester: str
    groups: Groups | None = None
    ref: SnapshotRef | None = None
    split: str = ""  # "" = the purpose's split; if set it must be that one
    max_samples: int = 0  # 0 = the whole split; else at least the server's min_batch
    reduction: str = "mean"
    target_version: int = 0  # push: the receiver's snapshot version the gradient was computed on
    align: bool = False  # cross-gradient: reply with ⟨g, align⟩ only
    purpose: str = ""  # which strategy step asks (privacy/purposes.py); the server refuses none


@dataclass
class ComputeReply:
    loss: float = 0.0  # NaN beside a private gradient (the loss would be a second release)
    samples: int = 0
    grad: Groups | None = None  # cross-gradient without align: {"grad": g}
    inner_product: float = 0.0
    accepted: bool = True  # push
    message: str = ""


class LocalSnapshot:
    """A snapshot this node publishes: its model and extra tensor groups at one version.

    Its encoded form (what the gRPC transport streams, and whose sha256 names it in references)
    is made once, by ``prepare`` — in a worker thread (``ready``), off the event loop — into one
    buffer; the groups then become zero-copy views of that buffer, so a published snapshot is
    held once, not as tensors plus bytes."""

    def __init__(self, node_id: str, version: int, round: int, groups: Groups):
        self.node_id, self.version, self.round, self.groups = node_id, version, round, groups
        self._encoded: memoryview | None = None
        self._digest = ""
        self._lock = threading.Lock()

    @property
    def params(self) -> dict[str, Any]:
        return self.groups["params"]

    def prepare(self) -> memoryview:
        """Encode (once) and return the encoded snapshot."""
        with self._lock:
            if self._encoded is not None:
                return self._encoded
            buf = encode_buffer(self.groups, {"node_id": self.node_id, "version": self.version, "round": self.round})
            self._digest = hashlib.sha256(buf).hexdigest()
            self.groups, _ = decode(buf)
            self._encoded = buf
            return buf

    async def ready(self) -> LocalSnapshot:
        if self._encoded is None:
            await asyncio.to_thread(self.prepare)
        return self

    @property
    def encoded(self) -> memoryview:
        return self.prepare()

    @property
    def digest(self) -> str:
        self.prepare()
        return self._digest

    def header(self, unchanged: bool = False) -> SnapshotHeader:
        return SnapshotHeader(self.node_id, self.version, self.round, self.digest, unchanged)

    def ref(self) -> SnapshotRef:
        return SnapshotRef(self.node_id, self.version, self.digest)
