"""AutoNAT-style reachability check (``Relay.DialBack``, docs/nat.md): a node with a peer port
asks its bootstrap peers to dial it back. A peer dials only the caller's own IP address (as the
connection shows it, so it cannot be used to probe third parties) at the port the caller names,
and asks TLS for the caller's certificate, so "reachable" means this node, not whatever answers."""

from __future__ import annotations

import asyncio
import contextlib
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


async def dial(tls: TLS, host: str, port: int, node_id: str) -> tuple[bool, str, bool]:
    """Whether ``node_id`` answers at host:port (a health check over TLS asking for its
    certificate), why not, and — when it did not — whether the port accepted a TCP connection."""
    address = f"{host}:{port}"
    ch = relay_channel(address, tls.channel_credentials(), tls.target_name(node_id))
    try:
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=DIAL_TIMEOUT_S)
        return True, f"dialled {address}", True
    except grpc.aio.AioRpcError as e:
        why = f"dialled {address}: {e.code().name}: {(e.details() or '')[:200]}"
        timed_out = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await ch.close()
    if not timed_out:  # refused, or another certificate answered there: a verdict
        return False, why, False
    # no answer in time. The kernel accepts a connection on a listening port however busy the
    # process is; a NAT or firewall accepts none on a port nobody forwarded. An open port that did
    # not answer in time is a node too loaded to finish TLS (100 daemons on 2 cores: 44 moved
    # behind relays), not one nobody can dial
    open_ = await port_open(host, port)
    return False, why + ("; the port accepts connections" if open_ else ""), open_


async def port_open(host: str, port: int, timeout: float = DIAL_TIMEOUT_S) -> bool:
    """Whether a TCP connection to host:port is accepted within ``timeout``."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def check(tls: TLS, peers: list[str], port: int) -> dict[str, str]:
    """Ask each peer to dial this node back: peer -> "reachable: ..." / "unreachable: ..." /
    "busy: ..." (the port is open, the node did not answer in time: no verdict) / the error."""

    async def ask(peer: str) -> str:
        ch = relay_channel(peer, tls.channel_credentials(), GENERIC_NAME)
        try:
            # the dialler's health check and, when that fails, its TCP check: 2 x 3 s, and slack
            reply = await rpc.RelayStub(ch).DialBack(pb.DialBackRequest(port=port), timeout=2 * DIAL_TIMEOUT_S + 2)
            if reply.reachable:
                return "reachable: " + reply.detail
            return ("busy: " if reply.port_open else "unreachable: ") + reply.detail
        except grpc.aio.AioRpcError as e:
            return f"no answer: {e.code().name}: {(e.details() or '')[:200]}"
        finally:
            await ch.close()

    answers = await asyncio.gather(*(ask(p) for p in peers))
    return dict(zip(peers, answers, strict=True))
