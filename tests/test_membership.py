"""SWIM membership: the peer table's precedence rules, the bounded candidate set, the gossip
queue, and the protocol itself over an in-memory transport (real asyncio timing, short periods):
joining through one seed, detecting a silent member, refuting a false suspicion, coming back
after a stall, O(1) messages per node per period, and the peer-exchange flood."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from coterie.node.peering import peer_table as table_mod
from coterie.node.peering.errors import UNKNOWN_PEER, PeerCallError, Refusal
from coterie.node.peering.membership import Broadcasts, Candidates, Membership, Settings, full_membership
from coterie.node.peering.messages import ALIVE, DEAD, SUSPECT, MemberUpdate, NodeInfo, PeerEntry
from coterie.node.peering.peer_table import PeerTable
from coterie.node.peering.problems import ProblemLog


# ----------------------------------------------------------------------------- peer table rules
@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(table_mod.time, "monotonic", lambda: now[0])
    return now


def test_incarnation_precedence(clock):
    t = PeerTable("me", suspect_after_s=1, dead_after_s=5)
    t.upsert("a", "h:1")
    assert not t.apply(MemberUpdate("a", "h:1", 0, ALIVE))  # nothing new
    assert t.apply(MemberUpdate("a", "h:1", 0, SUSPECT)) and t.records["a"].state == SUSPECT
    assert not t.apply(MemberUpdate("a", "h:1", 0, ALIVE))  # same incarnation: suspicion stands
    assert t.apply(MemberUpdate("a", "h:1", 1, ALIVE)) and t.records["a"].state == ALIVE  # refuted
    assert not t.apply(MemberUpdate("a", "h:1", 0, DEAD))  # stale news
    assert t.apply(MemberUpdate("a", "h:1", 1, DEAD)) and t.records["a"].state == DEAD
    assert not t.apply(MemberUpdate("a", "h:1", 1, SUSPECT))  # dead beats suspect at one incarnation
    assert not t.apply(MemberUpdate("a", "h:9", 1, ALIVE))
    assert t.apply(MemberUpdate("a", "h:9", 2, ALIVE)) and t.records["a"].state == ALIVE
    assert t.records["a"].address == "h:1"  # gossip never moves an address: its handshake does
    assert not t.apply(MemberUpdate("stranger", "h:5", 9, ALIVE)) and "stranger" not in t.records


def test_suspicion_times_out_to_dead_and_first_hand_evidence_revives(clock):
    t = PeerTable("me", suspect_after_s=1, dead_after_s=5, suspicion_max_mult=1)
    seen = []
    t.listeners.append(lambda *tr: seen.append(tr))
    t.upsert("a", "h:1")
    t.upsert("b", "h:2")
    clock[0] += 100  # silence alone suspects nobody: only a failed probe does
    assert t.refresh() == [] and t.alive() == ["a", "b"]
    assert t.suspect("a") and not t.suspect("a")
    clock[0] += 4
    assert t.refresh() == []
    t.pause(3)  # this node stalled 3 s: the suspicion clock stood still meanwhile
    clock[0] += 2
    assert t.refresh() == []
    clock[0] += 2
    assert t.refresh() == [("a", SUSPECT, DEAD)]
    assert t.alive() == ["b"] and t.counts() == {ALIVE: 1, SUSPECT: 0, DEAD: 1}
    assert t.probe_targets() == ["b"]  # the dead are not probed
    t.seen("a", round=7, version=8, rtt_s=0.01, incarnation=3)
    assert t.records["a"].state == ALIVE and t.records["a"].round == 7 and t.records["a"].incarnation == 3
    assert seen == [("a", ALIVE, SUSPECT), ("a", SUSPECT, DEAD), ("a", DEAD, ALIVE)]


def test_independent_accusers_shorten_the_suspicion_timeout(clock):
    """Lifeguard: one accuser alone waits max_mult × the timeout, k more bring it to the base."""
    t = PeerTable("me", suspect_after_s=1, dead_after_s=5, suspicion_max_mult=6, confirmations=3)
    for p in "abcde":
        t.upsert(p, f"h:{p}")
    t.apply(MemberUpdate("a", "h:a", 0, SUSPECT, accuser="b"))
    rec = t.records["a"]
    timeouts = [t.suspicion_timeout(rec)]
    assert not t.apply(MemberUpdate("a", "h:a", 0, SUSPECT, accuser="b"))  # the same accuser again
    for accuser in "cd":
        assert t.apply(MemberUpdate("a", "h:a", 0, SUSPECT, accuser=accuser))  # news: passed on
        timeouts.append(t.suspicion_timeout(rec))
    t.suspect("a")
    timeouts.append(t.suspicion_timeout(rec))  # this node's own probe confirms it too
    assert timeouts[0] == 30 and timeouts[-1] == 5 and timeouts == sorted(timeouts, reverse=True)
    clock[0] += 5
    assert t.refresh() == [("a", SUSPECT, DEAD)]
    t.upsert("b", "h:b")
    assert t.suspect("b") and t.suspicion_timeout(t.records["b"]) == 30  # alone: 30 s to refute
    clock[0] += 29
    assert t.refresh() == []
    assert t.apply(MemberUpdate("b", "h:b", 1, ALIVE)) and t.records["b"].accusers == set()


def test_dead_members_get_reconnect_attempts_with_backoff(clock):
    t = PeerTable("me", 1, 2, reconnect_min_s=1, reconnect_max_s=8)
    t.load_json([{"node_id": "a", "address": "h:1", "labels": {"cluster": "1"}}])
    assert t.alive() == [] and t.records["a"].state == DEAD and t.records["a"].labels == {"cluster": "1"}
    assert [r.node_id for r in t.due_reconnects()] == ["a"]  # a restored peer is tried at once
    gaps = []
    for _ in range(6):
        t.reconnect_failed("a")
        gaps.append(t.records["a"].reconnect_at - clock[0])
        assert t.due_reconnects() == []
        clock[0] = t.records["a"].reconnect_at
        assert [r.node_id for r in t.due_reconnects()] == ["a"]
    assert gaps == [1, 2, 4, 8, 8, 8]
    t.upsert("a", "h:9")  # it came back (on a new port) and handshook us
    assert t.alive() == ["a"] and t.records["a"].address == "h:9"


# ----------------------------------------------------------------------------- candidates, gossip
def test_candidates_are_bounded_backed_off_and_forgotten(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    c = Candidates(max_total=10, max_per_source=4, attempts=2, forget_s=100, backoff_s=1)
    added = [c.add(f"10.0.0.1:{p}", source="flooder") for p in range(50)]
    assert sum(added) == 4 and c.dropped == 46  # one source fills at most its share
    for i in range(20):
        c.add(f"10.0.0.2:{i}", source=f"peer{i}")
    assert len(c) == 10  # the total bound
    c.add("seed:1", pinned=True)  # a configured bootstrap address always fits
    assert "seed:1" in c and len(c) == 11
    assert len(c.due(3)) == 3
    a = "10.0.0.1:0"
    assert not c.failed(a) and a in c and a not in {x.address for x in c.due(100)}  # backing off
    now[0] += 1.5
    assert a in {x.address for x in c.due(100)}
    assert c.failed(a) and a not in c  # second failure: forgotten
    assert not c.add(a, source="someone")  # and not taken up again for forget_s
    now[0] += 101
    c.discard("10.0.0.2:0")  # make room under the total bound
    assert c.add(a, source="someone")
    for _ in range(5):
        c.failed("seed:1")
    assert "seed:1" in c  # pinned: retried, never forgotten


def test_broadcasts_retransmit_a_bounded_number_of_times():
    b = Broadcasts(lambda: 3)
    for i in range(5):
        b.add(MemberUpdate(f"n{i}", "", 0, ALIVE))
    b.add(MemberUpdate("n0", "", 1, SUSPECT))  # newer news about n0 replaces the older
    sent = []
    while len(b):
        sent.append(b.take(2))
    assert all(len(m) <= 2 for m in sent)
    flat = [u for m in sent for u in m]
    assert len(flat) == 5 * 3
    assert [u for u in flat if u.node_id == "n0"] == [MemberUpdate("n0", "", 1, SUSPECT)] * 3


# ----------------------------------------------------------------------------- the protocol
class MemNet:
    """An in-memory PeerTransport: each address is a Membership; calls hop through the event
    loop. ``down``: refuses connections; ``frozen``: never answers (the caller's deadline fires)."""

    def __init__(self):
        self.nodes: dict[str, Membership] = {}
        self.down: set[str] = set()
        self.frozen: set[str] = set()
        self.calls: dict[str, int] = {}  # caller node -> calls made
        self.dials: dict[str, int] = {}  # address -> attempts

    def transport(self, me: str) -> MemTransport:
        return MemTransport(self, me)

    def address_of(self, node_id: str) -> str | None:
        return next((a for a, m in self.nodes.items() if m.node_id == node_id), None)


class MemTransport:
    def __init__(self, net: MemNet, me: str):
        self.net, self.me = net, me

    async def _reach(self, address: str, timeout: float) -> Membership:
        self.net.calls[self.me] = self.net.calls.get(self.me, 0) + 1
        self.net.dials[address] = self.net.dials.get(address, 0) + 1
        await asyncio.sleep(0)
        node = self.net.nodes.get(address)
        if node is None or address in self.net.down or self.net.address_of(self.me) in self.net.frozen:
            raise PeerCallError("unavailable", f"connection to {address} refused")
        if address in self.net.frozen:
            await asyncio.sleep(timeout)
            raise PeerCallError("unavailable", "Deadline Exceeded")
        return node

    @staticmethod
    def _served(fn, *args):
        try:
            return fn(*args)
        except Refusal as e:
            raise PeerCallError(e.kind, e.message) from None

    async def handshake(self, address, info, timeout):
        node = await self._reach(address, timeout)
        entries = self._served(node.on_handshake, info)
        return node.state.info(), entries

    async def heartbeat(self, address, beat, timeout, *, peer=None):
        node = await self._reach(address, timeout)
        return self._served(node.on_heartbeat, beat), 0.001

    async def indirect_probe(self, address, probe, timeout, *, peer=None):
        node = await self._reach(address, timeout)
        try:
            return await asyncio.wait_for(node.on_indirect_probe(probe), timeout)
        except Refusal as e:
            raise PeerCallError(e.kind, e.message) from None
        except asyncio.TimeoutError:
            raise PeerCallError("unavailable", "Deadline Exceeded") from None

    async def exchange_peers(self, address, sender, entries, timeout, *, members=(), incarnation=0, peer=None):
        node = await self._reach(address, timeout)
        return self._served(node.on_peer_list, sender, entries, members, incarnation)

    async def forget(self, address):
        pass


PERIOD = 0.05
FAST = Settings(probe_timeout_s=0.05, push_pull_interval_s=1.0, reconnect_min_s=0.2, reconnect_max_s=1.0)


def _member(net: MemNet, i: int, bootstrap: list[str], settings: Settings = FAST) -> Membership:
    nid, address = f"n{i}", f"a{i}"
    info = NodeInfo(nid, 1, "arch", address=address)
    table = PeerTable(
        nid,
        suspect_after_s=0.3,
        dead_after_s=1.0,
        reconnect_min_s=settings.reconnect_min_s,
        reconnect_max_s=settings.reconnect_max_s,
    )
    m = full_membership(
        lambda: info,
        lambda: (0, 0),
        table,
        net.transport(nid),
        ProblemLog(),
        bootstrap=bootstrap,
        period=PERIOD,
        rng=random.Random(i),
        settings=settings,
    )
    net.nodes[address] = m
    return m


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _network(n: int, settings: Settings = FAST):
    net = MemNet()
    members = [_member(net, i, [] if i == 0 else ["a0"], settings) for i in range(n)]
    tasks = [asyncio.create_task(m.run()) for m in members]
    return net, members, tasks


async def _stop(tasks):
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _state(members, of: str) -> set[str]:
    return {m.peers.records[of].state for m in members if of in m.peers.records and m.node_id != of}


def test_everyone_learns_everyone_through_one_seed_and_messages_stay_o1():
    async def go():
        net, members, tasks = await _network(24)
        try:
            await _until(lambda: all(len(m.peers.alive()) == 23 for m in members), 30, "full membership")
            # steady state: per node, one probe per period (+ an occasional push-pull), whatever N
            before, t0 = dict(net.calls), time.monotonic()
            await asyncio.sleep(40 * PERIOD)
            periods = (time.monotonic() - t0) / PERIOD
            per_period = [(net.calls.get(m.node_id, 0) - before.get(m.node_id, 0)) / periods for m in members]
            assert max(per_period) < 3, per_period  # pinging everyone would be 23 per period
            assert all(len(m.peers.alive()) == 23 for m in members)  # and nobody flapped
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_a_silent_member_is_suspected_then_dead_and_comes_back_when_it_answers():
    async def go():
        net, members, tasks = await _network(8)
        try:
            await _until(lambda: all(len(m.peers.alive()) == 7 for m in members), 20, "full membership")
            net.frozen.add("a3")  # SIGSTOP-like: calls to it time out, it sends nothing
            victim = members[3]
            await _until(lambda: _state(members, "n3") == {DEAD}, 20, "n3 dead everywhere")
            others = [m for m in members if m is not victim]
            assert all(len(m.peers.alive()) == 6 for m in others)  # nobody healthy went down with it
            # each table counts the death it declared and names the victim (/status membership:
            # how bench/daemons_discovery.py counts false deaths), and no other
            for m in others:
                assert m.state.stats["declared_dead"] == 1 and list(m.state.deaths) == ["n3"], m.node_id
            net.frozen.discard("a3")
            await _until(lambda: _state(members, "n3") == {ALIVE}, 20, "n3 alive again everywhere")
            assert victim.state.incarnation > 0 and all(len(m.peers.alive()) == 7 for m in members)
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_a_false_suspicion_is_refuted_before_it_kills():
    async def go():
        net, members, tasks = await _network(6)
        try:
            await _until(lambda: all(len(m.peers.alive()) == 5 for m in members), 20, "full membership")
            target = members[2]
            inc = target.state.incarnation
            dead = []
            for m in members:
                m.peers.listeners.append(lambda nid, old, new: dead.append(nid) if new == DEAD else None)
            rumour = MemberUpdate("n2", "a2", inc, SUSPECT, "n1")
            # n1 tells n0 a rumour, n2 is fine: n0 checks it with its own probe, n1 gets a strike
            members[0].gossip.merge([rumour], source="n1")
            members[0].state.broadcasts.add(rumour)  # and n0 passes it on: the others check it too
            target.gossip.merge([rumour], source="n1")  # n2 hears it: it outbids it
            await _until(lambda: target.state.incarnation > inc, 10, "n2 to refute")
            await _until(lambda: members[0].gossip.claims.of("n1") >= 1, 10, "n0's probe to refute the rumour")
            await asyncio.sleep(2.0)  # longer than the suspicion timeout
            assert _state(members, "n2") == {ALIVE}
            assert dead == [] and target.state.stats["refuted"] >= 1
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_a_probe_that_failed_while_this_node_stalled_is_inconclusive():
    class Stalled:
        def worst_since(self, t):
            return 5.0

    async def go():
        net, members, tasks = await _network(4)
        try:
            await _until(lambda: all(len(m.peers.alive()) == 3 for m in members), 20, "full membership")
            await _stop(tasks)
            me = members[0]
            me.probes.loop_lag = Stalled()
            net.frozen.add("a1")
            await me.probes.probe("n1")
            assert me.peers.records["n1"].state == ALIVE and me.state.stats["inconclusive"] == 1
            me.probes.loop_lag = None
            await me.probes.probe("n1")
            assert me.peers.records["n1"].state == SUSPECT
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_a_restarted_member_with_a_fresh_state_is_handshaken_again():
    async def go():
        net, members, tasks = await _network(4)
        try:
            await _until(lambda: all(len(m.peers.alive()) == 3 for m in members), 20, "full membership")
            tasks[2].cancel()
            await asyncio.gather(tasks[2], return_exceptions=True)
            fresh = _member(net, 2, ["a0"])  # same id and address, no memory of anyone
            assert fresh.state.incarnation >= members[2].state.incarnation
            tasks[2] = asyncio.create_task(fresh.run())
            members[2] = fresh
            await _until(
                lambda: len(fresh.peers.alive()) == 3 and _state(members, "n2") == {ALIVE},
                20,
                "the restarted n2 to be back in everyone's view",
            )
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_peer_exchange_flood_costs_a_few_dials_per_period():
    """One peer lists 2,000 unreachable addresses: the candidate set stays bounded, a handful
    are dialled per period, each a bounded number of times, then forgotten (a re-sent list adds
    nothing). Without the bounds every address was dialled every period, forever."""

    async def go():
        net, members, tasks = await _network(3)
        try:
            await _until(lambda: all(len(m.peers.alive()) == 2 for m in members), 20, "full membership")
            target, flooder = members[0], members[1]
            bogus = [PeerEntry(f"x{i}", f"bogus:{i}") for i in range(2000)]
            target.on_peer_list(flooder.node_id, bogus)
            s = target.state.s
            assert len(target.pending) <= s.max_candidates_per_source
            t0 = time.monotonic()
            await asyncio.sleep(30 * PERIOD)
            periods = (time.monotonic() - t0) / PERIOD + 1
            dials = sum(v for a, v in net.dials.items() if a.startswith("bogus:"))
            assert dials <= s.handshakes_per_period * periods
            assert max(v for a, v in net.dials.items() if a.startswith("bogus:")) <= s.candidate_attempts
            for _ in range(5):
                target.on_peer_list(flooder.node_id, bogus)  # again and again
                await asyncio.sleep(10 * PERIOD)
            periods = (time.monotonic() - t0) / PERIOD + 1
            dials = sum(v for a, v in net.dials.items() if a.startswith("bogus:"))
            assert dials <= s.handshakes_per_period * periods  # the rate bound holds throughout
            assert max(v for a, v in net.dials.items() if a.startswith("bogus:")) <= s.candidate_attempts
            assert len(target.pending) <= s.max_candidates_per_source
            assert len(target.peers.alive()) == 2  # the real members are untouched
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_unknown_callers_are_refused_and_the_caller_rehandshakes():
    async def go():
        net, members, tasks = await _network(2)
        try:
            await _until(lambda: all(len(m.peers.alive()) == 1 for m in members), 20, "the pair to meet")
            from coterie.node.peering.messages import Beat

            with pytest.raises(Refusal) as e:
                members[0].on_heartbeat(Beat("stranger", 0, 0))
            assert e.value.kind == UNKNOWN_PEER
        finally:
            await _stop(tasks)

    asyncio.run(go())


def test_membership_settings_come_from_the_node_config():
    from coterie.node.config import ConfigError, MembershipConfig, validate_config

    assert set(Settings.__dataclass_fields__) == set(MembershipConfig.model_fields)  # no drift
    cfg = validate_config({"membership": {"indirect_probes": 5, "max_candidates": 64}})
    s = Settings.from_config(cfg.membership)
    assert s.indirect_probes == 5 and s.max_candidates == 64 and s.probe_timeout_s == Settings().probe_timeout_s
    with pytest.raises(ConfigError, match="membership.indirect_probes"):
        validate_config({"membership": {"indirect_probes": -1}})
    with pytest.raises(ConfigError, match="membership.no_such_knob"):
        validate_config({"membership": {"no_such_knob": 1}})


# ----------------------------------------------------------------------------- cost at scale
def test_a_handshake_reply_carries_a_bounded_sample_and_the_full_view_travels_in_push_pull():
    """A join answered with the whole table makes N joins cost O(N²) entries per member (O(N³)
    in all): a thousand in-process nodes starting stalled on it. The reply is a bounded sample."""
    from coterie.node.peering.membership import HANDSHAKE_ENTRIES

    net = MemNet()
    seed = _member(net, 0, [])
    for i in range(1, 3 * HANDSHAKE_ENTRIES):
        seed.peers.upsert(f"n{i}", f"a{i}")
    seed.peers.suspect("n1")
    for i in range(2, 12):  # dead members are never passed on
        seed.peers.upsert(f"x{i}", f"dead{i}", seen=False)
    entries = seed.on_handshake(NodeInfo("joiner", 1, "arch", address="aj"))
    assert 0 < len(entries) <= HANDSHAKE_ENTRIES
    assert len({e.node_id for e in entries}) == len(entries)
    assert not [e for e in entries if e.node_id.startswith("x")]
    # different joiners hear different parts of the table (a random window, not always the head)
    seen = {e.node_id for k in range(8) for e in seed.on_handshake(NodeInfo(f"j{k}", 1, "arch", address=f"aj{k}"))}
    assert len(seen) > 2 * HANDSHAKE_ENTRIES
    full, _, _ = seed.on_peer_list("joiner", [], [], 0)  # the push-pull exchange: everyone not dead
    assert {e.node_id for e in full} >= {f"n{i}" for i in range(1, 3 * HANDSHAKE_ENTRIES)}


def test_push_pull_spacing_grows_with_log_n_past_32_members():
    m = _member(MemNet(), 0, [], Settings(push_pull_interval_s=10.0))
    assert [m.gossip.push_pull_interval_s(n) for n in (1, 32, 33, 64, 128, 1000)] == [
        10.0,
        10.0,
        20.0,
        20.0,
        30.0,
        60.0,
    ]


def test_peer_table_indexes_agree_with_a_full_scan_after_any_history(clock):
    """The table answers counts, alive, address lookups and due reconnects from indexes kept with
    every change (a scan per period per node is O(N²) for a network): they must match a scan."""
    rng = random.Random(7)
    t = PeerTable("me", suspect_after_s=1.0, dead_after_s=2.0)
    ids = [f"p{i}" for i in range(30)]
    for step in range(3000):
        nid = rng.choice(ids)
        op = rng.randrange(7)
        if op == 0:
            t.upsert(nid, f"addr{rng.randrange(40)}", seen=rng.random() < 0.7)
        elif op == 1 and nid in t.records:
            t.suspect(nid)
        elif op == 2:
            t.seen(nid, revive=True)
        elif op == 3 and nid in t.records:
            r = t.records[nid]
            t.apply(
                MemberUpdate(nid, r.address, r.incarnation + rng.randrange(2), rng.choice([ALIVE, SUSPECT, DEAD]), "x")
            )
        elif op == 4:
            clock[0] += rng.uniform(0, 3)
            t.refresh()
        elif op == 5:
            t.pause(rng.uniform(0, 1))
        else:
            t.reconnect_failed(nid)
        recs = list(t.records.values())
        assert t.counts() == {s: sum(r.state == s for r in recs) for s in (ALIVE, SUSPECT, DEAD)}
        assert t.alive() == sorted(r.node_id for r in recs if r.state == ALIVE)
        now = time.monotonic()
        assert sorted(r.node_id for r in t.due_reconnects(now)) == sorted(
            r.node_id for r in recs if r.state == DEAD and r.reconnect_at <= now
        )
        for a in {r.address for r in recs}:
            found = t.by_address(a)
            assert found is not None and found.address == a, (step, a)
        assert t.by_address("nowhere") is None


def test_a_member_that_forgot_us_is_handshaken_again_even_if_its_address_was_forgotten():
    """Seen in the container testbed: n0's handshake to a slow n1 reached n1 (which took n0 in) but
    n0 gave up on proving n1's certificate and, after three tries, forgot n1's address; n1's own
    handshakes to n0 had failed during its slow start, so n1 had forgotten n0's address too. n1's
    pings were refused ("unknown peer: handshake first") while a helper's indirect pings kept n0
    alive in n1's view, so nobody handshook again and membership stayed one-sided for ten minutes.
    A refusal proves the address answers: n1 must handshake it again, forgotten or not."""

    def forget(m: Membership, address: str) -> None:
        m.pending.add(address, source="gossip")
        while address in m.pending:
            m.pending.failed(address)
        assert not m.pending.add(address, source="gossip")  # gossip alone does not bring it back

    async def go():
        net = MemNet()
        m0, m1, m2 = (_member(net, i, []) for i in range(3))
        for m, others in ((m0, ["n2"]), (m1, ["n0", "n2"]), (m2, ["n0", "n1"])):
            for o in others:
                m.peers.upsert(o, "a" + o[1:])
        forget(m0, "a1")
        forget(m1, "a0")
        tasks = [asyncio.create_task(m.run()) for m in (m0, m1, m2)]
        try:
            await _until(lambda: "n1" in m0.peers.records, 10, "n0 taking n1 in")
            await _until(lambda: all(len(m.peers.alive()) == 2 for m in (m0, m1, m2)), 10, "full membership")
        finally:
            await _stop(tasks)

    asyncio.run(go())
