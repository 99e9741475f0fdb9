"""``TorchLearner``'s local steps on the node's own data (``train``), under the step guard, and
the rollback they restore on a divergence: the round guard's round-start copy while the live model
has not changed since it was taken, else a copy of their own (issue 34: one model-sized copy, not
two)."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import torch

from .config import LearnerConfig
from .guard import StepGuard, all_finite
from .learner import Params, TrainResult
from .live_reads import LiveReads
from .local_optim import LocalOptimizer, _Sampler


class Rollback:
    """Counts the changes to the live model, and holds — weakly — a finite copy of it that someone
    else keeps (the round guard's round-start copy) with the count when it was offered."""

    def __init__(self) -> None:
        self.changes = 0
        self._offer: tuple[weakref.ref, int] | None = None

    def changed(self) -> None:
        self.changes += 1

    def offer(self, params: Params, changes: int) -> None:
        """``params``: a finite copy of the live model taken after ``changes`` was read (a ``dict``
        subclass, so that it can be referenced weakly; a plain dict is not offered). The learner
        never keeps it alive."""
        try:
            self._offer = (weakref.ref(params), changes)
        except TypeError:  # a plain dict cannot be referenced weakly: train copies as before
            return

    def take(self) -> Params | None:
        """The offered copy, if it is still alive and the live model has not changed since; once."""
        if self._offer is None:
            return None
        ref, at = self._offer
        self._offer = None  # used once: after train the model has changed
        return ref() if at == self.changes else None


class LocalTraining:
    """The local steps of a round, given the few pieces of the learner they use."""

    def __init__(
        self,
        cfg: LearnerConfig,
        model: torch.nn.Module,
        splits: dict[str, tuple[torch.Tensor, torch.Tensor]],
        sampler: _Sampler,
        device: str,
        lock: threading.RLock,
        *,
        inputs: Callable[[torch.Tensor], torch.Tensor],
        loss_fn: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor],
        optimizer: Callable[[], LocalOptimizer],
        step_guard: StepGuard,
        rollback: Rollback,
        reset: Callable[[Params], None],
        live_reads: LiveReads,
    ):
        self.cfg, self.model, self.splits, self.sampler, self.device, self.lock = (
            cfg,
            model,
            splits,
            sampler,
            device,
            lock,
        )
        self.inputs, self.loss_fn, self.optimizer = inputs, loss_fn, optimizer
        self.guard, self.rollback, self.reset, self.live_reads = step_guard, rollback, reset, live_reads

    def run(self, steps: int) -> TrainResult:
        if steps <= 0:
            return TrainResult(loss=float("nan"), steps=0, samples=0)
        bs, (x, y), guard = self.cfg.batch_size, self.splits["train"], self.guard
        total, samples, done = 0.0, 0, 0
        with self.lock, self.live_reads.writing():  # evaluations of the live model see it before or after
            start = self.rollback.take()  # the last finite state: the guard's copy, or one of its own
            if start is None:
                start = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            self.rollback.changed()
            opt = self.optimizer()
            opt.lr = self.cfg.lr * guard.lr_scale
            self.model.train()
            problem = None
            for _ in range(steps):
                idx = torch.from_numpy(self.sampler.next(bs)).to(self.device)
                opt.zero_grad(set_to_none=True)
                loss = self.loss_fn(self.model(self.inputs(x[idx])), y[idx], "mean")
                value = float(loss.detach())
                problem = guard.loss_problem(value)
                if problem is not None:
                    break
                loss.backward()
                # (no name bound to the gradients: a list kept them alive through the next step's
                # backward, two model-sized gradients at once)
                norm = (
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                    if self.cfg.grad_clip
                    else torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
                )
                if not math.isfinite(float(norm)):
                    problem = f"gradient norm is {float(norm)}"
                    break
                opt.step()
                guard.observe(value)
                total += value
                samples += len(idx)
                done += 1
            if problem is None and not all_finite(dict(self.model.named_parameters())):
                problem = "non-finite parameters after the local steps"
            opt.zero_grad(set_to_none=True)
            if problem is not None:
                guard.diverged("step", problem)
                self.reset(start)
                return TrainResult(loss=total / done if done else float("nan"), steps=done, samples=samples)
            guard.clean()
        return TrainResult(loss=total / steps, steps=steps, samples=samples)
