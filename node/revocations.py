"""A node's side of certificate revocation (``security/revocation.py`` holds the CA-signed list):
revoked peers leave membership for good, and the list spreads peer to peer outside any round
(``security/crl_gossip.py``). Wired by the builder; the daemon only starts ``spread()``."""

from __future__ import annotations

import logging
from typing import Any

from .peering.api import RevocationList
from .peering.peer_table import PeerTable
from .peering.versions import REVOCATIONS
from .security import crl_gossip

log = logging.getLogger("coterie.node")


class Revocations:
    def __init__(self, revocation: Any, node_id: str, peers: PeerTable, timeout_s: float):
        self.revocation, self.node_id, self.peers, self.timeout_s = revocation, node_id, peers, timeout_s
        self.client: Any = None  # the node's PeerTransport, once connected
        revocation.listeners.append(self.revoked)
        peers.ban(revocation.revoked_ids)

    def revoked(self, node_ids) -> None:
        for node_id in self.peers.ban(node_ids):
            log.warning("peer %s: revoked by the network CA's revocation list; dropped", node_id)

    async def exchange(self, peer: str, mine: RevocationList) -> RevocationList | None:
        """One CRL exchange, outside any round's exchange phase (it is not the round's work)."""
        rec = self.peers.records.get(peer)
        if rec is None or not rec.address or self.client is None:
            return None
        try:
            if REVOCATIONS in rec.features:
                return await self.client.exchange_revocations(rec.address, mine, self.timeout_s, peer=peer)
            # a peer without the RPC (0.1.0) is asked the way it understands: under the gossip key
            reply = await self.client.gossip(
                rec.address, self.node_id, crl_gossip.LEGACY_KEY, crl_gossip.to_legacy(mine), self.timeout_s, peer=peer
            )
            return crl_gossip.from_legacy(reply, peer)
        except Exception as e:  # noqa: BLE001 - unreachable, refused, or an old peer: the next period tries another
            log.debug("CRL exchange with %s failed: %s", peer, e)
            return None

    async def spread(self) -> None:
        await crl_gossip.spread(self.revocation, self.node_id, self.peers.alive, self.exchange)
