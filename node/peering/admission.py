"""Bounded work per peer: what one authenticated caller may cost this node.

Every compute or bulk request (cross-loss, cross-gradient, gradient push, snapshot, gossip) passes
``Admission.admit(peer, kind)`` before its payload is read, keyed by the caller's *authenticated*
node id (the transport checked the certificate). Three limits, each refused with an ``exhausted``
refusal naming it:

- requests: a token bucket of ``requests_per_s`` (burst ``request_burst``) per peer;
- concurrency: at most ``max_concurrent`` of the peer's requests in flight;
- compute: a token bucket in *seconds of compute on my data*, refilled at ``compute_share`` per
  second (burst ``compute_burst_s``). A request is admitted while the peer's bucket is positive
  and charged afterwards with the CPU time it really took (``charge``; the worker thread's
  ``time.thread_time``, which is all of it with the default one torch thread), so the budget holds
  whatever the model costs — a 30 ms CNN gradient and a 2 ms MLP one alike — and a request that
  only waited (for the CPU, a lock, a warm-up) costs its peer nothing.

It lives here, in peering, rather than in the gRPC servicer: it is policy about peers (who gets
how much of this node), keyed by a domain identity, and any transport (the in-process one too)
gets the same budget by calling it. The transport keeps what is about its own wire: message
sizes, stream deadlines, the global cap on calls in flight."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from .api import COMPUTE
from .errors import exhausted

COMPUTE_KINDS = tuple(COMPUTE)  # billed in compute seconds too
MAX_TRACKED_PEERS = 4096  # budgets kept; the least recently seen are forgotten first


class Limits(Protocol):
    requests_per_s: float
    request_burst: float
    compute_share: float
    compute_burst_s: float
    max_concurrent: int


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; ``charge`` may take it below zero (a debt the
    peer pays off before its next admission)."""

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.t = burst, now

    def level(self, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        return self.tokens

    def take(self, now: float, n: float = 1.0) -> bool:
        if self.level(now) < n:
            return False
        self.tokens -= n
        return True

    def charge(self, now: float, n: float) -> None:
        self.level(now)
        self.tokens -= n

    def wait_s(self, now: float, n: float) -> float:
        return max(0.0, (n - self.level(now)) / self.rate)


@dataclass
class PeerBudget:
    requests: TokenBucket
    compute: TokenBucket
    in_flight: int = 0
    refused: int = 0
    compute_s: float = 0.0  # compute this peer has used in total (for /status and tests)
    admitted: dict[str, int] = field(default_factory=dict)


class Admission:
    def __init__(
        self,
        limits: Limits,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str, str], None] | None = None,
    ):
        self.limits = limits
        self.clock = clock
        self.on_refused = on_refused or (lambda peer, why: None)
        self._budgets: OrderedDict[str, PeerBudget] = OrderedDict()

    def budget(self, peer: str) -> PeerBudget:
        b = self._budgets.get(peer)
        if b is None:
            now, lim = self.clock(), self.limits
            b = PeerBudget(
                TokenBucket(lim.requests_per_s, lim.request_burst, now),
                TokenBucket(lim.compute_share, lim.compute_burst_s, now),
            )
            self._budgets[peer] = b
            while len(self._budgets) > MAX_TRACKED_PEERS:
                oldest = next(iter(self._budgets))
                if self._budgets[oldest].in_flight:
                    break
                del self._budgets[oldest]
        self._budgets.move_to_end(peer)
        return b

    def _refuse(self, peer: str, b: PeerBudget, why: str, message: str):
        b.refused += 1
        self.on_refused(peer, why)
        return exhausted(f"{peer}: {message}")

    @contextmanager
    def admit(self, peer: str, kind: str) -> Iterator[None]:
        """Hold one of ``peer``'s slots for a ``kind`` request, or raise an ``exhausted`` refusal."""
        b, now, lim = self.budget(peer), self.clock(), self.limits
        if b.in_flight >= lim.max_concurrent:
            raise self._refuse(
                peer,
                b,
                "concurrency",
                f"{b.in_flight} requests already in flight, the limit is {lim.max_concurrent} per peer",
            )
        if kind in COMPUTE_KINDS and b.compute.level(now) <= 0:
            raise self._refuse(
                peer,
                b,
                "compute",
                f"compute budget used up ({lim.compute_share:g} s per second, burst "
                f"{lim.compute_burst_s:g} s); retry in {b.compute.wait_s(now, 1e-3):.2f} s",
            )
        if not b.requests.take(now):
            raise self._refuse(
                peer,
                b,
                "rate",
                f"over {lim.requests_per_s:g} requests per second (burst {lim.request_burst:g}); "
                f"retry in {b.requests.wait_s(now, 1):.2f} s",
            )
        b.in_flight += 1
        b.admitted[kind] = b.admitted.get(kind, 0) + 1
        try:
            yield
        finally:
            b.in_flight -= 1

    def retune(self, limits: Limits) -> None:
        """New limits, live (a SIGHUP reload): every peer's buckets take the new rates and bursts
        and keep what they hold (capped at the new burst), so a reload hands nobody a fresh burst."""
        self.limits = limits
        now = self.clock()
        for b in self._budgets.values():
            for bucket, rate, burst in (
                (b.requests, limits.requests_per_s, limits.request_burst),
                (b.compute, limits.compute_share, limits.compute_burst_s),
            ):
                bucket.level(now)
                bucket.rate, bucket.burst = rate, burst
                bucket.tokens = min(bucket.tokens, burst)

    def charge(self, peer: str, seconds: float) -> None:
        """Bill ``peer`` for compute it caused (measured by whoever ran it)."""
        b = self.budget(peer)
        b.compute.charge(self.clock(), seconds)
        b.compute_s += seconds

    def view(self, last: int = 32) -> dict[str, dict[str, float]]:
        """The most recently active peers' use: compute seconds billed, requests refused, in flight."""
        recent = list(self._budgets.items())[-last:]
        return {
            p: {"compute_s": round(b.compute_s, 3), "refused": b.refused, "in_flight": b.in_flight} for p, b in recent
        }
