"""The NAT testbed's network (docs/nat.md, "Tested in CI behind a real NAT"): Linux network
namespaces joined by veth pairs, made with iproute2, and two site routers doing real address
translation with iptables.

    public segment 10.77.0.0/24 (a bridge in namespace <prefix>-pub)
      p0 10.77.0.10   p1 10.77.0.11       reachable nodes
      r1 10.77.0.1    r2 10.77.0.2        the sites' routers, WAN side
    site a 10.77.1.0/24 behind r1 (LAN bridge in r1, r1 = 10.77.1.1): a1 .11, a2 .12, ...
    site b 10.77.2.0/24 behind r2 (LAN bridge in r2, r2 = 10.77.2.1): b1 .11, b2 .12, ...

Each router MASQUERADEs what leaves its site and forwards from the WAN into its site only what
conntrack knows (ESTABLISHED,RELATED): a new inbound connection is dropped. The public hosts
even have routes to the sites through their routers, so the firewall alone stands in the way.

Everything is made inside namespaces whose names start with the prefix: nothing is added to the
host's own network. ``in_netns`` runs a function on a thread that has entered one namespace,
so the checker can open sockets there (admin APIs listen on each namespace's own loopback)."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

CLONE_NEWNET = 0x40000000
PUBLIC_NET = "10.77.0"


class NetnsError(RuntimeError):
    """A namespace, link, address or firewall rule could not be made."""


def sh(*args: str) -> str:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


@dataclass
class Site:
    name: str  # "a", "b"
    index: int  # 1, 2: router r<index>, LAN 10.77.<index>.0/24
    size: int

    @property
    def router(self) -> str:
        return f"r{self.index}"

    @property
    def wan_ip(self) -> str:
        return f"{PUBLIC_NET}.{self.index}"

    @property
    def lan(self) -> str:
        return f"10.77.{self.index}"

    @property
    def hosts(self) -> dict[str, str]:
        """host name -> LAN address"""
        return {f"{self.name}{k}": f"{self.lan}.{10 + k}" for k in range(1, self.size + 1)}


@dataclass
class Topology:
    prefix: str = "cnb"
    site_size: int = 3
    nat: bool = True  # False: the routers only route (the same network, flat, for comparison)
    rate_mbit: float = 0.0  # > 0: every host's link shaped by tc tbf to this rate, up and down (compare.py)
    public: dict[str, str] = field(default_factory=lambda: {"p0": f"{PUBLIC_NET}.10", "p1": f"{PUBLIC_NET}.11"})
    made: list[str] = field(default_factory=list)  # namespaces this object created, for down()
    _threads: dict[str, ThreadPoolExecutor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sites = [Site("a", 1, self.site_size), Site("b", 2, self.site_size)]

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        if host in self.public:
            return self.public[host]
        for s in self.sites:
            if host in s.hosts:
                return s.hosts[host]
        raise KeyError(host)

    def site_of(self, host: str) -> Site | None:
        return next((s for s in self.sites if host in s.hosts), None)

    # ------------------------------------------------------------------ making it
    def _netns(self, host: str) -> str:
        ns = self.ns(host)
        sh("ip", "netns", "add", ns)
        self.made.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _veth(self, host_ns: str, switch_ns: str, port: str, bridge: str, ifname: str = "eth0") -> None:
        """``ifname`` in host_ns, its peer ``port`` enslaved to ``bridge`` in switch_ns."""
        sh("ip", "-n", host_ns, "link", "add", ifname, "type", "veth", "peer", "name", port, "netns", switch_ns)
        sh("ip", "-n", switch_ns, "link", "set", port, "master", bridge, "up")
        sh("ip", "-n", host_ns, "link", "set", ifname, "up")
        if self.rate_mbit > 0 and ifname == "eth0":  # a host's link (not a router's uplink)
            self._tbf(host_ns, ifname)  # its upload
            self._tbf(switch_ns, port)  # its download

    def _tbf(self, ns: str, dev: str) -> None:
        # as bench/links.py: burst at least one timer tick's worth at this rate (HZ >= 100), >= 4 KB
        burst = max(4096, int(self.rate_mbit * 1e6 / 8 / 100))
        tbf = ("tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "400ms")
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf)

    def up(self) -> None:
        stale = [n for n in sh("ip", "netns", "list").split() if n.startswith(self.prefix + "-")]
        if stale:
            raise NetnsError(f"namespaces of an earlier run are still there: {stale} (`ip netns del` them)")
        pub = self._netns("pub")
        sh("ip", "-n", pub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", pub, "link", "set", "br0", "up")
        for host, ip in self.public.items():
            ns = self._netns(host)
            self._veth(ns, pub, host, "br0")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            for s in self.sites:  # the worst case for a NAT: the public side knows the way in
                sh("ip", "-n", ns, "route", "add", f"{s.lan}.0/24", "via", s.wan_ip)
        for s in self.sites:
            self._site(s, pub)

    def _site(self, s: Site, pub: str) -> None:
        r = self._netns(s.router)
        self._veth(r, pub, s.router, "br0", ifname="wan")
        sh("ip", "-n", r, "addr", "add", f"{s.wan_ip}/24", "dev", "wan")
        sh("ip", "-n", r, "link", "add", "lan", "type", "bridge")
        sh("ip", "-n", r, "addr", "add", f"{s.lan}.1/24", "dev", "lan")
        sh("ip", "-n", r, "link", "set", "lan", "up")
        for host, ip in s.hosts.items():
            ns = self._netns(host)
            self._veth(ns, r, host, "lan")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"{s.lan}.1")
        ipt = ("ip", "netns", "exec", r, "iptables")
        sh("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        if not self.nat:
            # flat: one routed network, every host reaches every other (without these routes a
            # site's nodes could not dial the other site's, and the flat side of compare.py waited
            # out its start timeout and pulled two peers fewer a round)
            for other in self.sites:
                if other is not s:
                    sh("ip", "-n", r, "route", "add", f"{other.lan}.0/24", "via", other.wan_ip)
            return
        sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", f"{s.lan}.0/24", "-o", "wan", "-j", "MASQUERADE")
        sh(*ipt, "-P", "FORWARD", "DROP")
        sh(*ipt, "-A", "FORWARD", "-i", "lan", "-o", "lan", "-j", "ACCEPT")  # within the site (br_netfilter)
        sh(*ipt, "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT")  # out: anything
        sh(
            *ipt,
            "-A",
            "FORWARD",
            "-i",
            "wan",
            "-o",
            "lan",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "ACCEPT",
        )  # in: answers only; the rest: policy DROP
        sh(*ipt, "-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        sh(*ipt, "-A", "INPUT", "-i", "wan", "-j", "DROP")

    def down(self) -> None:
        for t in self._threads.values():
            t.shutdown(wait=False, cancel_futures=True)
        self._threads.clear()
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()

    def dropped_inbound(self, s: Site) -> int:
        """Packets the router's FORWARD policy dropped (new connections from the WAN)."""
        out = sh("ip", "netns", "exec", self.ns(s.router), "iptables", "-L", "FORWARD", "-v", "-x", "-n")
        m = re.search(r"\(policy (\w+) (\d+) packets", out)
        if not m:
            raise NetnsError(f"{s.router}: no FORWARD policy counter in {out.splitlines()[:1]}")
        return int(m.group(2)) if m.group(1) == "DROP" else 0

    # ------------------------------------------------------------------ acting inside
    def in_netns(self, host: str, fn: Callable[..., Any], *args: Any, timeout: float = 60) -> Any:
        """``fn(*args)`` on a thread that lives in ``host``'s namespace (sockets it opens are there)."""
        ex = self._threads.get(host)
        if ex is None:
            ex = self._threads[host] = ThreadPoolExecutor(1, f"ns-{host}", _enter, (self.ns(host),))
        return ex.submit(fn, *args).result(timeout)

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]


def _enter(ns: str) -> None:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise NetnsError(f"setns({ns}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
