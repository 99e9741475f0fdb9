"""Tiny TCP throughput probe for the testbed (stdlib only; runs inside the node image).

  python3 netcheck.py serve PORT            accept connections, read and discard, forever
  python3 netcheck.py send HOST PORT BYTES  send BYTES to HOST:PORT, print JSON {bytes, seconds, mbit_s}

Used by tests/testbed/check.py to show that the tc cap on the slow-link node is what a peer
receives, next to an uncapped node as the control."""

from __future__ import annotations

import json
import socket
import sys
import time


def serve(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port), reuse_port=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 16):
                pass
            conn.sendall(b"k")  # tell the sender everything arrived


def send(host: str, port: int, nbytes: int) -> None:
    payload = b"\0" * (1 << 14)
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=60) as s:
        left = nbytes
        while left > 0:
            n = s.send(payload[: min(left, len(payload))])
            left -= n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the receiver has read every byte
    dt = time.perf_counter() - t0
    print(json.dumps({"bytes": nbytes, "seconds": round(dt, 4), "mbit_s": round(nbytes * 8 / dt / 1e6, 3)}))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif len(sys.argv) >= 5 and sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)
