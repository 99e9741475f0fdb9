"""Errors the peer plane raises and maps to gRPC status codes."""
from __future__ import annotations

import grpc


class PeerError(Exception):
    """A request refused for a reason the caller should see verbatim."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def refused(message: str) -> PeerError:  # incompatible protocol / architecture
    return PeerError(grpc.StatusCode.FAILED_PRECONDITION, message)


def invalid(message: str) -> PeerError:  # malformed, oversized, NaN, wrong shape
    return PeerError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unknown_peer(node_id: str) -> PeerError:
    return PeerError(grpc.StatusCode.PERMISSION_DENIED,
                     f"unknown peer {node_id!r}: handshake first")


def not_cached(ref: str) -> PeerError:  # a request referenced a snapshot this node does not hold
    return PeerError(grpc.StatusCode.NOT_FOUND, f"snapshot {ref} is not cached here; send the model")
