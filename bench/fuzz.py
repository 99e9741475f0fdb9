"""Fuzz a real node's peer port: 10,000+ hostile calls over mTLS (cases: tests/peer_fuzz.py).

Starts one node daemon (FedeRiCo, tiny MLP) with a throwaway CA, handshakes as an authenticated
peer, sends every case through a generic channel and reports: calls per method and status code,
the most common refusal reasons, anything that came back UNKNOWN/INTERNAL or with a detail over
1 KB, the node's rounds during the run and the slowest /healthz answer (polled every 0.1 s from
another process). Exit status 1 if any reply was wrong or /healthz ever took 1 s or more.

    python bench/fuzz.py --cases 10000 --seed 0 [--json bench/results/fuzz.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from nodeproc import NodeProc, peer_channel, tiny_learner  # noqa: E402
from peer_fuzz import Target, calls, check, send  # noqa: E402
from test_fuzz import GENEROUS, HealthWatch  # noqa: E402

from coterie.node.config import PROTOCOL_VERSION  # noqa: E402
from coterie.node.wire.codec import decode  # noqa: E402
from coterie.proto.v1 import peer_pb2 as pb  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="coterie-fuzz-"))
    victim = NodeProc(
        root,
        "victim",
        {
            "strategy": "federico",
            "learner": tiny_learner(2, 0),
            "round_interval_s": 0.2,
            "limits": GENEROUS,
            "seed": args.seed,
        },
    ).start()
    loop = asyncio.new_event_loop()
    codes: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    bad: list[str] = []
    try:
        fp = victim.status()["fingerprint"]

        async def setup():
            ch = peer_channel(root, "fuzzer", victim.address, expect="victim")
            await ch.unary_unary("/coterie.v1.Peer/Handshake")(
                pb.HandshakeRequest(
                    node=pb.NodeInfo(
                        node_id="fuzzer", protocol_version=PROTOCOL_VERSION, arch_fingerprint=fp, address="127.0.0.1:1"
                    )
                ).SerializeToString(),
                timeout=10,
            )
            chunks = [
                pb.SnapshotChunk.FromString(raw)
                async for raw in ch.unary_stream("/coterie.v1.Peer/GetSnapshot")(
                    pb.SnapshotRequest(requester="fuzzer").SerializeToString(), timeout=10
                )
            ]
            return ch, decode(b"".join(c.data for c in chunks[1:]))[0]["params"]

        channel, params = loop.run_until_complete(setup())
        target = Target("fuzzer", "victim", fp, {k: torch.as_tensor(v) for k, v in params.items()})
        strategy = calls(target)
        watch = HealthWatch(victim.admin + "/healthz")
        round0 = victim.status()["round"]

        @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one(data):
            method, frames = data.draw(strategy)
            code, details = loop.run_until_complete(send(channel, method, frames))
            codes[(method, code.name)] += 1
            reasons[re.sub(r"'[^']*'|\d+", "_", details)[:70]] += 1
            why = check(method, code, details)
            if why:
                bad.append(why)

        t0 = time.monotonic()
        import hypothesis

        hypothesis.seed(args.seed)(one)()
        took = time.monotonic() - t0
        watch.finish()
        rounds = victim.status()["round"] - round0
        alive = victim.get_text("/healthz").strip() == "ok"
        loop.run_until_complete(channel.close())
    finally:
        victim.stop()
        loop.close()
    by_code = collections.Counter()
    for (_, code), n in codes.items():
        by_code[code] += n
    report = {
        "cases": sum(codes.values()),
        "seconds": round(took, 1),
        "by_code": dict(by_code),
        "by_method": {f"{m} {c}": n for (m, c), n in sorted(codes.items())},
        "top_reasons": dict(reasons.most_common(80)),
        "wrong": bad[:50],
        "wrong_count": len(bad),
        "rounds_during": rounds,
        "healthz_worst_s": round(watch.worst, 3),
        "healthz_polls": watch.polls,
        "alive_after": alive,
        "seed": args.seed,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if bad or watch.worst >= 1.0 or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
