"""Protocol ranges, features and releases (node/peering/versions.py): what two nodes agree on,
what a refusal names, a daemon refusing handshakes of releases it cannot speak while it keeps the
ones it can, and the revocation list reaching a peer that lacks the RPC (0.1.0's gossip key)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tomllib

from coterie.node.peering import versions
from coterie.node.peering.api import RevocationList
from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.messages import NodeInfo
from coterie.node.peering.peer_table import PeerTable
from coterie.node.peering.versions import LEGACY_CRL_KEY, RELAY, REVOCATIONS, Agreement, agree
from coterie.node.revocations import Revocations
from coterie.node.security import crl_gossip, pki
from coterie.node.security.crl_gossip import CrlExchange
from coterie.node.security.revocation import Revocation, revoke
from tests.nodeproc import NodeProc, node_certs, tiny_learner, wait_for

REPO = Path(__file__).resolve().parents[1]


def test_release_is_pyprojects_version_and_protocol_versions_name_a_release():
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == versions.RELEASE
    assert versions.PROTOCOL_MIN <= versions.PROTOCOL_MAX
    for v in range(versions.PROTOCOL_MIN, versions.PROTOCOL_MAX + 1):
        assert v in versions.PROTOCOL_RELEASES, f"protocol {v} names no release that introduced it"
    assert f"## [{versions.RELEASE.split('.dev')[0]}" in (REPO / "CHANGELOG.md").read_text()


def test_ranges_agree_on_the_newest_version_both_speak():
    assert agree("p", 1, 3, (), "0.4.0", mine=(2, 5)) == Agreement(3, (), "0.4.0")
    assert agree("p", 2, 6, (), "", mine=(1, 3)) == Agreement(3, (), "")
    # a 0.1.0 node sends no maximum: it speaks its one version
    assert agree("p", 1, 0, (), "", mine=(1, 2)) == Agreement(1, (), "")


def test_an_older_peer_is_told_which_release_to_install(monkeypatch):
    monkeypatch.setattr(versions, "PROTOCOL_RELEASES", {1: "0.1.0", 2: "0.3.0", 3: "0.5.0"})
    why = agree("n3", 1, 0, (), "", mine=(2, 3))
    assert why == "peer 'n3' speaks protocol 1..1, this node needs ≥ 2: upgrade it to coterie ≥ 0.3.0"


def test_a_newer_peer_names_its_release_bounded_and_printable():
    why = agree("n4", 4, 5, (), "0.9.0", mine=(1, 2))
    assert isinstance(why, str) and "speaks protocol 4..5, this node only 1..2" in why and "≥ 0.9.0" in why
    hostile = agree("n5", 4, 5, (), "9.9\n\x1b[2J" + "x" * 10_000, mine=(1, 2))
    assert isinstance(hostile, str) and "\n" not in hostile and "\x1b" not in hostile and len(hostile) < 200


def test_features_are_those_both_have_and_nothing_else():
    got = agree("p", 1, 1, ("gossip", REVOCATIONS, "x" * 1000, "teleport"), "0.2.0", mine=(1, 1))
    assert isinstance(got, Agreement) and got.features == (REVOCATIONS,)
    assert agree("p", 1, 1, (), "", mine=(1, 1)).features == ()  # type: ignore[union-attr]


# --- the revocation list across releases ---------------------------------------------------------
@pytest.fixture
def crls(tmp_path):
    ca = tmp_path / "ca"
    pki.init_ca(ca)
    pki.issue_cert(ca, "mallory", tmp_path / "mallory")
    _, crl = revoke(ca, node_id="mallory")
    other = tmp_path / "other-ca"
    pki.init_ca(other)
    pki.issue_cert(other, "mallory", tmp_path / "other-mallory")
    _, forged = revoke(other, node_id="mallory")
    return (ca / pki.CA_CERT).read_bytes(), crl, forged


def test_legacy_gossip_key_takes_only_the_cas_list(crls):
    """0.1.0 peers offer their list under the gossip key: a forged one, numbered far ahead, or a
    malformed one is not taken; the CA's is, and the answer is in 0.1.0's shape."""
    ca_pem, crl, forged = crls
    revocation = Revocation(ca_pem)
    exchange = CrlExchange(revocation, "me")
    assert exchange.answer_legacy("old", {"number": 10**6, "crl": forged.pem}) == {"number": 0}
    for junk in ({"number": "1", "crl": crl.pem}, {"number": True, "crl": crl.pem}, {"crl": 5}, {"number": -1}):
        assert exchange.answer_legacy("old", junk) == {"number": 0}
    assert revocation.current is None
    assert exchange.answer_legacy("old", {"number": crl.number, "crl": crl.pem}) == {
        "number": crl.number,
        "crl": crl.pem,
    }
    assert "mallory" in revocation.revoked_ids


class _Client:
    """Records how each peer was asked; answers as a node holding ``theirs`` would."""

    def __init__(self, theirs: RevocationList):
        self.theirs, self.asked = theirs, []

    async def exchange_revocations(self, address, mine, timeout=None, *, peer=None):
        self.asked.append((peer, "rpc"))
        return self.theirs

    async def gossip(self, address, sender, key, payload, timeout=None, *, peer=None):
        if key != LEGACY_CRL_KEY:
            raise PeerCallError("invalid", f"unknown gossip key {key!r}")
        self.asked.append((peer, "gossip"))
        return crl_gossip.to_legacy(self.theirs)


def test_a_peer_without_the_rpc_is_asked_under_the_old_gossip_key(crls):
    ca_pem, crl, _ = crls
    peers = PeerTable("me", suspect_after_s=1.0, dead_after_s=3.0)
    peers.upsert("old", "127.0.0.1:1", agreed=Agreement(1, (), ""))
    peers.upsert("new", "127.0.0.1:2", agreed=Agreement(1, (REVOCATIONS, RELAY), "0.2.0"))
    revocation = Revocation(ca_pem)
    node = Revocations(revocation, "me", peers, timeout_s=1.0)
    node.client = _Client(RevocationList("old", crl.number, crl.pem))
    reply = asyncio.run(node.exchange("old", crl_gossip.mine(revocation, "me")))
    assert reply == RevocationList("old", crl.number, crl.pem)  # the old peer's list, understood
    asyncio.run(node.exchange("new", crl_gossip.mine(revocation, "me")))
    assert node.client.asked == [("old", "gossip"), ("new", "rpc")]


# --- a daemon refusing what it cannot speak ------------------------------------------------------
@pytest.mark.slow
def test_daemon_refuses_unspeakable_ranges_naming_the_release_and_keeps_the_rest(tmp_path):
    from coterie.node.security.pki import load_credentials
    from coterie.node.transport.client import PeerClient
    from coterie.node.transport.tls import TLS
    from tests.nodeproc import _NoTraffic

    node = NodeProc(tmp_path, "n1", {"strategy": "local", "round_interval_s": 0.3, "learner": tiny_learner(2, 0)})
    node.start()
    try:
        fp = node.status()["fingerprint"]

        async def handshake(who: str, oldest: int, newest: int, release: str) -> str | None:
            client = PeerClient(
                who,
                _NoTraffic(),
                chunk_bytes=1 << 20,
                max_model_bytes=1 << 26,
                max_gossip_bytes=1 << 20,
                timeout_s=20,
                tls=TLS(load_credentials(node_certs(tmp_path, who))),
            )
            info = NodeInfo(who, oldest, fp, address="127.0.0.1:1", protocol_max=newest, release=release)
            try:
                await client.handshake(node.address, info, timeout=20)
                return None
            except PeerCallError as e:
                return e.message
            finally:
                await client.close()

        too_old = asyncio.run(handshake("ancient", 0, 0, ""))
        too_new = asyncio.run(handshake("future", 7, 9, "3.0.0"))
        fine = asyncio.run(handshake("current", versions.PROTOCOL_MIN, versions.PROTOCOL_MAX + 4, "9.0.0"))
        assert too_old and f"upgrade it to coterie ≥ {versions.PROTOCOL_RELEASES[versions.PROTOCOL_MIN]}" in too_old
        assert too_new and "upgrade this node to coterie ≥ 3.0.0" in too_new
        assert fine is None  # a newer node that still speaks this one's version is let in
        st = node.status()
        problems = " | ".join(p["message"] for p in st["problems"])
        assert "peer 'ancient' speaks protocol 0..0" in problems and "peer 'future' speaks protocol 7..9" in problems
        ids = {p["node_id"] for p in node.get("/peers")}
        assert "current" in ids and not {"ancient", "future"} & ids
        assert st["version"]["release"] == versions.RELEASE and st["health"] == "ok"
        r = st["round"]
        wait_for(lambda: node.status()["round"] > r, 30, "n1 to keep running rounds")
    finally:
        node.stop()
