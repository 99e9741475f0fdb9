"""Snapshot transfer throughput: Coterie's gRPC snapshot stream vs a raw TCP socket, loopback.

Both servers run in a child process (so client and server do not share a GIL) and send the same
bytes: a Coterie-encoded model of the given size. The gRPC side is the real path a node uses to
pull a peer's snapshot (``PeerClient.get_snapshot``: 1 MiB chunks framed from the published
buffer as they are sent; received chunks copied once into one buffer and sha256-checked as they
arrive, tensors decoded as views of it). The raw side is ``sendall`` / ``recv_into`` of the same
bytes into one preallocated buffer, no hashing.
Each size is measured ``--repeat`` times, alternating the two, and medians are compared.

    python bench/wire_throughput.py --sizes 1MB,100MB,1GB --repeat 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time

import torch

from coterie.node.config import PROTOCOL_VERSION
from coterie.node.peering.messages import LocalSnapshot, NodeInfo
from coterie.node.transport.client import PeerClient
from coterie.node.transport.server import serve

UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for u, m in UNITS.items():
        if s.endswith(u):
            return int(float(s[:-len(u)]) * m)
    return int(s)


def model_groups(n: int) -> dict:
    return {"params": {"w": torch.randn(max(n // 4, 1))}}


class _NullStats:
    def record(self, *a, **k): pass
    def latency(self, *a, **k): pass


class BenchHandler:
    """Serves one snapshot to anyone (the peering.interfaces.PeerHandler surface a pull uses)."""
    node_id = "server"

    def __init__(self, groups: dict):
        self.snap = LocalSnapshot("server", 1, 1, groups)
        self.snap.prepare()  # encoded once, as a node does when it publishes

    def info(self):
        return NodeInfo("server", PROTOCOL_VERSION, "")

    async def snapshot(self, requester, min_round=0, wait_s=0.0):
        return self.snap

    def check_known(self, node_id):
        return None


def _grpc_server(size: int, port_q: mp.Queue) -> None:
    async def main():
        server, port = await serve(BenchHandler(model_groups(size)), _NullStats(), "127.0.0.1:0",
                                   max_model_bytes=1 << 34)
        port_q.put(port)
        await server.wait_for_termination()
    asyncio.run(main())


def _tcp_server(size: int, port_q: mp.Queue) -> None:
    data = LocalSnapshot("server", 1, 1, model_groups(size)).encoded
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    while True:
        conn, _ = srv.accept()
        with conn:
            conn.recv(1)
            conn.sendall(len(data).to_bytes(8, "little"))
            conn.sendall(data)


def tcp_fetch(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"g")
        hdr = b""
        while len(hdr) < 8:
            hdr += s.recv(8 - len(hdr))
        n = int.from_bytes(hdr, "little")
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = s.recv_into(view[got:], min(n - got, 1 << 20))
            if not k:
                raise ConnectionError("short read")
            got += k
        return got


async def grpc_fetch(client: PeerClient, address: str) -> int:
    _, groups = await client.get_snapshot(address, "bench", 0)
    return sum(t.numel() * t.element_size() for ts in groups.values() for t in ts.values())


def measure(size: int, repeat: int) -> dict:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_grpc_server, args=(size, q), daemon=True),
             ctx.Process(target=_tcp_server, args=(size, q), daemon=True)]
    procs[0].start()
    gport = q.get(timeout=120)
    procs[1].start()
    tport = q.get(timeout=120)
    client = PeerClient("bench", _NullStats(), chunk_bytes=1 << 20, max_model_bytes=1 << 34,
                        max_gossip_bytes=1 << 20, timeout_s=600)
    loop = asyncio.new_event_loop()
    g_times, t_times = [], []
    try:
        loop.run_until_complete(grpc_fetch(client, f"127.0.0.1:{gport}"))  # warm the channel
        tcp_fetch(tport)
        for _ in range(repeat):
            t0 = time.perf_counter()
            n = loop.run_until_complete(grpc_fetch(client, f"127.0.0.1:{gport}"))
            g_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m = tcp_fetch(tport)
            t_times.append(time.perf_counter() - t0)
            assert m - 4096 < n <= m  # tensor bytes vs the encoded message (a small header more)
    finally:
        loop.run_until_complete(client.close())
        loop.close()
        for p in procs:
            p.kill()
    g, t = statistics.median(g_times), statistics.median(t_times)
    return {"bytes": n, "grpc_median_s": g, "tcp_median_s": t, "grpc_MBps": n / g / 1e6,
            "tcp_MBps": n / t / 1e6, "ratio_grpc_over_tcp": (n / g) / (n / t), "repeat": repeat}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MB,100MB,1GB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    load0 = _load()
    rows = []
    print(f"{'size':>8} {'gRPC MB/s':>10} {'TCP MB/s':>10} {'ratio':>6}   (medians of {args.repeat})")
    for s in args.sizes.split(","):
        r = measure(parse_size(s), args.repeat)
        r["size"] = s
        rows.append(r)
        print(f"{s:>8} {r['grpc_MBps']:10.0f} {r['tcp_MBps']:10.0f} {r['ratio_grpc_over_tcp']:6.2f}   load {_load()}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_before": load0, "load_after": _load(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
