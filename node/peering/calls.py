"""Per-peer deadlines of the requesting side (``NodeNetwork``'s calls): each call runs under its
peer's deadline (``deadlines.Deadlines``: a multiple of that peer's recent latency for that kind
of call, capped by ``request_timeout_s``) and the round's exchange phase (``Phase``: one deadline
for all of a round's calls, counted from the first); a call to a peer that turns suspect or dead
meanwhile is abandoned at once; a call that times out asks membership to probe that peer now; a
call refused because the peer no longer knows this node (past the partial-view threshold tables
hold views, so a peer forgets whoever is in neither) is made once more after a handshake."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from .deadlines import Deadlines, Phase, quantile
from .errors import UNAVAILABLE, UNKNOWN_PEER, PeerCallError
from .peer_table import PeerTable

T = TypeVar("T")


class PeerCalls:
    def __init__(
        self,
        table: PeerTable,
        deadlines: Deadlines,
        *,
        request_timeout_s: float,
        exchange_timeout_s: float = 0.0,
        on_call_failed: Callable[[str], None] | None = None,
    ):
        self.table = table
        self.deadlines = deadlines
        self.request_timeout_s = request_timeout_s
        self.exchange_timeout_s = exchange_timeout_s  # 0: adaptive
        self.on_call_failed = on_call_failed or (lambda peer: None)
        self._inflight: dict[str, set[asyncio.Task]] = {}
        self._timed_out: dict[str, float] = {}  # peer -> when a call to it last timed out
        self._abandoned: set[asyncio.Task] = set()
        self._phases: deque[float] = deque(maxlen=32)  # recent exchange-phase durations
        self._phase: Phase | None = None
        # handshake ``peer`` again within a timeout (True: it knows this node now); None: a
        # refusal is final
        self.reintroduce: Callable[[str, float], Awaitable[bool]] | None = None
        # "unknown peer" refusals, and what came of them: the call made again after a handshake,
        # the handshake failing (the refusal stands), the call refused again after it
        self.reintroductions = {"retried": 0, "handshake_failed": 0, "refused_again": 0}

    def exchange_budget(self) -> float:
        """How long a round's exchange phase may last: ``exchange_timeout_s`` if set, else
        ``deadline_mult`` × the 90th percentile of recent phases (at least twice the deadline
        floor), capped by the request timeout."""
        cap = self.request_timeout_s
        if self.exchange_timeout_s:
            return min(self.exchange_timeout_s, cap)
        if len(self._phases) < 5:
            return cap
        d = self.deadlines
        return min(cap, max(2 * d.floor_s, d.mult * quantile(self._phases, 0.9)))

    @contextlib.contextmanager
    def exchange_phase(self) -> Iterator[Phase]:
        """Around a round: its peer calls share one deadline, counted from the first call."""
        self._phase = phase = Phase(self.exchange_budget())
        try:
            yield phase
        finally:
            self._phase = None
            took = phase.close()
            if took is not None:
                self._phases.append(took)

    def abandon(self, node_id: str) -> None:
        """``node_id`` turned suspect or dead: what is in flight to it is abandoned (the round
        goes on without it)."""
        for t in self._inflight.get(node_id, ()):
            self._abandoned.add(t)
            t.cancel()

    def responsive(self, peer: str) -> bool:
        """Known, and not timed out since it last showed a sign of life."""
        rec = self.table.records.get(peer)
        return rec is not None and self._timed_out.get(peer, float("-inf")) < rec.last_seen

    async def call(self, peer: str, kind: str, make: Callable[[float], Awaitable[T]], wait_s: float = 0.0) -> T:
        """``make(timeout)`` under this peer's deadline and the round's; abandoned if the peer
        turns suspect or dead meanwhile. Refused as unknown: a handshake, then once more (a
        peer's table past the threshold holds its views: between two pulls of a slow round it may
        have forgotten a puller that is in neither — issue 32, 100 daemons, run 6)."""
        try:
            return await self._call_once(peer, kind, make, wait_s)
        except PeerCallError as e:
            if e.kind != UNKNOWN_PEER or self.reintroduce is None:
                raise
            # the handshake gets the call's own budget: under load a TLS handshake takes seconds,
            # and membership's probe-sized timeout (2 s) then lost the peer for the round
            if not await self.reintroduce(peer, self.deadlines.timeout(peer, kind)):
                self.reintroductions["handshake_failed"] += 1
                raise
        self.reintroductions["retried"] += 1
        try:
            return await self._call_once(peer, kind, make, wait_s)
        except PeerCallError as e:
            if e.kind == UNKNOWN_PEER:
                self.reintroductions["refused_again"] += 1
            raise

    async def _call_once(self, peer: str, kind: str, make: Callable[[float], Awaitable[T]], wait_s: float) -> T:
        timeout = self.deadlines.timeout(peer, kind)
        phase = self._phase
        now = time.monotonic()
        if phase is not None:
            left = phase.begin(now)
            if left <= 0:
                phase.skipped += 1
                raise PeerCallError(UNAVAILABLE, f"the round's exchange phase ({phase.budget_s:.1f}s) is over")
            timeout = min(timeout, left)
        task = asyncio.ensure_future(make(timeout + wait_s))
        calls = self._inflight.setdefault(peer, set())
        calls.add(task)
        ok = False
        try:
            # the transport bounds each call by the timeout it is given; this bounds it whatever the
            # transport does (a stream write that never returns once held a round for minutes)
            guard = timeout + wait_s + max(1.0, 0.25 * timeout)
            done, _ = await asyncio.wait({task}, timeout=guard)
            if not done:
                task.cancel()
                if phase is not None:
                    phase.abandoned += 1
                raise PeerCallError(UNAVAILABLE, f"{kind} to {peer}: no answer in {guard:.1f}s (its deadline)")
            out = task.result()
            ok = True
            return out
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()  # the caller gave up: so does its call
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise  # this caller is being cancelled: so be it
            if phase is not None:
                phase.abandoned += 1
            if task in self._abandoned:
                rec = self.table.records.get(peer)
                raise PeerCallError(
                    UNAVAILABLE, f"{peer} turned {rec.state if rec else 'unknown'}: call abandoned"
                ) from None
            # the call was cancelled under us (grpc.aio raises CancelledError from a call another
            # coroutine cancelled, e.g. a pull session closed meanwhile): a failed call, never a
            # cancellation of the caller (it once ended a daemon's round loop without a word)
            raise PeerCallError(UNAVAILABLE, f"{kind} to {peer}: the call was cancelled") from None
        except PeerCallError as e:
            if e.kind == UNAVAILABLE:  # a timeout or refused connection: membership probes it now,
                self._timed_out[peer] = time.monotonic()  # and it is not called again until it answers
                self.on_call_failed(peer)
            raise
        finally:
            calls.discard(task)
            self._abandoned.discard(task)
            if not calls:
                self._inflight.pop(peer, None)
            end = time.monotonic()
            if ok and not wait_s:
                self.deadlines.observe(peer, kind, end - now)
            if phase is not None:
                phase.ended(now, end, ok)
