"""The revocation list's own RPC (``ExchangeRevocations``, declared in node/peering/api.py), attacked
through the in-process transport (the same gate as gRPC; tests/test_insiders.py runs it over mTLS
between real daemons): a stranger is refused before its list is looked at, a list the CA did not
sign is not taken, an oversized one is refused by the gate even when the caller skips its own
check, and a newer signed list is taken and answered with."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from coterie.node.peering import api
from coterie.node.peering.api import RevocationList
from coterie.node.peering.errors import INVALID, UNKNOWN_PEER, PeerCallError, unknown_peer
from coterie.node.security import pki
from coterie.node.security.crl_gossip import CrlExchange
from coterie.node.security.revocation import Revocation, revoke
from coterie.node.transport.inproc import InProcNetwork


class _Traffic:
    def record(self, kind, *, sent=0, received=0):
        pass

    def latency(self, kind, seconds, side):
        pass


class _Victim:
    """The served side of one node: knows only ``honest``; answers with a real ``CrlExchange``."""

    node_id = "victim"

    def __init__(self, revocation: Revocation):
        self.exchange = CrlExchange(revocation, self.node_id)
        self.admitted: list[tuple[str, str]] = []

    def check_known(self, node_id):
        if node_id != "honest":
            raise unknown_peer(node_id)

    def admit(self, peer, kind):
        self.admitted.append((peer, kind))
        return contextlib.nullcontext()

    def on_revocations(self, theirs):
        return self.exchange.answer(theirs)


def _ca_with_crl(root, name):
    ca = root / name
    pki.init_ca(ca)
    pki.issue_cert(ca, "mallory", root / f"{name}-mallory")
    _, crl = revoke(ca, node_id="mallory")
    return (ca / pki.CA_CERT).read_bytes(), crl


@pytest.fixture
def setup(tmp_path):
    ca_pem, crl = _ca_with_crl(tmp_path, "ca")
    _, forged = _ca_with_crl(tmp_path, "other-ca")
    return Revocation(ca_pem), crl, forged


def test_revocation_exchange_defends_itself(setup):
    revocation, crl, forged = setup

    async def go():
        net = InProcNetwork()
        victim = _Victim(revocation)
        server = net.transport().bind(victim, _Traffic(), None)
        honest = net.transport().connect("honest", _Traffic())
        stranger = net.transport().connect("stranger", _Traffic())

        with pytest.raises(PeerCallError) as e:  # not a known peer: refused before the list is read
            await stranger.exchange_revocations(server.address, RevocationList("stranger", crl.number, crl.pem))
        assert e.value.kind == UNKNOWN_PEER and revocation.current is None

        with pytest.raises(PeerCallError) as e:  # speaking for another node
            await honest.exchange_revocations(server.address, RevocationList("stranger", crl.number, crl.pem))
        assert revocation.current is None

        # another CA's list, numbered far ahead: not taken; the answer is the victim's (none)
        reply = await honest.exchange_revocations(server.address, RevocationList("honest", 10**6, forged.pem))
        assert revocation.current is None and reply == RevocationList("victim", 0, b"")

        huge = RevocationList("honest", 10**6, b"x" * (api.MAX_CRL_BYTES + 1))
        with pytest.raises(PeerCallError) as e:  # the caller's own check
            await honest.exchange_revocations(server.address, huge)
        assert e.value.kind == INVALID and "exceeds the limit" in e.value.message
        admitted = len(victim.admitted)
        with pytest.raises(PeerCallError) as e:  # a caller that skips it: the gate refuses, before admission
            await honest.send(api.REVOCATIONS, server.address, huge)
        assert e.value.kind == INVALID and "revocation list from honest" in e.value.message
        assert len(victim.admitted) == admitted

        # the CA's own list: taken, and answered with
        reply = await honest.exchange_revocations(server.address, RevocationList("honest", crl.number, crl.pem))
        assert revocation.current is not None and revocation.current.number == crl.number
        assert reply.sender == "victim" and reply.number == crl.number and reply.crl == crl.pem
        assert "mallory" in revocation.revoked_ids
        assert ("honest", "revocations") in victim.admitted
        await server.stop()

    asyncio.run(go())
