"""The private *shadow* model of ``TorchLearner`` and the evaluations on it: a copy of the
architecture that ``torch.func.functional_call`` runs with the given parameters under its own
lock, so a request thread can evaluate or differentiate a peer's model while training runs on
the live one. ``Shadow`` is what every part that evaluates on it (``ShadowEval`` here,
``torch_private.PerSampleTerms``, ``torch_mixture.MixtureEval``) is given; ``Shadow.run`` gives
them the tensors to evaluate: given parameters as they are, the live model's own tensors without
a copy or its lock (``live_reads.py``: run again on a copy only if a write overlapped)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
import torch
from torch.func import functional_call

from .learner import EvalResult, Params, Split
from .live_reads import LiveReads

EVAL_BATCH = 2048  # samples evaluated at once
T = TypeVar("T")


@dataclass(frozen=True)
class Shadow:
    """The shadow model and the learner's pieces an evaluation on it takes."""

    model: torch.nn.Module  # the architecture, in eval mode, its parameters storage-free (without_weights)
    data: dict[str, tuple[torch.Tensor, torch.Tensor]]  # split -> (x, y), on the device
    lock: threading.Lock  # guards the shadow model (not the live one)
    names: list[str]  # parameter names, in the model's order
    device: str
    task: str
    inputs: Callable[[torch.Tensor], torch.Tensor]  # a batch as the model sees it (input transform)
    loss_fn: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (out, y, reduction)
    # (params or None for the live model's, requires_grad, copy) -> device tensors: given ones
    # as they are (a copy only to change device or dtype), the live model's own or, with copy, a
    # copy taken under the learner's lock
    device_params: Callable[[Params | None, bool, bool], Params]
    live_reads: LiveReads  # the live model's sequence lock

    def run(self, params: list[Params | None], requires_grad: bool, fn: Callable[[list[Params]], T]) -> T:
        """``fn`` on the device tensors of each of ``params`` (None: the live model). The live
        model is read in place; if a write overlapped the read, ``fn`` runs again on a copy, so
        it always sees one model, and the same values it would have seen on a copy."""
        if all(p is not None for p in params):
            return fn([self.device_params(p, requires_grad, False) for p in params])
        return self.live_reads.read(
            lambda: fn([self.device_params(p, requires_grad, False) for p in params]),
            lambda: fn([self.device_params(p, requires_grad, True) for p in params]),
        )


def without_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter replaced by a zero-stride view of one scalar (same shape,
    dtype, device; no storage): ``functional_call`` is always given all the parameters, so the
    shadow's own would be a model-sized copy nobody reads (issue 34). Buffers stay as they are."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                empty = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
                module._parameters[name] = torch.nn.Parameter(empty, requires_grad=False)
    return model


class DeviceParams:
    """``Shadow.device_params`` of a learner's live ``model`` (guarded by ``lock``)."""

    def __init__(self, model: torch.nn.Module, lock: threading.RLock, check: Callable[[Params], None], device: str):
        self.model, self.lock, self.check, self.device = model, lock, check, device

    def __call__(self, params: Params | None, requires_grad: bool = False, copy: bool = False) -> Params:
        """``params`` on the device as float32 (copied only to move or convert them: the caller
        does not change them during the call); None: the live model's own tensors, or with
        ``copy`` a copy taken under the lock (``Shadow.run`` decides which)."""
        if params is None and copy:
            with self.lock:
                out = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        elif params is None:
            out = {n: p.detach() for n, p in self.model.named_parameters()}
        else:
            self.check(params)
            out = {n: params[n].detach().to(self.device, torch.float32) for n, _ in self.model.named_parameters()}
        if requires_grad:
            for t in out.values():
                t.requires_grad_(True)
        return out


class ShadowEval:
    """Loss, accuracy and gradient of given parameters on a split (``Learner.loss``,
    ``evaluate``, ``gradient``); ``eval_rng`` draws the ``max_samples`` subsets."""

    def __init__(self, shadow: Shadow, eval_rng: np.random.Generator):
        self.shadow, self.eval_rng = shadow, eval_rng

    def _batch(self, split: Split, max_samples: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.shadow.data[split]
        if max_samples is not None and max_samples < len(y):
            idx = np.sort(self.eval_rng.choice(len(y), max_samples, replace=False))
            t = torch.from_numpy(idx).to(self.shadow.device)
            return x[t], y[t]
        return x, y

    def loss(
        self,
        params: Params | None = None,
        split: Split = "train",
        max_samples: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> EvalResult:
        with self.shadow.lock:  # the subset drawn once: a read run again scores the same samples
            x, y = self._batch(split, max_samples)
        return self.shadow.run([params], False, lambda ps: self._eval(ps[0], x, y, reduction))

    def evaluate(self, split: Split = "test", params: Params | None = None) -> EvalResult:
        x, y = self.shadow.data[split]
        return self.shadow.run([params], False, lambda ps: self._eval(ps[0], x, y, "mean"))

    def _eval(self, p: Params, x: torch.Tensor, y: torch.Tensor, reduction: str) -> EvalResult:
        s = self.shadow
        n = len(y)
        if n == 0:
            return EvalResult(loss=float("nan"), n=0, accuracy=None)
        total, correct = 0.0, 0
        losses: list[np.ndarray] = []
        hits: list[np.ndarray] = []
        with s.lock, torch.no_grad():
            for i in range(0, n, EVAL_BATCH):
                out = functional_call(s.model, p, (s.inputs(x[i : i + EVAL_BATCH]),))
                yb = y[i : i + EVAL_BATCH]
                total += float(s.loss_fn(out, yb, "sum"))  # as before, bit for bit: the figure others compare
                losses.append(s.loss_fn(out, yb, "none").reshape(len(yb)).double().cpu().numpy())
                if s.task == "classification":
                    hit = out.argmax(1) == yb
                    correct += int(hit.sum())
                    hits.append(hit.double().cpu().numpy())
        acc = correct / n if s.task == "classification" else None
        return EvalResult(
            loss=total / n if reduction == "mean" else total,
            n=n,
            accuracy=acc,
            losses=np.concatenate(losses),
            correct=np.concatenate(hits) if hits else None,
        )

    def gradient(
        self,
        params: Params | None = None,
        split: Split = "train",
        max_samples: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> tuple[Params, EvalResult]:
        s = self.shadow
        with s.lock:  # the subset drawn once: a read run again differentiates on the same samples
            x, y = self._batch(split, max_samples)
        if len(y) == 0:
            raise ValueError(f"split {split!r} is empty on this node: no gradient")

        def on(ps: list[Params]) -> tuple[Params, EvalResult]:
            p = ps[0]
            with s.lock:
                with torch.enable_grad():
                    out = functional_call(s.model, p, (s.inputs(x),))
                    loss = s.loss_fn(out, y, reduction)
                    grads = torch.autograd.grad(loss, [p[n] for n in s.names])
                acc = float((out.argmax(1) == y).float().mean()) if s.task == "classification" else None
            g = {n: t.detach().to("cpu", torch.float32) for n, t in zip(s.names, grads, strict=True)}
            return g, EvalResult(loss=float(loss.detach()), n=len(y), accuracy=acc)

        return s.run([params], True, on)
