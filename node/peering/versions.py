"""Which release this is, which protocol versions it speaks, and what two nodes agree on.

A node speaks a range of protocol versions, ``PROTOCOL_MIN..PROTOCOL_MAX``; two nodes use
min(max_a, max_b) if that is at least both their minimums, and otherwise the one that can tell
which release to upgrade to refuses the other, naming it. The handshake carries the range as
``protocol_version`` (the OLDEST version a node speaks) and ``protocol_max``: a 0.1.0 node compares
``protocol_version`` for equality and sends no maximum, so it accepts exactly the newer nodes that
still speak its version, and reads to them as the range v..v.

Optional parts of the protocol are features (``FEATURES``, carried in the handshake's
``capabilities`` beside what a node serves): a caller asks a peer for one only if the peer's
handshake named it, and otherwise falls back to what that peer's release understands (as codecs
are negotiated). Bump ``PROTOCOL_MAX`` only for a change an older node cannot be talked around;
raise ``PROTOCOL_MIN`` when this release stops speaking an old version (docs/upgrades.md)."""

from __future__ import annotations

from dataclasses import dataclass

RELEASE = "0.2.0.dev0"  # this release (pyproject's version; tests/test_versions.py holds them equal)

PROTOCOL_MIN = 1  # the oldest protocol version this release speaks
PROTOCOL_MAX = 1  # the newest
# the first release that speaks each protocol version: what a refusal tells the operator to install
PROTOCOL_RELEASES = {1: "0.1.0"}

# optional RPCs and services, named in the handshake by the nodes that have them
REVOCATIONS = "revocations"  # ExchangeRevocations (0.1.0 spread the CRL under the gossip key "coterie.crl")
RELAY = "relay"  # the Relay service (Reserve, Connect, Accept, DialBack): docs/nat.md
RECOMMEND = "recommend"  # Recommend, discovery's "whom do you weight?" (0.1.0 asked it under gossip)
VIEWS = "views"  # Shuffle and Link, partial views (peering/overlay.py)
FEATURES = (REVOCATIONS, RELAY, RECOMMEND, VIEWS)
LEGACY_CRL_KEY = "coterie.crl"  # the gossip key 0.1.0 spreads revocation lists under (no REVOCATIONS)

MAX_RELEASE_CHARS = 40  # of a peer's advertised release, as shown in /status and refusals


@dataclass(frozen=True)
class Agreement:
    """What a handshake settled with one peer: the protocol version spoken and the features both have."""

    protocol: int
    features: tuple[str, ...]
    release: str  # the peer's, as it advertised it ("" from 0.1.0 nodes, which did not say)


def peer_range(oldest: int, newest: int) -> tuple[int, int]:
    """A peer's advertised range; a node that sends no maximum (0.1.0) speaks only its version."""
    return oldest, max(newest, oldest)


def release_for(protocol: int) -> str:
    """The first release that speaks ``protocol`` (the newest known one if none is listed)."""
    known = [r for v, r in sorted(PROTOCOL_RELEASES.items()) if v >= protocol]
    return known[0] if known else RELEASE


def shown_release(release: str) -> str:
    """A peer's release string fit for a log line: printable, bounded ("" from 0.1.0 nodes)."""
    return "".join(c for c in release if c.isprintable())[:MAX_RELEASE_CHARS]


def agree(
    peer: str, oldest: int, newest: int, features: tuple[str, ...], release: str, mine: tuple[int, int] | None = None
) -> Agreement | str:
    """The protocol and features this node and ``peer`` (which speaks ``oldest..newest``) share,
    or why they cannot talk, naming the release that would let them."""
    my_min, my_max = mine or (PROTOCOL_MIN, PROTOCOL_MAX)
    lo, hi = peer_range(oldest, newest)
    spoken = min(my_max, hi)
    if spoken >= my_min and spoken >= lo:
        return Agreement(spoken, tuple(f for f in FEATURES if f in features), shown_release(release))
    if hi < my_min:  # the peer is older: this node knows which release the peer needs
        return (
            f"peer {peer!r} speaks protocol {lo}..{hi}, this node needs ≥ {my_min}: "
            f"upgrade it to coterie ≥ {release_for(my_min)}"
        )
    theirs = shown_release(release)
    return (  # the peer is newer than anything this node speaks
        f"peer {peer!r} speaks protocol {lo}..{hi}, this node only {my_min}..{my_max}: upgrade this node "
        + (f"to coterie ≥ {theirs} (the peer's release)" if theirs else "to the peer's release")
    )
