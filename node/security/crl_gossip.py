"""Spreading the CA's revocation list between peers (anti-entropy over the gossip RPC).

A signed CRL is self-authenticating, so any peer may hand one over: a node takes it only if the
network CA's signature verifies and its number is newer than its own (``Revocation.offer``). Every
``CRL_GOSSIP_S`` a node offers its list (number and PEM) to one random alive peer and takes the
reply's if newer, so a CRL that one node got from its operator reaches every node in about
log(n) periods. The exchange rides on the gossip RPC under its own key; other keys still go to
the strategy (``CrlHooks`` wraps the strategy's hooks)."""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Awaitable, Callable

from .pki import PKIError
from .revocation import Revocation

log = logging.getLogger("coterie.security")

KEY = "coterie.crl"
CRL_GOSSIP_S = 2.0


def _offer(revocation: Revocation, payload: Any, peer: str) -> None:
    pem = payload.get("crl") if isinstance(payload, dict) else None
    number = payload.get("number") if isinstance(payload, dict) else None
    cur = revocation.current
    if not isinstance(pem, (bytes, bytearray)) or not isinstance(number, int):
        return
    if cur is not None and number <= cur.number:
        return  # not newer: not even worth a signature check
    try:
        revocation.offer(bytes(pem), where=f"peer {peer}")
    except PKIError as e:  # a forged or broken list: refused, the one held stays
        log.warning("revocation list from peer %s refused: %s", peer, e)


def _mine(revocation: Revocation) -> dict[str, Any]:
    cur = revocation.current
    return {"number": cur.number, "crl": cur.pem} if cur is not None else {"number": 0}


class CrlHooks:
    """The strategy's hooks, with the CRL exchange answered first."""

    def __init__(self, strategy: Any, revocation: Revocation):
        self._strategy, self._revocation = strategy, revocation

    def on_gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        if key == KEY:
            _offer(self._revocation, payload, peer)
            return _mine(self._revocation)
        return self._strategy.on_gossip(peer, key, payload)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)


async def spread(revocation: Revocation, alive: Callable[[], list[str]],
                 gossip: Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any] | None]],
                 period_s: float = CRL_GOSSIP_S, rng: random.Random | None = None) -> None:
    """Forever: offer this node's list to one random alive peer and take its reply if newer."""
    rng = rng or random.Random()
    while True:
        await asyncio.sleep(period_s)
        peers = alive()
        if not peers:
            continue
        peer = rng.choice(peers)
        reply = await gossip(peer, KEY, _mine(revocation))
        if reply is not None:
            _offer(revocation, reply, peer)
