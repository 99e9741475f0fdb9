"""How many copies of its model a node's learner and round guard hold between rounds (issue 34
item 2): the live model and the optimizer's state, nothing else. The shadow model that request
threads evaluate on is the architecture only (its parameters hold no storage), and the divergence
guard's round-start copy is released once the round's model is published. Counted by walking
every live tensor, so a copy kept anywhere by these objects shows."""

from __future__ import annotations

import gc

import torch

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
