"""The learner's two hooks: which loss it minimises and what it does to every input batch first.

- ``learner.loss``: "auto" (cross-entropy for classification, MSE for regression),
  "cross_entropy", "mse", or the name of an entry point in group ``coterie.losses``:
  ``loss(output, target, reduction) -> Tensor`` with ``reduction`` one of "mean", "sum", "none"
  ("none": one loss per sample, which per-sample clipping needs). ``output`` is the model's
  (batch, outputs); ``target`` int64 class indices or float32 targets.
- ``learner.input_transform``: the name of an entry point in group ``coterie.transforms``:
  ``transform(x) -> x`` on every batch tensor before the model, in training and evaluation
  alike (normalisation, a fixed feature map). It also runs under ``torch.func.vmap`` for
  per-sample gradients, so it must be a plain tensor function (no in-place writes to ``x``).

Entry points are found with ``importlib.metadata.entry_points`` (``name = "pkg.module:fn"`` in
the package's ``[project.entry-points."coterie.losses"]``)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import torch
import torch.nn.functional as F

LOSS_GROUP, TRANSFORM_GROUP = "coterie.losses", "coterie.transforms"
LossFn = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]


def _entry_point(group: str, name: str, what: str) -> Callable:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}
    if name not in eps:
        raise ValueError(
            f"learner.{what} {name!r}: no entry point of that name in group {group!r} "
            f"(installed: {sorted(eps) or 'none'})"
        )
    fn = eps[name].load()
    if not callable(fn):
        raise ValueError(f"learner.{what} {name!r}: entry point {eps[name].value} is not callable")
    return fn


def cross_entropy(out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction=reduction)


def make_mse(num_classes: int) -> LossFn:
    """MSE on the targets (regression) or on one-hot classes (classification), summed over the
    outputs of a sample."""

    def mse(out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
        if num_classes > 0:
            per = ((out - F.one_hot(y, num_classes).to(out.dtype)) ** 2).sum(1)
        else:
            per = (out.reshape(-1) - y.reshape(-1)) ** 2
        return per if reduction == "none" else per.sum() if reduction == "sum" else per.mean()

    return mse


def resolve_loss(name: str, task: str, num_classes: int) -> LossFn:
    if name == "auto":
        name = "cross_entropy" if task == "classification" else "mse"
    if name == "cross_entropy":
        if task != "classification":
            raise ValueError("learner.loss 'cross_entropy' needs classes; this node does regression")
        return cross_entropy
    if name == "mse":
        return make_mse(num_classes if task == "classification" else 0)
    return _entry_point(LOSS_GROUP, name, "loss")


def resolve_transform(name: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    return None if name is None else _entry_point(TRANSFORM_GROUP, name, "input_transform")
