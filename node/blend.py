"""Predict with a blend of the collaborative model and the local-only twin instead of choosing one
(issue 33; docs/never-worse.md). Two spaces: ``prediction``, α·p(y|x; collab) + (1−α)·p(y|x; twin)
(softmax probabilities, or outputs for regression) — a mixture, which the export format already
carries (``Checkpoint.mixture``); ``weight``, one model α·θ_collab + (1−α)·θ_twin — both start
from the same θ⁰ (a strategy that predicts with a mixture blends each member with the twin and
keeps the weights). α is the one of {0, 1/steps, ..., 1}
with the lowest loss on the node's validation split (classification: of those with the highest
validation accuracy), ties to the twin's side: a node whose
split cannot tell the two apart still gets the part of each that fits it, and a wrong call costs
less than predicting with the wrong one of the two (bench/never_worse_blend.py measured it on the
audit set against the binary back-off). No model, no I/O: the caller scores each α."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, cast

import torch

Params = dict[str, torch.Tensor]
Members = list[tuple[str, float, Params | None]]  # params None: the live model (prediction space only)
Space = Literal["prediction", "weight"]


def alphas(steps: int) -> list[float]:
    """The grid α is chosen on: 0 (the twin), 1/steps, ..., 1 (the collaborative model)."""
    if steps < 1:
        raise ValueError(f"a blend needs at least one step between the twin and collaboration, not {steps}")
    return [k / steps for k in range(steps + 1)]


def blend(
    collab: Sequence[tuple[str, float, Params | None]],
    twin: Params,
    alpha: float,
    twin_id: str,
    space: Space = "weight",
) -> Members:
    """The members the node predicts with at weight ``alpha`` on collaboration, in ``space``.
    α = 0 is the twin itself and α = 1 the collaborative members themselves (not 0·θ + 1·θ': a
    diverged model's inf/nan would survive a zero weight)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"blend weight α must be in [0, 1], not {alpha}")
    if space not in ("prediction", "weight"):
        raise ValueError(f"no such blend space {space!r}: 'prediction' or 'weight'")
    if alpha == 0.0:
        return [(twin_id, 1.0, twin)]
    if alpha == 1.0:
        return cast(Members, collab)  # the caller's list itself
    if space == "prediction":
        return [(node_id, alpha * w, params) for node_id, w, params in collab] + [(twin_id, 1.0 - alpha, twin)]
    out: Members = []
    for node_id, w, params in collab:
        if params is None:  # a weight-space blend is computed from the member's tensors
            raise ValueError(f"cannot blend member {node_id!r} in weight space: its parameters are not given")
        if set(params) != set(twin):
            raise ValueError(
                f"cannot blend member {node_id!r} with the twin: parameters {sorted(set(params) ^ set(twin))} differ"
            )
        out.append((node_id, w, {k: alpha * v + (1.0 - alpha) * twin[k] for k, v in params.items()}))
    return out


def choose(
    grid: list[float], val_loss: Callable[[float], float], val_accuracy: Callable[[float], float] | None = None
) -> tuple[float, list[float]]:
    """(α of ``grid`` with the lowest validation loss, every α's loss). Ties and non-finite
    losses go to the twin's side (the smaller α); nothing finite at all: the twin.
    ``val_accuracy`` (classification): only the α of the highest validation accuracy compete,
    the loss decides among them — the goal is accuracy, and the loss favours a flat
    collaborative model over an overconfident twin whose argmax is right more often
    (bench/results/never_worse_alpha.md: 4 real losses over 3 seeds against 2)."""
    losses = [float(val_loss(a)) for a in grid]
    finite = [(x, a) for a, x in zip(grid, losses, strict=True) if math.isfinite(x)]
    if val_accuracy is not None and finite:
        acc = {a: float(val_accuracy(a)) for _, a in finite}
        top = max(acc.values())
        finite = [(x, a) for x, a in finite if acc[a] == top]
    best = min(finite, default=(math.inf, 0.0))
    return best[1], losses
