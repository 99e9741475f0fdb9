"""Many concurrent calls on one connection (issue 22): the refusal reason reaches the caller.

A certified peer opens 100 compute calls at once on one channel. Admission lets 3 of one peer's
requests run at a time and refuses the rest with RESOURCE_EXHAUSTED naming the limit. Before,
the HTTP/2 layer capped a connection at 64 streams and refused the streams past it with a bare
RST_STREAM, which the caller read as UNAVAILABLE (14 of 100 here): it could not tell "slow down"
from "the node is gone"."""

from __future__ import annotations

import asyncio
import collections

import pytest

from coterie.node.peering.errors import PeerCallError
from coterie.node.peering.messages import CROSS_GRADIENT, ComputeRequest
from tests.nodeproc import CertifiedPeer, NodeProc, tiny_learner

pytestmark = pytest.mark.slow
STREAMS = 100


def test_a_hundred_concurrent_calls_on_one_connection_are_refused_with_a_reason(tmp_path):
    victim = NodeProc(
        tmp_path,
        "victim",
        {
            "strategy": "local",
            "learner": tiny_learner(1, 0, samples=300),
            "round_interval_s": 0.3,
            "privacy": {"enabled": False, "serve_purposes": ["scool-gradient"]},
        },
    ).start()

    async def go():
        m = CertifiedPeer(tmp_path, victim, "mallory")
        try:
            await m.join()
            _, groups = await m.client.get_snapshot(victim.address, "mallory", peer="victim")
            outcomes: collections.Counter = collections.Counter()

            async def one() -> None:
                try:
                    await m.client.compute(
                        victim.address,
                        ComputeRequest(
                            CROSS_GRADIENT,
                            "mallory",
                            groups={"params": groups["params"]},
                            max_samples=0,
                            purpose="scool-gradient",
                        ),
                        peer="victim",
                    )
                    outcomes["ok"] += 1
                except PeerCallError as e:
                    outcomes[(e.kind, str(e))] += 1

            await asyncio.gather(*(one() for _ in range(STREAMS)))
            return outcomes
        finally:
            await m.close()

    try:
        outcomes = asyncio.run(go())
        assert victim.status()["round"] >= 0  # and the node is still serving
    finally:
        victim.stop()
    refused = {k: n for k, n in outcomes.items() if k != "ok"}
    assert sum(outcomes.values()) == STREAMS
    assert refused and all(kind == "exhausted" and "limit is 3 per peer" in why for kind, why in refused), outcomes
    assert 3 <= outcomes["ok"] < STREAMS, outcomes
    print(f"{STREAMS} concurrent calls on one connection: {dict(outcomes)}")
