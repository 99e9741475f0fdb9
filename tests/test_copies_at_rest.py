"""How many copies of its model a node's learner and round guard hold between rounds (issue 34
item 2): the live model and the optimizer's state, nothing else. The shadow model that request
threads evaluate on is the architecture only (its parameters hold no storage), and the divergence
guard's round-start copy is released once the round's model is published. Counted by walking
every live tensor, so a copy kept anywhere by these objects shows."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import torch

from coterie.node import publishing
from coterie.node.config import LearnerConfig, ReferenceConfig
from coterie.node.learning.guard import RoundGuard
from coterie.node.learning.torch_learner import TorchLearner
from coterie.node.local_reference import LocalReference
from tests.nodeproc import tiny_learner


class _Strategy:  # shares the live model, nothing else (as "local")
    def shared_params(self):
        return None

    def published_extras(self):
        return {}


def _copies(shape: torch.Size) -> int:
    """Distinct storages that hold a whole tensor of ``shape`` (views of one buffer count once)."""
    gc.collect()
    need = shape.numel() * 4
    ptrs = set()
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.shape == shape and o.untyped_storage().nbytes() >= need:
            ptrs.add(o.untyped_storage().data_ptr())
    return len(ptrs)


def _learner() -> TorchLearner:
    cfg = {**tiny_learner(2, 0), "model_params": {"hidden": [333]}, "optimizer": "adam", "local_steps": 2}
    return TorchLearner(LearnerConfig(**cfg))


def test_between_rounds_only_the_model_and_its_optimizer_state_are_held():
    learner = _learner()
    guard = RoundGuard(learner, _Strategy(), on_event=lambda where, msg: None)
    shape = _biggest(learner)
    before = learner.evaluate("val")
    for _ in range(2):
        guard.before_round()
        learner.train()
        assert guard.after_round()
        published = guard.publishable({"params": learner.get_params()})
        del published
    # the model, Adam's two moments: 3 (the shadow's own weights and the round-start copy made 5)
    assert _copies(shape) == 3
    # the storage-free shadow still evaluates the given parameters (the live model's by default)
    after = learner.evaluate("val")
    assert after.loss != before.loss
    live = learner.get_params()
    assert learner.evaluate("val", live).loss == after.loss
    zeros = {n: torch.zeros_like(t) for n, t in live.items()}
    assert learner.loss(zeros, "val").loss != after.loss


def test_a_diverged_round_still_rolls_back_to_its_start():
    learner = _learner()
    guard = RoundGuard(learner, _Strategy(), on_event=lambda where, msg: None)
    guard.before_round()
    start = learner.get_params()
    learner.train()
    with torch.no_grad():
        next(learner.model.parameters()).fill_(float("nan"))
    assert not guard.after_round()
    assert all(torch.equal(start[n], t) for n, t in learner.get_params().items())


def _biggest(learner: TorchLearner) -> torch.Size:
    return max((p.shape for p in learner.model.parameters()), key=lambda s: s.numel())


def test_the_twin_of_a_large_model_keeps_no_optimizer_state_between_its_trainings():
    learner = _learner()
    small = LocalReference(ReferenceConfig(), learner, "dpsgd")  # under shadow_max_params: trains every round
    small.train(1)
    assert small.twin is not None and small.twin.optimizer.state  # its Adam moments carry on
    large = LocalReference(ReferenceConfig(shadow_max_params=0, large_every=2), learner, "dpsgd")
    assert large.twin is not None
    before = large.twin.get_params()
    large.train(2)
    assert any(not torch.equal(before[n], t) for n, t in large.twin.get_params().items())  # it did train
    assert large.twin.optimizer.state == {}  # Adam's two model-sized moments dropped


class _Board:
    current = None

    def publish(self, snap):
        self.current = snap


class _Publishing(_Strategy):
    def __init__(self, shared=None):
        self.shared = shared

    def shared_params(self):
        return self.shared

    def on_published(self, params):
        pass


def _published_node(learner: TorchLearner, strategy: _Publishing) -> SimpleNamespace:
    guard = RoundGuard(learner, strategy, on_event=lambda where, msg: None)
    return SimpleNamespace(
        learner=learner, strategy=strategy, guard=guard, board=_Board(), node_id="n0", version=0, round=1
    )


def _storages(params) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in params.values()}


def test_a_round_starts_from_the_snapshot_it_published_not_from_a_copy():
    learner = _learner()
    node = _published_node(learner, _Publishing())
    learner.train()
    asyncio.run(publishing.publish_round(node))
    published = node.board.current.groups["params"]
    node.guard.before_round()
    start = node.guard._start
    assert start is not None and _storages(start) == _storages(published)  # main: a copy of the model
    # and it is still the rollback: a diverged round returns to the published model, bit for bit
    values = {n: t.clone() for n, t in published.items()}
    learner.train()
    with torch.no_grad():
        next(learner.model.parameters()).fill_(float("nan"))
    assert not node.guard.after_round()
    assert all(torch.equal(values[n], t) for n, t in learner.get_params().items())
    assert all(torch.equal(values[n], t) for n, t in published.items())  # what peers read is untouched


def test_a_model_changed_since_it_was_published_or_not_published_itself_starts_from_a_copy():
    learner = _learner()
    node = _published_node(learner, _Publishing())
    asyncio.run(publishing.publish_round(node))
    moved = {n: t + 1.0 for n, t in learner.get_params().items()}
    learner.set_params(moved)  # changed after the publish (a resume, a strategy's merge)
    node.guard.before_round()
    start = node.guard._start
    assert start is not None and not _storages(start) & _storages(node.board.current.groups["params"])
    assert all(torch.equal(moved[n], t) for n, t in start.items())
    # a strategy that publishes a model of its own (D-PSGD's trained copy): never the live model's start
    other = _published_node(learner, _Publishing(shared={n: t - 1.0 for n, t in moved.items()}))
    asyncio.run(publishing.publish_round(other))
    other.guard.before_round()
    assert other.guard._start is not None and all(torch.equal(moved[n], t) for n, t in other.guard._start.items())
