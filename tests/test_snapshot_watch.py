"""Snapshot subscriptions (``WatchSnapshots``): a peer pulled from round after round pushes each
snapshot it publishes on one long-lived stream instead of answering a call a round.

``NodeNetwork`` over a transport whose subscriptions the test drives (pulls become cache reads,
a round not pushed yet is waited for, a bad pushed snapshot ends the subscription and pulls take
over), then real daemons over mTLS: the stream itself, its bounds attacked by an authenticated
peer, and a D-PSGD pair whose rounds run on it."""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest
import torch

from coterie.node.peering.calls import PeerCalls
from coterie.node.peering.deadlines import Deadlines
from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.inbox import PushInbox
from coterie.node.peering.messages import LocalSnapshot, SnapshotHeader
from coterie.node.peering.network import NetworkSettings, NodeNetwork
from coterie.node.peering.peer_table import PeerTable
from coterie.node.peering.problems import ProblemLog
from coterie.node.peering.snapshots import SnapshotCache
from coterie.node.transport.client import PeerClient
from coterie.node.transport.server import serve
from tests.nodeproc import NodeProc, tiny_learner, wait_for
from tests.test_security_limits import Mallory

SPEC = {"w": ((4,), "float32")}


class WatchingTransport:
    """One peer ``p`` at address ``a``: pulls answer its current round; a subscription yields
    what the test puts on ``pushed`` (an exception ends it)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.round = 1
        self.pulls = 0
        self.watches: list[int] = []  # min_round of each subscription opened
        self.pushed: asyncio.Queue = asyncio.Queue()

    def snapshot(self, rnd: int, value: float = 1.0):
        return SnapshotHeader("p", rnd, rnd, ""), {"params": {"w": torch.full((self.size,), value)}}

    async def get_snapshot(
        self, address, requester, have_version=0, *, min_round=0, wait_s=0.0, timeout=None, peer=None
    ):
        self.pulls += 1
        return self.snapshot(self.round)

    async def watch_snapshots(self, address, requester, *, min_round=0, peer=None):
        self.watches.append(min_round)
        while True:
            item = await self.pushed.get()
            if isinstance(item, Exception):
                raise item
            yield item


def _net(t, spec=SPEC, problems=None):
    table = PeerTable("me", 1.0, 2.0)
    table.upsert("p", "a")
    calls = PeerCalls(table, Deadlines(5.0), request_timeout_s=5.0)
    return NodeNetwork(
        NetworkSettings("me", spec),
        t,
        calls,
        SnapshotCache(),
        PushInbox(),
        lambda: None,
        None,
        problems or ProblemLog(),
    )


def test_a_peer_pulled_round_after_round_is_subscribed_to_and_pulls_become_cache_reads():
    async def go():
        problems = ProblemLog()
        t = WatchingTransport()
        net = _net(t, problems=problems)
        assert (await net.pull("p", min_round=1)).round == 1 and t.pulls == 1 and not t.watches  # once is not a habit
        t.round = 2
        assert (await net.pull("p", min_round=2)).round == 2 and t.pulls == 2  # again: subscribed
        await asyncio.wait_for(_until(lambda: t.watches), 2)
        assert t.watches == [2]  # from the round after the one cached when it opened

        t.pushed.put_nowait(t.snapshot(3, 3.0))
        assert (await net.pull("p", min_round=3, wait_s=2.0)).round == 3
        got = asyncio.ensure_future(net.pull("p", min_round=4, wait_s=5.0))  # not published yet: waits
        await asyncio.wait_for(_until(lambda: "p" in net.subscriptions._watch_news), 2)  # it waits on the subscription
        assert not got.done()
        t.pushed.put_nowait(t.snapshot(4, 4.0))
        snap = await asyncio.wait_for(got, 2)
        assert snap.round == 4 and float(snap.params["w"][0]) == 4.0
        assert (await net.pull("p")).round == 4  # the latest pushed, no call
        assert t.pulls == 2
        # a round that does not come in time: None, as a pull that timed out
        assert await net.pull("p", min_round=5, wait_s=0.2) is None

        # a pushed snapshot that fails validation (NaN) ends the subscription; pulls take over
        t.pushed.put_nowait(t.snapshot(5, float("nan")))
        await asyncio.wait_for(_until(lambda: "p" not in net.subscriptions._watches), 2)
        assert any(
            p["peer"] == "p" and p["rejected"] and "snapshot watch" in p["message"] for p in problems.recent()
        ), problems.recent()
        t.round = 5
        assert (await net.pull("p", min_round=5, wait_s=1.0)).round == 5 and t.pulls == 3
        assert net.cached("p").round == 5 and torch.isfinite(net.cached("p").params["w"]).all()
        await net.close()

    asyncio.run(go())


def test_sampled_pulls_are_not_subscribed_to():
    """A subscription pushes at the publisher's pace: to a strategy that samples its peers
    (FedFomo, FedeRiCo) that is more snapshots than it uses (in the testbed it saturated the
    slow-link node's 1 Mbit/s and buried its weight), so only round-aligned pulls subscribe."""

    async def go():
        t = WatchingTransport()
        net = _net(t)
        for rnd in (1, 2, 3):
            t.round = rnd
            assert (await net.pull("p")).round == rnd
        assert t.pulls == 3 and not net.subscriptions._watches  # (one is registered the moment it is decided)
        await net.close()

    asyncio.run(go())


def test_a_large_model_is_pulled_not_subscribed_to():
    """A subscription pushes every snapshot; for a 2 MB model that is more bytes than pulling
    where a strategy samples its peers, and a call's CPU is small beside the transfer."""

    async def go():
        table = PeerTable("me", 1.0, 2.0)
        table.upsert("p", "a")
        t = WatchingTransport(size=1 << 19)
        net = NodeNetwork(
            NetworkSettings("me", {"w": ((1 << 19,), "float32")}),
            t,
            PeerCalls(table, Deadlines(5.0), request_timeout_s=5.0),
            SnapshotCache(),
            PushInbox(),
            lambda: None,
            None,
            ProblemLog(),
        )
        for rnd in (1, 1, 2, 3):
            t.round = rnd
            assert (await net.pull("p", min_round=rnd)).round == rnd
        assert t.pulls == 3 and not net.subscriptions._watches  # (the second round-1 pull was a cache hit)
        await net.close()

    asyncio.run(go())


def test_a_broken_subscription_wakes_its_waiting_pull():
    async def go():
        t = WatchingTransport()
        net = _net(t)
        await net.pull("p", min_round=1)
        t.round = 2
        await net.pull("p", min_round=2)
        await asyncio.wait_for(_until(lambda: t.watches), 2)
        waiting = asyncio.ensure_future(net.pull("p", min_round=3, wait_s=5.0))
        await asyncio.wait_for(_until(lambda: "p" in net.subscriptions._watch_news), 2)
        t.round = 3
        t.pushed.put_nowait(PeerCallError("unavailable", "connection reset"))
        snap = await asyncio.wait_for(waiting, 2)  # not the whole 5 s: the pull takes over at once
        assert snap.round == 3 and t.pulls == 3
        await net.close()

    asyncio.run(go())


async def _until(cond, interval: float = 0.01):
    while not cond():
        await asyncio.sleep(interval)


class _NoTraffic:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


def test_a_subscription_to_a_peer_with_nothing_new_ends_instead_of_spinning():
    """A handler that answers at once with the snapshot the reader already has (one that ignores
    the round asked for) used to send the server round a hot loop; the subscription now ends
    cleanly after the one snapshot, and the reader pulls."""

    class Still:
        snap = LocalSnapshot("still", 1, 1, {"params": {"w": torch.ones(4)}})

        async def snapshot(self, requester, min_round=0, wait_s=0.0):
            return self.snap

        def check_known(self, node_id):
            return None

        def admit(self, peer, kind):
            return contextlib.nullcontext()

    async def go():
        server, port = await serve(Still(), _NoTraffic(), "127.0.0.1:0", tls=None)  # plaintext: a unit test
        client = PeerClient(
            "me",
            _NoTraffic(),
            chunk_bytes=1 << 20,
            max_model_bytes=1 << 20,
            max_gossip_bytes=1 << 20,
            timeout_s=5,
            tls=None,
        )
        try:
            got = [
                (h.version, float(g["params"]["w"].sum()))
                async for h, g in client.watch_snapshots(f"127.0.0.1:{port}", "me")
            ]
        finally:
            await client.close()
            await server.stop(0)
        return got

    assert asyncio.run(go()) == [(1, 4.0)]


# ------------------------------------------------------------------------------ real daemons
@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    root = tmp_path_factory.mktemp("watch")
    node = NodeProc(
        root,
        "victim",
        {"strategy": "local", "round_interval_s": 0.2, "learner": tiny_learner(1, 0), "limits": {"max_watches": 2}},
    ).start()
    yield root, node
    node.stop()


def test_a_subscription_pushes_each_new_snapshot_on_one_stream(victim):
    root, node = victim

    async def go():
        m = Mallory(root, node)
        await m.join()
        got = []
        async for header, groups in m.client.watch_snapshots(node.address, "mallory", peer="victim"):
            got.append((header.round, header.version, groups["params"]))
            if len(got) == 4:
                break
        await m.close()
        return got

    got = asyncio.run(go())
    rounds = [r for r, _, _ in got]
    assert rounds == sorted(rounds) and len(set(rounds)) == 4, rounds  # each a newer round, none twice
    assert all(torch.isfinite(t).all() for _, _, p in got for t in p.values())
    assert got[0][2].keys() == got[-1][2].keys()


def test_subscriptions_are_bounded_per_peer_and_in_all(victim):
    """Without the bounds a peer could open a subscription per HTTP/2 stream and have every
    snapshot pushed to it many times over; a stranger could subscribe without a handshake."""
    root, node = victim

    async def first_snapshot(m: Mallory):
        agen = m.client.watch_snapshots(node.address, m.node_id, peer="victim")
        await agen.__anext__()
        return agen

    async def refused(m: Mallory) -> str:
        with pytest.raises(PeerCallError) as e:
            await first_snapshot(m)
        return str(e.value)

    async def admitted_within(m: Mallory, timeout: float):
        """Subscribe once the server has let go of an ended one (it unwinds asynchronously)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return await first_snapshot(m)
            except PeerCallError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def go():
        a, b, c, stranger = (Mallory(root, node, n) for n in ("mallory", "eve", "trent", "stranger"))
        for m in (a, b, c):
            await m.join()
        # the module's earlier test subscribed as mallory too; the server lets go of that asynchronously
        open_a = await admitted_within(a, 10)
        assert "already has one open" in await refused(a)
        open_b = await first_snapshot(b)
        assert "the limit is 2" in await refused(c)  # limits.max_watches = 2 here
        assert re.search(r"unknown|handshake", await refused(stranger), re.I)
        await open_a.aclose()  # a closed subscription frees its place
        open_c = await admitted_within(c, 10)
        for g in (open_b, open_c):
            await g.aclose()
        for m in (a, b, c, stranger):
            await m.close()

    asyncio.run(go())
    assert node.status()["round"] > 0  # and the node kept running


def test_a_dpsgd_pair_runs_its_rounds_on_subscriptions(tmp_path):
    base = {"strategy": "dpsgd", "round_interval_s": 0.0, "rounds": 30, "min_peers": 1}
    a = NodeProc(tmp_path, "a", {**base, "learner": tiny_learner(2, 0)}).start()
    b = NodeProc(tmp_path, "b", {**base, "learner": tiny_learner(2, 1), "peers": [a.address]}).start()
    try:
        wait_for(lambda: a.status().get("done") and b.status().get("done"), 120, "both to finish 30 rounds")
        for node in (a, b):
            text = node.get_text("/metrics")
            served = _count(text, "snapshot-push", "server")
            pulled = _count(text, "snapshot", "server")
            # the peer's snapshots went out on its subscription, not a call a round
            assert served >= 20 and pulled <= 6, (node.node_id, served, pulled)
    finally:
        a.stop()
        b.stop()


def _count(text: str, kind: str, side: str) -> float:
    m = re.search(rf'coterie_request_duration_seconds_count\{{kind="{kind}",side="{side}"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0
