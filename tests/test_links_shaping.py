"""bench/links.py's shaped namespaces really limit the rate: 2 MB from one namespace to another
at 10 Mbit/s cannot take less than 1.6 s (1.3 s allowed for the shaper's burst); the same path at
1000 Mbit/s moves it in well under a second. Needs root and iproute2 (`ip`, `tc`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.links import ShapedNet, cleanup, shaping_problem

PREFIX = "ctlkt"  # not the bench's own prefix: a running benchmark is never touched
SUBNET = "10.231.7"

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5201)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); n = 0
while (b := c.recv(1 << 16)):
    n += len(b)
c.sendall(str(n).encode()); c.close()
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5201), timeout=15)
t0 = time.monotonic()
c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR); got = c.recv(32).decode()
print(got, time.monotonic() - t0)
"""

pytestmark = [
    pytest.mark.timeout(20),
    pytest.mark.skipif(bool(shaping_problem()), reason=f"shaped namespaces: {shaping_problem()}"),
]


def transfer_s(net: ShapedNet, nbytes: int) -> float:
    server = subprocess.Popen(
        [*net.wrap(1), sys.executable, "-c", SERVER, net.ip(1)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout and server.stdout.readline().strip() == "listening"
        got = subprocess.run(
            [*net.wrap(0), sys.executable, "-c", CLIENT, net.ip(1), str(nbytes)],
            capture_output=True,
            text=True,
            timeout=15,
        )
        received, took = got.stdout.split() if got.stdout.strip() else ("", "")
        assert received == str(nbytes), got.stderr
        return float(took)  # connected to all bytes acknowledged: no interpreter start-up in it
    finally:
        server.kill()
        server.wait()


def test_tbf_limits_throughput_between_namespaces():
    with ShapedNet(2, 10, prefix=PREFIX, subnet=SUBNET) as net:
        took = transfer_s(net, 2_000_000)
        up = net.kernel_bytes(0)["up"]
    # 16 Mbit at 10 Mbit/s: 1.6 s
    assert took >= 1.3, f"2 MB at 10 Mbit/s took {took:.2f} s: the link is not shaped"
    assert up >= 2_000_000, f"the shaper on n0's upload saw {up} bytes: the traffic went another way"
    assert cleanup(PREFIX) == [], "the context manager left namespaces or links behind"


def test_unshaped_rate_is_far_above_the_limit():
    """The control: the same path at 1000 Mbit/s moves 2 MB fast, so the 10 Mbit/s test measures the
    shaper, not a slow path or a busy machine."""
    with ShapedNet(2, 1000, prefix=PREFIX, subnet=SUBNET) as net:
        took = transfer_s(net, 2_000_000)
    assert took < 1.3, f"2 MB at 1000 Mbit/s took {took:.2f} s"
