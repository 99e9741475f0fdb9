"""The certified insider (issue 22), attacked on real daemons over mTLS.

The attacker holds a valid certificate from the network's CA and has handshaken: it is a
compromised or buggy device. What it may cost the others is bounded; each test names the
defence it attacks and would fail without it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest
import torch

from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.messages import CROSS_LOSS, ComputeRequest
from coterie.node.privacy.ledger import FILE as LEDGER_FILE
from coterie.node.privacy.ledger import PrivacyLedger, ReleaseRateLimited
from coterie.node.security.pki import load_credentials
from tests.nodeproc import CertifiedPeer, NodeProc, node_certs, tiny_learner, wait_for

pytestmark = pytest.mark.slow


class Insider(CertifiedPeer):
    """A peer with a valid certificate, speaking through Coterie's own client."""

    async def params(self) -> dict[str, torch.Tensor]:
        _, groups = await self.client.get_snapshot(self.target.address, self.node_id, peer=self.target.node_id)
        return groups["params"]

    async def evidence(self, params) -> str:
        """One SCool evidence request (a loss on the target's training data): 'ok' or the refusal."""
        try:
            await self.client.compute(
                self.target.address,
                ComputeRequest(
                    CROSS_LOSS, self.node_id, groups={"params": params}, max_samples=64, purpose="scool-evidence"
                ),
                peer=self.target.node_id,
            )
            return "ok"
        except PeerCallError as e:
            return f"{e.kind}: {e}"


# ------------------------------------------------------------------------- privacy budget
def _victim(root, node_id: str = "victim", **privacy) -> NodeProc:
    return NodeProc(
        root,
        node_id,
        {
            "strategy": "local",
            "learner": tiny_learner(1, 0, samples=300),
            "limits": {"compute_share": 50.0},
            "privacy": {
                "serve_purposes": ["scool-evidence"],
                "peer_release_rate": 1000.0,
                "peer_release_burst": 1000,
                **privacy,
            },
        },
    )


async def _drain(root, victim: NodeProc, who: str, most: int) -> list[str]:
    """``who`` asks for evidence until refused for the budget (or ``most`` answers)."""
    m = Insider(root, victim, who)
    try:
        await m.join()
        params = await m.params()
        out = []
        for _ in range(most):
            out.append(await m.evidence(params))
            if out[-1] != "ok":
                break
        return out
    finally:
        await m.close()


def test_one_peer_cannot_drain_the_budget_and_honest_peers_still_get_answers(tmp_path):
    """Mallory asks for releases as fast as it can. Without the per-peer share (expected_peers = 1,
    the old default of no per-peer cap) it spends the node's whole budget (~170 releases here) and
    every honest peer is refused from then on; with the default share it is refused after its
    1/10 and an honest peer is still answered."""
    victim = _victim(tmp_path).start()
    try:
        mallory = asyncio.run(_drain(tmp_path, victim, "mallory", 400))
        honest = asyncio.run(_drain(tmp_path, victim, "honest", 3))
        priv = victim.status()["privacy"]
    finally:
        victim.stop()
    answered = mallory.count("ok")
    assert mallory[-1].startswith("privacy_budget") and "share" in mallory[-1], mallory[-3:]
    assert 1 <= answered <= 40, answered
    assert honest == ["ok"] * 3, honest
    assert priv["epsilon"] < priv["budget_epsilon"] / 2, priv
    print(
        f"one insider draining: answered {answered}, then refused ({mallory[-1][:90]}); "
        f"ε total {priv['epsilon']:.2f} of {priv['budget_epsilon']}; honest peer: {honest}"
    )


def test_releases_to_one_peer_are_rate_limited():
    """A token bucket per peer: a burst, then refusals until it refills (a fake clock)."""
    import tempfile

    now = [0.0]
    with tempfile.TemporaryDirectory() as d:
        ledger = PrivacyLedger(d, delta=1e-5, peer_rate=2.0, peer_burst=3, clock=lambda: now[0])
        for _ in range(3):
            ledger.charge("mallory", "scool-evidence", 2.0, 0.01)
        with pytest.raises(ReleaseRateLimited, match="mallory"):
            ledger.charge("mallory", "scool-evidence", 2.0, 0.01)
        ledger.charge("honest", "scool-evidence", 2.0, 0.01)  # another peer's bucket is its own
        now[0] += 0.5  # one release's worth at 2/s
        ledger.charge("mallory", "scool-evidence", 2.0, 0.01)
        with pytest.raises(ReleaseRateLimited):
            ledger.charge("mallory", "scool-evidence", 2.0, 0.01)
        assert ledger.total.releases == 5 and ledger.rate_refusals == 2


def test_the_share_and_rate_bound_what_a_peer_asks_not_what_the_node_sends(tmp_path):
    """A FedeRiCo push or COBO alignment vector is this node's own choice, paced by its rounds: the
    total bounds it, the per-peer share and rate (against a peer asking) do not."""
    ledger = PrivacyLedger(tmp_path, delta=1e-5, budget=8.0, expected_peers=10, peer_rate=1.0, peer_burst=1)
    ledger.charge("n1", "scool-evidence", 2.0, 0.5)
    with pytest.raises(ReleaseRateLimited):
        ledger.charge("n1", "scool-evidence", 2.0, 0.5)
    for _ in range(5):  # past n1's share (2 such releases) and its rate, all sent by this node
        ledger.charge("n1", "federico-push", 2.0, 0.5, requested=False)
    assert ledger.peers["n1"].releases == 6 and ledger.epsilon() <= 8.0


@pytest.fixture
def spent_victim(tmp_path):
    """A victim that has released to a peer, with those releases checkpointed; stopped."""
    victim = _victim(tmp_path)
    victim.start()
    try:
        out = asyncio.run(_drain(tmp_path, victim, "peer", 5))
        assert out == ["ok"] * 5, out
        r = victim.status()["round"]
        wait_for(lambda: victim.status()["round"] >= r + 2, 60, "a checkpoint after the releases")
        eps = victim.status()["privacy"]["epsilon"]
    finally:
        victim.stop()
    assert eps > 0
    return victim, eps


def _refuses_to_start(node: NodeProc, *words: str) -> str:
    """Start the node's daemon as NodeProc does; it must exit at once, saying ``words``."""
    r = subprocess.run(
        [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config", str(node.config_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    msg = r.stdout + r.stderr
    assert r.returncode != 0, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_a_deleted_ledger_refuses_to_start_naming_the_file(spent_victim):
    """Deleting privacy-ledger.json used to reset ε to 0 silently on the next start."""
    victim, eps = spent_victim
    (victim.state_dir / LEDGER_FILE).unlink()
    _refuses_to_start(victim, LEDGER_FILE, "is missing", "--reset-privacy-ledger")


def test_a_ledger_rewritten_with_less_refuses_to_start_and_reset_restores_the_pin(spent_victim, tmp_path):
    """A consistent ledger (valid format and checksum) that records fewer releases than the
    checkpoint pinned is refused; --reset-privacy-ledger starts, logged, from the pin (not 0)."""
    victim, eps = spent_victim
    forged = PrivacyLedger(tmp_path / "forged", delta=1e-5)
    forged.charge("peer", "scool-evidence", 2.0, 0.5)  # one release instead of five
    shutil.copy(forged.path, victim.state_dir / LEDGER_FILE)
    _refuses_to_start(victim, LEDGER_FILE, "fewer than", "rewritten")
    victim.start(extra_args=["--reset-privacy-ledger"])
    try:
        priv = victim.status()["privacy"]
        assert priv["epsilon"] >= eps * 0.999 and priv["peers"]["peer"]["releases"] >= 5, priv
        assert "reset-privacy-ledger" in (victim.dir / "node.log").read_text()
        assert list(victim.state_dir.glob(LEDGER_FILE + ".bad-*")), "the bad ledger is kept aside"
    finally:
        victim.stop()


def test_a_tampered_ledger_fails_its_checksum(spent_victim):
    victim, _ = spent_victim
    path = victim.state_dir / LEDGER_FILE
    data = json.loads(path.read_text())
    data["total"]["releases"] = 0  # an edit that leaves the JSON valid
    path.write_text(json.dumps(data))
    _refuses_to_start(victim, LEDGER_FILE, "checksum")


# ------------------------------------------------------------------------- revocation
def _peer_state(node: NodeProc, node_id: str) -> str | None:
    return next((p["state"] for p in node.get("/peers") if p["node_id"] == node_id), None)


def test_a_revoked_node_is_refused_and_dropped_from_membership(tmp_path):
    """n1 holds a valid certificate; the CA revokes it (`coterie cert revoke`, a signed CRL) and
    the operator drops the CRL into n0's cert dir. n1's next call is refused (FORBIDDEN, naming
    the revocation), n0 marks it dead and it stays dead. Without the CRL check n1 stays alive and
    answered."""
    n0 = NodeProc(tmp_path, "n0", {"strategy": "local", "learner": tiny_learner(3, 0)}).start()
    n1 = NodeProc(tmp_path, "n1", {"strategy": "local", "learner": tiny_learner(3, 1), "peers": [n0.address]}).start()
    n2 = NodeProc(tmp_path, "n2", {"strategy": "local", "learner": tiny_learner(3, 2), "peers": [n0.address]}).start()
    try:
        wait_for(lambda: _peer_state(n0, "n1") == "alive", 60, "n0 to see n1")
        wait_for(lambda: _peer_state(n2, "n1") == "alive", 60, "n2 to see n1")
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "coterie.cli.main",
                "cert",
                "revoke",
                "--ca",
                str(tmp_path / "pki" / "ca"),
                "--node-id",
                "n1",
            ],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        shutil.copy(tmp_path / "pki" / "ca" / "crl.pem", node_certs(tmp_path, "n0") / "crl.pem")
        wait_for(lambda: _peer_state(n0, "n1") == "dead", 60, "n0 to drop the revoked n1")
        # n2 was given no file: the signed list reaches it from n0 by gossip, and it drops n1 too
        wait_for(lambda: _peer_state(n2, "n1") == "dead", 60, "n2 to learn the revocation by gossip")
        assert (n2.state_dir / "crl.pem").exists()  # kept across a restart

        async def call_as_n1():
            m = Insider(tmp_path, n0, "n1")
            try:
                await m.join()
            except PeerCallError as e:
                return e.kind, str(e)
            finally:
                await m.close()
            return "ok", ""

        kind, msg = asyncio.run(call_as_n1())
        # FORBIDDEN travels as PERMISSION_DENIED, which a caller reads as unknown_peer
        assert kind in ("forbidden", "unknown_peer") and "is revoked by CRL" in msg, (kind, msg)
        for _ in range(20):  # n1 keeps calling (heartbeats, handshakes): it never comes back
            assert _peer_state(n0, "n1") == "dead"
            wait_for(lambda: True, 1, "a poll")
        log = (n0.dir / "node.log").read_text()
        # the log names the revocation: as the list's listener drops a live n1, or as n0 refuses
        # n1's handshake where that came first (seen once on a loaded box: the refusal alone)
        assert "revoked by the network CA" in log or "is revoked by CRL" in log
        assert "Traceback" not in log
        assert "revocation list 1 from peer n0" in (n2.dir / "node.log").read_text()
    finally:
        n2.stop()
        n1.stop()
        n0.stop()


def test_an_expired_or_revoked_own_certificate_refuses_to_start(tmp_path):
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    from coterie.node.security.pki import NODE_CERT, PKIError, _load_ca

    d = node_certs(tmp_path, "old")
    ca_cert, ca_key = _load_ca(tmp_path / "pki" / "ca")
    cert = x509.load_pem_x509_certificate((d / NODE_CERT).read_bytes())
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2)
    b = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(ca_cert.subject)
        .public_key(cert.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(past - dt.timedelta(days=30))
        .not_valid_after(past)
    )
    for ext in cert.extensions:
        b = b.add_extension(ext.value, ext.critical)
    (d / NODE_CERT).write_bytes(b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    with pytest.raises(PKIError, match="expired"):
        load_credentials(d)
    node = NodeProc(tmp_path, "old", {"strategy": "local", "learner": tiny_learner(1, 0)})
    _refuses_to_start(node, "expired", NODE_CERT)


# ------------------------------------------------------------------------- health, reflection
def test_health_and_reflection_answer_garbage_cleanly(tmp_path):
    """Malformed bytes to the standard gRPC health service (and to reflection, off by default)
    gave UNKNOWN and library tracebacks in the node's log. Now: a clean status, no traceback."""
    import grpc

    from tests.nodeproc import peer_channel

    n0 = NodeProc(tmp_path, "n0", {"strategy": "local", "learner": tiny_learner(1, 0)}).start()
    garbage = [b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" * 33, bytes(range(256)), b"\x12\x05ab"]
    codes: dict[str, set] = {}
    try:

        async def go():
            ch = peer_channel(tmp_path, "prober", n0.address)
            try:
                for method in ("/grpc.health.v1.Health/Check",):
                    call = ch.unary_unary(method)
                    for g in garbage:
                        try:
                            await call(g, timeout=5)
                            codes.setdefault(method, set()).add("OK")
                        except grpc.aio.AioRpcError as e:
                            codes.setdefault(method, set()).add(e.code().name)
                for method in ("/grpc.health.v1.Health/Watch",):
                    for g in garbage:
                        try:
                            async for _ in ch.unary_stream(method)(g, timeout=2):
                                break
                            codes.setdefault(method, set()).add("OK")
                        except grpc.aio.AioRpcError as e:
                            codes.setdefault(method, set()).add(e.code().name)
                for method in (
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                ):
                    # off: the method does not exist, whatever is sent. Nothing is written: a write
                    # racing the server's refusal ends the call INTERNAL on the client's side
                    # ("Internal error from Core"), which is not the server's answer
                    call = ch.stream_stream(method)(iter(()), timeout=5)
                    try:
                        async for _ in call:
                            pass
                    except grpc.aio.AioRpcError:
                        pass
                    codes.setdefault(method, set()).add((await call.code()).name)
                # a well-formed check still answers
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return reply.status
            finally:
                await ch.close()

        status = asyncio.run(go())
        alive = n0.status()
    finally:
        n0.stop()
    log = (n0.dir / "node.log").read_text()
    print("garbage to health/reflection:", codes)
    assert status == 1 and alive["node_id"] == "n0"  # SERVING
    assert all("UNKNOWN" not in c for c in codes.values()), codes
    assert codes["/grpc.health.v1.Health/Check"] <= {"INVALID_ARGUMENT", "OK"}, codes
    assert all(codes[m] == {"UNIMPLEMENTED"} for m in codes if "reflection" in m), codes
    assert "Traceback" not in log, log[-3000:]
