"""What a round holds besides what a node keeps at rest (issue 34 item 2: the peak while a node
trains). Measured on main with bench/roundpeaks.py (21 MB MLP, Adam): the guard's finiteness
check made 1.7 model-sized temporaries (``isfinite`` of a whole tensor: ``|t|`` and two bool
masks), an Adam step 2 (the ``sqrt`` of the second moment and its quotient), and ``train`` took a
copy of the model for its step-level rollback that duplicated the round guard's round-start copy.
Now the check and the step work in chunks of a tensor (the same values, bit for bit), and
``train`` rolls back to the guard's copy while the model has not changed since it was taken."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.guard import RoundGuard, all_finite
from coterie.node.learning.local_optim import STEP_CHUNK, LocalOptimizer
from coterie.node.learning.torch_learner import build_learner
from tests.peak_probe import run_peak_probe

SINE = {
    "dataset": "sine",
    "dataset_params": {"num_samples": 800, "noise": 0.1},
    "partition": "sine_intervals",
    "partition_params": {"samples_per_node": 100},
    "model": "mlp",
    "model_params": {"hidden": [64, 64]},
    "optimizer": "adam",
    "lr": 0.01,
    "batch_size": 16,
    "local_steps": 5,
    "num_nodes": 2,
    "device": "cpu",
}


class _Alone:  # a strategy that shares nothing but the live model
    def shared_params(self):
        return None

    def published_extras(self):
        return {}


def _old_adam(params, grads, steps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
    """The whole-tensor Adam update this module made before (torch.optim's single-tensor rule)."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    for t in range(1, steps + 1):
        for k in p:
            g = grads[t - 1][k]
            m[k].lerp_(g, 1 - betas[0])
            v2[k].mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            bc1, bc2 = 1 - betas[0] ** t, 1 - betas[1] ** t
            denom = (v2[k].sqrt() / math.sqrt(bc2)).add_(eps)
            p[k].addcdiv_(m[k], denom, value=-lr / bc1)
    return p, m, v2


def test_adam_in_chunks_is_bit_for_bit_the_whole_tensor_update():
    g = torch.Generator().manual_seed(5)
    shapes = {"big": (3, STEP_CHUNK + 12345), "small": (7, 11), "odd": (STEP_CHUNK + 1,)}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) * 10.0 ** (t - 2) for k, s in shapes.items()} for t in range(4)]
    expected, m, v = _old_adam(params, grads, 4)
    live = {k: torch.nn.Parameter(t.clone()) for k, t in params.items()}
    opt = LocalOptimizer("adam", list(live.items()), lr=1e-3)
    for step in grads:
        for k, p in live.items():
            p.grad = step[k].clone()
        opt.step()
    for k in shapes:
        assert torch.equal(live[k].detach().view(torch.int32), expected[k].view(torch.int32)), k
        assert torch.equal(opt.state[k]["exp_avg"], m[k]) and torch.equal(opt.state[k]["exp_avg_sq"], v[k])


_PEAK = """
import sys, torch
from coterie.node.learning.guard import all_finite
from coterie.node.learning.local_optim import LocalOptimizer

n = 25_000_003  # 100 MB of float32
p = torch.nn.Parameter(torch.randn(n))
opt = LocalOptimizer("adam", [("w", p)], lr=1e-3)
p.grad = torch.randn(n)
work = {"adam step": opt.step, "finite check": lambda: all_finite({"w": p.detach()})}
work[sys.argv[1]]()  # once, to warm up (Adam's moments exist after it)
print(peak_over(work[sys.argv[1]]) / (4 * n))
"""


@pytest.mark.parametrize("what", ["adam step", "finite check"])
def test_a_step_and_the_finite_check_make_no_model_sized_temporary(what):
    """Peak RSS over the call in model sizes (a fresh interpreter; buffers this large are mapped
    and given back when freed, so the peak is what was alive at once). Main: an Adam step 2.00, the
    check 1.75 (checked); now a chunk's few MB."""
    peak = float(run_peak_probe(_PEAK, what))
    assert peak <= 0.25, f"{what}: peak {peak:.2f} model sizes over the call"


def _clones_during(fn, min_numel: int) -> int:
    """How many tensors of at least ``min_numel`` elements ``fn`` clones."""
    seen = []
    clone = torch.Tensor.clone

    def counting(self, *a, **kw):
        if self.numel() >= min_numel:
            seen.append(self.shape)
        return clone(self, *a, **kw)

    torch.Tensor.clone = counting
    try:
        fn()
    finally:
        torch.Tensor.clone = clone
    return len(seen)


def test_train_rolls_back_to_the_guards_round_start_copy_instead_of_copying_again():
    lrn = build_learner(LearnerConfig(**SINE))
    guard = RoundGuard(lrn, _Alone(), lambda where, msg: None)
    biggest = max(p.numel() for p in lrn.model.parameters())
    lrn.train()
    guard.before_round()
    assert _clones_during(lrn.train, biggest) == 0  # main: one per weight matrix
    # the offer is used once: the model changed in that training, so the next one copies again
    assert _clones_during(lrn.train, biggest) > 0


def _poison(learner) -> None:
    x, y = learner._data["train"]
    x = x.clone()
    x[:] = float("nan")  # every step's loss is NaN: the first one rolls back
    learner._data["train"] = (x, y)


def test_a_diverged_training_restores_the_round_start_bit_for_bit():
    lrn = build_learner(LearnerConfig(**SINE))
    guard = RoundGuard(lrn, _Alone(), lambda where, msg: None)
    lrn.train()
    guard.before_round()
    start = lrn.get_params()
    _poison(lrn)
    lrn.train()
    assert lrn.step_guard.total == 1
    after = lrn.get_params()
    assert all(torch.equal(after[k], start[k]) for k in start)


def test_a_model_changed_after_the_guards_copy_rolls_back_to_where_training_started():
    """The guard's copy is not where ``train`` started once the model changed in between (a
    strategy that merges before it trains): train takes its own copy then."""
    lrn = build_learner(LearnerConfig(**SINE))
    guard = RoundGuard(lrn, _Alone(), lambda where, msg: None)
    lrn.train()
    guard.before_round()
    moved = {k: v + 1.0 for k, v in lrn.get_params().items()}
    lrn.set_params(moved)
    _poison(lrn)
    lrn.train()
    after = lrn.get_params()
    assert lrn.step_guard.total == 1
    assert all(torch.equal(after[k], moved[k]) for k in moved)


def test_the_learner_never_keeps_the_guards_copy_alive():
    lrn = build_learner(LearnerConfig(**SINE))
    guard = RoundGuard(lrn, _Alone(), lambda where, msg: None)
    guard.before_round()
    guard.publishable({"params": lrn.get_params()})  # the round is over: the guard drops its copy
    assert guard._start is None
    assert lrn.rollback.take() is None  # collected: only a weak reference was held
    assert all_finite(lrn.get_params())


def test_a_step_holds_one_gradient_not_the_previous_steps_too():
    """While a step's gradient is computed, the model-sized buffers alive are the model, Adam's two
    moments, ``train``'s start copy and that gradient; main also held the previous step's gradient
    (a list bound to it lived through the next backward)."""
    lrn = build_learner(LearnerConfig(**SINE))
    lrn.train()  # Adam's moments exist
    weight = max(lrn.model.parameters(), key=lambda p: p.numel())
    extra: list[int] = []

    def alive() -> list[torch.Tensor]:
        gc.collect()
        return [
            o
            for o in gc.get_objects()
            if type(o) in (torch.Tensor, torch.nn.Parameter)
            and o.shape == weight.shape
            and o.untyped_storage().nbytes() >= weight.nbytes  # (not the storage-free shadow model)
        ]

    # tensors of this shape alive before (earlier tests' in the same process): held, so that no
    # buffer made during train can reuse their addresses, and left out of the count
    before = alive()
    earlier = {o.untyped_storage().data_ptr() for o in before}

    def count(grad):
        known = {weight.untyped_storage().data_ptr(), grad.untyped_storage().data_ptr()} | earlier
        known |= {t.untyped_storage().data_ptr() for t in lrn.optimizer.state[_name(lrn, weight)].values()}
        extra.append(len({o.untyped_storage().data_ptr() for o in alive()} - known))
        return grad

    handle = weight.register_hook(count)
    try:
        lrn.train(4)
    finally:
        handle.remove()
    assert extra and max(extra) == 1, extra  # train's start copy only (main: 2 from the second step)


def _name(lrn, param) -> str:
    return next(n for n, p in lrn.model.named_parameters() if p is param)


class _Board:
    current = None

    def publish(self, snap):
        self.current = snap


def test_publishing_a_large_model_encodes_the_live_tensors_without_copying_them_first(monkeypatch):
    """``local`` publishes the live model: a large one is encoded at once into the buffer peers are
    served from; main copied it first (``get_params``), one more model alive while it encoded."""
    from types import SimpleNamespace

    from coterie.node import publishing

    monkeypatch.setattr(publishing, "OFF_LOOP_BYTES", 0)  # this small model takes the large model's path
    lrn = build_learner(LearnerConfig(**SINE))
    lrn.train()
    strategy = SimpleNamespace(shared_params=lambda: None, published_extras=dict, on_published=lambda params: None)
    node = SimpleNamespace(
        learner=lrn,
        strategy=strategy,
        guard=RoundGuard(lrn, strategy, lambda where, msg: None),
        board=_Board(),
        node_id="n0",
        version=3,
        round=3,
    )
    copies = []
    real = lrn.get_params
    monkeypatch.setattr(lrn, "get_params", lambda: copies.append(1) or real())
    import asyncio

    asyncio.run(publishing.publish_round(node))
    assert copies == []  # main: [1]
    published, live = node.board.current.params, dict(lrn.model.named_parameters())
    assert node.version == 4
    for name, p in live.items():  # the live values, in the snapshot's own buffer
        assert torch.equal(published[name], p.detach())
        assert published[name].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
