"""The in-process transport: many nodes in one asyncio event loop reach each other through memory.

``InProcNetwork`` is the switchboard of one process: peer address → the ``PeerHandler`` serving
it. Each node gets its own ``InProcTransport`` (a ``peering.interfaces.TransportFactory``) from
it; its client hands a call straight to the target's handler — no sockets, no serialisation of
tensors — with the gRPC transport's semantics:

- **For one trusted process.** There is no TLS here and none is needed: a call never leaves the
  process. A caller's identity is the node id its client was created with (``connect``): every id
  a request claims (handshake node, heartbeat sender, probe requester, peer-exchange and gossip
  sender, snapshot and compute requester) must be that one, or the request is refused as
  ``forbidden`` before the handler sees it — what mTLS enforces on gRPC, enforced by construction,
  so no node of the process can speak for another. ``peer=`` (the node id a caller expects at an
  address) is checked against the handler serving there (``unavailable`` otherwise, as a TLS name
  mismatch is on gRPC). Whoever can run code in the process can of course reach every node's
  memory: the in-process backend is for simulations on one machine, not for mutually distrustful
  parties. (Mixed mode's gRPC side keeps the node's certificates.)
- **The same checks and budgets.** A call goes through the same ``gate`` (``gate.py``) as a gRPC
  request, then to the handler, whose own checks run exactly as behind the gRPC server (protocol
  and architecture, purposes, tensor shapes and finiteness, splits): claimed id, known peer,
  references and sizes (``max_model_bytes`` for compute payloads, ``max_gossip_bytes`` and the key
  length for gossip), per-peer admission (``admit(peer, kind)``: request rate, concurrency,
  compute share) held until the call ends. The caller's side applies its own ``max_model_bytes``
  to snapshots and gradients it receives, as the gRPC client does. Gossip payloads still go
  through msgpack: msgpack defines what a payload may hold, and the receiver gets its own copy.
- **The same failures.** A refusal arrives as ``PeerCallError`` of its kind (``invalid``,
  ``refused``, ``unknown_peer``, ``not_cached``, ``unavailable``, ``exhausted`` for an admission
  limit, ``privacy_budget`` for a spent privacy budget, ``forbidden`` for a claimed id that is
  not the caller's); an address nobody serves, a node that stopped (also while a call to it is in
  flight) or a passed deadline as ``unavailable``. A call's peer side runs as its own task and is
  cancelled when the deadline passes or the peer stops, as gRPC cancels a server handler (its
  admission slot is released then).
- **Snapshots are shared, not copied.** Every puller of a published version gets the publisher's
  own tensors (a node publishes copies of its model and never changes them afterwards; the
  handler hands out a snapshot once it is ``ready()``, encoded off the loop, so its tensors are
  the zero-copy views the gRPC transport would stream). They are read-only for the receiver, as
  peer snapshots are for every strategy; torch has no read-only tensors, so the switchboard
  records each tensor's in-place version counter the first time it hands a snapshot out and
  checks it at every later hand-out: a snapshot some receiver modified is refused (``WireError``
  naming the publisher and version) instead of spreading.
  ``InProcNetwork(share_snapshots=False)`` gives every puller its own clone instead (what a
  gRPC pull gives). Pushed gradients are cloned (the receiver keeps them until its next round);
  compute payloads and replies are used within the call and handed over as they are.
- **Traffic** is accounted as payload bytes: tensor bytes for snapshots and compute requests,
  msgpack bytes for gossip; membership calls carry no payload and count 0 bytes (they still
  count in the latency histograms).

Addresses are ``inproc:<n>`` (a node configured to listen on ``inproc:<n>`` gets exactly that,
otherwise the next free number), so configs and bootstrap lists look as they do for gRPC.

Mixed networks (a group of in-process nodes in one Ray actor, say) run on ``routing.py``, which
serves a node over gRPC too, registers it here under its gRPC address (``InProcTransport.bind``)
and routes each call to memory or gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ..peering.api import HANDSHAKE, Unary, UnaryCalls, check_compute_kind
from ..peering.errors import (
    EXHAUSTED,
    FORBIDDEN,
    INVALID,
    NOT_CACHED,
    PRIVACY_BUDGET,
    REFUSED,
    UNAVAILABLE,
    UNKNOWN_PEER,
    PeerCallError,
    forbidden,
)
from ..peering.interfaces import UNSET_MODEL_BYTES, Health, PeerHandler, SizeLimits, Traffic
from ..peering.messages import (
    CROSS_LOSS,
    PUSH_GRADIENT,
    ComputeReply,
    ComputeRequest,
    LocalSnapshot,
    NodeInfo,
    SnapshotHeader,
    Welcome,
)
from ..wire.codec import Groups, WireError
from .gate import Gate, refusal_of

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")

HOST = "inproc"
_KINDS = (INVALID, REFUSED, UNKNOWN_PEER, NOT_CACHED, UNAVAILABLE, EXHAUSTED, PRIVACY_BUDGET, FORBIDDEN)


def nbytes(groups: Groups | None) -> int:
    return sum(t.numel() * t.element_size() for g in (groups or {}).values() for t in g.values())


def _own(msg: Any) -> Any:
    """A message as a receiver may keep it: messages are frozen, but a ``NodeInfo``'s labels are a
    dict (in a handshake and its answer)."""
    if isinstance(msg, NodeInfo):
        return replace(msg, labels=dict(msg.labels))
    if isinstance(msg, Welcome):
        return Welcome(_own(msg.node), tuple(msg.peers))
    return msg


def _clone(groups: Groups) -> Groups:
    return {g: {k: t.detach().clone() for k, t in ts.items()} for g, ts in groups.items()}


def _call_error(e: Exception, kind: str) -> PeerCallError:
    """What the caller sees of an exception raised by the peer's handler (as gRPC maps it)."""
    if isinstance(e, PeerCallError):
        return e
    refusal = refusal_of(e)
    if refusal is not None:
        return PeerCallError(refusal.kind if refusal.kind in _KINDS else INVALID, refusal.message)
    return PeerCallError(UNAVAILABLE, f"{kind} failed at the peer: {type(e).__name__}: {e}")


@dataclass
class _Served:
    """One node's served side as the switchboard holds it: its gate (handler and limits)."""

    gate: Gate
    traffic: Traffic
    stopped: asyncio.Future  # resolved when the node stops serving: in-flight calls fail

    @property
    def node_id(self) -> str:
        return self.gate.node_id


class _Caller:
    """The caller of an in-process call (``gate.Caller``): the node its client was opened for —
    the mTLS check of the gRPC server, here by construction."""

    __slots__ = ("node_id",)

    def __init__(self, node_id: str):
        self.node_id = node_id

    def vouch(self, claimed: str, what: str) -> str:
        if claimed != self.node_id:
            raise forbidden(f"{what}: claims to be node {claimed!r}, but the caller is {self.node_id!r}")
        return claimed


class Serving:
    """The node's serving flag (``peering.interfaces.Health``): in one process nobody runs gRPC
    health checks; the flag is kept for ``/status`` and tests."""

    def __init__(self) -> None:
        self.serving = True

    async def set(self, serving: bool) -> None:
        self.serving = serving


class InProcNetwork:
    """The switchboard of one process (one event loop)."""

    def __init__(self, *, share_snapshots: bool = True):
        self.share_snapshots = share_snapshots
        self._served: dict[str, _Served] = {}
        self._next = 0
        # published snapshot -> the tensors' version counters when first handed out
        self._seals: weakref.WeakKeyDictionary[LocalSnapshot, tuple[int, ...]] = weakref.WeakKeyDictionary()

    def transport(
        self,
        *,
        listen: str | None = None,
        timeout_s: float = 30.0,
        delay_ms: float = 0.0,
        max_model_bytes: int | None = None,
        max_gossip_bytes: int = 1 << 20,
        limits: SizeLimits | None = None,
    ) -> InProcTransport:
        """``limits``: the node's ``SizeLimits`` where another transport shares them (routing);
        else one of ``max_model_bytes`` and ``max_gossip_bytes``."""
        if limits is None:
            limits = SizeLimits(max_model_bytes or UNSET_MODEL_BYTES, max_gossip_bytes)
        return InProcTransport(self, listen=listen, timeout_s=timeout_s, delay_ms=delay_ms, limits=limits)

    def transport_for(self, cfg: Any) -> InProcTransport:
        """A node's transport from its ``NodeConfig`` (listen address, timeout, limits, delay)."""
        return self.transport(
            listen=cfg.listen,
            timeout_s=cfg.request_timeout_s,
            delay_ms=cfg.delay_ms,
            max_model_bytes=cfg.max_model_bytes,
            max_gossip_bytes=cfg.max_gossip_bytes,
        )

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
            raise WireError(
                f"snapshot v{snap.version} of {snap.node_id} was modified in place after it was "
                f"handed out (in-process snapshots are shared and read-only for receivers)"
            )
        return {g: dict(ts) for g, ts in snap.groups.items()}  # the tensors shared, the dicts the puller's own


@dataclass
class InProcServer:
    """A node served on the switchboard (``peering.interfaces.PeerServer``)."""

    address: str
    network: InProcNetwork
    served: _Served

    async def stop(self) -> None:
        self.network._unbind(self.address, self.served)


class InProcTransport:
    """One node's in-process transport (``peering.interfaces.TransportFactory``). No credentials:
    ``identity`` is None, ``mtls`` False."""

    def __init__(
        self, network: InProcNetwork, *, listen: str | None, timeout_s: float, delay_ms: float, limits: SizeLimits
    ):
        self.network, self.listen = network, listen
        self.timeout_s, self.delay_ms = timeout_s, delay_ms
        self.limits = limits  # set once by the node; its served side and clients read it
        self.identity: str | None = None
        self.mtls = False
        self.health: Health = Serving()

    def connect(self, node_id: str, traffic: Traffic) -> InProcClient:
        return InProcClient(
            self.network, node_id, traffic, timeout_s=self.timeout_s, delay_ms=self.delay_ms, limits=self.limits
        )

    def bind(self, handler: PeerHandler, traffic: Traffic, address: str | None) -> InProcServer:
        """Serve ``handler`` on the switchboard at ``address`` (None: the next free one)."""
        served = _Served(Gate(handler, self.limits), traffic, asyncio.get_running_loop().create_future())
        return InProcServer(self.network._bind(address, served), self.network, served)

    async def serve(self, handler: PeerHandler, traffic: Traffic) -> InProcServer:
        host, _, port = (self.listen or "").rpartition(":")
        return self.bind(handler, traffic, self.listen if host == HOST and port.isdigit() and int(port) > 0 else None)


class InProcClient(UnaryCalls):
    """The calling side (``peering.interfaces.PeerTransport``): addresses served in this process
    are called in memory, any other fails (``routing.RoutingClient`` sends those over gRPC).
    Every call is made as ``node_id``, the node this client was opened for."""

    def __init__(
        self,
        network: InProcNetwork,
        node_id: str,
        traffic: Traffic,
        *,
        timeout_s: float,
        delay_ms: float = 0.0,
        limits: SizeLimits | None = None,
    ):
        self.network, self.node_id, self.traffic = network, node_id, traffic
        self.timeout_s = timeout_s
        self.delay_s = delay_ms / 1000.0  # emulated one-way link latency (testbed)
        self.limits = limits if limits is not None else SizeLimits()
        self.me = _Caller(node_id)
        self.evicted = 0  # no connections to close

    def channels(self) -> int:
        """Connections held open: none in memory."""
        return 0

    # --- routing and the two ways of calling a gate ---
    def _route(self, address: str, expected: str | None) -> _Served:
        """The node served at ``address`` in this process; with ``expected``, it must be that
        node (as TLS refuses another certificate at the address)."""
        peer = self.network.lookup(address)
        if peer is None:
            raise PeerCallError(UNAVAILABLE, f"no node serves {address} in this process")
        if expected is not None and peer.node_id != expected:
            raise PeerCallError(UNAVAILABLE, f"{address} is node {peer.node_id!r}, not the expected {expected!r}")
        return peer

    async def _link(self) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # the emulated wire delay itself, not a wait for state

    async def _sync(self, peer: _Served, address: str, kind: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """A call the handler answers at once (membership): no task of its own."""
        if peer.stopped.done():
            raise PeerCallError(UNAVAILABLE, f"{address} stopped serving")
        t0 = time.perf_counter()
        try:
            return await make()
        except Exception as e:
            raise self._refused(e, kind, address) from None
        finally:
            peer.traffic.latency(kind, time.perf_counter() - t0, "server")

    async def _async(
        self, peer: _Served, address: str, kind: str, make: Callable[[], Awaitable[Any]], timeout: float
    ) -> Any:
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
        if refusal_of(e) is not None:
            log.warning("refused %s at %s: %s", kind, address, err.message)
        elif not isinstance(e, PeerCallError):
            log.error("%s at %s failed", kind, address, exc_info=e)
        return err

    def _timed(self, kind: str, t0: float) -> None:
        self.traffic.latency(kind, time.perf_counter() - t0, "client")

    # --- the unary calls (peering/api.py): one path for all; call/the named ones are UnaryCalls' ---
    async def send(
        self, rpc: Unary[Req, Rep], address: str, request: Req, timeout: float | None = None, *, peer: str | None = None
    ) -> Rep:
        served = self._route(address, None if rpc is HANDSHAKE else peer)
        t0 = time.perf_counter()
        await self._link()
        request = _own(request)  # the receiver's own copy (frozen messages; a NodeInfo's labels)

        async def answer() -> Rep:
            return await served.gate.unary(rpc, self.me, request)

        if rpc.waits:  # (an indirect probe pings its target itself)
            reply = await self._async(served, address, rpc.kind, answer, timeout or self.timeout_s)
        else:  # the handler answers at once
            reply = await self._sync(served, address, rpc.kind, answer)
        size, back = rpc.payload(request), rpc.payload(reply)
        served.traffic.record(rpc.kind, received=size, sent=back)
        self.traffic.record(rpc.kind, sent=size, received=back)
        self._timed(rpc.kind, t0)
        return _own(reply)

    # --- snapshots ---
    async def get_snapshot(
        self,
        address: str,
        requester: str,
        have_version: int = 0,
        *,
        min_round: int = 0,
        wait_s: float = 0.0,
        timeout: float | None = None,
        peer: str | None = None,
        lazy: bool = False,  # (nothing is encoded in memory: the tensors are handed over as they are)
    ) -> tuple[SnapshotHeader, Groups | None]:
        served = self._route(address, peer)
        t0 = time.perf_counter()
        await self._link()

        async def answer() -> LocalSnapshot:
            with contextlib.ExitStack() as slot:  # admitted while it waits for a round
                who = served.gate.requester(self.me, requester)
                snap = await served.gate.snapshot(who, min_round, wait_s, slot)
                return await snap.ready()  # encoded off the loop; its groups the zero-copy views

        snap: LocalSnapshot = await self._async(served, address, "snapshot", answer, timeout or self.timeout_s)
        unchanged = have_version > 0 and have_version == snap.version
        groups = None if unchanged else self.network.hand_out(snap)  # a modified one: WireError here
        size = nbytes(groups)
        if size > self.limits.max_model_bytes:
            raise WireError(
                f"snapshot of {snap.node_id}: payload of {size} bytes exceeds the limit of "
                f"{self.limits.max_model_bytes}"
            )
        served.traffic.record("snapshot", sent=size)
        self.traffic.record("snapshot", received=size)
        self._timed("snapshot", t0)
        return snap.header(unchanged), groups

    # --- compute requests ---
    async def compute(
        self, address: str, request: ComputeRequest, timeout: float | None = None, *, peer: str | None = None
    ) -> ComputeReply:
        served = self._route(address, peer)
        kind = request.kind
        check_compute_kind(kind)
        t0 = time.perf_counter()
        await self._link()
        # what the wire would carry: a reference instead of the model; the receiver's own dicts
        groups = None if request.ref is not None or request.groups is None else request.groups
        if groups is not None:
            groups = _clone(groups) if kind == PUSH_GRADIENT else {g: dict(ts) for g, ts in groups.items()}
        req = replace(request, groups=groups)
        size = nbytes(groups)

        async def answer() -> ComputeReply:
            with contextlib.ExitStack() as slot:
                return await served.gate.compute(served.gate.admit_compute(self.me, req, size, slot))

        reply: ComputeReply = await self._async(served, address, kind, answer, timeout or self.timeout_s)
        if kind == CROSS_LOSS:
            out = ComputeReply(loss=float(reply.loss), samples=int(reply.samples))
        elif kind == PUSH_GRADIENT:
            out = ComputeReply(accepted=bool(reply.accepted), message=str(reply.message))
        else:
            out = ComputeReply(
                loss=float(reply.loss),
                samples=int(reply.samples),
                grad=reply.grad,
                inner_product=float(reply.inner_product),
            )
        back = nbytes(out.grad)
        if back > self.limits.max_model_bytes:
            raise WireError(
                f"gradient from {address}: payload of {back} bytes exceeds the limit of {self.limits.max_model_bytes}"
            )
        served.traffic.record(kind, received=size, sent=back)
        self.traffic.record(kind, sent=size, received=back)
        self._timed(kind, t0)
        return out

    async def forget(self, address: str) -> None:
        pass  # no per-address state in memory

    async def close(self) -> None:
        pass
