"""Fuzzing every RPC of a real node over mTLS: thousands of hostile calls (tests/peer_fuzz.py)
from an authenticated peer. Every reply is OK or a refusal with a short reason — never UNKNOWN
or INTERNAL — while the node keeps running rounds and its /healthz answers within 1 s
throughout. ``FUZZ_CASES`` sets the count (default 2,000; bench/fuzz.py runs 10,000+)."""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coterie.node.config import PROTOCOL_VERSION
from coterie.node.wire.codec import decode
from coterie.proto.v1 import peer_pb2 as pb
from tests.nodeproc import NodeProc, peer_channel, tiny_learner, wait_for
from tests.peer_fuzz import METHODS, Target, calls, check, send

pytestmark = pytest.mark.slow
CASES = int(os.environ.get("FUZZ_CASES", "2000"))
# parsing and refusing are under test, not the budget: a budget this size never refuses
GENEROUS = {
    "requests_per_s": 1e6,
    "request_burst": 1e6,
    "compute_share": 1e3,
    "compute_burst_s": 1e3,
    "max_concurrent": 64,
}


class HealthWatch:
    """Polls /healthz every 0.1 s from a process of its own (the test process is busy generating
    cases: timing it there would measure the fuzzer's GIL, not the node); counts the polls, the
    ones not answered ``ok`` within 5 s, and keeps the slowest answer (a failure counting as 5 s)
    for bench/fuzz.py, which holds the node to answering within 1 s."""

    SCRIPT = (
        "import sys, time, urllib.request, select\n"
        "url, worst, polls, failed = sys.argv[1], 0.0, 0, 0\n"
        "while not select.select([sys.stdin], [], [], 0.1)[0]:\n"
        "    t0 = time.monotonic()\n"
        "    try:\n"
        "        with urllib.request.urlopen(url, timeout=5) as r:\n"
        "            ok = r.read().strip() == b'ok'\n"
        "    except OSError:\n"
        "        ok = False\n"
        "    worst, polls, failed = max(worst, time.monotonic() - t0 if ok else 5.0), polls + 1, failed + (not ok)\n"
        "print(worst, polls, failed, flush=True)\n"
    )

    def __init__(self, url: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.worst, self.polls, self.failed = 0.0, 0, 0

    def finish(self) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=30)
        worst, polls, failed = out.split()
        self.worst, self.polls, self.failed = float(worst), int(polls), int(failed)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    victim = NodeProc(
        root,
        "victim",
        {"strategy": "federico", "learner": tiny_learner(2, 0), "round_interval_s": 0.2, "limits": GENEROUS},
    ).start()
    loop = asyncio.new_event_loop()
    fp = victim.status()["fingerprint"]

    async def open_channel():  # a grpc.aio channel belongs to the loop it was made in
        return peer_channel(root, "fuzzer", victim.address, expect="victim")

    channel = loop.run_until_complete(open_channel())

    async def setup():
        await channel.unary_unary("/coterie.v1.Peer/Handshake")(
            pb.HandshakeRequest(
                node=pb.NodeInfo(
                    node_id="fuzzer", protocol_version=PROTOCOL_VERSION, arch_fingerprint=fp, address="127.0.0.1:1"
                )
            ).SerializeToString(),
            timeout=10,
        )
        chunks = []
        async for raw in channel.unary_stream("/coterie.v1.Peer/GetSnapshot")(
            pb.SnapshotRequest(requester="fuzzer").SerializeToString(), timeout=10
        ):
            chunks.append(pb.SnapshotChunk.FromString(raw))
        groups, _ = decode(b"".join(c.data for c in chunks[1:]))
        return groups["params"]

    params = loop.run_until_complete(setup())
    watch = HealthWatch(victim.admin + "/healthz")
    yield (
        victim,
        loop,
        channel,
        Target("fuzzer", "victim", fp, {k: torch.as_tensor(v) for k, v in params.items()}),
        watch,
    )
    if watch.proc.poll() is None:
        watch.proc.kill()
    loop.run_until_complete(channel.close())
    loop.close()
    victim.stop()


def test_fuzz_every_rpc(session):
    victim, loop, channel, target, watch = session
    codes: collections.Counter = collections.Counter()
    bad: list[str] = []
    round_before = victim.status()["round"]
    strategy = calls(target)  # built once: building it per example costs more than the call

    @settings(
        max_examples=CASES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(st.data())
    def one(data):
        method, frames = data.draw(strategy)
        code, details = loop.run_until_complete(send(channel, method, frames))
        codes[(method, code.name)] += 1
        why = check(method, code, details)
        if why:
            bad.append(why)

    t0 = time.monotonic()
    one()
    took = time.monotonic() - t0
    watch.finish()
    summary = collections.Counter()
    for (_, code), n in codes.items():
        summary[code] += n
    print(
        f"\nfuzz: {sum(codes.values())} calls in {took:.0f} s: {dict(summary)}; "
        f"/healthz worst {watch.worst * 1000:.0f} ms over {watch.polls} polls"
    )
    assert not bad, bad[:10]
    assert sum(codes.values()) >= CASES
    assert {m for m, _ in codes} == set(METHODS)  # every unary call of the table, and the streams
    assert summary["OK"] > 0 and summary["INVALID_ARGUMENT"] > 0  # both deep and shallow paths ran
    wait_for(lambda: victim.status()["round"] > round_before + 2, 60, "the victim to keep running rounds")
    # behaviour, not speed: /healthz kept answering ok throughout (the 1 s figure is bench/fuzz.py's)
    assert watch.polls > 10 and watch.failed == 0, f"/healthz failed {watch.failed} of {watch.polls} polls"
    assert "Traceback" not in (victim.dir / "node.log").read_text()
