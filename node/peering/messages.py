"""What nodes say to each other, as plain domain objects.

Both transports speak these: the gRPC one converts them to and from protobuf (``serde``), the
in-process one hands them over as they are. Model-sized payloads are tensor ``Groups``
({"params": θ, "x:delta": Δθ, ...}); only the gRPC transport ever encodes them to bytes."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..wire.codec import Groups, encode

# kinds of compute request a node serves on its private data
CROSS_LOSS, CROSS_GRADIENT, PUSH_GRADIENT = "cross_loss", "cross_gradient", "push_gradient"


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    protocol_version: int
    arch_fingerprint: str
    capabilities: tuple[str, ...] = ()
    address: str = ""
    admin_url: str = ""
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerEntry:
    node_id: str
    address: str
    last_seen_age_s: float = 0.0


@dataclass(frozen=True)
class Beat:
    """A heartbeat and its answer: who, at which round and published snapshot version."""
    node_id: str
    round: int
    version: int
    sent_at: float = 0.0


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
    split: str = "train"
    max_samples: int = 0  # 0 = the whole split
    reduction: str = "mean"
    target_version: int = 0  # push: the receiver's snapshot version the gradient was computed on
    align: bool = False  # cross-gradient: reply with ⟨g, align⟩ only


@dataclass
class ComputeReply:
    loss: float = 0.0
    samples: int = 0
    grad: Groups | None = None  # cross-gradient without align: {"grad": g}
    inner_product: float = 0.0
    accepted: bool = True  # push
    message: str = ""


class LocalSnapshot:
    """A snapshot this node publishes: its model and extra tensor groups at one version.
    The encoded form (what the gRPC transport streams, and whose sha256 names it in references)
    is computed once, on first use, and shared by every puller."""

    def __init__(self, node_id: str, version: int, round: int, groups: Groups):
        self.node_id, self.version, self.round, self.groups = node_id, version, round, groups

    @property
    def params(self) -> dict[str, Any]:
        return self.groups["params"]

    @cached_property
    def encoded(self) -> bytes:
        return encode(self.groups, {"node_id": self.node_id, "version": self.version, "round": self.round})

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.encoded).hexdigest()

    def header(self, unchanged: bool = False) -> SnapshotHeader:
        return SnapshotHeader(self.node_id, self.version, self.round, self.digest, unchanged)

    def ref(self) -> SnapshotRef:
        return SnapshotRef(self.node_id, self.version, self.digest)
