"""The peer plane's own mechanisms (node daemons in one event loop), against both transports —
real gRPC on loopback and the in-process switchboard: round-aligned snapshot pulls and the
fault-injection layer."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from coterie.node.config import validate_config
from tests.nodeproc import node_certs, tiny_learner
from tests.transports import TRANSPORTS, NodeMaker

pytestmark = pytest.mark.slow


@pytest.fixture(params=TRANSPORTS)
def make(request):
    return NodeMaker(request.param)


def _config(tmp, i, peers, **extra):
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": "local",
            "peers": peers,
            "heartbeat_interval_s": 0.2,
            "request_timeout_s": 10,
            "learner": tiny_learner(2, i),
            "security": {"cert_dir": str(node_certs(tmp, f"n{i}"))},
            **extra,
        }
    )


async def _pair(make, tmp, **extra_second):
    a = make(_config(tmp, 0, [], round_interval_s=0.2))
    await a.start()
    b = make(_config(tmp, 1, [a.address], **extra_second))
    await b.start()
    deadline = time.monotonic() + 30
    while not (a.peers.alive() == ["n1"] and b.peers.alive() == ["n0"]):
        assert time.monotonic() < deadline, "the two nodes never met"
        await asyncio.sleep(0.05)
    return a, b


def test_round_aligned_pull_waits_for_the_round_and_gives_up_in_time(tmp_path, make):
    async def go():
        a, b = await _pair(make, tmp_path, round_interval_s=0.5)
        try:
            target = b.round + 2
            t0 = time.monotonic()
            snap = await a.network.pull("n1", min_round=target, wait_s=20)
            assert snap is not None and snap.round >= target, snap
            assert time.monotonic() - t0 < 15
            # a round the peer will not reach within the wait: None, after about the wait
            t0 = time.monotonic()
            assert await a.network.pull("n1", min_round=b.round + 1000, wait_s=0.5) is None
            assert 0.4 < time.monotonic() - t0 < 8
            # a round already held comes from the cache, without waiting
            t0 = time.monotonic()
            again = await a.network.pull("n1", min_round=target, wait_s=20)
            assert again is not None and again.round >= target and time.monotonic() - t0 < 1
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())


def test_fault_layer_corrupts_what_is_served_not_what_is_learned(tmp_path, make):
    async def go():
        a, b = await _pair(make, tmp_path, faulty="scale", rounds=0)  # no rounds: one version, v1
        try:
            snap = await a.network.pull("n1")
            true = b.board.current
            assert snap is not None and snap.version == true.version == 1
            for k, v in true.params.items():
                # served: blown up (to within the q8 snapshot codec's half step, scale / 254 per block)
                assert torch.allclose(snap.params[k], 25.0 * v, atol=float((25.0 * v).abs().max()) / 250), k
            assert torch.allclose(true.params[k], b.learner.get_params()[k])  # learned: untouched
            assert b.status()["faulty"] == "scale"
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(go())
