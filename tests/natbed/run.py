"""The NAT testbed, run by CI (.ci/run, "NAT testbed (network namespaces)"; docs/nat.md):

    sudo python -m tests.natbed.run            # NATBED_SITE_SIZE (default 3), NATBED_ROUNDS (6)

Real daemons in network namespaces (netns.py): two reachable nodes p0, p1 on a public segment;
two sites of outbound-only nodes (``--no-listen --relay p0 --relay p1``) behind routers doing
iptables MASQUERADE that drop new inbound connections. It asserts that the NAT is real (a plain
TCP connect from the public side to a site host fails, the same connect inside the site works,
and a site host's outbound connection arrives from its router's public address), then that every
NAT'd node is a full member: relayed via both public nodes, it pulls snapshots of nodes at the
other site and they pull its, and FedFomo weighs models across the NAT. Exit status 0 = all held;
namespaces and daemons are removed on any exit (SIGTERM and SIGINT included)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from .daemons import PEER_PORT, NsNode, make_pki, wait_for
from .netns import Site, Topology

PROBE_PORT = 9000


def _listen(ip: str) -> socket.socket:
    s = socket.create_server((ip, PROBE_PORT))
    s.settimeout(10)
    return s


def _connect(ip: str, timeout: float) -> str:
    """``ok`` or why not (a plain TCP connect, nothing Coterie)."""
    try:
        socket.create_connection((ip, PROBE_PORT), timeout=timeout).close()
        return "ok"
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def check_nat_is_real(topo: Topology) -> None:
    p0_ip = topo.address("p0")
    for site in topo.sites:
        inside, other = list(site.hosts)[:2]
        server = topo.in_netns(inside, _listen, topo.address(inside))
        try:
            before = topo.dropped_inbound(site)
            got = topo.in_netns("p0", _connect, topo.address(inside), 3.0)
            assert got != "ok", f"p0 connected to {inside} behind {site.router}: the NAT lets new inbound in"
            assert topo.dropped_inbound(site) > before, f"{site.router}'s firewall dropped nothing ({got})"
            assert topo.in_netns(other, _connect, topo.address(inside), 5.0) == "ok", "no control connect in the site"
            print(f"  site {site.name}: public -> {inside} refused by {site.router} ({got}); {other} -> {inside} ok")
        finally:
            topo.in_netns(inside, server.close)
        server = topo.in_netns("p0", _listen, p0_ip)
        try:
            assert topo.in_netns(inside, _connect, p0_ip, 5.0) == "ok", f"{inside} cannot dial out"
            conn, (src, _) = server.accept()
            conn.close()
            assert src == site.wan_ip, f"{inside}'s connection arrived from {src}, not {site.router}'s {site.wan_ip}"
            print(f"  site {site.name}: {inside} ({topo.address(inside)}) -> p0 arrives from {src} (MASQUERADE)")
        finally:
            topo.in_netns("p0", server.close)


def node_config(n: int, index: int, rounds: int, peers: list[str]) -> dict[str, Any]:
    return {
        "peers": peers,
        "rounds": rounds,
        "min_peers": n - 1,
        "start_timeout_s": 90.0,
        "round_interval_s": 0.0,
        "heartbeat_interval_s": 0.5,
        "suspect_after_s": 4.0,
        "dead_after_s": 10.0,
        "request_timeout_s": 30.0,
        "strategy": "fedfomo",
        "strategy_params": {"num_models": n - 1, "eps": 0.0},  # pull every peer every round
        "learner": {
            "dataset": "mnist1d",
            "partition": "label_permutation",
            "num_nodes": n,
            "node_index": index,
            "model": "mlp",
            "local_steps": int(os.environ.get("NATBED_LOCAL_STEPS", "20")),
            "dataset_params": {"num_samples": 2000},
            "partition_params": {"num_clusters": 1, "samples_per_node": int(os.environ.get("NATBED_SAMPLES", "120"))},
        },
    }


def start_nodes(
    topo: Topology, root: Path, rounds: int, nodes: dict[str, NsNode], extra: dict[str, Any] | None = None
) -> None:
    """Into ``nodes`` as each starts, so that the caller's clean-up finds every one. Without NAT
    (``topo.nat`` false) the site nodes listen on their own addresses, as in a flat network.
    ``extra``: config keys set on every node (compare.py's shaped links)."""
    hosts = [*topo.public, *(h for s in topo.sites for h in s.hosts)]
    make_pki(root, hosts)
    relays = [f"{topo.address(p)}:{PEER_PORT}" for p in topo.public]
    for i, host in enumerate(hosts):
        cfg = {**node_config(len(hosts), i, rounds, [relays[0]] if host != "p0" else []), **(extra or {})}
        if host in topo.public or not topo.nat:
            cfg["listen"] = f"{topo.address(host)}:{PEER_PORT}"
            args: list[str] = []
        else:  # outbound-only, as a user behind NAT starts it
            args = ["--no-listen", *(a for r in relays for a in ("--relay", r))]
        nodes[host] = NsNode(topo, root, host, cfg, args).start()
    for node in nodes.values():
        try:
            wait_for(node.ready, 120, f"{node.host} to come up")
        except AssertionError:
            raise AssertionError(f"{node.host} did not come up:\n{node.log_tail()}") from None


def check_full_members(topo: Topology, nodes: dict[str, NsNode], rounds: int) -> None:
    relays = ",".join(f"{topo.address(p)}:{PEER_PORT}" for p in topo.public)
    natted = [h for s in topo.sites for h in s.hosts]
    for h in natted:
        # both reservations held and both relays advertised: a relay that came up after the node
        # leaves its address for a while (relay housekeeping) and comes back on the next heartbeat
        last: dict[str, Any] = {}
        try:
            wait_for(partial(_relayed_via, nodes[h], relays, last), 60, f"{h} relayed via both relays, both held")
        except Exception as e:
            raise AssertionError(f"{h}: {last.get('relay')}") from e
    t0 = time.monotonic()
    for h, node in nodes.items():
        wait_for(partial(finished_rounds, node, rounds), 180, f"{h} to finish {rounds} rounds")
    print(f"  {rounds} rounds on all {len(nodes)} nodes {time.monotonic() - t0:.1f} s after every relay was held")
    history = {h: n.get("/history") for h, n in nodes.items()}
    contacted = {h: {p for e in hist for p in (e.get("contacted") or [])} for h, hist in history.items()}
    weighted = {
        h: {p for e in hist for p, w in (e.get("weights") or {}).items() if p != h and (w or 0) > 0}
        for h, hist in history.items()
    }
    for site in topo.sites:
        others = [h for h in natted if h not in site.hosts]
        for h in site.hosts:
            pulled = contacted[h] & set(others)
            assert pulled, f"{h} pulled no snapshot from the other site (contacted: {sorted(contacted[h])})"
            pulled_by = {o for o in others if h in contacted[o]}
            assert pulled_by, f"no node at the other site pulled {h}'s snapshot"
            print(
                f"  {h}: pulled {sorted(pulled)}, pulled by {sorted(pulled_by)}, "
                f"weighs {sorted(weighted[h] & set(others)) or 'none'} across the NAT"
            )
    cross = sum(bool(weighted[h] & (set(natted) - set(_site(topo, h).hosts))) for h in natted)
    assert cross, "no NAT'd node gave a positive FedFomo weight to a model from the other site"
    print(f"  {cross}/{len(natted)} NAT'd nodes weigh a model from the other site")
    loss = [[float(hist[k]["eval"]["test_loss"]) for hist in history.values()] for k in (0, -1)]
    acc = [sum(float(hist[k]["eval"]["test_acc"]) for hist in history.values()) / len(history) for k in (0, -1)]
    print(
        f"  mean test loss round 1 -> {rounds}: {_mean(loss[0]):.3f} -> {_mean(loss[1]):.3f}; "
        f"mean test accuracy {acc[0]:.3f} -> {acc[1]:.3f}"
    )
    assert _mean(loss[1]) < _mean(loss[0]), "the network did not learn: mean test loss did not fall"
    for h in natted:  # informative only: a loaded box may time a tunnel out, which the dialer retries
        problems = [p for p in nodes[h].get("/status")["problems"] if "relay" in str(p)]
        if problems:
            print(f"  note: {h} reports relay problems {problems}")


def _relayed_via(node: NsNode, relays: str, last: dict[str, Any]) -> bool:
    relay: dict[str, Any] = node.get("/status")["relay"]
    last["relay"] = relay
    return relay["reachability"] == f"relayed via {relays}" and set(relay["reservations"].values()) == {"held"}


def finished_rounds(node: NsNode, rounds: int) -> bool:
    return int(node.get("/status")["round"]) >= rounds


def _site(topo: Topology, host: str) -> Site:
    site = topo.site_of(host)
    assert site is not None
    return site


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> int:
    if os.geteuid() != 0:
        print("natbed: needs root (network namespaces, iptables)", file=sys.stderr)
        return 2
    size, rounds = int(os.environ.get("NATBED_SITE_SIZE", "3")), int(os.environ.get("NATBED_ROUNDS", "6"))
    topo = Topology(prefix=os.environ.get("NATBED_PREFIX", "cnb"), site_size=size)
    nodes: dict[str, NsNode] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below cleans up
    t0 = time.monotonic()
    keep = os.environ.get("NATBED_DIR")
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="natbed-"))
    root.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        topo.up()
        print(f"natbed: {len(topo.made)} namespaces up ({time.monotonic() - t0:.1f} s); checking the NAT")
        check_nat_is_real(topo)
        start_nodes(topo, root, rounds, nodes)
        print(f"natbed: {len(nodes)} daemons up ({time.monotonic() - t0:.1f} s); {2 * size} behind NAT")
        check_full_members(topo, nodes, rounds)
        print(f"natbed: ok ({time.monotonic() - t0:.1f} s)")
        ok = True
        return 0
    except AssertionError as e:
        print(f"natbed: FAILED: {e}", file=sys.stderr)
        for n in nodes.values():
            print(f"--- {n.host} log tail\n{n.log_tail(15)}", file=sys.stderr)
        return 1
    finally:
        for n in nodes.values():  # all at once, then wait for each
            n.terminate()
        for n in nodes.values():
            n.stop()
        topo.down()
        if ok and not keep:
            shutil.rmtree(root, ignore_errors=True)
        print("natbed: namespaces and daemons removed" + ("" if ok and not keep else f"; logs and state in {root}"))


if __name__ == "__main__":
    sys.exit(main())
