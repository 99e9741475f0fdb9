"""False deaths under load (issue 32), over the in-memory membership harness of
``test_membership.py`` (real asyncio timing, short periods).

In 100 real daemons with the default SWIM timing, 886 false deaths were all declared by the 31
nodes that started last. By then the rest of the network ran membership on its partial views and
forgot whoever was not in them; the late starters, still on full membership, were refused ("unknown
peer") by most members they probed, counted each refusal as no answer, and their helpers (other
late starters, also refused) answered with nacks: each refused member was suspected, could not
hear the suspicion (it refuses the accuser) and so never refuted it, and died (the handshake
that would have revived it timed out: TLS handshakes under a load of 400). Each death kept the
late starter under the partial-view threshold, so it went on doing it. A refusal is an answer: the
member is alive."""

from __future__ import annotations

import asyncio
import time

from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.loop_lag import LoopLag
from coterie.node.peering.messages import ALIVE, DEAD, SUSPECT, MemberUpdate

from .test_membership import PERIOD, MemNet, _member, _stop, _until


class _HandshakesTimeOut:
    def __init__(self, transport):
        self.transport = transport

    def __getattr__(self, name):
        return getattr(self.transport, name)

    async def handshake(self, address, info, timeout):
        await asyncio.sleep(0)
        raise PeerCallError("unavailable", "Deadline Exceeded")


def test_members_that_forgot_a_late_starter_are_not_buried_by_it():
    async def go():
        net = MemNet()
        members = [_member(net, i, []) for i in range(5)]
        early, late = members[:3], members[3:]  # early: on their views, they forget the late two
        for m in members:
            for o in members:
                if o is not m and (m in late or o in early):
                    m.peers.upsert(o.node_id, o.state.info().address)
        strangers = {m.node_id for m in late}

        def forgetting(m):
            tick = m.tick

            def tick_and_forget() -> None:  # as a member past the threshold prunes its table
                tick()
                for nid in strangers:
                    m.peers.forget(nid)

            m.tick = tick_and_forget

        for m in early:
            forgetting(m)
        for m in late:  # and their handshakes time out, as TLS handshakes did under a load of 400
            m.handshakes.transport = _HandshakesTimeOut(m.handshakes.transport)
        deaths: list[tuple[str, str]] = []
        for m in late:
            m.peers.listeners.append(
                lambda nid, old, new, m=m: deaths.append((m.node_id, nid)) if new == DEAD else None
            )
        tasks = [asyncio.create_task(m.run()) for m in members]
        try:
            # every late starter probes each early member many times over (3 of 4 targets)
            await _until(lambda: all(m.state.stats["probes"] >= 40 for m in late), 30, "40 probes per late starter")
            # the suspicion timeout is 1-6 s here: longer than that, and no one is suspected at all
            await asyncio.sleep(6.5 - 40 * PERIOD)
            assert deaths == [], f"false deaths (declarer, victim): {deaths}"
            for m in late:
                assert {m.peers.records[e.node_id].state for e in early} == {ALIVE}, m.node_id
                assert m.state.stats["suspected"] == 0, (m.node_id, m.state.stats)
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_a_suspicion_clock_stands_still_while_the_declarers_loop_is_blocked_within_a_bound():
    """The loop blocked 40 ms in every 50 (shorter than a period each time, so the old check —
    a period's tick late by more than a period — never saw it): a suspicion of a killed member
    runs on the time this node's loop actually ran, up to its own timeout of pause, so it is
    still declared dead within twice the longest suspicion timeout (the stated bound). Before, the clock ran in
    wall time through the stalls: refutations the node could not hear counted against the suspect."""

    async def go():
        net = MemNet()
        members = [_member(net, i, [] if i == 0 else ["a0"]) for i in range(4)]
        lag = LoopLag(interval_s=0.01)
        for m in members:
            m.probes.loop_lag = lag
        tasks = [asyncio.create_task(lag.run())] + [asyncio.create_task(m.run()) for m in members]
        suspected: dict[str, float] = {}
        dead: dict[str, float] = {}
        timeouts: dict[str, float] = {}

        def watch(m):
            def on(nid: str, old: str, new: str) -> None:
                if nid != "n3":
                    return
                if new == SUSPECT:
                    suspected.setdefault(m.node_id, time.monotonic())
                if new == DEAD:
                    dead.setdefault(m.node_id, time.monotonic())

            return on

        async def block() -> None:
            while True:
                time.sleep(0.04)  # the loop itself blocked (training on it, a starved process)
                await asyncio.sleep(0.01)

        try:
            await _until(lambda: all(len(m.peers.alive()) == 3 for m in members), 20, "full membership")
            survivors = members[:3]
            for m in survivors:
                m.peers.listeners.append(watch(m))
            net.frozen.add("a3")  # killed: no answers, no refutation
            tasks.append(asyncio.create_task(block()))
            t_kill = time.monotonic()

            def all_dead() -> bool:
                for m in survivors:  # the timeout each table held for it last
                    rec = m.peers.records["n3"]
                    if rec.state == SUSPECT:
                        timeouts[m.node_id] = m.peers.suspicion_timeout(rec)
                return len(dead) == len(survivors)

            await _until(all_dead, 60, "n3 declared dead by every survivor")
            for m in survivors:
                took, timeout = dead[m.node_id] - suspected[m.node_id], timeouts[m.node_id]
                # 80% of the wall time stalled: the clock stood still up to its own timeout
                assert took >= 1.6 * timeout, (m.node_id, took, timeout)
                # the bound: suspected within a round-robin pass of periods and probe budgets each
                # stretched up to 9x (Lifeguard), run at 1/5 speed; then dead within twice the longest
                # suspicion timeout (one accuser alone: suspicion_max_mult x the base)
                longest = m.peers.suspicion_s * m.peers.suspicion_max_mult
                assert suspected[m.node_id] - t_kill <= 15.0, (m.node_id, suspected[m.node_id] - t_kill)
                assert took <= 2 * longest + 0.5, (m.node_id, took, longest)
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_local_health_stretches_a_slow_nodes_probes_and_recovers():
    """Lifeguard's Local Health Multiplier: a node whose probes are spoiled by its own stalls, or
    which finds itself suspected, probes less often and waits longer (up to 9x); answered probes
    bring it back."""

    async def go():
        net = MemNet()
        members = [_member(net, i, [] if i == 0 else ["a0"]) for i in range(3)]
        tasks = [asyncio.create_task(m.run()) for m in members]
        try:
            await _until(lambda: all(len(m.peers.alive()) == 2 for m in members), 20, "full membership")
            await _stop(tasks)
            me = members[0]
            assert me.state.health.score == 0

            class Stalled:
                def worst_since(self, t):
                    return 5.0

            me.probes.loop_lag = Stalled()
            net.frozen.add("a1")
            t0 = time.monotonic()
            assert await me.probes.probe("n1") is None  # inconclusive: this node stalled
            healthy_took = time.monotonic() - t0
            assert me.state.health.score == 1
            for _ in range(3):
                await me.probes.probe("n1")
            assert me.state.health.score == 4
            t0 = time.monotonic()
            await me.probes.probe("n1")
            assert time.monotonic() - t0 > 3 * healthy_took  # waited 5x the budget, not 1x
            # suspected itself: refuting raises it too
            inc = me.state.incarnation
            me.gossip.merge([MemberUpdate("n0", "a0", inc, SUSPECT, "n2")], source="n2")
            assert me.state.incarnation == inc + 1 and me.state.health.score == 6
            net.frozen.discard("a1")
            me.probes.loop_lag = None
            for _ in range(6):
                assert await me.probes.probe("n1") is True
            assert me.state.health.score == 0
        finally:
            await _stop(tasks)

    asyncio.run(go())
