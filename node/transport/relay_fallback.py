"""A node with a peer port finds out whether it can be dialled, and switches to relays by itself
when it cannot (docs/nat.md, "Finding out"; libp2p's AutoNAT followed by a circuit reservation).

Once serving, it asks its bootstrap peers to dial it back (``dial_back.py``). When every peer
that answered failed, twice (``CONFIRM_AFTER_S`` apart), its advertised address is of no use to
anyone: it reserves at relays — the pinned ones (``relay.via``), else up to ``AUTO_RELAYS``
reachable members it knows, those that just answered it first (they are reachable: they
answered) — and, once one holds its reservation, advertises ``relay://R1,R2/ID`` instead.
Tunnels the relays offer are spliced to its own peer port (``RelayReservations``), so the same
server and mTLS serve relayed callers. The node is told of the move (``on_moved``) to pass the
new address to its members.

The check is repeated every ``recheck_s`` (config ``relay.recheck_s``): a relayed node that
peers can dial again (a port opened, the NAT gone) stops reserving and advertises its own
address again; a direct one that nobody can dial any more moves behind relays."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from . import dial_back
from .relay_address import RelayAddress, is_relayed
from .relay_reservations import RelayReservations
from .tls import TLS

log = logging.getLogger(__name__)
AUTO_RELAYS = 2  # relays a node that cannot be dialled picks by itself when none are pinned
MEMBERS_WAIT_S = 5.0  # for that many candidates, membership may still be meeting the members
# a failed dial-back is asked again this much later before the node moves: a peer too loaded to
# dial back within its 3 s (seen on a loaded CI box) must not push a reachable node behind relays
CONFIRM_AFTER_S = 3.0


class RelayFallback:
    """The dial-back check of one listening node, and its switch to relays when it fails."""

    def __init__(self, tls: TLS, asked: tuple[str, ...], pinned: tuple[str, ...] = ()):
        self.tls = tls
        self.asked = asked  # peers asked to dial this node back (its bootstrap peers)
        self.pinned = pinned  # relays configured (relay.via): used as they are
        self.answers: dict[str, str] = {}  # peer -> its dial-back answer
        self.reservations: RelayReservations | None = None  # once switched
        # set by the transport: its node's members' addresses (relay candidates)
        self.members: Callable[[], list[str]] = list

    async def watch(self, address: str, port: int, local: str, moved: Callable[[str], None], recheck_s: float) -> None:
        """``run``, then the same check again every ``recheck_s``; ``moved`` is told each new
        address (relayed, or ``address`` again once peers can dial it)."""
        while True:
            if self.reservations is None:
                relayed = await self.run(address, port, local)
                if relayed is not None:
                    moved(relayed)
            else:
                self.answers = await dial_back.check(self.tls, list(self.asked), port)
                if any(a.startswith("reachable") for a in self.answers.values()):
                    log.warning("peers can dial this node at port %d again: advertising %s, not relays", port, address)
                    await self.stop()
                    self.reservations = None
                    moved(address)
            await asyncio.sleep(recheck_s)  # (a period: nothing to wait on)

    async def run(self, address: str, port: int, local: str) -> str | None:
        """Check ``port`` (advertised as ``address``); when nobody can dial it, reserve at relays
        that splice to ``local`` (this node's peer server). The relayed address once one relay
        holds a reservation; None while the node is reachable (or cannot tell)."""
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(CONFIRM_AFTER_S)
            self.answers = await dial_back.check(self.tls, list(self.asked), port)
            # a peer that could not answer, or found the port open but this node too busy to
            # answer in time, gives no verdict: only "unreachable" from every one that did counts
            answered = [p for p, a in self.answers.items() if not a.startswith(("no answer", "busy"))]
            if not answered or any(self.answers[p].startswith("reachable") for p in answered):
                return None
        why = "; ".join(self.answers[p] for p in answered)
        relays = self.choose(answered, address)
        loop = asyncio.get_running_loop()
        until = loop.time() + MEMBERS_WAIT_S
        while not self.pinned and len(relays) < AUTO_RELAYS and loop.time() < until:
            await asyncio.sleep(0.25)  # (polls membership's table: it has no change events)
            relays = self.choose(answered, address)
        if not relays:
            log.warning(
                "no peer can dial this node at port %d (%s) and no relay is known: start it with "
                "--relay HOST:PORT or --no-listen (docs/nat.md)",
                port,
                why,
            )
            return None
        log.warning("no peer can dial this node at port %d (%s): reserving at relays %s", port, why, ",".join(relays))
        self.reservations = RelayReservations(self.tls, relays, local)
        self.reservations.start()
        await self.reservations.any_held.wait()  # (the reservations retry until one holds)
        moved = str(RelayAddress(tuple(relays), self.tls.node_id))
        log.warning("this node is reached through relays now: advertising %s instead of %s", moved, address)
        return moved

    def choose(self, answered: list[str], own: str) -> list[str]:
        """Pinned relays as they are; else the peers that answered, then the members known,
        direct addresses only (a relayed node cannot relay), ``AUTO_RELAYS`` at most."""
        if self.pinned:
            return list(self.pinned)
        chosen: list[str] = []
        for a in [*answered, *self.members()]:
            if a and a != own and not is_relayed(a) and a not in chosen:
                chosen.append(a)
        return chosen[:AUTO_RELAYS]

    async def stop(self) -> None:
        if self.reservations is not None:
            await self.reservations.stop()
