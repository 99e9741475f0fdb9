"""A large model's local twin trains on its own at the start of a round, not beside the
strategy's round (issue 34 item 2): its Adam moments, re-made for the round it trains, its
gradient and its rollback copy came on top of the round's own training and exchange, and every
node of an 8-node D-PSGD network of a 21 MB MLP peaked in that round (bench/results/memory.md,
branch dpsgdpeak). A small model's twin still trains beside the round (its copies are small, and
the round is shorter)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from coterie.node.daemon import Node
from coterie.node.local_reference import LocalReference
from coterie.node.strategies import baselines
from coterie.node.transport.inproc import InProcNetwork
from tests.test_exchange_memory import _wait, start_chain

pytestmark = pytest.mark.slow
ROUNDS = 4


@pytest.mark.parametrize("large", [True, False])
def test_a_large_models_twin_trains_before_the_strategys_round(tmp_path, monkeypatch, large):
    spans: dict[str, list[tuple[int, float, float]]] = {"round": [], "twin": []}  # node 0's, (round, start, end)
    first: list[Node] = []
    lock = threading.Lock()
    real_round, real_twin = baselines.DPSGD.run_round, LocalReference.train

    async def run_round(self, rnd):
        t0 = time.monotonic()
        try:
            return await real_round(self, rnd)
        finally:
            if first and self is first[0].strategy:
                spans["round"].append((rnd, t0, time.monotonic()))

    def train(self, rnd):
        t0 = time.monotonic()
        trained = self._trained
        try:
            return real_twin(self, rnd)
        finally:
            if first and self is first[0].reference and self._trained > trained:
                with lock:
                    spans["twin"].append((rnd, t0, time.monotonic()))

    monkeypatch.setattr(baselines.DPSGD, "run_round", run_round)
    monkeypatch.setattr(LocalReference, "train", train)

    async def go():
        hub = InProcNetwork(share_snapshots=False)
        nodes = []
        try:
            # the 1.6 MB model of test_exchange_memory counts as large under a 100k-parameter bound
            reference = {"shadow_max_params": 100_000 if large else 10_000_000, "large_every": 2}

            def configure(c):
                return c.model_copy(update={"rounds": ROUNDS, "reference": c.reference.model_copy(update=reference)})

            await start_chain(tmp_path, hub, nodes, configure, first_made=lambda node: first.append(node))
            await _wait(lambda: all(n.done and n.saved["round"] == ROUNDS for n in nodes), "the rounds never finished")
            return getattr(first[0].reference, "trains_alone", None)
        finally:
            for n in nodes:
                await n.stop()

    after = asyncio.run(go())
    rounds = {r: (a, b) for r, a, b in spans["round"]}
    expected = [2, 4] if large else [1, 2, 3, 4]
    assert [r for r, _, _ in spans["twin"]] == expected, spans
    if large:  # each training has ended before its round's strategy work starts
        assert all(b <= rounds[r][0] for r, _, b in spans["twin"]), spans
    else:  # beside it: it starts before the round's work ends
        assert all(a < rounds[r][1] for r, a, _ in spans["twin"]), spans
    assert after is large
