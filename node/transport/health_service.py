"""The standard gRPC health service, behind a parser that refuses malformed requests cleanly.

``grpc_health``'s own registration deserializes requests inside the gRPC library: garbage from a
caller became UNKNOWN and a library traceback in the node's log (240 UNKNOWN, 18 tracebacks when
fuzzed). Here the request arrives as bytes and is parsed by us: a malformed one is answered
INVALID_ARGUMENT with a one-line reason and nothing is logged; a well-formed one goes to the
library's servicer, unchanged."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2

SERVICE = health.SERVICE_NAME  # grpc.health.v1.Health
MAX_REQUEST_BYTES = 4096  # a HealthCheckRequest is a service name


async def _parse(data: bytes, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckRequest:
    if len(data) > MAX_REQUEST_BYTES:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"health request of {len(data)} bytes")
    try:
        req = health_pb2.HealthCheckRequest.FromString(data)
        req.service.encode()  # a string field holding invalid UTF-8 fails here, not later
        return req
    except (DecodeError, UnicodeError, ValueError) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed HealthCheckRequest: {type(e).__name__}")


def add_health_service(servicer: health.aio.HealthServicer, server: grpc.aio.Server) -> None:
    async def check(data: bytes, context: grpc.aio.ServicerContext):
        return await servicer.Check(await _parse(data, context), context)

    async def watch(data: bytes, context: grpc.aio.ServicerContext):
        req = await _parse(data, context)
        async for reply in servicer.Watch(req, context):
            yield reply

    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Check": grpc.unary_unary_rpc_method_handler(
                        check, response_serializer=health_pb2.HealthCheckResponse.SerializeToString
                    ),
                    "Watch": grpc.unary_stream_rpc_method_handler(
                        watch, response_serializer=health_pb2.HealthCheckResponse.SerializeToString
                    ),
                },
            ),
        )
    )
