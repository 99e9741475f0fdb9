"""Identity attacks on real daemons over mTLS (loopback). The test plays the attacker: raw gRPC
channels with certificates from the network's CA (or none, or another CA's), and a rogue server.

Each test attacks one defence and asserts the attack fails; run against the code before mTLS
(plaintext, claimed ids trusted) every one of them succeeds."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import grpc
import pytest

from coterie.node.config import PROTOCOL_VERSION
from coterie.node.peering.messages import Beat, NodeInfo
from coterie.node.security.pki import init_ca, issue_cert, load_credentials
from coterie.node.transport.server import serve
from coterie.node.transport.tls import TLS
from coterie.proto.v1 import peer_pb2 as pb
from coterie.proto.v1 import peer_pb2_grpc as rpc
from tests.nodeproc import NodeProc, node_certs, peer_channel, tiny_learner, wait_for

pytestmark = pytest.mark.slow
LEARNER = tiny_learner(2, 0)
DENIED, UNAVAILABLE = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE


class _NoTraffic:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """``victim`` and its honest peer ``n0``, on mTLS with the CA of ``root``."""
    root = tmp_path_factory.mktemp("sec")
    base = {"strategy": "local", "round_interval_s": 0.3, "learner": LEARNER}
    n0 = NodeProc(root, "n0", base).start()
    victim = NodeProc(root, "victim", {**base, "peers": [n0.address]}).start()
    wait_for(lambda: _peer(victim, "n0") and _peer(victim, "n0")["state"] == "alive", 30, "victim to know n0")
    yield root, victim, n0
    victim.stop()
    n0.stop()


def _peer(node: NodeProc, node_id: str) -> dict | None:
    return next((p for p in node.get("/peers") if p["node_id"] == node_id), None)


def _info(node_id: str, fingerprint: str, address: str = "127.0.0.1:1") -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=node_id, protocol_version=PROTOCOL_VERSION, arch_fingerprint=fingerprint, address=address
    )


async def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def _one_frame_call(method, header: pb.ComputeHeader):
    async def frames():
        yield pb.ComputeFrame(header=header)

    return await method(frames(), timeout=10)


def test_impostor_with_its_own_certificate_cannot_speak_for_another_node(net):
    """mallory holds a valid certificate — for mallory. Everything it says as n0 is refused, and
    the victim's record of n0 (address, liveness) is untouched."""
    root, victim, n0 = net
    fp = victim.status()["fingerprint"]
    before = _peer(victim, "n0")

    async def go():
        async with peer_channel(root, "mallory", victim.address, expect="victim") as ch:
            stub = rpc.PeerStub(ch)
            calls = {
                "handshake": stub.Handshake(pb.HandshakeRequest(node=_info("n0", fp, "127.0.0.1:9")), timeout=10),
                "heartbeat": stub.Heartbeat(pb.HeartbeatRequest(node_id="n0", round=10**6), timeout=10),
                "peers": stub.ExchangePeers(pb.PeerList(node_id="n0"), timeout=10),
                "snapshot": stub.GetSnapshot(pb.SnapshotRequest(requester="n0"), timeout=10).read(),
                "cross-loss": _one_frame_call(
                    stub.CrossLoss, pb.ComputeHeader(requester="n0", ref=pb.SnapshotRef(node_id="victim", version=1))
                ),
                "push": _one_frame_call(stub.PushGradient, pb.ComputeHeader(requester="n0", target_version=1)),
                "gossip": stub.GossipState(pb.GossipMessage(node_id="n0", key="omega"), timeout=10),
            }
            out = {name: await _code(c) for name, c in calls.items()}
            # the same certificate speaking for itself is fine: the refusals are about the claim
            ok = await _code(stub.Handshake(pb.HandshakeRequest(node=_info("mallory", fp)), timeout=10))
            return out, ok

    out, ok = asyncio.run(go())
    for name, (code, details) in out.items():
        assert code == DENIED, (name, code, details)
        assert "'n0'" in details and "certificate is for 'mallory'" in details, (name, details)
    assert ok[0] == grpc.StatusCode.OK, ok
    after = _peer(victim, "n0")
    assert after["address"] == before["address"] == n0.address
    assert after["round"] < 10**6  # the forged heartbeat did not move n0's round
    wait_for(lambda: _peer(victim, "n0")["state"] == "alive", 10, "n0 to stay alive at the victim")


class _Liar:
    """A server with mallory's (valid) certificate whose handshake reply says it is n0."""

    node_id = "n0"

    def __init__(self, fingerprint: str):
        self.fingerprint, self.address = fingerprint, ""

    def info(self):
        return NodeInfo("n0", PROTOCOL_VERSION, self.fingerprint, address=self.address)

    def on_handshake(self, remote):
        return []

    def on_heartbeat(self, beat):
        return Beat("n0", 10**6, 1)

    def on_peer_list(self, sender, entries):
        return []

    def check_known(self, node_id):
        return None

    def admit(self, peer, kind):
        return contextlib.nullcontext()


def test_a_server_claiming_another_nodes_id_is_not_believed(net):
    """The stranger-rewires-n0 attack from the dialling side: mallory advertises a candidate
    address by peer exchange; whoever answers there claims to be n0. The victim dials it, asks
    for n0's certificate, does not get it, and keeps n0's real address."""
    root, victim, n0 = net
    fp = victim.status()["fingerprint"]

    async def go():
        liar = _Liar(fp)
        server, port = await serve(
            liar, _NoTraffic(), "127.0.0.1:0", tls=TLS(load_credentials(node_certs(root, "mallory")))
        )
        liar.address = f"127.0.0.1:{port}"
        try:
            async with peer_channel(root, "mallory", victim.address, expect="victim") as ch:
                stub = rpc.PeerStub(ch)
                await stub.Handshake(pb.HandshakeRequest(node=_info("mallory", fp, "127.0.0.1:2")), timeout=10)
                await stub.ExchangePeers(
                    pb.PeerList(node_id="mallory", peers=[pb.PeerEntry(node_id="ghost", address=liar.address)]),
                    timeout=10,
                )

            def refused():
                return any(
                    "could not prove" in p["message"] and "'n0'" in p["message"] for p in victim.status()["problems"]
                )

            await asyncio.to_thread(wait_for, refused, 30, "the victim to refuse the liar's claim")
        finally:
            await server.stop(0)
        return liar.address

    liar_address = asyncio.run(go())
    assert _peer(victim, "n0")["address"] == n0.address != liar_address
    assert _peer(victim, "ghost") is None


def _other_ca_certs(tmp_path, node_id: str):
    init_ca(tmp_path / "other-ca", name="someone else's CA")
    return load_credentials(issue_cert(tmp_path / "other-ca", node_id, tmp_path / f"other-{node_id}"))


def test_strangers_without_a_valid_certificate_never_reach_the_node(net, tmp_path):
    """Plaintext, TLS without a client certificate, a certificate from another CA: the TLS
    handshake fails, no request reaches the servicer, the peer table does not change. A
    certificate from the network's CA over the same code path succeeds (the control)."""
    root, victim, _ = net
    fp = victim.status()["fingerprint"]
    ca_pem = (node_certs(root, "victim") / "ca.pem").read_bytes()
    other = _other_ca_certs(tmp_path, "stranger")
    target = ("grpc.ssl_target_name_override", TLS.target_name("victim"))
    channels = {
        "plaintext": lambda: grpc.aio.insecure_channel(victim.address),
        "tls, no client certificate": lambda: grpc.aio.secure_channel(
            victim.address, grpc.ssl_channel_credentials(ca_pem), options=[target]
        ),
        "certificate from another CA": lambda: grpc.aio.secure_channel(
            victim.address, grpc.ssl_channel_credentials(ca_pem, other.key_pem, other.cert_pem), options=[target]
        ),
    }

    async def attempt(make) -> tuple[grpc.StatusCode, str]:
        async with make() as ch:
            return await _code(rpc.PeerStub(ch).Handshake(pb.HandshakeRequest(node=_info("stranger", fp)), timeout=5))

    async def go():
        out = {name: await attempt(make) for name, make in channels.items()}
        async with peer_channel(root, "stranger", victim.address, expect="victim") as ch:
            control = await _code(
                rpc.PeerStub(ch).Handshake(pb.HandshakeRequest(node=_info("stranger", fp)), timeout=10)
            )
        return out, control

    known_before = {p["node_id"] for p in victim.get("/peers")}
    out, control = asyncio.run(go())
    for name, (code, details) in out.items():
        assert code == UNAVAILABLE, (name, code, details)
    assert "stranger" not in known_before
    assert control[0] == grpc.StatusCode.OK, control  # the same request with a real certificate
    assert _peer(victim, "stranger") is not None


def test_sybils_need_a_certificate_each(net):
    """One attacker, many identities: without certificates none gets in; with one certificate
    exactly one identity gets in, the one the certificate names."""
    root, victim, _ = net
    fp = victim.status()["fingerprint"]
    sybils = [f"sybil-{i}" for i in range(5)]

    async def go():
        codes = []
        async with grpc.aio.insecure_channel(victim.address) as ch:  # no certificate at all
            for s in sybils:
                codes.append(
                    (
                        "plain",
                        s,
                        *await _code(rpc.PeerStub(ch).Handshake(pb.HandshakeRequest(node=_info(s, fp)), timeout=5)),
                    )
                )
        async with peer_channel(root, "sybil-master", victim.address, expect="victim") as ch:
            for s in [*sybils, "sybil-master"]:
                codes.append(
                    (
                        "cert",
                        s,
                        *await _code(rpc.PeerStub(ch).Handshake(pb.HandshakeRequest(node=_info(s, fp)), timeout=10)),
                    )
                )
        return codes

    codes = asyncio.run(go())
    assert all(c[2] == UNAVAILABLE for c in codes if c[0] == "plain"), codes
    assert all(c[2] == DENIED for c in codes if c[0] == "cert" and c[1] != "sybil-master"), codes
    assert [c[2] for c in codes if c[1] == "sybil-master"] == [grpc.StatusCode.OK]
    known = {p["node_id"] for p in victim.get("/peers")}
    assert "sybil-master" in known and not known & set(sybils)


def test_allow_list_keeps_out_certified_nodes_not_on_it(net):
    root, victim, n0 = net
    gated = NodeProc(
        root,
        "gated",
        {
            "strategy": "local",
            "learner": LEARNER,
            "peers": [n0.address],
            "security": {"cert_dir": str(node_certs(root, "gated")), "allow_ids": ["n0"]},
        },
    ).start()
    try:
        fp = gated.status()["fingerprint"]

        async def go():
            async with peer_channel(root, "mallory", gated.address, expect="gated") as ch:
                return await _code(
                    rpc.PeerStub(ch).Handshake(pb.HandshakeRequest(node=_info("mallory", fp)), timeout=10)
                )

        code, details = asyncio.run(go())
        assert code == DENIED and "allow-list" in details, (code, details)
        wait_for(lambda: (_peer(gated, "n0") or {}).get("state") == "alive", 30, "gated to admit n0")
    finally:
        gated.stop()


def test_no_certificates_no_start_and_insecure_is_explicit_and_loud(tmp_path):
    """Fail closed: a node with neither certificates nor ``insecure`` does not start, and says
    what to set. With ``insecure = true`` it runs plaintext, warns at start, and plaintext peers
    can talk to it (the explicit insecure path)."""
    cfg = tmp_path / "n.toml"
    cfg.write_text(f'node_id = "bare"\nstate_dir = "{tmp_path / "bare"}"\n')
    r = subprocess.run(
        [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "security.cert_dir" in r.stderr and "security.insecure" in r.stderr, r.stderr

    base = {"strategy": "local", "learner": LEARNER, "round_interval_s": 0.3, "security": {"insecure": True}}
    a = NodeProc(tmp_path, "plain-a", base).start()
    try:
        b = NodeProc(tmp_path, "plain-b", {**base, "peers": [a.address]}).start()
        try:
            wait_for(lambda: (_peer(b, "plain-a") or {}).get("state") == "alive", 30, "plaintext nodes to meet")
            assert a.status()["mtls"] is False
        finally:
            b.stop()
    finally:
        a.stop()
    assert "WITHOUT TLS" in (tmp_path / "plain-a" / "node.log").read_text()
