"""Refusals and failed calls, independent of any transport.

A node refuses a peer's request by raising ``Refusal`` with a kind; each transport maps the kind
to its own status (gRPC: ``transport/errors.py``). A call to a peer that fails for any reason —
refused, timed out, unreachable, malformed reply — raises ``PeerCallError`` on the calling side."""

from __future__ import annotations

INVALID = "invalid"  # malformed, oversized, NaN, wrong shape
REFUSED = "refused"  # incompatible protocol / architecture, a precondition not met
UNKNOWN_PEER = "unknown_peer"  # the caller never handshook (or is not who it claims)
NOT_CACHED = "not_cached"  # a referenced snapshot is not held here; send the model
UNAVAILABLE = "unavailable"  # nothing to serve yet, peer unreachable, deadline passed
PRIVACY_BUDGET = "privacy_budget"  # the node's privacy budget (or the caller's share) is spent
FORBIDDEN = "forbidden"  # the caller claims an identity its certificate does not carry
EXHAUSTED = "exhausted"  # the caller is over its budget (rate, concurrency, compute, time)

MAX_MESSAGE = 1000  # a refusal's message stays short whatever a peer put into it (gRPC metadata)


def short(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters, saying so: peer-controlled strings end up in messages."""
    return text if len(text) <= limit else text[: limit - 20] + f"… [{len(text)} chars]"


class Refusal(Exception):
    """A request refused for a reason the caller should see verbatim."""

    def __init__(self, kind: str, message: str):
        message = short(message)
        super().__init__(message)
        self.kind = kind
        self.message = message


class PeerCallError(Exception):
    """A call to a peer did not produce a usable answer."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def invalid(message: str) -> Refusal:
    return Refusal(INVALID, message)


def refused(message: str) -> Refusal:
    return Refusal(REFUSED, message)


def unknown_peer(node_id: str) -> Refusal:
    return Refusal(UNKNOWN_PEER, f"unknown peer {short(node_id, 140)!r}: handshake first")


def forbidden(message: str) -> Refusal:
    return Refusal(FORBIDDEN, message)


def exhausted(message: str) -> Refusal:
    return Refusal(EXHAUSTED, message)


def not_cached(ref: str) -> Refusal:
    return Refusal(NOT_CACHED, f"snapshot {ref} is not cached here; send the model")


def budget_spent(message: str) -> Refusal:
    return Refusal(PRIVACY_BUDGET, message)
