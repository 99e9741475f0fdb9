"""gRPC status codes for the peer plane's refusal kinds (``peering/errors.py``), both ways."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import grpc

from ..peering import errors as e
from ..peering.errors import PeerCallError, Refusal
from ..wire.codec import WireError

_CODES = {
    e.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    e.REFUSED: grpc.StatusCode.FAILED_PRECONDITION,
    e.UNKNOWN_PEER: grpc.StatusCode.PERMISSION_DENIED,
    e.NOT_CACHED: grpc.StatusCode.NOT_FOUND,
    e.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    e.PRIVACY_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    e.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# both UNKNOWN_PEER and FORBIDDEN travel as PERMISSION_DENIED; the caller sees UNKNOWN_PEER, whose
# remedy (handshake again) is the one an honest node can act on. Both EXHAUSTED (admission) and
# PRIVACY_BUDGET travel as RESOURCE_EXHAUSTED; the message tells them apart (a spent privacy budget
# does not come back, a rate limit does).
_KINDS = {code: kind for kind, code in _CODES.items() if kind not in (e.FORBIDDEN, e.PRIVACY_BUDGET)}


def status_of(refusal: e.Refusal) -> grpc.StatusCode:
    return _CODES.get(refusal.kind, grpc.StatusCode.INVALID_ARGUMENT)


def call_error(err: grpc.aio.AioRpcError) -> e.PeerCallError:
    """A failed gRPC call as the domain sees it (deadline, unreachable, refused with a reason)."""
    kind = _KINDS.get(err.code(), e.UNAVAILABLE)
    if kind == e.EXHAUSTED and "privacy budget" in (err.details() or ""):
        kind = e.PRIVACY_BUDGET
    return e.PeerCallError(kind, err.details() or err.code().name)


@contextlib.contextmanager
def in_flight(client: Any, address: str) -> Iterator[None]:
    """gRPC failures become PeerCallError; a malformed stream (bad chunk, size, hash) a WireError.
    The call counts as in flight on its address meanwhile (idle channel eviction spares it)."""
    client._busy[address] = client._busy.get(address, 0) + 1
    try:
        yield
    except grpc.aio.AioRpcError as e:
        raise call_error(e) from None
    except Refusal as e:
        raise WireError(e.message) from None
    except (StopAsyncIteration, ValueError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"malformed reply: {e}") from None
    except OSError as e:
        raise PeerCallError("unavailable", str(e)) from None
    finally:
        client._busy[address] -= 1
        if not client._busy[address]:
            del client._busy[address]


def domain_errors(fn):
    """A call under ``in_flight``."""

    @functools.wraps(fn)
    async def wrapper(self, address, *args, **kwargs):
        with in_flight(self, address):
            return await fn(self, address, *args, **kwargs)

    return wrapper
