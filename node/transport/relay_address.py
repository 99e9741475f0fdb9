"""The address of a node reached through relays, as it travels in membership (``NodeInfo.address``):

    relay://HOST:PORT[,HOST:PORT...]/NODE_ID

"reach NODE_ID through any of these relays, first one first". The relays are reachable nodes'
peer ports; NODE_ID is also the certificate name the dialer asks TLS for through the pipe, so
the address itself pins whom a relayed connection may end at (docs/nat.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..security.ids import node_id_problem

SCHEME = "relay://"
MAX_RELAYS = 8  # relays one address may name


class RelayAddressError(ValueError):
    pass


@dataclass(frozen=True)
class RelayAddress:
    relays: tuple[str, ...]
    node_id: str

    def __str__(self) -> str:
        return f"{SCHEME}{','.join(self.relays)}/{self.node_id}"


def is_relayed(address: str) -> bool:
    return address.startswith(SCHEME)


def parse(address: str) -> RelayAddress:
    """``address`` as a ``RelayAddress``; ``RelayAddressError`` names what is wrong."""
    if not is_relayed(address):
        raise RelayAddressError(f"not a relay address (expected {SCHEME}HOST:PORT,.../NODE_ID): {address!r}")
    hosts, sep, node_id = address[len(SCHEME) :].rpartition("/")
    if not sep or not hosts or not node_id:
        raise RelayAddressError(f"expected {SCHEME}HOST:PORT,.../NODE_ID, got {address!r}")
    problem = node_id_problem(node_id)
    if problem:
        raise RelayAddressError(f"relay address {address!r}: {problem}")
    relays = tuple(r.strip() for r in hosts.split(","))
    if len(relays) > MAX_RELAYS:
        raise RelayAddressError(f"relay address {address!r} names {len(relays)} relays, over {MAX_RELAYS}")
    for r in relays:
        host, colon, port = r.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RelayAddressError(f"relay address {address!r}: relay {r!r} is not host:port")
    return RelayAddress(relays, node_id)


def reachability(address: str) -> str:
    """How a node at ``address`` is reached: ``direct``, or ``relayed via R1,R2``."""
    if not is_relayed(address):
        return "direct"
    try:
        return "relayed via " + ",".join(parse(address).relays)
    except RelayAddressError:
        return "relayed (malformed address)"
