"""Hostile input for every RPC of the peer service: hypothesis strategies producing the raw frames
of one call, and a runner that sends them through a generic channel (bytes in, bytes out — no
generated stub, so anything goes on the wire). Shared by tests/test_fuzz.py (CI) and
bench/fuzz.py (10,000+ cases).

A case is (method, [frame bytes, ...]). Frames are, in some mix: random bytes; protobuf messages
with hostile field values (ids far too long or not ids at all, other nodes' ids, huge versions,
NaN clocks, unknown splits and reductions); compute payloads that are valid tensor messages, or
tensor messages with a forged table (bool or negative sizes, > 64 dimensions, element counts that
overflow int64, unknown dtypes, bytes that are not bools) — with a correct sha256 most of the
time, so they reach the decoder; and streams in the wrong order."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack
import torch
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

from coterie.node.config import PROTOCOL_VERSION
from coterie.node.peering import api
from coterie.node.transport.serde import WIRE
from coterie.node.wire.codec import MAGIC, encode
from coterie.proto.v1 import peer_pb2 as pb

UNARY = tuple(rpc.name for rpc in api.UNARY)  # every unary call of the table, fuzzed without a list to keep
STREAMS = ("GetSnapshot", "CrossLoss", "PushGradient", "CrossGradient")
METHODS = (*UNARY, *STREAMS)
# codes a refusal may carry (plus OK); UNKNOWN or INTERNAL is a bug. DEADLINE_EXCEEDED is the
# client's own timeout; NOT_FOUND a snapshot reference the node does not hold.
ACCEPTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
MAX_DETAIL = 1024


@dataclass
class Target:
    """What the fuzzer knows: its own (certified, handshaken) id, the victim's id, fingerprint
    and the shapes of its model."""

    me: str
    victim: str
    fingerprint: str
    params: dict[str, torch.Tensor]


U64 = st.one_of(st.integers(0, 16), st.integers(0, 2**64 - 1), st.sampled_from([2**63, 2**64 - 1]))
U32 = st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))
FLOATS = st.floats(allow_nan=True, allow_infinity=True)


def mostly(percent: int, usual, other):
    """``usual`` ``percent``% of the time, else ``other`` (hypothesis' own choice among branches
    is not uniform: it favours what looks simplest)."""
    return st.integers(0, 99).flatmap(lambda x: usual if x < percent else other)


def ids(t: Target):
    """Mostly the fuzzer's own (certified) id, so calls get past the identity check to the layers
    behind it; else another node's, empty, arbitrary text, or far too long."""
    hostile = st.one_of(
        st.sampled_from([t.victim, ""]), st.text(max_size=40), st.integers(129, 100_000).map(lambda n: "x" * n)
    )
    return mostly(70, st.just(t.me), hostile)


def _frame_bytes(msg) -> bytes:
    return msg.SerializeToString()


def tensor_tables(t: Target):
    """A tensor message whose table lies: shapes of bools, negatives, too many dims, overflowing
    counts; unknown dtypes; bool bytes that are not 0/1; or a valid table with random data."""
    shape_atoms = st.one_of(
        st.integers(-3, 8),
        st.booleans(),
        st.sampled_from([2**31, 2**40, 2**62, 2**64 - 1, -(2**63)]),
        st.floats(allow_nan=True),
        st.text(max_size=3),
    )
    shapes = st.one_of(
        st.lists(shape_atoms, max_size=6),
        st.lists(st.just(1), min_size=60, max_size=80),
        st.lists(st.sampled_from([2**20, 2**30]), min_size=2, max_size=5),
    )
    dtypes = st.one_of(st.sampled_from(["float32", "bool", "int64", "bfloat16", "uint8"]), st.text(max_size=8))
    entry = st.one_of(
        st.tuples(st.text(max_size=8), dtypes, shapes).map(list),
        st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4),
        st.none(),
        st.text(max_size=4),
    )
    table = st.dictionaries(
        st.sampled_from(["params", "grad", "align", "x:delta"]) | st.text(max_size=6),
        st.lists(entry, max_size=4) | st.integers(0, 9),
        max_size=3,
    )
    header = st.one_of(
        st.builds(
            lambda g, m: {"meta": m, "groups": g},
            table,
            st.dictionaries(st.text(max_size=4), st.integers(0, 99), max_size=2),
        ),
        st.lists(st.integers(0, 99), max_size=3),
        st.none(),
    )

    def pack(h, body: bytes) -> bytes:
        raw = msgpack.packb(h, use_bin_type=True)
        return MAGIC + struct.pack("<I", len(raw)) + raw + body

    return st.builds(pack, header, st.binary(max_size=512))


def payloads(t: Target):
    # fixed payloads by index: hypothesis reprs its arguments, and these are tens of kB
    fixed = [
        encode({"params": t.params}),
        encode({"grad": {k: torch.randn_like(v) for k, v in t.params.items()}}),
        encode({"grad": {k: torch.full_like(v, 1e30) for k, v in t.params.items()}}),
    ]
    good = fixed[0]
    return mostly(
        50,
        tensor_tables(t),
        st.one_of(
            st.integers(0, len(fixed) - 1).map(lambda i: fixed[i]),
            st.binary(max_size=2048),
            st.integers(0, len(good)).map(lambda i: good[:i]),
        ),
    )


def compute_calls(t: Target, method: str):
    refs = mostly(
        80,
        st.none(),
        st.builds(lambda n, v, h: pb.SnapshotRef(node_id=n, version=v, sha256=h), ids(t), U64, st.text(max_size=70)),
    )

    def build(requester, ref, payload, good_hash, split, max_samples, reduction, version, align, order, junk):
        h = pb.ComputeHeader(
            requester=requester,
            split=split,
            max_samples=max_samples,
            reduction=reduction,
            target_version=version,
            align=align,
        )
        if ref is not None:
            h.ref.CopyFrom(ref)
        else:
            h.total_bytes = len(payload) if good_hash else len(payload) + 7
            h.sha256 = hashlib.sha256(payload).hexdigest() if good_hash else "0" * 64
        frames = [_frame_bytes(pb.ComputeFrame(header=h))]
        frames += [_frame_bytes(pb.ComputeFrame(data=payload[i : i + 4096])) for i in range(0, len(payload), 4096)]
        if order == "data first":
            frames = frames[1:] + frames[:1]
        elif order == "two headers":
            frames = frames[:1] + frames
        elif order == "empty":
            frames = []
        elif order == "junk frame":
            frames.insert(1, junk)
        return method, frames

    return st.builds(
        build,
        ids(t),
        refs,
        payloads(t),
        mostly(85, st.just(True), st.just(False)),
        st.sampled_from(["train", "val", "test", "", "secret"]) | st.text(max_size=10),
        U32,
        st.sampled_from(["mean", "sum", "", "max"]) | st.text(max_size=6),
        U64,
        st.booleans(),
        mostly(80, st.just("ok"), st.sampled_from(["data first", "two headers", "empty", "junk frame"])),
        st.binary(max_size=64),
    )


def message_calls(t: Target):
    node_info = st.builds(
        lambda n, v, fp, a, labels: pb.NodeInfo(
            node_id=n, protocol_version=v, arch_fingerprint=fp, address=a, labels=labels
        ),
        ids(t),
        st.sampled_from([PROTOCOL_VERSION, 0, 2**32 - 1]),
        st.sampled_from([t.fingerprint, "", "0" * 64]),
        st.text(max_size=30),
        st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3),
    )
    entries = st.lists(
        st.builds(
            lambda n, a, age: pb.PeerEntry(node_id=n, address=a, last_seen_age_s=age),
            ids(t),
            st.text(max_size=25),
            FLOATS,
        ),
        max_size=20,
    )
    return st.one_of(
        st.builds(lambda n: ("Handshake", [_frame_bytes(pb.HandshakeRequest(node=n))]), node_info),
        st.builds(
            lambda n, r, v, s: (
                "Heartbeat",
                [_frame_bytes(pb.HeartbeatRequest(node_id=n, round=r, snapshot_version=v, sent_at=s))],
            ),
            ids(t),
            U64,
            U64,
            FLOATS,
        ),
        st.builds(lambda n, e: ("ExchangePeers", [_frame_bytes(pb.PeerList(node_id=n, peers=e))]), ids(t), entries),
        st.builds(
            lambda n, hv, cb, mr, w: (
                "GetSnapshot",
                [
                    _frame_bytes(
                        pb.SnapshotRequest(requester=n, have_version=hv, chunk_bytes=cb, min_round=mr, wait_ms=w)
                    )
                ],
            ),
            ids(t),
            U64,
            U32,
            st.integers(0, 3) | U64,
            st.integers(0, 50),
        ),
        st.builds(
            lambda n, k, p: ("GossipState", [_frame_bytes(pb.GossipMessage(node_id=n, key=k, payload=p))]),
            ids(t),
            st.sampled_from(["omega", "encoder", ""]) | st.text(max_size=10),
            st.binary(max_size=256)
            | st.builds(
                lambda d: msgpack.packb(d),
                st.dictionaries(
                    st.text(max_size=5),
                    st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.lists(st.floats(), max_size=4),
                    max_size=4,
                ),
            ),
        ),
    )


ID_FIELDS = {"node_id", "requester", "target_id", "accuser"}


def messages(t: Target, cls, depth: int = 0):
    """Any ``cls`` protobuf message, field by field from its descriptor, with hostile values:
    node ids as ``ids``, numbers at the edges of their type, NaN clocks, random bytes or msgpack
    maps — so an RPC added to the table is fuzzed on its own message without a line here."""
    fields: dict[str, Any] = {}
    for f in cls.DESCRIPTOR.fields:
        if f.type == F.TYPE_MESSAGE:
            one: Any
            if f.message_type.GetOptions().map_entry:
                one = st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3)
            elif depth >= 2:
                continue
            else:
                sub = messages(t, getattr(pb, f.message_type.name), depth + 1)
                one = st.lists(sub, max_size=3) if f.is_repeated else sub
            fields[f.name] = one
            continue
        value: Any
        if f.type == F.TYPE_STRING:
            value = ids(t) if f.name in ID_FIELDS else st.text(max_size=40)
        elif f.type == F.TYPE_BYTES:
            value = st.binary(max_size=256) | st.builds(
                lambda d: msgpack.packb(d),
                st.dictionaries(
                    st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5), max_size=4
                ),
            )
        elif f.type in (F.TYPE_UINT64, F.TYPE_FIXED64):
            value = U64
        elif f.type in (F.TYPE_UINT32, F.TYPE_FIXED32, F.TYPE_ENUM):
            value = U32 if f.type != F.TYPE_ENUM else st.integers(0, 5)
        elif f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            value = FLOATS
        elif f.type == F.TYPE_BOOL:
            value = st.booleans()
        else:
            value = st.integers(-(2**31), 2**31 - 1)
        fields[f.name] = st.lists(value, max_size=3) if f.is_repeated else value
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def table_calls(t: Target):
    """Every unary call of ``api.UNARY``, its request message (``serde.WIRE``) filled with hostile values."""
    return st.one_of(
        *(
            st.builds(lambda m, name=rpc.name: (name, [_frame_bytes(m)]), messages(t, WIRE[rpc.name].request))
            for rpc in api.UNARY
        )
    )


def raw_calls():
    return st.tuples(st.sampled_from(METHODS), st.lists(st.binary(max_size=300), min_size=1, max_size=3))


def calls(t: Target):
    """One call of any method, in a mix that reaches every layer: raw bytes (the parser),
    well-formed messages with hostile values (the servicer and handler), compute streams (the
    chunk assembler, the tensor decoder, the validation and the push checks)."""
    return st.one_of(
        raw_calls(),
        message_calls(t),
        table_calls(t),
        compute_calls(t, "CrossLoss"),
        compute_calls(t, "PushGradient"),
        compute_calls(t, "CrossGradient"),
    )


async def send(
    channel: grpc.aio.Channel, method: str, frames: list[bytes], timeout: float = 10.0
) -> tuple[grpc.StatusCode, str]:
    """Send one case through a generic (bytes) call; the status code and detail that came back."""
    path = f"/coterie.v1.Peer/{method}"
    kw: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
    try:
        if method in UNARY:
            await channel.unary_unary(path, **kw)(frames[0] if frames else b"", timeout=timeout)
        elif method == "GetSnapshot":
            async for _ in channel.unary_stream(path, **kw)(frames[0] if frames else b"", timeout=timeout):
                pass
        else:

            async def gen():
                for f in frames:
                    yield f

            if method == "CrossGradient":
                async for _ in channel.stream_stream(path, **kw)(gen(), timeout=timeout):
                    pass
            else:
                await channel.stream_unary(path, **kw)(gen(), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def check(method: str, code: grpc.StatusCode, details: str) -> str | None:
    """Why a reply is wrong, or None."""
    if code not in ACCEPTED:
        return f"{method}: {code.name} ({details[:200]!r})"
    if len(details.encode()) > MAX_DETAIL:
        return f"{method}: {code.name} with a {len(details.encode())}-byte detail"
    return None
