"""What membership costs one node per protocol period, full membership against membership on
partial views, and how fast discovery finds cluster mates — in-process, side by side
(``bench/scale.py --sections overlay,discovery``).

Both kinds are the daemon's real membership (``full_membership``: SWIM probes, piggybacked news,
handshakes, push-pull) over the in-process transport (``peering/views_inproc.py``: every call
through the gate; bytes estimated from each call's request and reply, 24 bytes of framing
each), driven period by period (every node ticks, then the calls it started are answered).
Full membership: every table converged (every member alive), push-pull on memberlist's schedule
(``push_pull_interval_s(n)`` in periods, each node at its own phase), measured over one
push-pull cycle. Partial views: membership on the views (``view_scope.py``: probes to active
neighbours, a shuffle a period, a handshake before calling outside the active view, tables
pruned to the views), the views set up directly as a converged overlay holds them
(``bootstrap_views``; joining thousands one by one costs more than the measurement), sized as a
daemon sizes them (``ViewSettings.for_network(2 × discovery.above)``: active 10, passive 60 by
default) at every N; 5 periods of warm-up, then 20 measured. The set-up's objects are frozen
out of the garbage collector (``gc.freeze``) before measuring: N nodes share one heap where a
daemon holds one, and a full collection costs in proportion to the heap. CPU: the process's CPU
time over the measured periods / (nodes x periods); each point runs in a process of its own (its
peak RSS is the point's). At ``--overlay-big`` sizes partial views alone run 5 periods straight from the
bootstrapped views (no warm-up)."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from coterie.node.config import DiscoveryConfig
from coterie.node.fsutil import atomic_write_json
from coterie.node.peering import views_inproc as vi
from coterie.node.peering.dissemination import PUSH_PULL_SCALE_THRESHOLD
from coterie.node.peering.membership import Settings
from coterie.node.peering.overlay_sim import simulate_discovery
from coterie.node.peering.partial_view import ViewSettings, view_components
from coterie.node.transport.inproc import InProcNetwork

PERIOD_S = 1.0  # heartbeat_interval_s (the default): push-pull's schedule is in these
PARTIAL_PERIODS = 20
WARMUP_PERIODS = 5
# a daemon's views: ``ViewSettings.for_network(2 × discovery.above)``, above = 200 by default
DAEMON_VIEWS = ViewSettings.for_network(2 * DiscoveryConfig().above)


def push_pull_periods(n: int) -> int:
    """One push-pull cycle of full membership at ``n`` nodes, in periods (memberlist's
    ``pushPullScale``): every node exchanges its view once in it."""
    base = Settings().push_pull_interval_s
    if n > PUSH_PULL_SCALE_THRESHOLD:
        base *= math.ceil(math.log2(n) - math.log2(PUSH_PULL_SCALE_THRESHOLD)) + 1
    return max(1, round(base / PERIOD_S))


def cost_point(
    kind: str,
    n: int,
    periods: int,
    warmup: int = WARMUP_PERIODS,
    ballast: int = 0,
    networks: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """One kind at ``n`` nodes: CPU ms and bytes per node-period, entries held, wall and peak RSS.
    ``ballast``: as many more nodes made and bootstrapped in the same heap but never ticked (a
    control: what a larger heap alone costs the ``n`` nodes that run). ``networks`` (partial
    views): the ``n`` nodes split into that many separate networks, made interleaved (node i of
    each in turn, so each network's nodes are spread over the heap as one big network's are) and
    ticked together — a control that tells what the network's size costs a node from what
    simulating ``n`` nodes in one process does."""

    async def go() -> dict[str, Any]:
        t0 = time.monotonic()
        nets = [InProcNetwork() for _ in range(networks)]
        partial = kind == "partial views"
        views = DAEMON_VIEWS  # as a daemon sizes them (for twice the threshold), whatever N
        members = [
            vi.make_member(nets[i % networks], f"node-{i:05d}", views, partial=partial, seed=seed) for i in range(n)
        ]
        rng = random.Random(seed)
        if ballast:
            idle = [vi.make_member(nets[0], f"idle-{i:05d}", views, partial=True, seed=seed) for i in range(ballast)]
            vi.bootstrap_views(idle, rng)
        before = None
        if partial:
            for k in range(networks):
                vi.bootstrap_views(members[k::networks], rng)
            for _ in range(warmup):
                await vi.period(members)
        else:
            vi.converge_full(members)
            due = {x.node_id: rng.randrange(periods) for x in members}  # each node's push-pull phase

            def before(p: int) -> None:  # the push-pull schedule in periods, not wall time
                for x in members:
                    x.membership._next_push_pull = 0.0 if p == due[x.node_id] else math.inf

        setup_s = time.monotonic() - t0
        # the set-up's objects out of the collector's reach: N nodes share this heap, where a
        # daemon holds one, and a full collection's cost grows with the heap, not with the node
        gc.collect()
        gc.freeze()
        sent0 = sum(x.traffic.sent for x in members)
        kinds0 = sum((x.traffic.kinds for x in members), Counter())
        t1 = time.monotonic()
        cpu0 = time.process_time()
        for p in range(periods):
            if before is not None:
                before(p)
            await vi.period(members)
        cpu = time.process_time() - cpu0
        wall = time.monotonic() - t1
        sent = sum(x.traffic.sent for x in members) - sent0
        row: dict[str, Any] = {
            "kind": kind,
            "nodes": n,
            "periods": periods,
            "warmup": warmup if partial else 0,
            **({"ballast": ballast} if ballast else {}),
            **({"networks": networks} if networks > 1 else {}),
            "cpu_ms": 1000 * cpu / (n * periods),
            "bytes": sent / (n * periods),
            "state_entries": statistics.median(len(x.peers.records) for x in members),
            "max_entries": max(len(x.peers.records) for x in members),
            "setup_s": round(setup_s, 1),
            "wall_s": round(wall, 1),
            "false_deaths": sum(len(x.deaths) for x in members),
            "calls": {  # answered calls per node-period, by kind
                k: round(v / (n * periods), 2)
                for k, v in (sum((x.traffic.kinds for x in members), Counter()) - kinds0).items()
            },
        }
        if partial:
            row.update(
                active=views.active_size,
                passive=views.passive_size,
                components=sum(
                    len(view_components({x.node_id: x.overlay.view.active for x in members[k::networks]}))
                    for k in range(networks)
                ),
            )
        else:
            row["push_pull_every"] = periods
        await vi.stop(members)
        return row

    row = asyncio.run(go())
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return row


def overlay_section(
    sizes: list[int], big: list[int] | None = None, full_up_to: int = 1000, timeout_s: float = 600
) -> list[dict[str, Any]]:
    """Side by side at each of ``sizes``: full membership (up to ``full_up_to``: its converged
    tables are N² records) and partial views, each point a process of its own; then partial
    views alone at each of ``big``, 5 periods (wall and peak memory)."""
    points = [
        (kind, n, push_pull_periods(n) if kind == "full membership" else PARTIAL_PERIODS)
        for n in sizes
        for kind in ["full membership"] * (n <= full_up_to) + ["partial views"]
    ]
    points = [(kind, n, periods, WARMUP_PERIODS) for kind, n, periods in points]
    points += [("partial views", n, 5, 0) for n in big or ()]  # 5 periods from the bootstrapped views
    rows = []
    for kind, n, periods, warmup in points:
        cmd = [sys.executable, __file__, kind, str(n), str(periods), str(warmup)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            r = {"kind": kind, "nodes": n, "periods": periods, "timed_out_s": timeout_s}
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


OVERLAY_NOTES = (  # what the last run measured (bench/results/scale.md)
    "Issue 32 asks for per-node cost flat from 100 to 3,000 nodes (<= 1.3x). Bytes per node-period with m"
    "embership on partial views: 1,422 -> 1,625 -> 1,654 (3,000 / 100: 1.16x, met); full membership's gro"
    "w with N (1,173 -> 3,236 at 1,000: push-pull carries the whole table), its tables hold N - 1 entries"
    ", and its converged tables at 3,000 nodes (9 M records) were not built. Entries held with partial vi"
    "ews: median 23 at 1,000 and 3,000 (at most 42) against 999. CPU per node-period: 0.86 -> 1.16 -> 1.3"
    "9 ms (3,000 / 100: 1.62x, **not met**). The growth is not in what a node holds or sends (tables, 3.1"
    " calls and ~1.6 kB a period at 1,000 and 3,000 alike) nor in the heap's size: as a control (`overlay"
    '_cost.py "partial views" 100 20 5 2900`), 100 nodes running beside 2,900 idle bootstrapped ones in t'
    "he same heap cost 0.93, 0.82, 0.86 ms (median 0.86) against 0.86, 0.84, 0.83 (median 0.84) alone (same run, interleaved). It follows h"
    "ow many nodes run in the one event loop (all N nodes' calls in flight at once: the loop's timer heap"
    " is O(log N) an operation, the working set outgrows the caches): likely an artifact of simulating N "
    "nodes in one process, which a daemon does not have; not proven here. At 100 nodes membership on the "
    "views costs more than full membership (3 calls a period — a probe, a shuffle and the handshake befor"
    "e it, since the partner may have pruned this node and Shuffle is a known-peer call — against a probe"
    " and a push-pull every 30 periods): 2.7x the CPU, 1.2x the bytes; at 1,000 half the bytes and 1.36x "
    "the CPU. Letting a shuffle from an authenticated but unknown peer through (it only feeds the passive"
    " view, bounded per source) would save a third of the calls; not done (it changes what Shuffle accept"
    "s). 10,000 nodes: 5 periods straight from bootstrapped views in 254 s (27 s set-up), peak RSS 1,130 "
    "MB for the process, one component, no false death; more calls and entries there (3.8 calls, tables o"
    "f 62) because without warm-up every first shuffle partner needs a handshake and the bootstrapped ent"
    "ries are still within the pruning grace. The machine was shared throughout (load 13-45 on 2 cores): "
    "CPU is process time, wall is not comparable between rows."
)


def report(data: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if "overlay" in data:
        out += [
            "",
            "## Membership cost per node and period: full membership against membership on partial views",
            "",
            "In-process, side by side (`--sections overlay`; " + __doc__.split("\n\n")[1].replace("\n", " ") + ")",
            "",
            "| nodes | membership | periods | CPU ms / node-period | bytes / node-period | calls / node-period "
            "| entries held (median, max) | wall s (set-up + measured) | peak RSS MB | views |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["overlay"]:
            if "timed_out_s" in r:
                out.append(
                    f"| {r['nodes']} | {r['kind']} | {r['periods']} | did not finish in {r['timed_out_s']:.0f} s |"
                )
                continue
            sizes = (
                f"active {r['active']}, passive {r['passive']}; {r['components']} component(s)"
                if "active" in r
                else f"push-pull every {r['push_pull_every']} periods"
            )
            calls = sum(r.get("calls", {}).values()) / 2  # (each call is recorded by both ends)
            out.append(
                f"| {r['nodes']} | {r['kind']} | {r['periods']} | {r['cpu_ms']:.3f} | {r['bytes']:.0f} | {calls:.2f} | "
                f"{r['state_entries']:.0f}, {r.get('max_entries', '–')} | {r.get('setup_s', 0):.0f} + "
                f"{r['wall_s']:.0f} | {r.get('peak_rss_mb', '–')} | {sizes} |"
            )
        big = [r for r in data["overlay"] if r["kind"] == "partial views" and r.get("warmup") == 0]
        by = {(r["kind"], r["nodes"]): r for r in data["overlay"] if "cpu_ms" in r and r not in big}
        for kind in ("full membership", "partial views"):
            ns = sorted(n for k, n in by if k == kind)
            if len(ns) >= 2:
                a, b = by[(kind, ns[0])], by[(kind, ns[-1])]
                out.append(
                    f"\n{kind}, {ns[-1]} / {ns[0]} nodes: CPU {b['cpu_ms'] / a['cpu_ms']:.2f}x, "
                    f"bytes {b['bytes'] / a['bytes']:.2f}x."
                )
        out += ["", OVERLAY_NOTES]
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


def network_size_control(total: int, each: int, reps: int, out: str | None = None) -> list[dict[str, Any]]:
    """Partial views, side by side and interleaved, each point a process of its own: ``each``
    nodes alone; ``total`` nodes as ``total / each`` separate networks of ``each``; ``total``
    nodes as one network. The second against the third is the cost of the network's size to a
    node, with the process holding as many nodes either way; the first against the second is what
    holding ``total`` nodes in one process costs (a daemon holds one)."""
    rows = []
    for rep in range(reps):
        for n, networks in ((each, 1), (total, total // each), (total, 1)):
            cmd = [sys.executable, __file__, "partial views", str(n), str(PARTIAL_PERIODS)]
            cmd += [str(WARMUP_PERIODS), "0", str(networks)]
            r = json.loads(
                subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            )
            r.update(rep=rep, networks=networks)
            print("  ", {k: r[k] for k in ("rep", "nodes", "networks", "cpu_ms", "bytes", "components")}, flush=True)
            rows.append(r)
    if out:
        cfg = {"total": total, "each": each, "reps": reps, "periods": PARTIAL_PERIODS, "warmup": WARMUP_PERIODS}
        atomic_write_json(out, {"config": cfg, "views": DAEMON_VIEWS.__dict__, "rows": rows})
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "control":  # control TOTAL EACH REPS [OUT.json]
        network_size_control(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
    else:  # one point (overlay_section runs each in its own process): KIND N PERIODS [WARMUP [BALLAST [NETWORKS]]]
        print(json.dumps(cost_point(*sys.argv[1:2], *map(int, sys.argv[2:]))))
