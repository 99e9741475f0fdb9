"""AutoNAT-style reachability check (``Relay.DialBack``, docs/nat.md): a node with a peer port
asks its bootstrap peers to dial it back. A peer dials only the caller's own IP address (as the
connection shows it, so it cannot be used to probe third parties) at the port the caller names,
and asks TLS for the caller's certificate, so "reachable" means this node, not whatever answers."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ...proto.v1 import relay_pb2 as pb
from ...proto.v1 import relay_pb2_grpc as rpc
from ..security.pki import GENERIC_NAME
from .relay_pipe import relay_channel
from .tls import TLS

log = logging.getLogger(__name__)
DIAL_TIMEOUT_S = 3.0


def caller_host(peer: str) -> str | None:
    """The IP in a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); None otherwise."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rpartition(":")[0]
    return host or None


async def dial(tls: TLS, host: str, port: int, node_id: str) -> tuple[bool, str]:
    """Whether ``node_id`` answers at host:port (a health check over TLS asking for its certificate)."""
    address = f"{host}:{port}"
    ch = relay_channel(address, tls.channel_credentials(), tls.target_name(node_id))
    try:
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=DIAL_TIMEOUT_S)
        return True, f"dialled {address}"
    except grpc.aio.AioRpcError as e:
        return False, f"dialled {address}: {e.code().name}: {(e.details() or '')[:200]}"
    finally:
        await ch.close()


async def check(tls: TLS, peers: list[str], port: int) -> dict[str, str]:
    """Ask each peer to dial this node back: peer -> "reachable: ..." / "unreachable: ..." / the error."""

    async def ask(peer: str) -> str:
        ch = relay_channel(peer, tls.channel_credentials(), GENERIC_NAME)
        try:
            reply = await rpc.RelayStub(ch).DialBack(pb.DialBackRequest(port=port), timeout=2 * DIAL_TIMEOUT_S + 2)
            return ("reachable: " if reply.reachable else "unreachable: ") + reply.detail
        except grpc.aio.AioRpcError as e:
            return f"no answer: {e.code().name}: {(e.details() or '')[:200]}"
        finally:
            await ch.close()

    answers = await asyncio.gather(*(ask(p) for p in peers))
    return dict(zip(peers, answers, strict=True))
