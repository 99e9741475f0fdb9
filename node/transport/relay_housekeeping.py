"""Keeping a relayed node's advertised address true (docs/nat.md, "Relay housekeeping"): the
relays in ``relay://R1,R2/ID`` are those that hold this node's reservation now, or lost it only
lately. A relay that has held nothing for ``drop_after_s`` (a few heartbeat periods) leaves the
address, so dialers stop trying it first, and comes back once it holds a reservation again (its
reservation is retried all along). When every relay is gone, the node reserves at other
reachable members it knows instead (up to ``max_relays``), so a node whose relays all died is
not cut off until someone restarts it. Each change of address goes out through membership
(``on_address``: the node raises its incarnation and shakes hands again)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .relay_address import RelayAddress, is_relayed
from .relay_reservations import RelayReservations

log = logging.getLogger(__name__)


class RelayHousekeeping:
    def __init__(
        self,
        reservations: RelayReservations,
        node_id: str,
        on_address: Callable[[str], None],
        members: Callable[[], list[str]],
        *,
        drop_after_s: float,
        max_relays: int,
    ):
        self.reservations, self.node_id = reservations, node_id
        self.on_address, self.members = on_address, members
        self.drop_after_s, self.max_relays = drop_after_s, max_relays
        self.advertised: list[str] = list(reservations.relays)  # the relays the address names now

    async def run(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)  # (a period, as membership's heartbeat: nothing to wait on)
            await self.tick(time.monotonic())

    def alive(self, now: float) -> list[str]:
        """The relays worth advertising: holding a reservation, or lost it less than drop_after_s ago."""
        res = self.reservations
        return [
            r for r in res.relays if res.state.get(r) == "held" or now - res.lost_since.get(r, now) < self.drop_after_s
        ]

    async def tick(self, now: float) -> str | None:
        """One look: the new address when it changed (and was passed on), else None."""
        res = self.reservations
        if not self.alive(now):
            await self._replace_all(now)
        alive = self.alive(now)
        if not alive or alive == self.advertised:
            return None  # (with no relay at all, the old address is as good as none)
        dropped = [r for r in self.advertised if r not in alive]
        added = [r for r in alive if r not in self.advertised]
        self.advertised = alive
        address = str(RelayAddress(tuple(alive), self.node_id))
        log.warning(
            "relays changed (dropped %s, added %s; reservations %s): advertising %s",
            ",".join(dropped) or "none",
            ",".join(added) or "none",
            res.state,
            address,
        )
        self.on_address(address)
        return address

    async def _replace_all(self, now: float) -> None:
        """Every relay has been gone for drop_after_s: reserve at reachable members instead."""
        res = self.reservations
        fresh = []
        for a in self.members():
            if a and not is_relayed(a) and a not in res.relays and a not in fresh:
                fresh.append(a)
        fresh = fresh[: self.max_relays]
        if not fresh:
            return  # (nobody else known: the old relays are retried, they may come back)
        log.warning("every relay is gone (%s): reserving at %s instead", res.state, ",".join(fresh))
        for r in list(res.relays):
            await res.drop(r)
        for r in fresh:
            res.add(r)
