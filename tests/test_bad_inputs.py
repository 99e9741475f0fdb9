"""Every bad input a peer can send is refused with a message naming the problem, and the node
keeps serving. The test plays a rogue peer: a raw gRPC client, and a rogue server the node pulls from."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import subprocess
import sys

import grpc
import msgpack
import pytest
import torch

from coterie.node.config import PROTOCOL_VERSION
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.peering.messages import Beat, LocalSnapshot, NodeInfo
from coterie.node.security.pki import load_credentials
from coterie.node.transport.chunks import sha256, split
from coterie.node.transport.serde import node_info_to_pb
from coterie.node.transport.server import serve
from coterie.node.transport.tls import TLS
from coterie.node.wire.codec import encode
from coterie.proto.v1 import peer_pb2 as pb
from coterie.proto.v1 import peer_pb2_grpc as rpc
from tests.nodeproc import NodeProc, node_certs, peer_channel, tiny_learner, wait_for

pytestmark = pytest.mark.slow
LEARNER = tiny_learner(2, 0)


class _NoTraffic:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


class RogueHandler:
    """A peer that speaks the protocol correctly but publishes whatever ``self.payload`` holds:
    raw bytes streamed as they are (a LocalSnapshot whose encoding is forged)."""

    node_id = "rogue"

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.address = ""
        self.snap: LocalSnapshot | None = None
        self.version = 0

    def set_payload(self, data: bytes) -> None:
        self.version += 1
        snap = LocalSnapshot("rogue", self.version, 0, {})
        snap._encoded, snap._digest = memoryview(data), hashlib.sha256(data).hexdigest()  # what the server streams
        self.snap = snap

    def info(self):
        return NodeInfo("rogue", PROTOCOL_VERSION, self.fingerprint, address=self.address)

    def on_handshake(self, remote):
        return []

    def on_heartbeat(self, beat):
        return Beat("rogue", 0, self.version)

    def on_peer_list(self, sender, entries, members=(), incarnation=0):
        return [], [], 0

    async def snapshot(self, requester, min_round=0, wait_s=0.0):
        return self.snap

    def check_known(self, node_id):
        return None

    def admit(self, peer, kind):
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def params():
    return build_learner(LearnerConfig(**LEARNER)).get_params()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    node = NodeProc(
        tmp_path_factory.mktemp("bad"),
        "victim",
        {
            "strategy": "dpsgd",
            "round_interval_s": 0.2,
            "learner": LEARNER,
            "max_model_bytes": 256 * 1024,
            "max_gossip_bytes": 1024,
            # D-PSGD serves no compute on its data; these tests need one purpose open
            # (exact answers: malformed input is refused before any DP release)
            "privacy": {"serve_purposes": ["scool-evidence"], "enabled": False},
        },
    ).start()
    yield node
    node.stop()


def _channel(node, as_id="tester"):
    """A channel to ``node`` presenting a certificate for ``as_id`` from the node's own CA."""
    return peer_channel(node.dir.parent, as_id, node.address, expect=node.node_id)


async def _handshake(stub, fingerprint, node_id="tester", version=PROTOCOL_VERSION):
    return await stub.Handshake(
        pb.HandshakeRequest(
            node=pb.NodeInfo(
                node_id=node_id, protocol_version=version, arch_fingerprint=fingerprint, address="127.0.0.1:1"
            )
        ),
        timeout=10,
    )


async def _cross_loss(
    stub, payload: bytes, *, digest: str | None = None, total: int | None = None, requester="tester", reduction="mean"
):
    """A cross-loss call; ``requester`` other than the channel's certificate id is refused before
    anything else (test_security.py), so tests of strangers use a channel with their own cert."""

    async def frames():
        yield pb.ComputeFrame(
            header=pb.ComputeHeader(
                requester=requester,
                total_bytes=len(payload) if total is None else total,
                sha256=sha256(payload) if digest is None else digest,
                split="train",
                reduction=reduction,
                purpose="scool-evidence",
            )
        )
        for part in split(payload, 64 * 1024):
            yield pb.ComputeFrame(data=part)

    return await stub.CrossLoss(frames(), timeout=10)


async def _expect(coro, code, *needles):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() == code, err.value
    for n in needles:
        assert n.lower() in err.value.details().lower(), err.value.details()
    return err.value.details()


def test_handshake_refuses_other_protocol_and_architecture(target):
    fp = target.status()["fingerprint"]

    async def go():
        async with _channel(target) as ch:
            stub = rpc.PeerStub(ch)
            await _expect(
                _handshake(stub, fp, version=PROTOCOL_VERSION + 1),
                grpc.StatusCode.FAILED_PRECONDITION,
                f"speaks protocol {PROTOCOL_VERSION + 1}..{PROTOCOL_VERSION + 1}, this node only",
            )
            await _expect(_handshake(stub, "0" * 64), grpc.StatusCode.FAILED_PRECONDITION, "architecture")
            reply = await _handshake(stub, fp)
            assert reply.node.node_id == "victim"

    asyncio.run(go())


def test_unknown_peer_is_refused(target):
    async def go():
        async with _channel(target, "stranger") as ch:  # a certificate, but never handshook
            stub = rpc.PeerStub(ch)
            await _expect(
                _cross_loss(stub, b"x", requester="stranger"),
                grpc.StatusCode.PERMISSION_DENIED,
                "unknown peer",
                "stranger",
            )
            await _expect(
                stub.Heartbeat(pb.HeartbeatRequest(node_id="stranger"), timeout=5),
                grpc.StatusCode.PERMISSION_DENIED,
                "unknown peer",
            )

    asyncio.run(go())


def test_bad_models_in_requests_are_refused_with_reasons(target, params):
    fp = target.status()["fingerprint"]
    nan = {k: v.clone() for k, v in params.items()}
    next(iter(nan.values()))[0] = float("nan")
    wrong = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in params.items()}

    async def go():
        async with _channel(target) as ch:
            stub = rpc.PeerStub(ch)
            await _handshake(stub, fp)
            good = await _cross_loss(stub, encode({"params": params}))
            assert good.samples > 0 and good.loss > 0
            await _expect(_cross_loss(stub, b"\x00garbage" * 10), grpc.StatusCode.INVALID_ARGUMENT, "magic")
            await _expect(_cross_loss(stub, encode({"params": nan})), grpc.StatusCode.INVALID_ARGUMENT, "nan")
            await _expect(_cross_loss(stub, encode({"params": wrong})), grpc.StatusCode.INVALID_ARGUMENT, "expected")
            await _expect(
                _cross_loss(stub, encode({"params": params}), reduction="max"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "unknown reduction",
            )
            await _expect(
                _cross_loss(stub, encode({"params": params}), digest="0" * 64),
                grpc.StatusCode.INVALID_ARGUMENT,
                "sha256",
            )
            big = encode({"params": {"x": torch.zeros(100_000)}})  # 400 kB > the 256 KiB limit
            await _expect(_cross_loss(stub, big), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit")
            truncated = encode({"params": params})
            await _expect(
                _cross_loss(stub, truncated[:-10], digest=sha256(truncated), total=len(truncated)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "truncated",
            )
            await _expect(
                stub.GossipState(pb.GossipMessage(node_id="tester", key="omega", payload=b"\x00" * 4096), timeout=5),
                grpc.StatusCode.INVALID_ARGUMENT,
                "exceeds the limit",
            )
            await _expect(
                stub.GossipState(
                    pb.GossipMessage(node_id="tester", key="omega", payload=msgpack.packb({"a": 1})), timeout=5
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "does not understand",
            )

    asyncio.run(go())
    # still serving and still learning
    r = target.status()["round"]
    wait_for(lambda: target.status()["round"] > r, 30, "victim to keep running rounds")


def test_refused_uploads_report_the_reason_not_a_broken_stream(target):
    """The server refuses an oversized upload at its header while the sender is still writing;
    without draining first, grpc surfaces that as a bare INTERNAL error on the sender (seen in CI)."""
    fp = target.status()["fingerprint"]

    async def go():
        async with _channel(target) as ch:
            stub = rpc.PeerStub(ch)
            await _handshake(stub, fp)
            for elems in (250_000, 2_500_000):  # 1 MB and 10 MB against the 256 KiB limit
                big = encode({"params": {"x": torch.zeros(elems)}})
                for _ in range(8):
                    await _expect(_cross_loss(stub, big), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit")
        async with _channel(target, "stranger") as ch:
            await _expect(
                _cross_loss(rpc.PeerStub(ch), encode({"params": {"x": torch.zeros(10)}}), requester="stranger"),
                grpc.StatusCode.PERMISSION_DENIED,
                "stranger",
            )

    asyncio.run(go())


def test_bad_snapshots_from_a_rogue_peer_are_rejected(target, params):
    fp = target.status()["fingerprint"]
    nan = {k: v.clone() for k, v in params.items()}
    next(iter(nan.values())).fill_(float("inf"))
    wrong = {k: v.t().contiguous() if v.dim() == 2 else v for k, v in params.items()}
    cases = [
        (b"CTW1\xff\xff\xff\xffjunk", "malformed"),
        (encode({"params": nan}), "nan or inf"),
        (encode({"params": wrong}), "expected"),
    ]

    async def go():
        rogue = RogueHandler(fp)
        tls = TLS(load_credentials(node_certs(target.dir.parent, "rogue")))
        server, port = await serve(rogue, _NoTraffic(), "127.0.0.1:0", tls=tls)
        rogue.address = f"127.0.0.1:{port}"
        try:
            async with _channel(target, "rogue") as ch:
                # introduce the rogue: the victim learns it from the handshake's address
                await rpc.PeerStub(ch).Handshake(pb.HandshakeRequest(node=node_info_to_pb(rogue.info())), timeout=10)
            for payload, needle in cases:
                rogue.set_payload(payload)

                def seen(needle: str = needle) -> bool:
                    return any(
                        p["peer"] == "rogue" and needle in p["message"].lower() for p in target.status()["problems"]
                    )

                await asyncio.to_thread(wait_for, seen, 30, f"victim to reject a {needle} snapshot")
        finally:
            await server.stop(0)

    asyncio.run(go())
    assert target.get_text("/healthz").strip() == "ok"
    metrics = target.get_text("/metrics")
    assert "coterie_rejected_total" in metrics


def test_bad_config_exits_nonzero_naming_the_field(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "coterie.cli.main",
            "node",
            "start",
            "--state-dir",
            str(tmp_path),
            "--set",
            "learner.lr=-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "learner.lr" in r.stderr


def test_corrupt_checkpoint_is_reported_not_replaced(tmp_path):
    node = NodeProc(tmp_path, "c", {"strategy": "local", "rounds": 2, "learner": LEARNER}).start()
    wait_for(lambda: node.status()["done"], 60, "two rounds")
    node.stop()
    ckpt = node.state_dir / "ckpt-000002.safetensors"
    history_before = (node.state_dir / "history.jsonl").read_bytes()
    ckpt.write_bytes(b"\x00" * 17)
    r = subprocess.run(
        [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config", str(node.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "ckpt-000002.safetensors" in r.stderr
    assert ckpt.read_bytes() == b"\x00" * 17  # nothing was overwritten
    assert (node.state_dir / "history.jsonl").read_bytes() == history_before
