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

from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.messages import ALIVE, DEAD

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
            m.peers.listeners.append(lambda nid, old, new, m=m: deaths.append((m.node_id, nid)) if new == DEAD else None)
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
