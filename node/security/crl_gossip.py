"""Spreading the CA's revocation list between peers (anti-entropy over its own RPC,
``ExchangeRevocations``, declared in ``peering/api.py``).

A signed CRL is self-authenticating, so any known peer may hand one over: a node takes it only if
the network CA's signature verifies and its number is newer than its own (``Revocation.offer``).
Every ``CRL_GOSSIP_S`` a node offers its list (number and PEM) to one random alive peer and takes
the reply's if newer, so a CRL that one node got from its operator reaches every node in about
log(n) periods. The served side (``CrlExchange.answer``) takes the offer the same way and answers
with its own.

0.1.0 nodes spread the list over the gossip RPC under ``LEGACY_KEY`` and lack the RPC: a node
asks a peer whose handshake did not name the ``revocations`` feature that way, and answers that
key itself, so one list reaches every node of a network that is part way through an upgrade."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from ..peering.api import RevocationList
from ..peering.versions import LEGACY_CRL_KEY
from .pki import PKIError
from .revocation import Revocation

log = logging.getLogger("coterie.security")

CRL_GOSSIP_S = 2.0
LEGACY_KEY = LEGACY_CRL_KEY  # 0.1.0's gossip key for the exchange: {"number": int, "crl": PEM bytes}


def take(revocation: Revocation, theirs: RevocationList) -> None:
    """``theirs`` held from now on if it is newer than this node's and signed by the CA."""
    cur = revocation.current
    if not theirs.crl or (cur is not None and theirs.number <= cur.number):
        return  # not newer: not even worth a signature check
    try:
        revocation.offer(bytes(theirs.crl), where=f"peer {theirs.sender}")
    except PKIError as e:  # a forged or broken list: refused, the one held stays
        log.warning("revocation list from peer %s refused: %s", theirs.sender, e)


def mine(revocation: Revocation, node_id: str) -> RevocationList:
    cur = revocation.current
    return RevocationList(node_id, cur.number, cur.pem) if cur is not None else RevocationList(node_id)


def to_legacy(mine: RevocationList) -> dict[str, Any]:
    """A list as a 0.1.0 node offers and answers it under ``LEGACY_KEY``."""
    return {"number": mine.number, "crl": mine.crl} if mine.number else {"number": 0}


def from_legacy(payload: Any, sender: str) -> RevocationList | None:
    """A 0.1.0 node's offer or answer (None: malformed, ignored as 0.1.0 ignored it)."""
    if not isinstance(payload, dict):
        return None
    number, pem = payload.get("number"), payload.get("crl", b"")
    if not isinstance(number, int) or isinstance(number, bool) or number < 0 or not isinstance(pem, bytes | bytearray):
        return None
    return RevocationList(sender, number, bytes(pem))


class CrlExchange:
    """The served side of ``ExchangeRevocations`` (``served.RevocationExchange``)."""

    def __init__(self, revocation: Revocation, node_id: str):
        self.revocation, self.node_id = revocation, node_id

    def answer(self, theirs: RevocationList) -> RevocationList:
        take(self.revocation, theirs)
        return mine(self.revocation, self.node_id)

    def answer_legacy(self, peer: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A 0.1.0 node's offer under ``LEGACY_KEY``: taken as ``answer`` takes one, answered its way."""
        theirs = from_legacy(payload, peer)
        if theirs is not None:
            take(self.revocation, theirs)
        return to_legacy(mine(self.revocation, self.node_id))


async def spread(
    revocation: Revocation,
    node_id: str,
    alive: Callable[[], list[str]],
    exchange: Callable[[str, RevocationList], Awaitable[RevocationList | None]],
    period_s: float = CRL_GOSSIP_S,
    rng: random.Random | None = None,
) -> None:
    """Forever: offer this node's list to one random alive peer and take its reply if newer."""
    rng = rng or random.Random()
    while True:
        await asyncio.sleep(period_s)
        peers = alive()
        if not peers:
            continue
        peer = rng.choice(peers)
        reply = await exchange(peer, mine(revocation, node_id))
        if reply is not None:
            take(revocation, reply)
