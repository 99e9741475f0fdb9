"""D-PSGD publishes a large trained model before it exchanges (issue 34 item 2): the trained
model is encoded once, straight into the buffer peers are served from, and the round holds it as
that buffer's views — not as a copy beside the old snapshot, encoded again beside both at the
round's end. Each round still publishes exactly one version, of its own round number, and it is
the model right after the local steps; a cancelled round restores that model."""

from __future__ import annotations

import asyncio
import threading

import pytest

from coterie.node.learning.torch_learner import TorchLearner
from coterie.node.peering.messages import LocalSnapshot
from coterie.node.peering.snapshots import PublishBoard
from coterie.node.strategies import baselines
from coterie.node.transport.inproc import InProcNetwork
from coterie.node.wire import codec as raw_codec
from tests.test_exchange_memory import N, _wait, start_chain
from tests.test_folded_pulls import _bits_equal, _learner, _network, cancel_after_first_add

pytestmark = pytest.mark.slow
ROUNDS = 3


def test_each_round_publishes_its_trained_model_once_before_it_exchanges(tmp_path, monkeypatch):
    events: list[tuple] = []  # node 0's: ("trained", params), ("publish", version, round, params), ("add",), ("copy",)
    me: list[TorchLearner] = []
    in_round = threading.local()

    real_train, real_add, real_get = TorchLearner.train, TorchLearner.add_to_params, TorchLearner.get_params
    real_publish, real_round = PublishBoard.publish, baselines.DPSGD.run_round

    def train(self, *a, **kw):
        out = real_train(self, *a, **kw)
        if me and self is me[0]:
            events.append(("trained", real_get(self)))
        return out

    def add(self, params):
        if me and self is me[0]:
            events.append(("add",))
        return real_add(self, params)

    def get_params(self):
        if me and self is me[0] and getattr(in_round, "on", False):
            events.append(("copy",))  # a copy of the model taken by the strategy's round
        return real_get(self)

    async def run_round(self, rnd):
        in_round.on = self.learner is me[0]
        try:
            return await real_round(self, rnd)
        finally:
            in_round.on = False

    monkeypatch.setattr(TorchLearner, "train", train)
    monkeypatch.setattr(TorchLearner, "add_to_params", add)
    monkeypatch.setattr(TorchLearner, "get_params", get_params)
    monkeypatch.setattr(baselines.DPSGD, "run_round", run_round)

    async def go():
        hub = InProcNetwork(share_snapshots=False)
        nodes = []
        try:

            def instrument(node):
                me.append(node.learner)
                board = node.board

                def publish(snap):
                    events.append(("publish", snap.version, snap.round, snap.params))
                    return real_publish(board, snap)

                board.publish = publish

            await start_chain(
                tmp_path, hub, nodes, lambda c: c.model_copy(update={"rounds": ROUNDS}), first_made=instrument
            )
            await _wait(lambda: all(n.done and n.saved["round"] == ROUNDS for n in nodes), "the rounds never finished")
            return [n.history[-1]["contacted"] for n in nodes]
        finally:
            for n in nodes:
                await n.stop()

    contacted = asyncio.run(go())
    assert all(len(c) == N - 1 for c in contacted)  # every round mixed every peer
    publishes = [e for e in events if e[0] == "publish"]
    # one version a round (and the start's), numbered in order, each of its own round
    assert [(v, r) for _, v, r, _ in publishes] == [(1 + r, r) for r in range(ROUNDS + 1)]
    rounds = []  # node 0's events, round by round, from each local training on
    for e in events:
        if e[0] == "trained":
            rounds.append([e])
        elif rounds:
            rounds[-1].append(e)
    assert len(rounds) == ROUNDS
    for r, seq in enumerate(rounds, start=1):
        kinds = [e[0] for e in seq]
        # published right after the local steps, before any peer's model is added; no copy taken
        assert kinds[1] == "publish" and kinds.count("publish") == 1 and kinds.count("add") == N - 1, kinds
        assert kinds.index("publish") < kinds.index("add") and "copy" not in kinds, kinds
        assert seq[1][2] == r and _bits_equal(seq[1][3], seq[0][1])  # round r's trained model, bit for bit


def test_a_cancelled_round_restores_the_trained_model_it_published(monkeypatch):
    """With ``publish_now`` (the trained model held as the published buffer's views), a round
    cancelled after one peer was added returns to the trained model; the published tensors are
    untouched."""

    async def go():
        learner = _learner()
        published: list[LocalSnapshot] = []

        async def publish_now():
            snap = LocalSnapshot("me", len(published) + 1, 1, {"params": learner.live_params()})
            snap.prepare()
            published.append(snap)
            return snap.groups["params"]

        async with _network(learner) as (_, net, _):
            dpsgd = baselines.DPSGD("me", learner, net, seed=0)
            dpsgd.publish_now = publish_now
            await cancel_after_first_add(monkeypatch, dpsgd)
            assert len(published) == 1
            trained = {k: t.clone() for k, t in published[0].params.items()}
            assert _bits_equal(learner.get_params(), trained)
            again, _ = raw_codec.decode(published[0].encoded)
            assert _bits_equal(again["params"], trained)  # the published buffer itself unchanged

    asyncio.run(go())
