"""Splicing a local byte stream (TCP or Unix socket) with a Relay bidi stream (``relay.proto``):
what the dialer and the reserved node each do with their end of a tunnel. Bytes pass as they
are: on both ends they are the two nodes' own TLS records."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from ...proto.v1 import relay_pb2 as pb

READ_BYTES = 256 << 10  # one frame per read of the local socket, at most this


async def splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, call) -> None:
    """Copy both ways until either end closes or fails; then close both."""

    async def up() -> None:
        while data := await reader.read(READ_BYTES):
            await call.write(pb.RelayFrame(data=data))

    async def down() -> None:
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.WhichOneof("body") != "data":
                return
            writer.write(msg.data)
            await writer.drain()

    tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        call.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
            await writer.wait_closed()


def relay_channel(address: str, creds: grpc.ChannelCredentials | None, target_name: str) -> grpc.aio.Channel:
    """A channel to a relay's peer port, presenting this node's certificate (any node of the CA may relay)."""
    options = [
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.ssl_target_name_override", target_name),
    ]
    if creds is None:  # the node has no TLS identity: only with security.insecure (tls.load_tls)
        return grpc.aio.insecure_channel(address, options=options[:-1])
    return grpc.aio.secure_channel(address, creds, options=options)
