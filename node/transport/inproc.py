"""The in-process transport: many nodes in one asyncio event loop reach each other through memory.

``InProcNetwork`` is the switchboard of one process: peer address → the ``PeerHandler`` serving
it. Each node gets its own ``InProcTransport`` (a ``peering.interfaces.TransportFactory``) from
it; its client hands a call straight to the target's handler — no sockets, no serialisation of
tensors — with the gRPC transport's semantics:

- **The same checks.** The handler's own checks run exactly as behind the gRPC server (known
  peer, protocol and architecture, tensor shapes and finiteness, splits); the size limits the
  gRPC transport applies (``max_model_bytes`` for snapshots, compute payloads and gradients,
  ``max_gossip_bytes`` for gossip) are applied here at the same points. Gossip payloads still go
  through msgpack: msgpack defines what a payload may hold, and the receiver gets its own copy.
- **The same failures.** A refusal arrives as ``PeerCallError`` of its kind (``invalid``,
  ``refused``, ``unknown_peer``, ``not_cached``, ``unavailable``); an address nobody serves, a
  node that stopped (also while a call to it is in flight) or a passed deadline as
  ``unavailable``. A call's peer side runs as its own task and is cancelled when the deadline
  passes or the peer stops, as gRPC cancels a server handler.
- **Snapshots are shared, not copied.** Every puller of a published version gets the publisher's
  own tensors (a node publishes copies of its model and never changes them afterwards). They are
  read-only for the receiver, as peer snapshots are for every strategy; torch has no read-only
  tensors, so the switchboard records each tensor's in-place version counter the first time it
  hands a snapshot out and checks it at every later hand-out: a snapshot some receiver modified
  is refused (``WireError`` naming the publisher and version) instead of spreading.
  ``InProcNetwork(share_snapshots=False)`` gives every puller its own clone instead (what a
  gRPC pull gives). Pushed gradients are cloned (the receiver keeps them until its next round);
  compute payloads and replies are used within the call and handed over as they are.
- **Traffic** is accounted as payload bytes: tensor bytes for snapshots and compute requests,
  msgpack bytes for gossip; membership calls carry no payload and count 0 bytes (they still
  count in the latency histograms).

Addresses are ``inproc:<n>`` (a node configured to listen on ``inproc:<n>`` gets exactly that,
otherwise the next free number), so configs and bootstrap lists look as they do for gRPC.

Mixed networks (a group of in-process nodes in one Ray actor, say): give ``transport()`` a
gRPC transport factory as ``grpc``. The node then also serves over gRPC, registers here under
its gRPC address, and its client reaches the nodes of this process through memory and every
other address over gRPC."""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

import msgpack

from ..peering.errors import (INVALID, NOT_CACHED, REFUSED, UNAVAILABLE, UNKNOWN_PEER, PeerCallError, Refusal,
                              invalid)
from ..peering.interfaces import PeerHandler, PeerServer, PeerTransport, Traffic, TransportFactory
from ..peering.messages import (CROSS_GRADIENT, CROSS_LOSS, PUSH_GRADIENT, Beat, ComputeReply, ComputeRequest,
                                LocalSnapshot, NodeInfo, PeerEntry, SnapshotHeader)
from ..wire.codec import Groups, WireError

log = logging.getLogger(__name__)

HOST = "inproc"
_KINDS = (INVALID, REFUSED, UNKNOWN_PEER, NOT_CACHED, UNAVAILABLE)


def nbytes(groups: Groups | None) -> int:
    return sum(t.numel() * t.element_size() for g in (groups or {}).values() for t in g.values())


def _clone(groups: Groups) -> Groups:
    return {g: {k: t.detach().clone() for k, t in ts.items()} for g, ts in groups.items()}


def _call_error(e: Exception, kind: str) -> PeerCallError:
    """What the caller sees of an exception raised by the peer's handler (as gRPC maps it)."""
    if isinstance(e, PeerCallError):
        return e
    if isinstance(e, Refusal):
        return PeerCallError(e.kind if e.kind in _KINDS else INVALID, e.message)
    if isinstance(e, WireError):
        return PeerCallError(INVALID, str(e))
    return PeerCallError(UNAVAILABLE, f"{kind} failed at the peer: {type(e).__name__}: {e}")


@dataclass
class _Served:
    """One node's handler as the switchboard holds it."""
    handler: PeerHandler
    traffic: Traffic
    max_model_bytes: int
    max_gossip_bytes: int
    stopped: asyncio.Future  # resolved when the node stops serving: in-flight calls fail


class InProcNetwork:
    """The switchboard of one process (one event loop)."""

    def __init__(self, *, share_snapshots: bool = True):
        self.share_snapshots = share_snapshots
        self._served: dict[str, _Served] = {}
        self._next = 0
        # published snapshot -> the tensors' version counters when first handed out
        self._seals: weakref.WeakKeyDictionary[LocalSnapshot, tuple[int, ...]] = weakref.WeakKeyDictionary()

    def transport(self, *, listen: str | None = None, timeout_s: float = 30.0, delay_ms: float = 0.0,
                  max_model_bytes: int = 1 << 31, max_gossip_bytes: int = 1 << 20,
                  grpc: TransportFactory | None = None) -> "InProcTransport":
        return InProcTransport(self, listen=listen, timeout_s=timeout_s, delay_ms=delay_ms,
                               max_model_bytes=max_model_bytes, max_gossip_bytes=max_gossip_bytes, grpc=grpc)

    def transport_for(self, cfg: Any, grpc: TransportFactory | None = None) -> "InProcTransport":
        """A node's transport from its ``NodeConfig`` (listen address, timeout, limits, delay)."""
        return self.transport(listen=cfg.listen, timeout_s=cfg.request_timeout_s, delay_ms=cfg.delay_ms,
                              max_model_bytes=cfg.max_model_bytes, max_gossip_bytes=cfg.max_gossip_bytes,
                              grpc=grpc)

    def addresses(self) -> list[str]:
        return sorted(self._served)

    def lookup(self, address: str) -> _Served | None:
        return self._served.get(address)

    def _bind(self, address: str | None, served: _Served) -> str:
        """Register ``served`` under ``address``, or under the next free ``inproc:<n>``."""
        if address is None:
            while f"{HOST}:{self._next + 1}" in self._served:
                self._next += 1
            self._next += 1
            address = f"{HOST}:{self._next}"
        if address in self._served:
            raise OSError(f"cannot bind peer address {address}: another node in this process serves it")
        self._served[address] = served
        return address

    def _unbind(self, address: str, served: _Served) -> None:
        if self._served.get(address) is served:
            del self._served[address]
        if not served.stopped.done():
            served.stopped.set_result(None)

    def hand_out(self, snap: LocalSnapshot) -> Groups:
        """The groups of ``snap`` for one puller: shared and checked unmodified, or a clone."""
        if not self.share_snapshots:
            return _clone(snap.groups)
        # Tensor._version counts in-place changes (autograd's own check for modified tensors)
        versions = tuple(t._version for g in snap.groups.values() for t in g.values())
        sealed = self._seals.setdefault(snap, versions)
        if sealed != versions:
            raise WireError(f"snapshot v{snap.version} of {snap.node_id} was modified in place after it was "
                            f"handed out (in-process snapshots are shared and read-only for receivers)")
        return {g: dict(ts) for g, ts in snap.groups.items()}  # the tensors shared, the dicts the puller's own


@dataclass
class InProcServer:
    """A node served on the switchboard (``peering.interfaces.PeerServer``)."""
    address: str
    network: InProcNetwork
    served: _Served
    also: PeerServer | None = None  # mixed mode: the node's gRPC server

    async def stop(self) -> None:
        self.network._unbind(self.address, self.served)
        if self.also is not None:
            await self.also.stop()


class InProcTransport:
    """One node's in-process transport (``peering.interfaces.TransportFactory``)."""

    def __init__(self, network: InProcNetwork, *, listen: str | None, timeout_s: float, delay_ms: float,
                 max_model_bytes: int, max_gossip_bytes: int, grpc: TransportFactory | None):
        self.network, self.listen, self.grpc = network, listen, grpc
        self.timeout_s, self.delay_ms = timeout_s, delay_ms
        self.max_model_bytes, self.max_gossip_bytes = max_model_bytes, max_gossip_bytes

    def connect(self, node_id: str, traffic: Traffic) -> "InProcClient":
        fallback = self.grpc.connect(node_id, traffic) if self.grpc is not None else None
        return InProcClient(self.network, node_id, traffic, timeout_s=self.timeout_s, delay_ms=self.delay_ms,
                            max_model_bytes=self.max_model_bytes, max_gossip_bytes=self.max_gossip_bytes,
                            fallback=fallback)

    async def serve(self, handler: PeerHandler, traffic: Traffic) -> InProcServer:
        also = await self.grpc.serve(handler, traffic) if self.grpc is not None else None
        served = _Served(handler, traffic, self.max_model_bytes, self.max_gossip_bytes,
                         asyncio.get_running_loop().create_future())
        host, _, port = (self.listen or "").rpartition(":")
        wanted = also.address if also is not None else (
            self.listen if host == HOST and port.isdigit() and int(port) > 0 else None)
        try:
            address = self.network._bind(wanted, served)
        except OSError:
            if also is not None:
                await also.stop()
            raise
        return InProcServer(address, self.network, served, also)


class InProcClient:
    """The calling side (``peering.interfaces.PeerTransport``): addresses served in this process
    are called in memory, any other through ``fallback`` (gRPC in mixed mode), or fail."""

    def __init__(self, network: InProcNetwork, node_id: str, traffic: Traffic, *, timeout_s: float,
                 delay_ms: float = 0.0, max_model_bytes: int = 1 << 31, max_gossip_bytes: int = 1 << 20,
                 fallback: PeerTransport | None = None):
        self.network, self.node_id, self.traffic = network, node_id, traffic
        self.timeout_s = timeout_s
        self.delay_s = delay_ms / 1000.0  # emulated one-way link latency (testbed)
        self.max_model_bytes, self.max_gossip_bytes = max_model_bytes, max_gossip_bytes
        self.fallback = fallback

    # --- routing and the two ways of calling a handler ---
    def _remote(self, address: str) -> PeerTransport:
        if self.fallback is None:
            raise PeerCallError(UNAVAILABLE, f"no node serves {address} in this process")
        return self.fallback

    async def _link(self) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # the emulated wire delay itself, not a wait for state

    def _sync(self, peer: _Served, address: str, kind: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A membership call: the handler answers at once."""
        if peer.stopped.done():
            raise PeerCallError(UNAVAILABLE, f"{address} stopped serving")
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:
            raise self._refused(e, kind, address) from None
        finally:
            peer.traffic.latency(kind, time.perf_counter() - t0, "server")

    async def _async(self, peer: _Served, address: str, kind: str, make: Callable[[], Awaitable[Any]],
                     timeout: float) -> Any:
        """A call whose peer side may take time: its own task, bounded by the deadline and by the
        peer staying up; cancelled when either runs out."""
        if peer.stopped.done():
            raise PeerCallError(UNAVAILABLE, f"{address} stopped serving")
        t0 = time.perf_counter()
        task = asyncio.ensure_future(make())
        try:
            await asyncio.wait((task, peer.stopped), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            peer.traffic.latency(kind, time.perf_counter() - t0, "server")
        if task.done() and not task.cancelled():
            e = task.exception()
            if e is None:
                return task.result()
            raise self._refused(e, kind, address)
        if peer.stopped.done():
            raise PeerCallError(UNAVAILABLE, f"{address} stopped serving during a {kind} call")
        raise PeerCallError(UNAVAILABLE, f"{kind} call to {address}: deadline of {timeout:g}s exceeded")

    @staticmethod
    def _refused(e: BaseException, kind: str, address: str) -> PeerCallError:
        if not isinstance(e, Exception):  # KeyboardInterrupt & co. are not the peer's answer
            raise e
        err = _call_error(e, kind)
        if isinstance(e, (Refusal, WireError)):
            log.warning("refused %s at %s: %s", kind, address, err.message)
        elif not isinstance(e, PeerCallError):
            log.error("%s at %s failed", kind, address, exc_info=e)
        return err

    def _timed(self, kind: str, t0: float) -> None:
        self.traffic.latency(kind, time.perf_counter() - t0, "client")

    # --- membership ---
    async def handshake(self, address: str, info: NodeInfo, timeout: float) -> tuple[NodeInfo, list[PeerEntry]]:
        peer = self.network.lookup(address)
        if peer is None:
            return await self._remote(address).handshake(address, info, timeout)
        t0 = time.perf_counter()
        await self._link()
        entries = self._sync(peer, address, "handshake", peer.handler.on_handshake,
                             replace(info, labels=dict(info.labels)))
        remote = self._sync(peer, address, "handshake", peer.handler.info)
        self._timed("handshake", t0)
        return replace(remote, labels=dict(remote.labels)), list(entries)

    async def heartbeat(self, address: str, beat: Beat, timeout: float) -> tuple[Beat, float]:
        peer = self.network.lookup(address)
        if peer is None:
            return await self._remote(address).heartbeat(address, beat, timeout)
        t0 = time.perf_counter()
        await self._link()
        reply = self._sync(peer, address, "heartbeat", peer.handler.on_heartbeat, beat)
        rtt = time.perf_counter() - t0
        self._timed("heartbeat", t0)
        return reply, rtt

    async def exchange_peers(self, address: str, sender: str, entries: list[PeerEntry],
                             timeout: float) -> list[PeerEntry]:
        peer = self.network.lookup(address)
        if peer is None:
            return await self._remote(address).exchange_peers(address, sender, entries, timeout)
        await self._link()
        return list(self._sync(peer, address, "peers", peer.handler.on_peer_list, sender, list(entries)))

    # --- snapshots ---
    async def get_snapshot(self, address: str, requester: str, have_version: int = 0, *,
                           min_round: int = 0, wait_s: float = 0.0,
                           timeout: float | None = None) -> tuple[SnapshotHeader, Groups | None]:
        peer = self.network.lookup(address)
        if peer is None:
            return await self._remote(address).get_snapshot(address, requester, have_version, min_round=min_round,
                                                            wait_s=wait_s, timeout=timeout)
        t0 = time.perf_counter()
        await self._link()
        snap: LocalSnapshot = await self._async(peer, address, "snapshot",
                                                lambda: peer.handler.snapshot(requester, min_round, wait_s),
                                                timeout or self.timeout_s)
        unchanged = have_version > 0 and have_version == snap.version
        groups = None if unchanged else self.network.hand_out(snap)
        size = nbytes(groups)
        if size > self.max_model_bytes:
            raise WireError(f"snapshot of {snap.node_id}: payload of {size} bytes exceeds the limit of "
                            f"{self.max_model_bytes}")
        peer.traffic.record("snapshot", sent=size)
        self.traffic.record("snapshot", received=size)
        self._timed("snapshot", t0)
        return snap.header(unchanged), groups

    # --- compute requests ---
    async def compute(self, address: str, request: ComputeRequest, timeout: float | None = None) -> ComputeReply:
        peer = self.network.lookup(address)
        if peer is None:
            return await self._remote(address).compute(address, request, timeout)
        kind = request.kind
        if kind not in (CROSS_LOSS, CROSS_GRADIENT, PUSH_GRADIENT):
            raise ValueError(f"unknown compute request kind {kind!r}")
        t0 = time.perf_counter()
        await self._link()
        # what the wire would carry: a reference instead of the model; the receiver's own dicts
        groups = None if request.ref is not None or request.groups is None else request.groups
        if groups is not None:
            groups = _clone(groups) if kind == PUSH_GRADIENT else {g: dict(ts) for g, ts in groups.items()}
        req = replace(request, groups=groups)
        size = nbytes(groups)

        async def served() -> ComputeReply:
            peer.handler.check_known(req.requester)  # before taking a payload from a stranger
            if size > peer.max_model_bytes:
                raise invalid(f"{kind} from {req.requester}: payload of {size} bytes exceeds the limit of "
                              f"{peer.max_model_bytes}")
            return await peer.handler.compute(req)

        reply: ComputeReply = await self._async(peer, address, kind, served, timeout or self.timeout_s)
        if kind == CROSS_LOSS:
            out = ComputeReply(loss=float(reply.loss), samples=int(reply.samples))
        elif kind == PUSH_GRADIENT:
            out = ComputeReply(accepted=bool(reply.accepted), message=str(reply.message))
        else:
            out = ComputeReply(loss=float(reply.loss), samples=int(reply.samples), grad=reply.grad,
                               inner_product=float(reply.inner_product))
        back = nbytes(out.grad)
        if back > self.max_model_bytes:
            raise WireError(f"gradient from {address}: payload of {back} bytes exceeds the limit of "
                            f"{self.max_model_bytes}")
        peer.traffic.record(kind, received=size, sent=back)
        self.traffic.record(kind, sent=size, received=back)
        self._timed(kind, t0)
        return out

    async def gossip(self, address: str, sender: str, key: str, payload: dict[str, Any],
                     timeout: float | None = None) -> dict[str, Any]:
        peer = self.network.lookup(address)
        if peer is None:
            return await self._remote(address).gossip(address, sender, key, payload, timeout)
        t0 = time.perf_counter()
        await self._link()
        raw = msgpack.packb(payload, use_bin_type=True)
        if len(raw) > self.max_gossip_bytes:
            raise PeerCallError(INVALID, f"gossip payload for {key!r} is {len(raw)} bytes, "
                                         f"over the limit of {self.max_gossip_bytes}")

        async def served() -> bytes:
            peer.handler.check_known(sender)
            if len(raw) > peer.max_gossip_bytes:
                raise invalid(f"gossip from {sender}: {len(raw)} bytes exceeds the limit of {peer.max_gossip_bytes}")
            try:
                theirs = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            except Exception as e:  # msgpack raises a zoo of types on garbage
                raise invalid(f"gossip from {sender}: payload is not msgpack ({e})") from None
            if not isinstance(theirs, dict):
                raise invalid(f"gossip from {sender}: payload is not a map")
            return msgpack.packb(await peer.handler.gossip(sender, key, theirs), use_bin_type=True)

        back = await self._async(peer, address, "gossip", served, timeout or self.timeout_s)
        if len(back) > self.max_gossip_bytes:
            raise WireError(f"gossip reply from {address} exceeds {self.max_gossip_bytes} bytes")
        peer.traffic.record("gossip", received=len(raw), sent=len(back))
        self.traffic.record("gossip", sent=len(raw), received=len(back))
        self._timed("gossip", t0)
        out = msgpack.unpackb(back, raw=False, strict_map_key=False)
        if not isinstance(out, dict):
            raise WireError(f"gossip reply from {address} is not a map")
        return out

    async def forget(self, address: str) -> None:
        if self.fallback is not None and self.network.lookup(address) is None:
            await self.fallback.forget(address)

    async def close(self) -> None:
        if self.fallback is not None:
            await self.fallback.close()
