"""The divergence guard (node/learning/guard.py): a node never trains on, nor publishes, a diverged
model. A step that produces NaN (a poisoned sample) or an exploding loss (plain SGD at a step size
far too large) is rolled back to the last finite model and backs off the step size; a strategy's
merge that yields a non-finite model is rolled back too; a real node then publishes only finite
tensors, says so in /status and counts coterie_training_divergences_total."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from coterie.node.config import validate_config
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.guard import RoundGuard, StepGuard, all_finite
from coterie.node.learning.torch_learner import build_learner
from tests.transports import NodeMaker

SINE = {
    "dataset": "sine",
    "dataset_params": {"num_samples": 800, "noise": 0.1},
    "partition": "sine_intervals",
    "partition_params": {"samples_per_node": 100},
    "model": "mlp",
    "optimizer": "sgd",
    "lr": 0.05,
    "batch_size": 16,
    "local_steps": 10,
    "num_nodes": 2,
    "device": "cpu",
}


def _learner(**kw):
    return build_learner(LearnerConfig(**{**SINE, **kw}))


def _poison(learner) -> None:
    """One training sample's input becomes NaN: every step whose minibatch holds it yields NaN."""
    x, y = learner._data["train"]
    x = x.clone()
    x[0] = float("nan")
    learner._data["train"] = (x, y)


def test_step_guard_flags_non_finite_and_exploding_losses():
    g = StepGuard(factor=100, warmup=3)
    assert g.loss_problem(float("nan")) and g.loss_problem(float("inf"))
    for v in (1.0, 0.9, 1.1):
        assert g.loss_problem(v) is None
        g.observe(v)
    assert g.loss_problem(50.0) is None
    assert "exploded" in g.loss_problem(1e4)
    g.diverged("step", "x")
    assert g.lr_scale == 0.5 and g.total == 1 and len(g.drain()) == 1 and g.drain() == []


def test_a_nan_step_is_rolled_back_and_the_step_size_backs_off():
    lrn = _learner()
    before = lrn.get_params()
    _poison(lrn)
    lrn.train(steps=20)  # 60 train samples, batches of 16: the poisoned one comes within 4 steps
    after = lrn.get_params()
    assert all_finite(after), "the learner kept a NaN model"
    assert lrn.step_guard.total >= 1 and lrn.step_guard.lr_scale == 0.5
    assert all(torch.equal(before[k], after[k]) for k in before)  # back to the call's start
    assert lrn.optimizer.lr == pytest.approx(0.025)
    assert any("nan" in m.lower() for _, m in lrn.step_guard.drain())


def test_plain_sgd_that_explodes_stays_finite_and_recovers_a_safe_step_size():
    lrn = _learner(lr=5.0, model_params={"hidden": [64, 64]})
    for _ in range(30):
        lrn.train()
        assert all_finite(lrn.get_params())
    assert lrn.step_guard.total >= 1 and lrn.step_guard.lr_scale < 1
    assert math.isfinite(lrn.evaluate("test").loss)


def test_grad_clip_bounds_every_step():
    lrn = _learner(lr=1.0, grad_clip=0.1, local_steps=1)
    before = lrn.get_params()
    lrn.train()
    after = lrn.get_params()
    moved = math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in before))
    assert moved <= 0.1 * 1.0 + 1e-5  # lr × clip


class _MergesNaN:
    """A strategy whose merge turns the live model into NaN and would share NaN."""

    def __init__(self, learner):
        self.learner, self.diverged = learner, 0
        self._shared = None

    def run(self):
        p = self.learner.get_params()
        bad = {k: torch.full_like(v, float("nan")) for k, v in p.items()}
        self.learner.set_params(bad)
        self._shared = bad

    def shared_params(self):
        return self._shared

    def published_extras(self):
        return {"delta": self._shared}

    def on_diverged(self):
        self.diverged += 1


def test_a_non_finite_merge_is_rolled_back_and_never_published():
    lrn = _learner()
    strat = _MergesNaN(lrn)
    events = []
    guard = RoundGuard(lrn, strat, lambda where, msg: events.append((where, msg)))
    guard.before_round()
    start = lrn.get_params()
    strat.run()
    assert guard.after_round() is False
    assert events and events[0][0] == "merge" and "non-finite" in events[0][1]
    assert strat.diverged == 1 and all_finite(lrn.get_params())
    assert all(torch.equal(start[k], lrn.get_params()[k]) for k in start)
    groups = guard.publishable({"params": strat.shared_params(), "x:delta": strat._shared})
    assert set(groups) == {"params"} and all_finite(groups["params"])


def _node_cfg(tmp, i, peers, rounds):
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": "dpsgd",
            "rounds": rounds,
            "peers": peers,
            "heartbeat_interval_s": 0.2,
            "min_peers": 1,
            "start_timeout_s": 20,
            "seed": 1,
            "security": {"insecure": True},
            "round_interval_s": 0.0,
            "learner": {**SINE, "node_index": i},
        }
    )


def test_a_node_whose_step_produces_nan_rolls_back_and_publishes_only_finite_models(tmp_path):
    async def main():
        make = NodeMaker("inproc")
        rounds = 4
        poisoned = _learner(node_index=0)
        _poison(poisoned)
        n0 = make(_node_cfg(tmp_path, 0, [], rounds), learner=poisoned)
        await n0.start()
        n1 = make(_node_cfg(tmp_path, 1, [n0.address], rounds))
        await n1.start()
        try:
            deadline = time.monotonic() + 120
            while not (n0.done and n1.done):
                assert time.monotonic() < deadline, f"rounds {n0.round}, {n1.round}"
                await asyncio.sleep(0.05)
            snap = await n1.network.pull("n0")  # what a peer gets: finite, accepted
            assert snap is not None and snap.round == rounds
            assert all_finite(snap.params)
            assert all_finite(n0.learner.get_params()) and all_finite(n1.learner.get_params())
            problems = [p for p in n0.status()["problems"] if p["peer"] == "this node (training)"]
            assert problems and "nan" in problems[-1]["message"].lower()
            assert n0.metrics.value("coterie_training_divergences_total", where="step") >= rounds
            assert "coterie_training_divergences_total" in n0.metrics.render()
            assert not [p for p in n1.status()["problems"] if "NaN" in p["message"]]  # n1 never refused n0
        finally:
            await n1.stop()
            await n0.stop()

    asyncio.run(main())
