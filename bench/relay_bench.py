"""Relayed vs direct snapshot transfer, side by side in one run (docs/nat.md).

Three child processes on loopback: a node serving one snapshot on a TCP peer port (direct); the
same node outbound-only (``no_listen``: its peer server on a private Unix socket, a ``Reserve``
stream to the relay); and a relay (``RelayService`` on its own mTLS port). The bench process pulls
the snapshot with a node's real client (``PeerClient.get_snapshot``: mTLS, chunks, sha256,
decode), from the direct node and through the relay (``relay://RELAY/server``: the TLS session
ends at the node, the relay splices ciphertext), alternating, ``--repeat`` times per size;
medians compared. The relay's CPU seconds (utime + stime from /proc) over the relayed pulls
give its CPU cost per relayed GB.

    python bench/relay_bench.py --sizes 100KB,20MB --repeat 7 --out bench/results/relay.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wire_throughput import BenchHandler, _NullStats, _tls, make_pki, model_groups, parse_size  # noqa: E402

from coterie.node.security.pki import issue_cert  # noqa: E402
from coterie.node.transport.client import PeerClient  # noqa: E402
from coterie.node.transport.relay_dialer import RelayDialer  # noqa: E402
from coterie.node.transport.relay_reservations import RelayReservations  # noqa: E402
from coterie.node.transport.relay_service import RelayBudget, RelayService  # noqa: E402
from coterie.node.transport.server import serve  # noqa: E402


def _node(size: int, q: mp.Queue, pki: Path, relay: str | None) -> None:
    async def main():
        tls = _tls(pki, "server")
        address = "127.0.0.1:0"
        if relay is not None:
            address = f"unix:{tempfile.mkdtemp(prefix='coterie-bench-')}/peer.sock"
        server, port = await serve(
            BenchHandler(model_groups(size)), _NullStats(), address, tls=tls, max_model_bytes=1 << 34
        )
        if relay is not None:
            RelayReservations(tls, [relay], address[len("unix:") :]).start()
        q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _relay(q: mp.Queue, pki: Path) -> None:
    async def main():
        import grpc

        from coterie.node.transport.relay_service import handlers

        tls = _tls(pki, "relay")
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handlers(RelayService(tls, RelayBudget(max_bytes_per_s=1e12))),))
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
        await server.start()
        q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def pull(client: PeerClient, address: str) -> int:
    _, groups = await client.get_snapshot(address, "bench", 0, peer="server")
    return sum(t.numel() * t.element_size() for ts in groups.values() for t in ts.values())


def measure(size: int, repeat: int, pki: Path) -> dict:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    relay = ctx.Process(target=_relay, args=(q, pki), daemon=True)
    relay.start()
    relay_addr = f"127.0.0.1:{q.get(timeout=120)}"
    direct = ctx.Process(target=_node, args=(size, q, pki, None), daemon=True)
    direct.start()
    direct_addr = f"127.0.0.1:{q.get(timeout=120)}"
    relayed = ctx.Process(target=_node, args=(size, q, pki, relay_addr), daemon=True)
    relayed.start()
    q.get(timeout=120)
    relayed_addr = f"relay://{relay_addr}/server"
    tls = _tls(pki, "bench")
    client = PeerClient(
        "bench",
        _NullStats(),
        chunk_bytes=1 << 20,
        max_model_bytes=1 << 34,
        timeout_s=600,
        tls=tls,
        relay_dialer=RelayDialer(tls),
    )
    loop = asyncio.new_event_loop()
    times: dict[str, list[float]] = {"direct": [], "relayed": []}
    relay_cpu = 0.0
    try:
        deadline = time.monotonic() + 30
        while True:  # the reservation is up once a relayed pull works
            try:
                loop.run_until_complete(pull(client, relayed_addr))
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        loop.run_until_complete(pull(client, direct_addr))
        for rep in range(repeat):
            for name in ("direct", "relayed") if rep % 2 else ("relayed", "direct"):
                c0 = cpu_s(relay.pid) if name == "relayed" else 0.0
                t0 = time.perf_counter()
                n = loop.run_until_complete(pull(client, direct_addr if name == "direct" else relayed_addr))
                times[name].append(time.perf_counter() - t0)
                if name == "relayed":
                    relay_cpu += cpu_s(relay.pid) - c0
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "bytes": n,
            "repeat": repeat,
            "median_s": med,
            "mb_per_s": {k: n / v / 1e6 for k, v in med.items()},
            "relayed_over_direct_throughput": med["direct"] / med["relayed"],
            "relay_cpu_s_per_gb": relay_cpu / (n * repeat / 1e9),
        }
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(client.relay_dialer.close())
        loop.close()
        for p in (relayed, direct, relay):
            p.terminate()
            p.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100KB,20MB")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pki = make_pki()
    issue_cert(pki / "ca", "relay", pki / "relay")
    results = {}
    for s in args.sizes.split(","):
        r = measure(parse_size(s), args.repeat, pki)
        results[s] = r
        print(
            f"{s:>6}: direct {r['mb_per_s']['direct']:.1f} MB/s, relayed {r['mb_per_s']['relayed']:.1f} MB/s "
            f"(relayed/direct throughput {r['relayed_over_direct_throughput']:.2f}); relay CPU "
            f"{r['relay_cpu_s_per_gb']:.2f} s per relayed GB",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
