"""What membership costs one node per protocol period, full membership against partial views,
and how fast discovery finds cluster mates — in-process, side by side (``bench/scale.py
--sections overlay,discovery``).

Full membership: the real ``Membership`` (SWIM probes, piggybacked news, push-pull on its
memberlist schedule) of N nodes over an in-memory transport, each table starting converged (every
member alive), driven period by period: every node ticks, then the loop runs until the calls the
period started are answered. Push-pull runs on the real schedule (``push_pull_interval_s(n)``
in periods; the simulated clock replaces the wall clock so that a loaded machine does not skip
exchanges). Partial views: ``PartialView`` (HyParView) of N nodes, joined and warmed up, driven
by ``SimOverlay`` (a probe of one active neighbour and one shuffle per period).

Bytes are counted the same way on both sides: 24 bytes of framing per message plus each id
(+2), address (+2) and incarnation/state (+10) it carries. CPU is the process's CPU time over
the measured periods / (nodes × periods). Partial views are delivered synchronously (no asyncio
task per call), full membership through the event loop as the daemon runs it: the partial-view
CPU leaves out that per-message constant, the bytes do not."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from typing import Any

from coterie.node.peering.errors import PeerCallError, Refusal
from coterie.node.peering.membership import Membership, Settings
from coterie.node.peering.messages import NodeInfo
from coterie.node.peering.overlay_sim import SimOverlay, simulate_discovery
from coterie.node.peering.partial_view import ViewSettings
from coterie.node.peering.peer_table import PeerTable
from coterie.node.peering.problems import ProblemLog

PERIOD_S = 1.0  # heartbeat_interval_s (the default): push-pull's schedule is in these


def _update_bytes(updates) -> int:
    return sum(len(u.node_id) + len(u.address) + 14 for u in updates)


class CountingNet:
    """An in-memory PeerTransport between Memberships that counts each node's bytes sent."""

    def __init__(self):
        self.nodes: dict[str, Membership] = {}
        self.sent: dict[str, int] = {}

    def transport(self, me: str) -> CountingTransport:
        return CountingTransport(self, me)


class CountingTransport:
    def __init__(self, net: CountingNet, me: str):
        self.net, self.me = net, me

    def _count(self, node: str, n: int) -> None:
        self.net.sent[node] = self.net.sent.get(node, 0) + n

    def _node(self, address: str) -> Membership:
        node = self.net.nodes.get(address)
        if node is None:
            raise PeerCallError("unavailable", f"connection to {address} refused")
        return node

    @staticmethod
    def _served(fn, *args):
        try:
            return fn(*args)
        except Refusal as e:
            raise PeerCallError(e.kind, e.message) from None

    async def handshake(self, address, info, timeout):
        node = self._node(address)
        entries = self._served(node.on_handshake, info)
        self._count(self.me, 24 + len(info.node_id) + len(info.address))
        self._count(node.node_id, 24 + sum(len(e.node_id) + len(e.address) + 4 for e in entries))
        return node.info(), entries

    async def heartbeat(self, address, beat, timeout, *, peer=None):
        node = self._node(address)
        self._count(self.me, 24 + len(beat.node_id) + _update_bytes(beat.updates))
        reply = self._served(node.on_heartbeat, beat)
        self._count(node.node_id, 24 + len(reply.node_id) + _update_bytes(reply.updates))
        return reply, 0.001

    async def indirect_probe(self, address, probe, timeout, *, peer=None):
        node = self._node(address)
        self._count(self.me, 24 + 2 * len(probe.target))
        ok, updates = await node.on_indirect_probe(probe)
        self._count(node.node_id, 24 + _update_bytes(updates))
        return ok, updates

    async def exchange_peers(self, address, sender, entries, timeout, *, members=(), incarnation=0, peer=None):
        node = self._node(address)
        self._count(self.me, 24 + sum(len(e.node_id) + len(e.address) + 4 for e in entries) + _update_bytes(members))
        theirs, their_members, inc = self._served(node.on_peer_list, sender, entries, members, incarnation)
        self._count(
            node.node_id, 24 + sum(len(e.node_id) + len(e.address) + 4 for e in theirs) + _update_bytes(their_members)
        )
        return theirs, tuple(their_members), inc

    async def forget(self, address):
        pass


def full_membership_cost(n: int, periods: int, seed: int = 0) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        net = CountingNet()
        ids = [f"node-{i:05d}" for i in range(n)]
        members = []
        for i, nid in enumerate(ids):
            info = NodeInfo(nid, 1, "arch", address=f"addr-{i:05d}")
            table = PeerTable(nid, suspect_after_s=5.0, dead_after_s=30.0)
            m = Membership(
                lambda info=info: info,
                lambda: (0, 0),
                table,
                net.transport(nid),
                ProblemLog(),
                bootstrap=[],
                heartbeat_interval_s=PERIOD_S,
                request_timeout_s=5.0,
                rng=random.Random(f"{seed}-{i}"),
                settings=Settings(),
            )
            for j, other in enumerate(ids):  # converged: everyone knows everyone, alive
                if other != nid:
                    table.upsert(other, f"addr-{j:05d}")
            net.nodes[info.address] = m
            members.append(m)
        every = max(1, round(members[0].push_pull_interval_s(n) / PERIOD_S))
        rng = random.Random(seed)
        due = {m.node_id: rng.randrange(every) for m in members}  # each node's push-pull phase
        net.sent.clear()
        cpu0 = time.process_time()
        for p in range(periods):
            for m in members:
                m._next_push_pull = 0.0 if p % every == due[m.node_id] else math.inf
                m.tick()
            for _ in range(20):  # the period's calls (all in memory) settle within a few hops
                await asyncio.sleep(0)
        cpu = time.process_time() - cpu0
        state = statistics.median(len(m.peers.records) for m in members)
        for m in members:
            for t in list(m._tasks):
                t.cancel()
        await asyncio.sleep(0)
        return {
            "cpu_ms": 1000 * cpu / (n * periods),
            "bytes": sum(net.sent.values()) / (n * periods),
            "state_entries": state,
            "push_pull_every": every,
        }

    return asyncio.run(go())


def partial_view_cost(n: int, periods: int, seed: int = 0, warmup: int = 10) -> dict[str, Any]:
    ids = [f"node-{i:05d}" for i in range(n)]
    o = SimOverlay(ids, ViewSettings.for_network(n), seed=seed)
    o.join_all()
    for _ in range(warmup):
        o.round()
    o.sent_bytes.clear()
    cpu0 = time.process_time()
    for _ in range(periods):
        o.round()
    cpu = time.process_time() - cpu0
    s = o.views[ids[0]].s
    return {
        "cpu_ms": 1000 * cpu / (n * periods),
        "bytes": sum(o.sent_bytes.values()) / (n * periods),
        "state_entries": statistics.median(len(v.active) + len(v.passive) for v in o.views.values()),
        "active": s.active_size,
        "passive": s.passive_size,
        "components": len(o.components()),
    }


def push_pull_periods(n: int) -> int:
    """One push-pull cycle of full membership at ``n`` nodes, in periods: every node exchanges
    its view once in it, so a window of it holds each node's O(N) exchange exactly once."""
    return max(1, round(Membership.push_pull_interval_s(_Probe(), n) / PERIOD_S))


class _Probe:
    s = Settings()


def overlay_section(sizes: list[int], full_up_to: int = 1000) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:  # side by side: both kinds at each size, one after the other, same periods
        periods = push_pull_periods(n)
        kinds = [("full membership", full_membership_cost)] if n <= full_up_to else []
        for kind, fn in kinds + [("partial views", partial_view_cost)]:
            t0 = time.monotonic()
            r = fn(n, periods)
            r.update(kind=kind, nodes=n, periods=periods, wall_s=round(time.monotonic() - t0, 1))
            print("  ", r, flush=True)
            rows.append(r)
    return rows


def discovery_section(sizes: list[int], rounds: int, seed: int = 0) -> list[dict[str, Any]]:
    marks = tuple(r for r in (5, 10, 20, 30, 50) if r <= rounds)
    rows = []
    for n in sizes:
        for mode in ("discovery", "uniform"):
            t0 = time.monotonic()
            r = simulate_discovery(n, 10, rounds, mode=mode, seed=seed, checkpoints=marks)
            rows.append(
                {
                    "nodes": n,
                    "mode": mode,
                    "found": {str(k): round(v, 2) for k, v in r.mates_found.items()},
                    "wall_s": round(time.monotonic() - t0, 1),
                }
            )
            print("  ", rows[-1], flush=True)
    return rows


def merged(old: list[dict[str, Any]], new: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """``old`` rows less those measured again, then ``new`` (``--merge``), sorted by size."""
    again = {tuple(r[k] for k in key) for r in new}
    return sorted([r for r in old if tuple(r[k] for k in key) not in again] + new, key=lambda r: r["nodes"])


def report(data: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if "overlay" in data:
        out += [
            "",
            "## Membership cost per node and period: full membership against partial views",
            "",
            "In-process, side by side (`--sections overlay`; " + __doc__.split("\n\n")[1].replace("\n", " ") + ")",
            "",
            "| nodes | membership | CPU ms / node-period | bytes / node-period | entries held (median) | view sizes |",
            "|---|---|---|---|---|---|",
        ]
        for r in data["overlay"]:
            sizes = (
                f"active {r['active']}, passive {r['passive']}; {r['components']} component(s)"
                if "active" in r
                else f"push-pull every {r['push_pull_every']} periods"
            )
            out.append(
                f"| {r['nodes']} | {r['kind']} | {r['cpu_ms']:.3f} | {r['bytes']:.0f} | "
                f"{r['state_entries']:.0f} | {sizes} |"
            )
        by = {(r["kind"], r["nodes"]): r for r in data["overlay"]}
        ns = sorted({r["nodes"] for r in data["overlay"]})
        if len(ns) >= 2:
            lo, hi = ns[0], ns[-1]
            for kind in ("full membership", "partial views"):
                a, b = by.get((kind, lo)), by.get((kind, hi))
                if a and b:
                    out.append(
                        f"\n{kind}, {hi} / {lo} nodes: CPU {b['cpu_ms'] / a['cpu_ms']:.2f}x, "
                        f"bytes {b['bytes'] / a['bytes']:.2f}x."
                    )
        out += [
            "",
            "Issue 32 asks for per-node cost flat from 100 to 3,000 nodes (<= 1.3x). Bytes per node-period "
            "of partial views are flat (full membership's grow with N: push-pull carries the whole table); "
            "their CPU per node-period is not yet: the views grow with log2 N (active + passive entries "
            "above) and each received entry scans the passive view (eviction, per-source cap), and the "
            "shared machine's load varied between rows. 3,000 nodes did not finish within the 4-minute "
            "budget of a run (joining them one by one in the simulation), and the per-node CPU of partial "
            "views leaves out the per-message cost of a real call (they are not yet carried by the RPCs).",
        ]
    if "discovery" in data:
        out += [
            "",
            "## Discovery: cluster mates among a node's top-weighted peers",
            "",
            "`simulate_discovery`: N nodes in clusters of 10 (label permutation: only mates help), each "
            "evaluating 5 candidates a round; a peer's weight is 1 for a mate, 0 otherwise, plus N(0, 0.2) "
            "noise clipped at 0; top-weighted = a node's 9 best running scores. *discovery*: candidates "
            "from `Discovery` over the node's partial view with recommendations; *uniform*: 5 of all the "
            "others drawn uniformly each round (the strategies' draw without discovery). Mean over nodes "
            "of mates found (of 9).",
            "",
        ]
        marks = sorted({int(k) for r in data["discovery"] for k in r["found"]})
        out += [
            "| nodes | candidates from | " + " | ".join(f"round {m}" for m in marks) + " |",
            "|---|---|" + "---|" * len(marks),
        ]
        for r in data["discovery"]:
            out.append(
                f"| {r['nodes']} | {r['mode']} | " + " | ".join(str(r["found"].get(str(m), "–")) for m in marks) + " |"
            )
        out += [
            "",
            "Issue 32 asks for >= 7 of 9 mates within 30 rounds at 1,000 nodes. Nearly reached at 300 nodes "
            "(7.0 of 9, about 2x uniform sampling); not at 1,000, where discovery is barely ahead of uniform "
            "sampling by round 30: with 5 evaluations a round a node first meets a mate by chance "
            "(9 of 999), and recommendations only spread mates once most nodes have one. Not measured "
            "yet: the oracle's gain, late joiners, and discovery on real daemons at scale.",
        ]
    return out
