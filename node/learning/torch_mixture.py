"""FedeRiCo's mixture prediction on ``TorchLearner``: Σ_j w_j p(y|x; θ_j) over members' models,
evaluated on the private shadow model (``torch_shadow.py``; never the live one)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from .learner import EvalResult, Params, Split
from .torch_shadow import EVAL_BATCH as _EVAL_BATCH
from .torch_shadow import Shadow


class MixtureEval:
    """The mixture of members' models, evaluated on a split."""

    def __init__(self, shadow: Shadow):
        self.shadow = shadow

    def evaluate_mixture(self, members: list[tuple[float, Params | None]], split: Split = "test") -> EvalResult:
        """Σ_j w_j p(y|x; θ_j) with the weights normalised to sum to 1 (classification: softmax
        probabilities, loss = NLL of the mixture; regression: weighted mean prediction, MSE)."""
        if not members:
            raise ValueError("evaluate_mixture needs at least one member")
        return self._score([_normalised([float(m[0]) for m in members])], [m[1] for m in members], split)[0]

    def evaluate_blends(
        self, members: list[tuple[float, Params | None]], other: Params, alphas: list[float], split: Split = "val"
    ) -> list[EvalResult]:
        """``evaluate_mixture`` of ``[(a·w_j, θ_j)…, (1 − a, other)]`` for every ``a``, bit for bit,
        with each model run once a batch for all of them (the blend's α is chosen on a grid of
        11 every check: scoring each blend afresh cost ~10× the check)."""
        if not members:
            raise ValueError("evaluate_blends needs at least one member")
        ws = []
        for a in alphas:
            if a == 0:  # ``other`` alone
                ws.append(np.asarray([0.0] * len(members) + [1.0]))
            elif a == 1:  # the members alone, normalised among themselves as evaluate_mixture does
                ws.append(np.append(_normalised([float(m[0]) for m in members]), 0.0))
            else:
                ws.append(_normalised([a * float(m[0]) for m in members] + [1 - a]))
        return self._score(ws, [m[1] for m in members] + [other], split)

    def _score(self, ws: list[np.ndarray], members: list[Params | None], split: Split) -> list[EvalResult]:
        """One EvalResult per weight vector in ``ws`` (over ``members``' models, None: the live
        one, read in place: ``Shadow.run``)."""
        return self.shadow.run(members, False, lambda ps: self._score_on(ws, ps, split))

    def _score_on(self, ws: list[np.ndarray], ps: list[Params], split: Split) -> list[EvalResult]:
        """Each model's outputs on a batch are computed once, when a weight vector first needs them."""
        s = self.shadow
        x, y = s.data[split]
        n = len(y)
        if n == 0:
            return [EvalResult(loss=float("nan"), n=0, accuracy=None) for _ in ws]
        total = [0.0] * len(ws)
        correct = [0] * len(ws)
        losses: list[list[np.ndarray]] = [[] for _ in ws]
        hits: list[list[np.ndarray]] = [[] for _ in ws]
        with s.lock, torch.no_grad():
            for i in range(0, n, _EVAL_BATCH):
                xb, yb = x[i : i + _EVAL_BATCH], y[i : i + _EVAL_BATCH]
                outs: list[torch.Tensor | None] = [None] * len(ps)
                for k, w in enumerate(ws):
                    mix: torch.Tensor | None = None
                    for j, (wj, pj) in enumerate(zip(w, ps, strict=True)):
                        if wj == 0:
                            continue
                        out = outs[j]
                        if out is None:
                            out = functional_call(s.model, pj, (s.inputs(xb),))
                            out = outs[j] = out.softmax(1) if s.task == "classification" else out.reshape(-1)
                        mix = wj * out if mix is None else mix + wj * out
                    assert mix is not None  # the weights were checked to have a positive sum
                    if s.task == "classification":
                        py = mix.gather(1, yb.view(-1, 1)).clamp_min(1e-12)
                        total[k] += float(-py.log().sum())
                        hit = mix.argmax(1) == yb
                        correct[k] += int(hit.sum())
                        losses[k].append(-py.log().reshape(-1).double().cpu().numpy())
                        hits[k].append(hit.double().cpu().numpy())
                    else:
                        total[k] += float(F.mse_loss(mix, yb.reshape(-1), reduction="sum"))
                        losses[k].append(F.mse_loss(mix, yb.reshape(-1), reduction="none").double().cpu().numpy())
        return [
            EvalResult(
                loss=total[k] / n,
                n=n,
                accuracy=correct[k] / n if s.task == "classification" else None,
                losses=np.concatenate(losses[k]),
                correct=np.concatenate(hits[k]) if hits[k] else None,
            )
            for k in range(len(ws))
        ]


def _normalised(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights)
    if np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {w.tolist()}")
    return w / w.sum()
