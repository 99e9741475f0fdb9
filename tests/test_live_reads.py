"""Evaluations of the live model without a copy of it (issue 34; node/learning/live_reads.py):
the live tensors are read in place, without the learner's lock, and an evaluation that a change
to the model overlapped runs again on a copy — it sees one model, never half of two. The races
are made deterministic: the evaluation stops between two of its batches (or between forward
and backward) until a write has run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from coterie.node.config import ReferenceConfig
from coterie.node.learning import torch_mixture, torch_shadow
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import TorchLearner, build_learner
from coterie.node.local_reference import LocalReference

CFG = LearnerConfig(dataset="digits", model="mlp", model_params={"hidden": [16]}, optimizer="adam", lr=0.01)
EVALUATOR = "evaluator"  # the thread whose evaluation is paused


def _same(a: Any, b: Any) -> bool:
    """Bit for bit: an EvalResult (loss, accuracy, per-sample losses) or a gradient's tensors."""
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return (a.loss, a.accuracy, a.n) == (b.loss, b.accuracy, b.n) and np.array_equal(a.losses, b.losses)


def _moved(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in params.items()}


def _race(learner: TorchLearner, evaluation: Callable[[], Any], write: Callable[[], Any], pause_in: str) -> Any:
    """``evaluation`` in a thread of its own, stopped at its second batch (``pause_in`` "inputs")
    or after its forward pass ("loss") while ``write`` runs here; its result."""
    reached, release = threading.Event(), threading.Event()
    calls = 0
    inputs, loss = learner._transform, learner._loss_hook

    def pause() -> None:
        nonlocal calls
        if threading.current_thread().name != EVALUATOR:
            return
        calls += 1
        if calls == (2 if pause_in == "inputs" else 1):
            reached.set()
            assert release.wait(30), "the write did not finish"

    def on_inputs(x: torch.Tensor) -> torch.Tensor:
        if pause_in == "inputs":
            pause()
        return x if inputs is None else inputs(x)

    def on_loss(out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
        if pause_in == "loss":
            pause()
        return loss(out, y, reduction)

    learner._transform, learner._loss_hook = on_inputs, on_loss
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(evaluation())
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    t = threading.Thread(target=run, name=EVALUATOR)
    t.start()
    try:
        assert reached.wait(30), "the evaluation never reached its pause"
        write()
    finally:
        release.set()
        t.join(30)
        learner._transform, learner._loss_hook = inputs, loss
    assert not t.is_alive()
    if errors:
        raise errors[0]
    return result[0]


def _copy_dropped(learner: TorchLearner) -> None:
    """The design this guards against: the live tensors read as they are, no check, no copy."""
    learner.live_reads.read = lambda on_live, on_copy: on_live()  # type: ignore[method-assign]


@pytest.mark.parametrize("write", ["set_params", "train"])
def test_an_evaluation_a_write_overlaps_sees_one_model(monkeypatch, write):
    monkeypatch.setattr(torch_shadow, "EVAL_BATCH", 32)  # several batches: the write falls between two

    def racing(dropped: bool) -> tuple[Any, Any, Any, TorchLearner]:
        learner = build_learner(CFG)
        moved = _moved(learner.get_params())
        before = learner.evaluate("test", learner.get_params())
        writes = {"set_params": lambda: learner.set_params(moved), "train": lambda: learner.train(3)}
        if dropped:
            _copy_dropped(learner)
        seen = _race(learner, lambda: learner.evaluate("test"), writes[write], "inputs")
        return seen, before, learner.evaluate("test", learner.get_params()), learner

    seen, before, after, learner = racing(dropped=False)
    assert _same(seen, before) or _same(seen, after)  # one model: the one before the write or after it
    assert learner.live_reads.raced == 1  # (it ran again, on a copy: the model after the write)
    # the race is real: read without the check, the evaluation mixes the two models
    seen, before, after, _ = racing(dropped=True)
    assert not _same(seen, before) and not _same(seen, after)


def test_a_gradient_a_write_overlaps_between_forward_and_backward_is_one_models():
    learner = build_learner(CFG)
    moved = _moved(learner.get_params())
    before = learner.gradient(learner.get_params(), "train", None)
    seen = _race(learner, lambda: learner.gradient(None, "train", None), lambda: learner.set_params(moved), "loss")
    after = learner.gradient(learner.get_params(), "train", None)
    assert _same(seen, before) or _same(seen, after)
    assert learner.live_reads.raced == 1
    # without the check autograd refuses the weights changed under it (or the gradient mixes two models)
    learner = build_learner(CFG)
    _copy_dropped(learner)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _race(learner, lambda: learner.gradient(None, "train", None), lambda: learner.set_params(moved), "loss")


def _storages(params: dict[str, torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in params.values()}


def _evaluated_on(monkeypatch) -> list[set[int]]:
    """The storages of the parameters every evaluation on the shadow model ran on."""
    seen: list[set[int]] = []
    for module in (torch_shadow, torch_mixture):
        real = module.functional_call

        def spy(model, params, args, _real=real):
            seen.append(_storages(params))
            return _real(model, params, args)

        monkeypatch.setattr(module, "functional_call", spy)
    return seen


def test_evaluating_the_live_model_copies_none_of_it(monkeypatch):
    learner = build_learner(CFG)
    learner.train()
    live = _storages(dict(learner.model.named_parameters()))
    seen = _evaluated_on(monkeypatch)
    learner.evaluate("test")
    learner.loss(None, "val", 50)
    learner.gradient(None, "train", 64)
    learner.evaluate_mixture([(0.5, None), (0.5, learner.get_params())], "val")
    assert seen and all(s == live for s in seen[:3])  # main: a copy each time
    assert seen[-1] == live or seen[-2] == live  # the mixture's live member
    assert learner.live_reads.raced == 0


def test_the_live_model_read_in_place_gives_what_a_copy_of_it_gave_bit_for_bit():
    a, b = build_learner(CFG), build_learner(CFG)  # b is scored on copies, as main scored the live model
    for learner in (a, b):
        learner.train()
    copy = b.get_params()
    assert _same(a.evaluate("test"), b.evaluate("test", copy))
    assert _same(a.loss(None, "val", 50), b.loss(copy, "val", 50))  # the same subset drawn
    assert _same(a.gradient(None, "train", 64), b.gradient(copy, "train", 64))
    idx = list(range(40))
    assert a.clipped_loss_sum(None, "train", idx, 1.0) == b.clipped_loss_sum(copy, "train", idx, 1.0)
    assert _same(a.clipped_gradient_sum(None, "train", idx, 1.0), b.clipped_gradient_sum(copy, "train", idx, 1.0))
    other = _moved(copy)
    assert _same(a.evaluate_mixture([(0.3, None), (0.7, other)]), b.evaluate_mixture([(0.3, copy), (0.7, other)]))


def test_the_blends_check_scores_the_model_and_the_twin_without_copying_either(monkeypatch):
    learner = build_learner(CFG)
    ref = LocalReference(ReferenceConfig(predict="blend", blend_space="prediction"), learner, "dpsgd")
    assert ref.twin is not None
    twin = ref.twin
    theta0 = twin.get_params()
    good = build_learner(CFG)
    for _ in range(5):
        good.train()
    # an overconfident collaborative model (as in test_blend.py): α lands strictly inside, so the
    # check scores every blend and the blend's test figures too
    g = good.get_params()
    learner.set_params({k: theta0[k] + 4 * (g[k] - theta0[k]) for k in g})
    collab = learner.get_params()
    grid = ref.grid
    expected = learner.evaluate_blends([(1.0, collab)], theta0, grid, "val")  # on copies, as main did
    copies = {"n": 0}
    for obj in (learner, twin):
        real = obj.get_params

        def counted(_real=real):
            copies["n"] += 1
            return _real()

        monkeypatch.setattr(obj, "get_params", counted)
    live = _storages(dict(learner.model.named_parameters())) | _storages(dict(twin.model.named_parameters()))
    seen = _evaluated_on(monkeypatch)
    ev = ref.judge(1, {"test_acc": 0.3, "test_loss": 2.0}, None)
    assert 0 < ref.alpha < 1
    assert copies["n"] == 0  # main: the model and the twin copied for the check, again for the test figures
    assert seen and all(s <= live for s in seen)  # and no copy inside the evaluations either
    assert ref.alpha_losses == [r.loss for r in expected]  # the same losses, bit for bit
    blended = learner.evaluate_mixture([(ref.alpha, collab), (1 - ref.alpha, theta0)], "test")
    assert ev["test_loss"] == blended.loss and ev["test_acc"] == blended.accuracy
