"""The compute RPCs of the gRPC server (``server.PeerService``'s part): a peer's request on this
node's data — cross-loss, cross-gradient, gradient push — as a stream of a header and its payload. Decode → gate → encode, as everywhere in the server:
the header is parsed and the gate (claimed id, known peer, reference, announced size, admission)
passes it before the payload is read, under the upload deadlines (``upload_timeout_s``, no gap
over ``upload_idle_s``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ...proto.v1 import peer_pb2 as pb
from ..peering.errors import exhausted, invalid
from ..peering.messages import CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT
from ..wire import codecs as wire_codecs
from ..wire.codec import WireError, encode
from . import serde
from .chunks import Assembler, collect, sha256, split
from .serde import parsed as _parsed

if TYPE_CHECKING:
    from ..peering.interfaces import Traffic
    from .gate import Gate
    from .replies import Replies
    from .served_versions import CodecPolicy
    from .stream_limits import StreamLimits


class ComputeRpcs:
    """The compute streams of ``server.PeerService``: its gate, traffic, stream limits, codecs and
    chunk size, and the server's ``Replies`` (guard, caller, bounded sends)."""

    def __init__(
        self,
        gate: Gate,
        traffic: Traffic,
        replies: Replies,
        *,
        streams: StreamLimits,
        codecs: CodecPolicy,
        chunk_bytes: int,
    ):
        self.gate, self.traffic, self.replies = gate, traffic, replies
        self.streams, self.codecs, self.chunk_bytes = streams, codecs, chunk_bytes

    async def _upload(self, frames: AsyncIterator[Any], who: str) -> AsyncIterator[Any]:
        """``frames`` under the server's deadlines: no gap longer than ``upload_idle_s``, and the
        whole upload within ``upload_timeout_s`` (stretched for a large announced payload once
        the header says how large: a slow or stalled sender is cut off)."""
        loop = asyncio.get_running_loop()
        total, idle = self.streams.upload_timeout_s, self.streams.upload_idle_s
        start = loop.time()
        deadline = start + total
        it = frames.__aiter__()
        first = True
        while True:
            left = min(idle, deadline - loop.time())
            if left <= 0:
                raise exhausted(f"{who}: upload not complete after {total:g} s")
            try:
                msg = await asyncio.wait_for(it.__anext__(), left)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise exhausted(
                    f"{who}: upload stalled for {idle:g} s"
                    if loop.time() < deadline
                    else f"{who}: upload not complete after {total:g} s"
                ) from None
            if first and getattr(msg, "WhichOneof", None) and msg.WhichOneof("body") == "header":
                total = self.streams.upload_deadline(msg.header.total_bytes)
                deadline = start + total  # the size is checked against the limit right after
            first = False
            yield msg

    async def _read_compute(self, context, raw_frames, kind: str, slot: contextlib.ExitStack):
        """The request a compute stream carries: header (within ``upload_idle_s``), caller
        authenticated and known, one of its admission slots taken (held by ``slot``), then the
        payload under the upload deadlines."""
        it = self._upload(_parsed(raw_frames, pb.ComputeFrame, kind), kind).__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        if first is None or first.WhichOneof("body") != "header":
            raise invalid(f"{kind}: stream must start with a header frame")
        h = first.header
        req = self.gate.admit_compute(
            self.replies.caller(context), serde.compute_request_from_pb(kind, h), h.total_bytes, slot, announced=True
        )
        who = f"{kind} from {req.requester}"
        limit = self.gate.limits.max_model_bytes
        asm = None if req.ref is not None else Assembler(who, h.total_bytes, h.sha256, limit)
        if asm is None:
            self.traffic.record(kind, received=first.ByteSize())
            return req
        data = await collect(it, asm)
        self.traffic.record(kind, received=first.ByteSize() + len(data))
        codec = h.codec or wire_codecs.FP32
        try:
            wire_codecs.check_codec(codec)
            if codec not in self.codecs.advertised:
                raise WireError(f"codec {codec!r} is not one this node advertised ({list(self.codecs.advertised)})")
            req.groups, meta = wire_codecs.decode(data, max_bytes=limit)  # a delta has no base here: refused
            section = wire_codecs.codec_of(meta)
            if (section.get("name") if section else wire_codecs.FP32) != codec:
                raise WireError(f"header says codec {codec!r}, the payload another")
        except WireError as e:
            raise invalid(f"{who}: {e}") from None
        return req

    async def _computed(self, context, raw_frames, kind: str):
        with contextlib.ExitStack() as slot:
            return await self.gate.compute(await self._read_compute(context, raw_frames, kind, slot))

    async def CrossLoss(self, raw_frames, context):
        async def go():
            reply = await self._computed(context, raw_frames, CROSS_LOSS)
            out = serde.loss_reply_to_pb(reply)
            self.traffic.record(CROSS_LOSS, sent=out.ByteSize())
            return out

        return await self.replies.guard(context, CROSS_LOSS, go(), raw_frames)

    async def CrossGradient(self, raw_frames, context):
        reply = await self.replies.guard(
            context, CROSS_GRADIENT, self._computed(context, raw_frames, CROSS_GRADIENT), raw_frames
        )
        data = encode(reply.grad) if reply.grad is not None else b""
        header = serde.gradient_header_to_pb(reply, len(data), sha256(data) if data else "")
        frames = (pb.GradientChunk(header=header), *(pb.GradientChunk(data=p) for p in split(data, self.chunk_bytes)))
        await self.replies.send(context, frames, "gradient")
        self.traffic.record(CROSS_GRADIENT, sent=header.ByteSize() + len(data))

    async def PushGradient(self, raw_frames, context):
        async def go():
            return serde.ack_to_pb(await self._computed(context, raw_frames, PUSH_GRADIENT))

        return await self.replies.guard(context, PUSH_GRADIENT, go(), raw_frames)
