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

    def evaluate_mixture(self, members: list[tuple[float, Params]], split: Split = "test") -> EvalResult:
        """Σ_j w_j p(y|x; θ_j) with the weights normalised to sum to 1 (classification: softmax
        probabilities, loss = NLL of the mixture; regression: weighted mean prediction, MSE)."""
        if not members:
            raise ValueError("evaluate_mixture needs at least one member")
        w = np.asarray([float(m[0]) for m in members])
        if np.any(w < 0) or not w.sum() > 0:
            raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {w.tolist()}")
        w = w / w.sum()
        s = self.shadow
        ps = [s.device_params(m[1], False) for m in members]
        x, y = s.data[split]
        n = len(y)
        if n == 0:
            return EvalResult(loss=float("nan"), n=0, accuracy=None)
        total, correct = 0.0, 0
        losses: list[np.ndarray] = []
        hits: list[np.ndarray] = []
        with s.lock, torch.no_grad():
            for i in range(0, n, _EVAL_BATCH):
                xb, yb = x[i : i + _EVAL_BATCH], y[i : i + _EVAL_BATCH]
                mix: torch.Tensor | None = None
                for wj, pj in zip(w, ps, strict=True):
                    if wj == 0:
                        continue
                    out = functional_call(s.model, pj, (s.inputs(xb),))
                    out = out.softmax(1) if s.task == "classification" else out.reshape(-1)
                    mix = wj * out if mix is None else mix + wj * out
                assert mix is not None  # the weights were checked to have a positive sum
                if s.task == "classification":
                    py = mix.gather(1, yb.view(-1, 1)).clamp_min(1e-12)
                    total += float(-py.log().sum())
                    hit = mix.argmax(1) == yb
                    correct += int(hit.sum())
                    losses.append(-py.log().reshape(-1).double().cpu().numpy())
                    hits.append(hit.double().cpu().numpy())
                else:
                    total += float(F.mse_loss(mix, yb.reshape(-1), reduction="sum"))
                    losses.append(F.mse_loss(mix, yb.reshape(-1), reduction="none").double().cpu().numpy())
        acc = correct / n if s.task == "classification" else None
        return EvalResult(
            loss=total / n,
            n=n,
            accuracy=acc,
            losses=np.concatenate(losses),
            correct=np.concatenate(hits) if hits else None,
        )
