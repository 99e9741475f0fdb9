"""Snapshot transfer throughput: Coterie's gRPC snapshot stream over mTLS and over plaintext, vs
a raw TCP socket, loopback.

Repeated pulls of one peer run on a pull session (``PullSnapshots``: one stream, a request and
its answer per pull), as a node's do; "mTLS call" is the same pull as a call of its own
(``pull_sessions = false``), side by side.

The servers run in child processes (so client and server do not share a GIL) and send the same
bytes: a Coterie-encoded model of the given size. The gRPC side is the real path a node uses to
pull a peer's snapshot (``PeerClient.get_snapshot``: 1 MiB chunks, size and sha256 checked while
reassembling, tensors decoded), once with mTLS (certificates from a throwaway CA, as nodes run by
default) and once plaintext (``security.insecure``). The raw side is ``sendall`` / ``recv_into``
of the same bytes, no hashing, no encryption. Each size is measured ``--repeat`` times, the three
alternating, and medians are compared.

A subscription (``WatchSnapshots``, how a node receives the snapshots of a peer it pulls from round
after round) is measured against its raw equivalent: ``--stream`` consecutive snapshots pushed on
one mTLS stream (each checked and decoded like a pull) vs the same number of payloads sent back to
back on one TCP socket; per-snapshot medians.

    python bench/wire_throughput.py --sizes 1MB,100MB,1GB --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from coterie.node.config import PROTOCOL_VERSION
from coterie.node.peering.messages import LocalSnapshot, NodeInfo
from coterie.node.security.pki import init_ca, issue_cert, load_credentials
from coterie.node.transport.client import PeerClient
from coterie.node.transport.server import serve
from coterie.node.transport.tls import TLS

UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for u, m in UNITS.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def model_groups(n: int) -> dict:
    return {"params": {"w": torch.randn(max(n // 4, 1))}}


class _NullStats:
    def record(self, *a, **k):
        pass

    def latency(self, *a, **k):
        pass


class BenchHandler:
    """Serves one snapshot to anyone (the peering.interfaces.PeerHandler surface a pull uses)."""

    node_id = "server"

    def __init__(self, groups: dict):
        self.snap = LocalSnapshot("server", 1, 1, groups)
        self.snap.prepare()  # encoded once, as a node does when it publishes

    def info(self):
        return NodeInfo("server", PROTOCOL_VERSION, "")

    async def snapshot(self, requester, min_round=0, wait_s=0.0):
        if not min_round:
            return self.snap
        # a subscription asks for the next round: "publish" it at once, the same encoded bytes
        # under a new version (a node encodes a snapshot once when it publishes, not per reader)
        snap = LocalSnapshot("server", min_round, min_round, {})
        snap._encoded, snap._digest = self.snap.encoded, self.snap.digest
        return snap

    def check_known(self, node_id):
        return None

    def admit(self, peer, kind):
        return contextlib.nullcontext()


def make_pki() -> Path:
    d = Path(tempfile.mkdtemp(prefix="coterie-wire-"))
    init_ca(d / "ca")
    issue_cert(d / "ca", "server", d / "server")
    issue_cert(d / "ca", "bench", d / "bench")
    return d


def _tls(pki: Path | None, node_id: str) -> TLS | None:
    return TLS(load_credentials(pki / node_id)) if pki is not None else None


def _grpc_server(size: int, port_q: mp.Queue, pki: Path | None, chunk: int = 1 << 20) -> None:
    async def main():
        server, port = await serve(
            BenchHandler(model_groups(size)),
            _NullStats(),
            "127.0.0.1:0",
            tls=_tls(pki, "server"),
            max_model_bytes=1 << 34,
            chunk_bytes=chunk,
        )
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
            ask = conn.recv(5)
            times = int.from_bytes(ask[1:5], "little") if ask[:1] == b"s" else 1
            for _ in range(times):  # "s" + n: n payloads back to back (a subscription's raw equivalent)
                conn.sendall(len(data).to_bytes(8, "little"))
                conn.sendall(data)


def tcp_fetch(port: int, times: int = 0) -> int:
    """One payload (``times`` = 0), or ``times`` sent back to back; the bytes of the last."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"s" + times.to_bytes(4, "little") if times else b"g")
        for _ in range(max(times, 1)):
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


async def grpc_watch(client: PeerClient, address: str, times: int) -> int:
    n = 0
    async for _, groups in client.watch_snapshots(address, "bench", min_round=1, peer="server"):
        n += 1
        if n == times:
            return sum(t.numel() * t.element_size() for ts in groups.values() for t in ts.values())
    raise RuntimeError("subscription ended early")


async def grpc_fetch(client: PeerClient, address: str) -> int:
    _, groups = await client.get_snapshot(address, "bench", 0, peer="server" if client.tls else None)
    return sum(t.numel() * t.element_size() for ts in groups.values() for t in ts.values())


def measure(size: int, repeat: int, pki: Path, chunk: int = 1 << 20, stream: int = 0) -> dict:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    ports = {}
    procs = []
    for name, target, args in (
        ("tls", _grpc_server, (size, q, pki, chunk)),
        ("plain", _grpc_server, (size, q, None, chunk)),
        ("tcp", _tcp_server, (size, q)),
    ):
        procs.append(ctx.Process(target=target, args=args, daemon=True))
        procs[-1].start()
        ports[name] = q.get(timeout=120)
    clients = {
        name: PeerClient(
            "bench",
            _NullStats(),
            chunk_bytes=chunk,
            max_model_bytes=1 << 34,
            max_gossip_bytes=1 << 20,
            timeout_s=600,
            tls=_tls(p, "bench"),
            sessions=sessions,
        )
        for name, p, sessions in (("tls", pki, True), ("plain", None, True), ("tls_call", pki, False))
    }
    ports["tls_call"] = ports["tls"]
    loop = asyncio.new_event_loop()
    times: dict[str, list[float]] = {"tls": [], "plain": [], "tcp": [], "tls_call": []}
    if stream:
        times.update({"watch": [], "tcp_stream": []})
    try:
        for name, c in clients.items():  # warm the channels (TLS handshake, HTTP/2 windows, the session)
            for _ in range(2):
                loop.run_until_complete(grpc_fetch(c, f"127.0.0.1:{ports[name]}"))
        tcp_fetch(ports["tcp"])
        for rep in range(repeat):  # session and call take turns going first (neither always follows the watch)
            for name in ("tls", "plain", "tcp", "tls_call") if rep % 2 else ("tls_call", "plain", "tcp", "tls"):
                t0 = time.perf_counter()
                if name == "tcp":
                    m = tcp_fetch(ports["tcp"])
                else:
                    n = loop.run_until_complete(grpc_fetch(clients[name], f"127.0.0.1:{ports[name]}"))
                times[name].append(time.perf_counter() - t0)
            assert m - 4096 < n <= m  # tensor bytes vs the encoded message (a small header more)
            if stream:  # per snapshot of a run of ``stream``
                t0 = time.perf_counter()
                n = loop.run_until_complete(grpc_watch(clients["tls"], f"127.0.0.1:{ports['tls']}", stream))
                times["watch"].append((time.perf_counter() - t0) / stream)
                t0 = time.perf_counter()
                m = tcp_fetch(ports["tcp"], stream)
                times["tcp_stream"].append((time.perf_counter() - t0) / stream)
                assert m - 4096 < n <= m
    finally:
        for c in clients.values():
            loop.run_until_complete(c.close())
        loop.close()
        for p in procs:
            p.kill()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bytes": n,
        **{f"{k}_median_s": v for k, v in med.items()},
        **{f"{k}_MBps": n / v / 1e6 for k, v in med.items()},
        "ratio_tls_over_plain": med["plain"] / med["tls"],
        "ratio_tls_over_tcp": med["tcp"] / med["tls"],
        "ratio_plain_over_tcp": med["tcp"] / med["plain"],
        "ratio_tls_call_over_tcp": med["tcp"] / med["tls_call"],
        "ratio_session_over_call": med["tls_call"] / med["tls"],
        "repeat": repeat,
        **({"stream": stream, "ratio_watch_over_tcp_stream": med["tcp_stream"] / med["watch"]} if stream else {}),
    }


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MB,100MB,1GB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--chunk", default="1MB", help="snapshot chunk size (node config chunk_bytes; the default is 1 MiB)"
    )
    ap.add_argument(
        "--stream",
        type=int,
        default=0,
        help="also a subscription: this many snapshots on one mTLS stream vs back to back on TCP",
    )
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    load0 = _load()
    rows = []
    pki = make_pki()
    print(
        f"{'size':>8} {'mTLS MB/s':>10} {'plain MB/s':>11} {'TCP MB/s':>9} {'mTLS/plain':>11} "
        f"{'mTLS/TCP':>9} {'plain/TCP':>10} {'mTLS call MB/s':>15} {'call/TCP':>9}   (medians of {args.repeat})"
    )
    for s in args.sizes.split(","):
        r = measure(parse_size(s), args.repeat, pki, parse_size(args.chunk), args.stream)
        r["size"] = s
        rows.append(r)
        print(
            f"{s:>8} {r['tls_MBps']:10.0f} {r['plain_MBps']:11.0f} {r['tcp_MBps']:9.0f} "
            f"{r['ratio_tls_over_plain']:11.2f} {r['ratio_tls_over_tcp']:9.2f} {r['ratio_plain_over_tcp']:10.2f} "
            f"{r['tls_call_MBps']:15.0f} {r['ratio_tls_call_over_tcp']:9.2f}",
            flush=True,
        )
        if args.stream:
            print(
                f"{'':>8} subscription (mTLS): {r['watch_MBps']:.0f} MB/s per snapshot vs TCP back to back "
                f"{r['tcp_stream_MBps']:.0f} MB/s = {r['ratio_watch_over_tcp_stream']:.2f}x",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_before": load0, "load_after": _load(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
