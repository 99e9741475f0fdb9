"""Peer-exchange amplification (issue 8) on real daemons: what one peer listing 2,000 unreachable
addresses, every half second, costs its target. Reports the target's round rate in a window
before the flood and during it (target: during >= 0.9 × before), its CPU use in both windows,
and the membership counters (candidates, failed handshakes, channels).

    python bench/peer_flood.py --window 30 --json bench/results/peer_flood.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import Lab, load, mnist1d_mlp, wait_for  # noqa: E402

from coterie.node.config import PROTOCOL_VERSION  # noqa: E402
from coterie.proto.v1 import peer_pb2 as pb  # noqa: E402
from coterie.proto.v1 import peer_pb2_grpc as rpc  # noqa: E402


def bogus_list(n: int) -> list[pb.PeerEntry]:
    return [
        pb.PeerEntry(
            node_id=f"ghost{i}", address=(f"127.0.0.1:{1 + i % 900}" if i % 2 else f"192.0.2.{i % 250 + 1}:7000")
        )
        for i in range(n)
    ]


async def flood(address: str, fingerprint: str, seconds: float, n: int) -> int:
    sent = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = rpc.PeerStub(ch)
        await stub.Handshake(
            pb.HandshakeRequest(
                node=pb.NodeInfo(
                    node_id="flooder",
                    protocol_version=PROTOCOL_VERSION,
                    arch_fingerprint=fingerprint,
                    address="127.0.0.1:9",
                )
            ),
            timeout=10,
        )
        entries = bogus_list(n)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await stub.ExchangePeers(pb.PeerList(node_id="flooder", peers=entries), timeout=10)
            sent += 1
            await asyncio.sleep(0.5)
    return sent


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, clock ticks


def rate(h, t0, t1):
    return sum(1 for r in h if t0 < r["t"] <= t1) / (t1 - t0)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # leave through the lab's cleanup
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--strategy", default="fedfomo")
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--addresses", type=int, default=2000)
    ap.add_argument("--json")
    ap.add_argument(
        "--python", default=sys.executable, help="interpreter of the daemons (e.g. python3 = the /work/main baseline)"
    )
    args = ap.parse_args()
    load0 = load()
    cfg = {"strategy": args.strategy, "round_interval_s": 0.0, "seed": 0}
    root = Path(tempfile.mkdtemp(prefix="coterie-flood-"))
    with Lab(
        root, [{**cfg, "learner": mnist1d_mlp(args.nodes, i)} for i in range(args.nodes)], python=args.python, tls=False
    ) as lab:  # the flood speaks plaintext: this measures the bound, not TLS
        lab.start()
        target = lab.nodes[0]
        wait_for(
            lambda: all(s and s["peers_alive"] == args.nodes - 1 and s["round"] >= 3 for s in lab.statuses()),
            300,
            "the network to meet",
        )
        c0, t_before = cpu_s(target.proc.pid), time.time()
        time.sleep(args.window)
        c1, t0 = cpu_s(target.proc.pid), time.time()
        sent = asyncio.run(flood(target.address, target.get("/status")["fingerprint"], args.window, args.addresses))
        c2, t1 = cpu_s(target.proc.pid), time.time()
        h = target.history()
        st = target.get("/status")
        out = {
            "python": args.python,
            "nodes": args.nodes,
            "strategy": args.strategy,
            "addresses": args.addresses,
            "lists_sent": sent,
            "window_s": args.window,
            "rate_before": rate(h, t_before, t0),
            "rate_during": rate(h, t0, t1),
            "cpu_before": (c1 - c0) / (t0 - t_before),
            "cpu_during": (c2 - c1) / (t1 - t0),
            "membership": st.get("membership"),
            "load_before": load0,
            "load_after": load(),
        }
        out["ratio"] = out["rate_during"] / out["rate_before"]
        # CPU per round: what the flood would inflate; unlike the rate it hardly depends on what
        # else the (shared) machine runs
        out["cpu_per_round_before"] = out["cpu_before"] / out["rate_before"] if out["rate_before"] else None
        out["cpu_per_round_during"] = out["cpu_during"] / out["rate_during"] if out["rate_during"] else None
        out["cpu_per_round_ratio"] = (
            out["cpu_per_round_during"] / out["cpu_per_round_before"]
            if out["cpu_per_round_before"] and out["cpu_per_round_during"]
            else None
        )
    print(
        f"target rounds/s {out['rate_before']:.2f} before, {out['rate_during']:.2f} during the flood "
        f"(x{out['ratio']:.3f}); cpu {out['cpu_before']:.2f} -> {out['cpu_during']:.2f} cores, "
        f"per round x{out['cpu_per_round_ratio'] or float('nan'):.2f}; "
        f"{sent} lists of {args.addresses}; membership {out['membership']}; load {load0} -> {out['load_after']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
