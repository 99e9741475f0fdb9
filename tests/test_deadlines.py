"""Deadlines that follow the peer, and a round's exchange phase that goes on with the peers that
answered: ``Deadlines`` itself, then ``NodeNetwork`` over a transport whose peers answer, stall
or freeze (real asyncio timing)."""

from __future__ import annotations

import asyncio
import time

import torch

from coterie.node.peering.calls import PeerCalls
from coterie.node.peering.deadlines import Deadlines, quantile
from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.inbox import PushInbox
from coterie.node.peering.messages import SUSPECT, SnapshotHeader
from coterie.node.peering.network import NetworkSettings, NodeNetwork
from coterie.node.peering.peer_table import PeerTable
from coterie.node.peering.problems import ProblemLog
from coterie.node.peering.snapshots import SnapshotCache
from coterie.node.strategies.base import gather_bounded

SPEC = {"w": ((4,), "float32")}


def test_deadline_follows_each_peers_latency_within_floor_and_cap():
    d = Deadlines(30.0, floor_s=0.5, mult=4.0)
    assert d.timeout("a", "snapshot") == 30.0  # nothing known yet: the cap
    for _ in range(20):
        d.observe("a", "snapshot", 0.01)
        d.observe("b", "snapshot", 2.0)
    assert d.timeout("a", "snapshot") == 0.5  # 4 × 10 ms is under the floor
    assert d.timeout("b", "snapshot") == 8.0  # a slow but steady peer keeps a longer deadline
    assert 0.5 <= d.timeout("c", "snapshot") <= 8.0  # a new peer: every peer's history
    for _ in range(20):
        d.observe("b", "snapshot", 60.0)
    assert d.timeout("b", "snapshot") == 30.0  # never above the cap
    assert quantile([1, 2, 3, 4], 0.5) == 2 and quantile([5], 0.99) == 5


class FakeTransport:
    """Peers by address: ``delay`` seconds to answer, or ``None`` = frozen (never answers)."""

    def __init__(self, delays: dict[str, float | None]):
        self.delays = delays
        self.timeouts: list[tuple[str, float]] = []

    async def get_snapshot(
        self, address, requester, have_version=0, *, min_round=0, wait_s=0.0, timeout=None, peer=None
    ):
        self.timeouts.append((address, timeout))
        delay = self.delays[address]
        if delay is None or delay > timeout:
            await asyncio.sleep(timeout)
            raise PeerCallError("unavailable", "Deadline Exceeded")
        await asyncio.sleep(delay)
        return SnapshotHeader(address, 1, 1, ""), {"params": {"w": torch.ones(4)}}


async def _in_flight(net, address: str, timeout: float = 5.0) -> None:
    """Wait until a call to ``address`` has reached the transport (not a fixed sleep)."""

    async def reached():
        while not any(a == address for a, _ in net.transport.timeouts):
            await asyncio.sleep(0.005)

    await asyncio.wait_for(reached(), timeout)


def _network(delays, **kw):
    table = PeerTable("me", 1.0, 2.0)
    for a in delays:
        table.upsert(a, a)
    hints = []
    calls = PeerCalls(
        table, Deadlines(30.0, floor_s=0.2, mult=4.0), request_timeout_s=30.0, on_call_failed=hints.append, **kw
    )
    # no private data released here
    net = NodeNetwork(
        NetworkSettings("me", SPEC),
        FakeTransport(delays),
        calls,
        SnapshotCache(),
        PushInbox(),
        lambda: None,
        None,
        ProblemLog(),
    )
    return net, table, hints


def test_a_frozen_peer_costs_a_round_a_few_times_the_usual_latency_not_the_request_timeout():
    async def go():
        net, table, hints = _network({"p1": 0.01, "p2": 0.01, "p3": 0.01})
        for _ in range(6):  # learn the usual latency
            with net.exchange_phase():
                got = await gather_bounded({p: net.pull(p) for p in table.alive()})
            assert set(got) == {"p1", "p2", "p3"}
        net.transport.delays["p2"] = None  # SIGSTOP
        t0 = time.monotonic()
        with net.exchange_phase() as phase:
            got = await gather_bounded({p: net.pull(p) for p in table.alive()})
        took = time.monotonic() - t0
        assert set(got) == {"p1", "p3"}  # the round goes on with the peers that answered
        assert took < 2.0, took  # the floor (0.2 s), far from the 30 s request timeout
        assert phase["failed"] == 1 and hints == ["p2"]  # membership is asked to probe it now
        # until it shows a sign of life it is neither offered for sampling nor waited for again
        assert net.peers() == ["p1", "p3"]
        t0 = time.monotonic()
        assert await net.pull("p2") is None and time.monotonic() - t0 < 0.1
        table.seen("p2")  # e.g. membership's probe got an ack
        assert net.peers() == ["p1", "p2", "p3"]

    asyncio.run(go())


def test_the_exchange_phase_has_its_own_deadline():
    async def go():
        net, table, _ = _network({"fast": 0.01, "slow": 5.0}, exchange_timeout_s=0.3)
        t0 = time.monotonic()
        with net.exchange_phase() as phase:
            got = await gather_bounded({p: net.pull(p) for p in table.alive()})
            late = await net.pull("fast")  # the phase is over: not even tried
        assert set(got) == {"fast"} and late is None and phase["skipped"] == 1
        assert time.monotonic() - t0 < 2.0
        assert all(t <= 0.31 for _, t in net.transport.timeouts)

    asyncio.run(go())


def test_adaptive_exchange_budget_follows_recent_phases():
    net, _, _ = _network({"a": 0.01})
    assert net.calls.exchange_budget() == 30.0  # nothing known: the request timeout
    net.calls._phases.extend([0.1] * 10)
    assert net.calls.exchange_budget() == 0.4  # 4 × p90, at least twice the floor (0.4)
    net.calls._phases.extend([3.0] * 10)
    assert net.calls.exchange_budget() == 12.0


def test_a_call_to_a_peer_that_turns_suspect_is_abandoned_at_once():
    async def go():
        net, table, _ = _network({"a": 0.01, "frozen": None})
        t0 = time.monotonic()
        pull = asyncio.ensure_future(net.pull("frozen"))  # no history: the 30 s cap applies
        await _in_flight(net, "frozen")
        table.suspect("frozen")  # membership's probe failed
        assert await pull is None
        assert time.monotonic() - t0 < 2.0
        assert table.records["frozen"].state == SUSPECT
        assert await net.pull("frozen") is None  # suspect peers are not called at all
        assert len(net.transport.timeouts) == 1

    asyncio.run(go())


def test_outer_cancellation_still_cancels():
    async def go():
        net, _, _ = _network({"frozen": None})
        task = asyncio.ensure_future(net.pull("frozen"))
        await _in_flight(net, "frozen")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return
        raise AssertionError("a cancelled round must stay cancelled")

    asyncio.run(go())


def test_a_call_whose_transport_ignores_its_timeout_still_ends_at_its_deadline():
    """The transport is meant to end a call at the timeout it is given; one that does not (a
    stream write blocked for good held a daemon's round for minutes in CI) is cut at the deadline
    plus a margin, and the peer is reported as not answering."""

    async def go():
        table = PeerTable("me", 1.0, 2.0)
        table.upsert("stuck", "stuck")
        failed: list[str] = []
        calls = PeerCalls(
            table, Deadlines(0.4, floor_s=0.2, mult=4.0), request_timeout_s=0.4, on_call_failed=failed.append
        )
        cancelled = asyncio.Event()

        async def ignores_timeout(timeout: float) -> None:
            try:
                await asyncio.Event().wait()  # never answers, never times out by itself
            finally:
                cancelled.set()

        t0 = time.monotonic()
        try:
            await asyncio.wait_for(calls.call("stuck", "snapshot", ignores_timeout), 10)
        except PeerCallError as e:
            assert "no answer" in str(e) and "stuck" in str(e)
        else:
            raise AssertionError("the call returned")
        assert time.monotonic() - t0 < 3.0 and failed == ["stuck"]
        await asyncio.wait_for(cancelled.wait(), 5)  # and the call itself was cancelled

    asyncio.run(go())


def test_a_caller_that_gives_up_cancels_its_call():
    async def go():
        table = PeerTable("me", 1.0, 2.0)
        table.upsert("slow", "slow")
        calls = PeerCalls(table, Deadlines(30.0, floor_s=0.2, mult=4.0), request_timeout_s=30.0)
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def slow(timeout: float) -> None:
            started.set()
            try:
                await asyncio.sleep(timeout)
            finally:
                cancelled.set()

        caller = asyncio.ensure_future(calls.call("slow", "snapshot", slow))
        await asyncio.wait_for(started.wait(), 5)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        await asyncio.wait_for(cancelled.wait(), 5)

    asyncio.run(go())


def test_a_call_cancelled_under_its_caller_is_a_failed_call_not_a_cancelled_caller():
    """grpc.aio raises CancelledError from a call another coroutine cancelled (a pull session
    closed meanwhile); leaked into the round, it once ended a daemon's round loop silently."""

    async def go():
        table = PeerTable("me", 1.0, 2.0)
        table.upsert("p", "p")
        calls = PeerCalls(table, Deadlines(30.0, floor_s=0.2, mult=4.0), request_timeout_s=30.0)

        async def cancelled_under_us(timeout: float) -> None:
            raise asyncio.CancelledError()

        try:
            await calls.call("p", "snapshot", cancelled_under_us)
        except PeerCallError as e:
            assert "cancelled" in str(e)
        else:
            raise AssertionError("the call returned")
        assert not asyncio.current_task().cancelling()

    asyncio.run(go())
