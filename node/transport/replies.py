"""How the gRPC peer server answers a call, whatever the call: a refusal turned into a status the
caller can read (``guard``), who calls (``caller``: with mTLS the certificate's node, which the
gate asks to vouch for the id a request claims), and reply streams written within their deadline
(``send``). One ``Replies`` per server, shared by its parts (``server.PeerService`` and its compute
streams, ``compute_rpcs.ComputeRpcs``)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..peering.errors import forbidden, short
from ..peering.interfaces import Traffic
from .errors import status_of
from .gate import refusal_of
from .stream_limits import StreamLimits
from .tls import TLS, caller_identity

log = logging.getLogger("coterie.node.transport.server")  # (its records read as the server's, as before)

# After refusing a streamed request, keep reading (and discarding) what the sender still has in
# flight before sending the status: if the server closes first, the sender's next write fails and
# grpc reports a bare INTERNAL "execute_batch" error instead of our reason (HTTP servers do the
# same "lingering close"). Bounded so a hostile sender cannot keep the call open: at most
# LINGER_BYTES, LINGER_S in all, and it ends as soon as the sender pauses for LINGER_IDLE_S.
LINGER_BYTES = 64 << 20
LINGER_S = 5.0
LINGER_IDLE_S = 1.0


async def _linger(frames) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_S
    it = frames.__aiter__()
    drained = 0
    try:
        while drained <= LINGER_BYTES:
            left = min(LINGER_IDLE_S, deadline - loop.time())
            if left <= 0:
                return
            msg = await asyncio.wait_for(it.__anext__(), left)
            drained += len(msg) if isinstance(msg, (bytes, memoryview)) else msg.ByteSize()
    except Exception:  # noqa: BLE001 - done, paused, broken or cancelled: nothing more to drain
        pass


class _GrpcCaller:
    """The caller of one gRPC request (``gate.Caller``): with mTLS, the node its certificate
    names (and allows); without, whoever it claims to be."""

    __slots__ = ("context", "tls")

    def __init__(self, context: grpc.aio.ServicerContext, tls: TLS | None):
        self.context, self.tls = context, tls

    def vouch(self, claimed: str, what: str) -> str:
        if self.tls is None:
            return claimed
        ident = caller_identity(self.context)
        if ident is None:
            raise forbidden(f"{what}: the caller's certificate names no Coterie node id")
        if claimed != ident:
            raise forbidden(f"{what}: claims to be node {claimed!r}, but its certificate is for {ident!r}")
        if not self.tls.allowed(ident):
            raise forbidden(f"{what}: node {ident!r} is not on this node's allow-list")
        refused = self.tls.refusal(self.context)  # revoked by the CA, or expired (security/revocation.py)
        if refused:
            raise forbidden(f"{what}: node {ident!r} is refused: {refused}")
        return ident


class Replies:
    def __init__(self, traffic: Traffic, tls: TLS | None, streams: StreamLimits):
        self.traffic, self.tls, self.streams = traffic, tls, streams

    async def guard(self, context: grpc.aio.ServicerContext, kind: str, coro, stream=None):
        """Run a handler call; turn a Refusal/WireError into a status the caller can read.
        ``stream``: the request stream, drained before refusing (see ``LINGER_BYTES``)."""
        t0 = time.perf_counter()
        try:
            return await coro
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            refusal = refusal_of(e)
            if refusal is None:  # a bug, not the peer's fault: say so briefly, keep the traceback here
                log.exception("internal error serving %s from %s", kind, context.peer())
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error serving {kind}")  # (raises)
            else:
                message = short(refusal.message)
                log.warning("refused %s from %s: %s", kind, context.peer(), message)
                if stream is not None:
                    await _linger(stream)
                await context.abort(status_of(refusal), message)
        finally:
            self.traffic.latency(kind, time.perf_counter() - t0, "server")

    def caller(self, context: grpc.aio.ServicerContext) -> _GrpcCaller:
        return _GrpcCaller(context, self.tls)

    async def send(self, context, messages, what: str, size: int | None = None) -> int:
        """Write a reply stream, all of it within ``send_timeout_s``: a reader that stops taking
        it (flow control blocks the writes) is cut off with RESOURCE_EXHAUSTED instead of holding
        the call, its admission slot and the buffers for ever."""
        loop = asyncio.get_running_loop()
        if size is None:  # (an iterator of frames built as they go out says its size instead)
            messages = list(messages)
            size = sum(len(m) if isinstance(m, bytes) else m.ByteSize() for m in messages)
        limit = self.streams.send_deadline(size)
        deadline = loop.time() + limit
        sent = 0
        for msg in messages:
            try:
                left = deadline - loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(context.write(msg), left)
            except asyncio.TimeoutError:
                log.warning("cut off %s after %.0f s: the reader is not taking it (%s)", what, limit, context.peer())
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: not taken within {limit:.0f} s; reader too slow"
                )
            sent += len(msg) if isinstance(msg, bytes) else msg.ByteSize()
        return sent
