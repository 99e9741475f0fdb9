"""The relayed side: this node holds a ``Reserve`` stream to each of its relays. Each tunnel a
relay offers is accepted and spliced to a fresh connection to this node's own peer server
(``local``: the private Unix socket of an outbound-only node, ``no_listen``; or the peer port of
a node nobody can dial, ``relay_fallback.py``), so the server (and its mTLS) serves relayed
callers exactly as it serves direct ones. A lost reservation is retried with backoff, while the
other relays keep this node reachable."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from ...proto.v1 import relay_pb2 as pb
from ...proto.v1 import relay_pb2_grpc as rpc
from ..security.pki import GENERIC_NAME
from .relay_pipe import relay_channel, splice
from .tls import TLS

log = logging.getLogger(__name__)
RETRY_S = (0.2, 2.0)  # first and longest wait before reserving again at a relay that failed
# tunnels this node has open through all its relays at once: a relay offering more (a hostile one
# can offer without end) gets its offers ignored until some close
MAX_TUNNELS = 64


class RelayReservations:
    def __init__(self, tls: TLS | None, relays: list[str], local: str):
        """``local``: this node's peer server, ``unix:PATH`` or ``HOST:PORT``."""
        self.relays = list(relays)
        self.local = local
        self.any_held = asyncio.Event()  # set once some relay holds a reservation for this node
        self._creds = tls.channel_credentials() if tls is not None else None
        self.state: dict[str, str] = {r: "reserving" for r in self.relays}  # relay -> "held" or why not
        # relay -> when it was added or last lost its reservation (how long it has been of no use)
        self.lost_since: dict[str, float] = dict.fromkeys(self.relays, time.monotonic())
        self._tasks: set[asyncio.Task] = set()
        self._holders: dict[str, asyncio.Task] = {}  # relay -> the task holding its reservation
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.open = 0  # tunnels accepted and not yet closed
        self.ignored = 0  # offers past MAX_TUNNELS

    def start(self) -> None:
        for relay in self.relays:
            self._holders[relay] = self._spawn(self._hold(relay))

    def held(self) -> list[str]:
        return [r for r, s in self.state.items() if s == "held"]

    def add(self, relay: str) -> None:
        """Reserve at ``relay`` too (relay housekeeping: all the others are gone)."""
        if relay in self.state:
            return
        self.relays.append(relay)
        self.state[relay] = "reserving"
        self.lost_since[relay] = time.monotonic()
        self._holders[relay] = self._spawn(self._hold(relay))

    async def drop(self, relay: str) -> None:
        """Stop reserving at ``relay`` (its tunnels already open run on until they end)."""
        if relay not in self.state:
            return
        self.relays.remove(relay)
        del self.state[relay]
        self.lost_since.pop(relay, None)
        task = self._holders.pop(relay, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        ch = self._channels.pop(relay, None)
        if ch is not None:
            with contextlib.suppress(Exception):
                await ch.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _hold(self, relay: str) -> None:
        ch = self._channels[relay] = relay_channel(relay, self._creds, GENERIC_NAME)
        stub = rpc.RelayStub(ch)
        wait = RETRY_S[0]
        while True:
            try:
                async for offer in stub.Reserve(pb.ReserveRequest()):
                    if self.state[relay] != "held":
                        log.info("relay reservation held at %s", relay)
                        self.state[relay] = "held"
                        self.any_held.set()
                        wait = RETRY_S[0]
                    if offer.tunnel_id and self.open < MAX_TUNNELS:
                        self._spawn(self._accept(stub, offer.tunnel_id))
                    elif offer.tunnel_id:
                        self.ignored += 1
                        log.warning(
                            "relay %s offers a tunnel past this node's %d open ones: ignored", relay, MAX_TUNNELS
                        )
                self._lost(relay, "the relay ended the reservation")
            except grpc.aio.AioRpcError as e:
                self._lost(relay, f"{e.code().name}: {e.details()}")
            log.info("relay reservation at %s lost (%s); again in %.1f s", relay, self.state[relay], wait)
            await asyncio.sleep(wait)  # backoff before reserving again
            wait = min(RETRY_S[1], wait * 2)

    def _lost(self, relay: str, why: str) -> None:
        if self.state.get(relay) == "held":
            self.lost_since[relay] = time.monotonic()
        self.state[relay] = why

    async def _accept(self, stub: rpc.RelayStub, tunnel_id: str) -> None:
        self.open += 1
        try:
            await self._bridge(stub, tunnel_id)
        finally:
            self.open -= 1

    async def _bridge(self, stub: rpc.RelayStub, tunnel_id: str) -> None:
        try:
            if self.local.startswith("unix:"):
                reader, writer = await asyncio.open_unix_connection(self.local[len("unix:") :])
            else:
                host, _, port = self.local.rpartition(":")
                reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError as e:
            log.warning("relayed tunnel %s: own peer server at %s unreachable: %s", tunnel_id, self.local, e)
            return
        call = stub.Accept()
        try:
            await call.write(pb.RelayFrame(tunnel_id=tunnel_id))
        except grpc.aio.AioRpcError:
            writer.close()
            return
        await splice(reader, writer, call)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
