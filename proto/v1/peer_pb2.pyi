from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_ALIVE: _ClassVar[MemberState]
    MEMBER_SUSPECT: _ClassVar[MemberState]
    MEMBER_DEAD: _ClassVar[MemberState]

class LinkKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LINK_JOIN: _ClassVar[LinkKind]
    LINK_FORWARD_JOIN: _ClassVar[LinkKind]
    LINK_NEIGHBOR: _ClassVar[LinkKind]
    LINK_NEIGHBOR_URGENT: _ClassVar[LinkKind]
    LINK_DISCONNECT: _ClassVar[LinkKind]
MEMBER_ALIVE: MemberState
MEMBER_SUSPECT: MemberState
MEMBER_DEAD: MemberState
LINK_JOIN: LinkKind
LINK_FORWARD_JOIN: LinkKind
LINK_NEIGHBOR: LinkKind
LINK_NEIGHBOR_URGENT: LinkKind
LINK_DISCONNECT: LinkKind

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "protocol_version", "arch_fingerprint", "capabilities", "address", "admin_url", "labels", "task", "codecs", "protocol_max", "release")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARCH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_URL_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MAX_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    protocol_version: int
    arch_fingerprint: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    address: str
    admin_url: str
    labels: _containers.ScalarMap[str, str]
    task: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    protocol_max: int
    release: str
    def __init__(self, node_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., arch_fingerprint: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., address: _Optional[str] = ..., admin_url: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., task: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ..., protocol_max: _Optional[int] = ..., release: _Optional[str] = ...) -> None: ...

class PeerEntry(_message.Message):
    __slots__ = ("node_id", "address", "last_seen_age_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    last_seen_age_s: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., last_seen_age_s: _Optional[float] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("node", "peers")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    peers: _containers.RepeatedCompositeFieldContainer[PeerEntry]
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerEntry, _Mapping]]] = ...) -> None: ...

class MemberUpdate(_message.Message):
    __slots__ = ("node_id", "address", "incarnation", "state", "accuser")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACCUSER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    incarnation: int
    state: MemberState
    accuser: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., state: _Optional[_Union[MemberState, str]] = ..., accuser: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "round", "snapshot_version", "sent_at", "incarnation", "updates")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    snapshot_version: int
    sent_at: float
    incarnation: int
    updates: _containers.RepeatedCompositeFieldContainer[MemberUpdate]
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ..., snapshot_version: _Optional[int] = ..., sent_at: _Optional[float] = ..., incarnation: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[MemberUpdate, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("node_id", "round", "snapshot_version", "echo_sent_at", "incarnation", "updates")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ECHO_SENT_AT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    snapshot_version: int
    echo_sent_at: float
    incarnation: int
    updates: _containers.RepeatedCompositeFieldContainer[MemberUpdate]
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ..., snapshot_version: _Optional[int] = ..., echo_sent_at: _Optional[float] = ..., incarnation: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[MemberUpdate, _Mapping]]] = ...) -> None: ...

class IndirectProbeRequest(_message.Message):
    __slots__ = ("node_id", "target_id", "timeout_ms", "incarnation", "updates")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    target_id: str
    timeout_ms: int
    incarnation: int
    updates: _containers.RepeatedCompositeFieldContainer[MemberUpdate]
    def __init__(self, node_id: _Optional[str] = ..., target_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., incarnation: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[MemberUpdate, _Mapping]]] = ...) -> None: ...

class IndirectProbeReply(_message.Message):
    __slots__ = ("ack", "updates")
    ACK_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    ack: bool
    updates: _containers.RepeatedCompositeFieldContainer[MemberUpdate]
    def __init__(self, ack: _Optional[bool] = ..., updates: _Optional[_Iterable[_Union[MemberUpdate, _Mapping]]] = ...) -> None: ...

class PeerList(_message.Message):
    __slots__ = ("node_id", "peers", "members", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerEntry]
    members: _containers.RepeatedCompositeFieldContainer[MemberUpdate]
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerEntry, _Mapping]]] = ..., members: _Optional[_Iterable[_Union[MemberUpdate, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class SnapshotRef(_message.Message):
    __slots__ = ("node_id", "version", "sha256")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: int
    sha256: str
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("requester", "have_version", "chunk_bytes", "min_round", "wait_ms", "codecs", "delta", "have_sha256")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    HAVE_SHA256_FIELD_NUMBER: _ClassVar[int]
    requester: str
    have_version: int
    chunk_bytes: int
    min_round: int
    wait_ms: int
    codecs: _containers.RepeatedScalarFieldContainer[str]
    delta: bool
    have_sha256: str
    def __init__(self, requester: _Optional[str] = ..., have_version: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., min_round: _Optional[int] = ..., wait_ms: _Optional[int] = ..., codecs: _Optional[_Iterable[str]] = ..., delta: _Optional[bool] = ..., have_sha256: _Optional[str] = ...) -> None: ...

class SnapshotHeader(_message.Message):
    __slots__ = ("node_id", "version", "round", "sha256", "total_bytes", "unchanged", "codec", "base_version", "base_sha256", "payload_sha256")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: int
    round: int
    sha256: str
    total_bytes: int
    unchanged: bool
    codec: str
    base_version: int
    base_sha256: str
    payload_sha256: str
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[int] = ..., round: _Optional[int] = ..., sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ..., unchanged: _Optional[bool] = ..., codec: _Optional[str] = ..., base_version: _Optional[int] = ..., base_sha256: _Optional[str] = ..., payload_sha256: _Optional[str] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("header", "data", "inline")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    header: SnapshotHeader
    data: bytes
    inline: bytes
    def __init__(self, header: _Optional[_Union[SnapshotHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., inline: _Optional[bytes] = ...) -> None: ...

class ComputeHeader(_message.Message):
    __slots__ = ("requester", "ref", "total_bytes", "sha256", "split", "max_samples", "reduction", "target_version", "align", "purpose", "codec")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    requester: str
    ref: SnapshotRef
    total_bytes: int
    sha256: str
    split: str
    max_samples: int
    reduction: str
    target_version: int
    align: bool
    purpose: str
    codec: str
    def __init__(self, requester: _Optional[str] = ..., ref: _Optional[_Union[SnapshotRef, _Mapping]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., split: _Optional[str] = ..., max_samples: _Optional[int] = ..., reduction: _Optional[str] = ..., target_version: _Optional[int] = ..., align: _Optional[bool] = ..., purpose: _Optional[str] = ..., codec: _Optional[str] = ...) -> None: ...

class ComputeFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ComputeHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ComputeHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LossReply(_message.Message):
    __slots__ = ("loss", "samples")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    loss: float
    samples: int
    def __init__(self, loss: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class GradientHeader(_message.Message):
    __slots__ = ("loss", "samples", "total_bytes", "sha256", "inner_product")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    INNER_PRODUCT_FIELD_NUMBER: _ClassVar[int]
    loss: float
    samples: int
    total_bytes: int
    sha256: str
    inner_product: float
    def __init__(self, loss: _Optional[float] = ..., samples: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., inner_product: _Optional[float] = ...) -> None: ...

class GradientChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GradientHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[GradientHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class GossipMessage(_message.Message):
    __slots__ = ("node_id", "key", "payload")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    key: str
    payload: bytes
    def __init__(self, node_id: _Optional[str] = ..., key: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class RevocationList(_message.Message):
    __slots__ = ("node_id", "number", "crl")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    CRL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    number: int
    crl: bytes
    def __init__(self, node_id: _Optional[str] = ..., number: _Optional[int] = ..., crl: _Optional[bytes] = ...) -> None: ...

class RecommendRequest(_message.Message):
    __slots__ = ("node_id", "count")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    count: int
    def __init__(self, node_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class Recommendations(_message.Message):
    __slots__ = ("node_id", "peers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerEntry]
    def __init__(self, node_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerEntry, _Mapping]]] = ...) -> None: ...

class ViewSample(_message.Message):
    __slots__ = ("node_id", "peers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerEntry]
    def __init__(self, node_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerEntry, _Mapping]]] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("node_id", "kind", "joined", "ttl", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: LinkKind
    joined: PeerEntry
    ttl: int
    address: str
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[_Union[LinkKind, str]] = ..., joined: _Optional[_Union[PeerEntry, _Mapping]] = ..., ttl: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("node_id", "accepted")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    accepted: bool
    def __init__(self, node_id: _Optional[str] = ..., accepted: _Optional[bool] = ...) -> None: ...
