"""The dialing side of relayed connections: a grpc channel to ``relay://R1,R2/n7`` targets a
loopback listener of this node (one per relayed address); each connection gRPC opens to it
becomes a ``Connect`` stream through the first relay that answers, naming n7. The channel's TLS
runs through that pipe and asks for n7's certificate (``PeerClient`` pins the name the address
carries), so the session is end to end between this node and n7; the relay sees ciphertext.

A relay that fails or refuses (its budget: a busy relay, not a dead node) is remembered
(``problems``) and the next one tried. The one that last worked is tried first and the ones
that failed within ``FAILED_LAST_S`` last, so a dead relay (SIGKILLed, or a host that drops
packets) costs new connections nothing once it has failed; each attempt, connecting included,
is bounded by ``CONNECT_TIMEOUT_S``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import OrderedDict

import grpc

from ...proto.v1 import relay_pb2 as pb
from ...proto.v1 import relay_pb2_grpc as rpc
from ..security.pki import GENERIC_NAME
from .relay_address import RelayAddress, parse
from .relay_pipe import relay_channel, splice
from .tls import TLS

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0  # a relay must confirm a tunnel (its target accepted) within this
FAILED_LAST_S = 30.0  # a relay that failed a tunnel this recently is tried after the others
KNOWN_ADDRESSES = 4  # a node's relay addresses with a listener kept (the current one and the last few)


class RelayDialer:
    def __init__(self, tls: TLS | None):
        self._creds = tls.channel_credentials() if tls is not None else None
        self._local: dict[str, str] = {}  # relay address -> loopback host:port of its listener
        self._servers: dict[str, asyncio.AbstractServer] = {}  # relay address -> its listener
        self._current: dict[str, str] = {}  # node id -> its relay address last moved to
        self._known: dict[str, OrderedDict[str, None]] = {}  # node id -> its addresses asked for lately
        self._by_address: dict[str, set[asyncio.Task]] = {}  # relay address -> its tunnels
        self._stubs: dict[str, tuple[grpc.aio.Channel, rpc.RelayStub]] = {}
        self._preferred: dict[str, str] = {}  # node id -> relay that last worked
        self.problems: dict[str, str] = {}  # relay host:port -> why its last tunnel failed
        self._failed_at: dict[str, float] = {}  # relay host:port -> when its last tunnel failed
        self._tunnels: set[asyncio.Task] = set()

    def local(self, address: str) -> tuple[str, str]:
        """(loopback address a channel should dial, node id it must reach) for a relay address.
        Called from a synchronous channel lookup: the socket is bound and listening now, and
        the connections queued on it are served once the loop gets to the server task."""
        target = parse(address)
        current = self._current.get(target.node_id)
        known = self._known.setdefault(target.node_id, OrderedDict())
        if address != current and address not in known:
            # a move: the address it had ends (its tunnels too). One asked for again (stale news
            # of an address it had, a pending handshake) is served beside the current one and
            # retires nothing, or old news would cut the tunnels the node is reached by now.
            if current is not None:
                self._retire(current)
            self._current[target.node_id] = address
        known[address] = None
        known.move_to_end(address)
        while len(known) > KNOWN_ADDRESSES:
            oldest = next(iter(known))
            del known[oldest]
            if oldest != self._current.get(target.node_id):
                self._retire(oldest)
        if address not in self._local:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            self._local[address] = f"127.0.0.1:{sock.getsockname()[1]}"

            async def start(sock=sock, target=target):
                server = await asyncio.start_server(lambda r, w: self._tunnel(address, target, r, w), sock=sock)
                self._servers[address] = server

            asyncio.get_running_loop().create_task(start())
        return self._local[address], target.node_id

    def _retire(self, address: str) -> None:
        """The node moved (its relays changed, relay housekeeping): the old address's listener and
        tunnels end, so channels still open to it stop holding tunnels (each relay bounds them per
        node: ``max_tunnels_per_peer``) until the client evicts them as idle."""
        self._local.pop(address, None)
        server = self._servers.pop(address, None)
        if server is not None:
            server.close()
        for task in self._by_address.pop(address, set()):
            task.cancel()

    def _stub(self, relay: str) -> rpc.RelayStub:
        entry = self._stubs.get(relay)
        if entry is None:
            ch = relay_channel(relay, self._creds, GENERIC_NAME)
            entry = self._stubs[relay] = (ch, rpc.RelayStub(ch))
        return entry[1]

    async def _tunnel(
        self, address: str, target: RelayAddress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tunnels.add(task)
            self._by_address.setdefault(address, set()).add(task)
        try:
            await self._through_relays(target, reader, writer)
        except asyncio.CancelledError:  # the node is stopping: this connection ends with it
            writer.close()
        finally:
            if task is not None:
                self._tunnels.discard(task)
                self._by_address.get(address, set()).discard(task)

    def order(self, target: RelayAddress) -> list[str]:
        """The relays to try for ``target``: the one that last worked, then those that did not
        fail lately (in the address's order), then the ones that did (least recent first)."""
        preferred = self._preferred.get(target.node_id)
        now = time.monotonic()

        def rank(relay: str) -> tuple[int, float]:
            failed = self._failed_at.get(relay, float("-inf"))
            if relay == preferred and now - failed > FAILED_LAST_S:
                return (0, 0.0)
            return (2, failed) if now - failed <= FAILED_LAST_S else (1, 0.0)

        return sorted(target.relays, key=rank)  # (stable: the address's order among equals)

    async def _through_relays(
        self, target: RelayAddress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        for relay in self.order(target):
            call = self._stub(relay).Connect()
            try:
                await asyncio.wait_for(self._open(call, target), CONNECT_TIMEOUT_S)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError, ConnectionError) as e:
                call.cancel()
                if isinstance(e, asyncio.InvalidStateError):  # the relay ended the call before our first frame
                    why = await call.details() or str(e)
                else:
                    why = e.details() if isinstance(e, grpc.aio.AioRpcError) else (str(e) or "no answer")
                self.problems[relay] = f"relay {relay} to {target.node_id}: {why}"
                self._failed_at[relay] = time.monotonic()
                log.info("%s", self.problems[relay])
                continue
            self._preferred[target.node_id] = relay
            self.problems.pop(relay, None)
            self._failed_at.pop(relay, None)
            await splice(reader, writer, call)
            return
        writer.close()  # no relay reached the node: the TLS handshake on this connection fails

    @staticmethod
    async def _open(call, target: RelayAddress) -> None:
        """Name the target and wait for the relay's tunnel id (the target accepted)."""
        await call.write(pb.RelayFrame(target=target.node_id))
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "tunnel_id":
            raise ConnectionError("the relay ended the tunnel before it opened")

    async def close(self) -> None:
        for server in self._servers.values():
            server.close()
        for task in list(self._tunnels):
            task.cancel()
        await asyncio.gather(*self._tunnels, return_exceptions=True)
        for ch, _ in self._stubs.values():
            with contextlib.suppress(Exception):
                await ch.close()
        self._stubs.clear()
