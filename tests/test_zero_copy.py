"""Snapshots without copies: received chunks land in one aligned buffer and decode as views of
it; a published snapshot is held once (its tensors are views of its encoding); the frames sent
are built from that buffer as they go; the peers' snapshot cache is bounded by bytes."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch

from coterie.node.config import PROTOCOL_VERSION
from coterie.node.peering.errors import Refusal
from coterie.node.peering.messages import LocalSnapshot, NodeInfo
from coterie.node.peering.snapshots import SnapshotCache
from coterie.node.strategies.base import PeerSnapshot
from coterie.node.transport.chunks import Assembler, data_field, data_frames, sha256
from coterie.node.transport.client import PeerClient
from coterie.node.transport.server import serve
from coterie.node.wire.codec import decode, encode, encode_buffer
from coterie.proto.v1 import peer_pb2 as pb


def _groups():
    g = torch.Generator().manual_seed(0)
    return {
        "params": {"a": torch.randn(300, 7, generator=g), "b": torch.randn(5, generator=g)},
        "x:delta": {"a": torch.randn(300, 7, generator=g), "b": torch.zeros(5)},
    }


def _inside(t: torch.Tensor, buf) -> bool:
    start = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + len(buf)


def test_chunks_are_reassembled_into_one_buffer_and_decoded_as_views_of_it():
    data = encode(_groups(), {"v": 1})
    asm = Assembler("peer", len(data), sha256(data), 1 << 30)
    for frame in data_frames(data, 1000):
        asm.add(data_field(frame))
    buf = asm.finish()
    assert bytes(buf) == data and not memoryview(buf).readonly
    groups, meta = decode(buf)
    assert meta == {"v": 1}
    for g, ts in _groups().items():
        for k, t in ts.items():
            assert torch.equal(groups[g][k], t)
            assert _inside(groups[g][k], buf), f"{g}/{k} was copied"
            assert groups[g][k].data_ptr() % 4 == 0
    assert groups["params"]["a"].data_ptr() % 64 == 0  # the tensor bytes start aligned
    ro, _ = decode(data)  # over read-only bytes: copies, writable and independent
    ro["params"]["a"].add_(1.0)
    assert bytes(buf) == data


def test_assembler_still_refuses_what_it_refused():
    data = encode(_groups())
    with pytest.raises(Refusal, match="exceeds the limit"):
        Assembler("peer", len(data), sha256(data), 100)
    asm = Assembler("peer", len(data), sha256(data), 1 << 30)
    with pytest.raises(Refusal, match="more than the announced"):
        asm.add(data + b"x")
    asm = Assembler("peer", len(data), sha256(data), 1 << 30)
    asm.add(data[:-1])
    with pytest.raises(Refusal, match="truncated"):
        asm.finish()
    asm = Assembler("peer", len(data), sha256(data), 1 << 30)
    asm.add(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit
    with pytest.raises(Refusal, match="sha256 mismatch"):
        asm.finish()


def test_hand_built_frames_are_what_protobuf_would_send():
    data = bytes(range(256)) * 20
    frames = list(data_frames(data, 700))
    assert frames == [pb.SnapshotChunk(data=data[i : i + 700]).SerializeToString() for i in range(0, len(data), 700)]
    assert b"".join(bytes(data_field(f)) for f in frames) == data


def test_a_published_snapshot_is_held_once():
    groups = _groups()
    snap = LocalSnapshot("me", 3, 2, groups)
    asyncio.run(snap.ready())  # encoded and hashed in a worker thread
    assert bytes(snap.encoded) == encode(groups, {"node_id": "me", "version": 3, "round": 2})
    assert snap.digest == sha256(bytes(snap.encoded))
    for g, ts in snap.groups.items():
        for k, t in ts.items():
            assert torch.equal(t, groups[g][k]) and _inside(t, snap.encoded), f"{g}/{k} held twice"
    assert bytes(encode_buffer(groups)) == encode(groups)


def test_snapshot_cache_is_bounded_by_bytes_least_recently_used_first():
    def snap(peer, n_floats):
        return PeerSnapshot(peer, 1, 1, {"w": torch.zeros(n_floats)})

    cache = SnapshotCache(max_bytes=1000)
    cache.put(snap("a", 100))  # 400 bytes
    cache.put(snap("b", 100))
    assert cache.bytes == 800 and len(cache) == 2
    cache.get("a")  # a is now the most recently used
    cache.put(snap("c", 100))
    assert "b" not in cache and "a" in cache and "c" in cache and cache.bytes == 800 and cache.evicted == 1
    cache.put(snap("a", 150))  # a replaced: its old size no longer counts
    assert cache.bytes == 1000
    cache.put(snap("huge", 1000))  # larger than the bound alone: kept, everything else dropped
    assert len(cache) == 1 and "huge" in cache


class _Stats:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


class _Handler:
    node_id = "server"

    def __init__(self, snap):
        self.snap = snap

    def info(self):
        return NodeInfo("server", PROTOCOL_VERSION, "")

    async def snapshot(self, requester, min_round=0, wait_s=0.0):
        return await self.snap.ready()

    def check_known(self, node_id):
        return None

    def admit(self, peer, kind):
        return contextlib.nullcontext()


def test_a_pulled_snapshot_arrives_in_one_buffer_over_grpc():
    groups = {"params": {"w": torch.randn(600_000)}}  # 2.4 MB: several 1 MiB chunks

    async def go():
        server, port = await serve(_Handler(LocalSnapshot("server", 1, 1, groups)), _Stats(), "127.0.0.1:0", tls=None)
        client = PeerClient(
            "me",
            _Stats(),
            chunk_bytes=1 << 20,
            max_model_bytes=1 << 30,
            max_gossip_bytes=1 << 20,
            timeout_s=30,
            tls=None,
        )
        try:
            header, got = await client.get_snapshot(f"127.0.0.1:{port}", "me", 0)
            w = got["params"]["w"]
            assert torch.equal(w, groups["params"]["w"]) and header.version == 1
            base = w.numpy().base
            while getattr(base, "base", None) is not None:
                base = base.base
            assert base.nbytes < 2 * w.numel() * 4  # one buffer the size of the payload, not chunks + join + copy
            assert w.data_ptr() % 64 == 0
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(go())


def test_idle_channels_are_evicted_and_busy_ones_kept():
    snap = LocalSnapshot("server", 1, 1, {"params": {"w": torch.zeros(4)}})

    async def go():
        servers = [await serve(_Handler(snap), _Stats(), "127.0.0.1:0", tls=None) for _ in range(2)]
        a, b = (f"127.0.0.1:{port}" for _, port in servers)
        client = PeerClient(
            "me",
            _Stats(),
            chunk_bytes=1 << 20,
            max_model_bytes=1 << 30,
            max_gossip_bytes=1 << 20,
            timeout_s=30,
            tls=None,
            idle_channel_s=0.3,
        )
        try:
            await client.get_snapshot(a, "me", 0)
            assert client.channels() == 1
            await asyncio.sleep(0.5)
            await client.get_snapshot(b, "me", 0)  # a sweep runs as calls start
            assert client.channels() == 1 and client.evicted == 1  # a's channel is gone, b's is new
            await client.get_snapshot(a, "me", 0)  # and comes back on demand
            assert client.channels() == 2
        finally:
            await client.close()
            for server, _ in servers:
                await server.stop(None)

    asyncio.run(go())


def test_large_payloads_are_hashed_off_the_loop_and_still_checked():
    from coterie.node.transport import chunks

    data = bytes(np.random.default_rng(0).integers(0, 256, chunks.HASH_IN_THREAD_BYTES + 12345, dtype=np.uint8))
    for flip in (None, len(data) // 2):
        sent = bytearray(data)
        if flip is not None:
            sent[flip] ^= 1
        asm = Assembler("peer", len(data), sha256(data), 1 << 30)
        for frame in data_frames(bytes(sent), 1 << 20):
            asm.add(data_field(frame))
        assert asm._pending is not None  # went through the hashing thread
        if flip is None:
            assert bytes(asm.finish()) == data
        else:
            with pytest.raises(Refusal, match="sha256 mismatch"):
                asm.finish()
