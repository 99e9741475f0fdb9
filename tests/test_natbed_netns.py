"""The NAT testbed's network on its own (tests/natbed/netns.py; the daemons run in CI's phase
"NAT testbed (network namespaces)", python -m tests.natbed.run): its routers really translate and
really drop new inbound connections, and the check that says so fails once a router lets them in.
Needs root and iptables; skipped elsewhere (the CI phase itself fails instead of skipping)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.natbed.netns import Topology, sh
from tests.natbed.run import check_nat_is_real

pytestmark = pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("iptables")),
    reason="network namespaces and iptables need root, ip and iptables",
)


@pytest.fixture
def topo():
    t = Topology(prefix=f"cnt{os.getpid() % 10000}", site_size=2)
    try:
        t.up()
        yield t
    finally:
        t.down()
    assert not [n for n in sh("ip", "netns", "list").split() if n.startswith(t.prefix + "-")]


def test_routers_translate_and_drop_new_inbound_connections(topo):
    check_nat_is_real(topo)


def test_the_check_fails_when_a_router_lets_new_connections_in(topo):
    sh("ip", "netns", "exec", topo.ns("r1"), "iptables", "-P", "FORWARD", "ACCEPT")  # the firewall is gone
    with pytest.raises(AssertionError, match="p0 connected to a1 behind r1"):
        check_nat_is_real(topo)
